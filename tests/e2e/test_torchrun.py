"""dsv4 under the real `torchrun` launcher (`python -m torch.distributed.run`): every process
is one rank (nothing spawned), rank 0 runs the engine; `run` gives the same tokens as one
process, a `serve` answers a real client and `dsv4 stop` ends every rank; torchrun's
variables against flags that contradict them fail in one line before anything loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_parallel import alive, descendants
from tests.e2e.util import CMD, Daemon, dsv4, env_for, free_port, reap, run_json, short_dir, status, wait_until

PROMPT = "Hamlet:"
N = 12


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), "-m", "dsv4.cli.main", *args]


def test_run_under_torchrun_gives_the_tokens_of_one_process(tiny_model: Path) -> None:
    """`run` implies --local under torchrun (its parser takes `--local` for one of its own options)."""
    args = ("--model", str(tiny_model), "--max-tokens", str(N), "--ignore-eos", "--raw", "--json", PROMPT)
    one = dsv4("run", "--local", *args, timeout=120)
    two = subprocess.run(torchrun(2, "run", *args), capture_output=True, text=True, timeout=180, env=env_for(),
                         stdin=subprocess.DEVNULL)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    ref, out = json.loads(one.stdout), json.loads(two.stdout)  # rank 1 prints nothing
    assert out["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == N


def test_serve_under_torchrun_answers_and_stop_ends_every_rank(tiny_model: Path) -> None:
    d = short_dir()
    sock = d / "d.sock"
    log = open(d / "log", "wb")
    proc = subprocess.Popen(torchrun(2, "serve", "--model", str(tiny_model), "--socket", f"ipc://{sock}",
                                     "--num-speculative-tokens", "1"),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env_for())
    try:
        ready = Daemon.__new__(Daemon)  # reuse wait_ready on the torchrun process
        ready.proc, ready.socket, ready.endpoint, ready.log = proc, sock, f"ipc://{sock}", d / "log"
        ready.wait_ready(timeout=180)
        ranks = [p for p in descendants(proc.pid) if "dsv4.cli.main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 2, ranks  # both ranks are torchrun's workers, neither spawned another
        out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=f"ipc://{sock}")
        assert len(out["token_ids"]) == N
        st = status(f"ipc://{sock}")
        assert st["tensor_parallel_size"] == 2 and len(st["rank_weight_bytes"]) == 2
        r = dsv4("stop", endpoint=f"ipc://{sock}", timeout=60)
        assert r.returncode == 0, r.stderr
        assert proc.wait(60) == 0, (d / "log").read_text()
        assert wait_until(lambda: not any(alive(p) for p in ranks), timeout=15), [p for p in ranks if alive(p)]
        assert not sock.exists()
    finally:
        reap(proc)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def _as_rank(rank: int, world: int, *args: str) -> subprocess.CompletedProcess:
    env = env_for(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_flags_that_contradict_torchrun_are_refused(tiny_model: Path) -> None:
    m = ("--model", str(tiny_model))
    cases = [
        (("run", *m, "--tensor-parallel-size", "4", PROMPT), 2,
         "dsv4: --tensor-parallel-size 4 conflicts with WORLD_SIZE 2 set by torchrun (drop the flag: under torchrun "
         "every process is one rank)"),
        (("serve", *m, "--socket", "ipc:///tmp/dsv4t-none/x.sock", "--master-port", "1234"), 2,
         "dsv4: --master-port 1234 cannot be combined with torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are "
         "set; its rendezvous places the ranks): drop --master-port"),
        (("bench", *m, "--num-prompts", "1"), 3, "dsv4: WORLD_SIZE 3 does not divide the model's attention heads (4)"),
        (("serve", *m, "--detach"), 2,
         "dsv4: --detach cannot be used under torchrun (it supervises the ranks); serve in the foreground"),
    ]
    for args, world, line in cases:
        for rank in (0, 1):  # every rank refuses, before anything loads or waits
            r = _as_rank(rank, world, *args)
            assert r.returncode == 2 and r.stderr.strip() == line, (args, rank, r.stderr)
