"""`dsv4 serve --tensor-parallel-size 2` as a real daemon (rank 1 a spawned process, gloo):
the same greedy text as one process, each rank's weight bytes in `status`, `dsv4 stop`
stops every rank, and a rank killed mid-request fails the client and the daemon (exit 1)
with no process left behind; two "hosts" on loopback (--nnodes 2) give the same text; both
serve after idling past the collective timeout (rank 0 keeps its ranks waiting); and a host
whose master never answers fails in one line."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.e2e.util import (Daemon, dsv4, env_for, free_port, reap, run_json,
                            short_dir, spawn, status, status_now, wait_until)

PROMPT = "Hamlet:"
N = 12
SHORT_TIMEOUT = {"DSV4_COLLECTIVE_TIMEOUT": "5"}  # a collective fails after 5 s ...
IDLE_S = 7.0  # ... and the daemons idle longer than that


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children first-level and their own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_two_ranks_serve_the_same_text_and_stop_together(daemon: Daemon, tiny_model: Path) -> None:
    """... after idling longer than a collective may take: rank 0 keeps its idle ranks waiting."""
    ref = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=daemon.endpoint)
    d = Daemon(tiny_model, "--tensor-parallel-size", "2", env=env_for(**SHORT_TIMEOUT)).wait_ready(timeout=180)
    try:
        kids = descendants(d.proc.pid)
        assert kids
        time.sleep(IDLE_S)
        assert "did not read its socket" not in d.log.read_text()  # an idle wait is listening, not deaf time
        out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=d.endpoint)
        assert out["text"] == ref["text"]
        st = status(d.endpoint)
        assert st["tensor_parallel_size"] == 2 and len(st["rank_weight_bytes"]) == 2
        r = dsv4("stop", endpoint=d.endpoint, timeout=60)
        assert r.returncode == 0, r.stderr
        assert d.proc.wait(30) == 0
        assert wait_until(lambda: not any(alive(k) for k in kids), timeout=15), [k for k in kids if alive(k)]
    finally:
        d.cleanup()


def test_run_and_bench_local_with_two_ranks(tiny_model: Path) -> None:
    args = ("--local", "--model", str(tiny_model), "--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT)
    one = dsv4("run", *args, timeout=180)
    two = dsv4("run", *args, "--tensor-parallel-size", "2", timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout
    r = dsv4("bench", "--local", "--model", str(tiny_model), "--tensor-parallel-size", "2", "--prompt-len", "8",
             "--gen-len", "4", "--num-prompts", "2", "--concurrency", "1", "--mtp", "on", "--warmup", "0", timeout=180)
    assert r.returncode == 0, r.stderr


def test_killed_rank_fails_the_request_and_the_daemon(tiny_model: Path) -> None:
    d = Daemon(tiny_model, "--tensor-parallel-size", "2").wait_ready(timeout=180)
    try:
        kids = descendants(d.proc.pid)
        client = spawn("run", "--max-tokens", "400", "--ignore-eos", "--raw", PROMPT, endpoint=d.endpoint)
        assert wait_until(lambda: status_now(d.endpoint)["running"] == 1, timeout=30)
        ranks = [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]
        assert len(ranks) == 1, kids  # rank 1 (the spawn helper processes aside)
        os.kill(ranks[0], signal.SIGKILL)
        _, err = client.communicate(timeout=60)
        assert client.returncode != 0 and "tensor-parallel rank 1" in err and len(err.strip().splitlines()) == 1, err
        assert d.proc.wait(60) == 1, d.log.read_text()
        assert wait_until(lambda: not any(alive(k) for k in kids), timeout=15), [k for k in kids if alive(k)]
        assert not glob.glob(f"/dev/shm/dsv4-plan-{d.proc.pid}-*")  # the plan channel left nothing behind
    finally:
        reap(client)
        d.cleanup()


def test_two_hosts_on_loopback_give_the_same_text(daemon: Daemon, tiny_model: Path) -> None:
    """The same serve command on two "hosts" (node ranks 0 and 1, one rank each) forms one group."""
    ref = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=daemon.endpoint)
    port, other_dir = free_port(), short_dir()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    other = spawn("serve", "--model", str(tiny_model), "--socket", f"ipc://{other_dir}/h1.sock", *common,
                  "--node-rank", "1", env=env_for(**SHORT_TIMEOUT))
    d = Daemon(tiny_model, *common, "--node-rank", "0", env=env_for(**SHORT_TIMEOUT))
    try:
        try:
            d.wait_ready(timeout=180)
        except RuntimeError as e:  # node 1's own words (it may still be exiting: waited for, briefly)
            try:
                other.wait(10)
            except subprocess.TimeoutExpired:
                other.kill()
            raise AssertionError(f"{e}\nnode 1 (exit {other.wait()}): {other.stderr.read()}")
        assert list(other_dir.iterdir()) == []  # node 1 binds nothing
        time.sleep(IDLE_S)  # node 1 waits on the group, past the collective timeout: rank 0 keeps it alive
        assert other.poll() is None, other.stderr.read()
        out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=d.endpoint)
        assert out["text"] == ref["text"]
        assert dsv4("stop", endpoint=d.endpoint, timeout=60).returncode == 0
        assert d.proc.wait(30) == 0
        assert other.wait(30) == 0, other.stderr.read()
    finally:
        reap(other)
        d.cleanup()
        shutil.rmtree(other_dir, ignore_errors=True)


def test_unreachable_master_fails_in_one_line(tiny_model: Path) -> None:
    port, d = free_port(), short_dir()
    try:
        r = dsv4("serve", "--model", str(tiny_model), "--socket", f"ipc://{d}/d.sock", "--tensor-parallel-size", "2",
                 "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--rendezvous-timeout", "3", timeout=90)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()  # the daemon's log lines, then the error
        assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr
        assert lines[-1].startswith("dsv4: ") and (f"--nnodes 2: rank 0 did not answer at --master-addr 127.0.0.1 --master-port "
                                    f"{port} within 3 s") in lines[-1], r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_nnodes_without_master_is_refused(tiny_model: Path) -> None:
    r = dsv4("serve", "--model", str(tiny_model), "--socket", "ipc:///tmp/dsv4t-none/d.sock",
             "--tensor-parallel-size", "2", "--nnodes", "2")
    assert r.returncode == 2
    assert r.stderr.strip() == "dsv4: --nnodes 2 needs --master-addr and --master-port (the host of node rank 0 " \
                               "and a free port there)", r.stderr




def test_a_bad_collective_timeout_is_refused_before_loading(tiny_model: Path) -> None:
    r = dsv4("serve", "--model", str(tiny_model), "--socket", "ipc:///tmp/dsv4t-none/d.sock",
             "--tensor-parallel-size", "2", env=env_for(DSV4_COLLECTIVE_TIMEOUT="0"))
    assert r.returncode == 2
    assert r.stderr.strip() == "dsv4: DSV4_COLLECTIVE_TIMEOUT='0': a number of seconds above 0 (default 60)", r.stderr
