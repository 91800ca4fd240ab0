"""Engine replicas on other hosts (`--data-parallel-address`), with the hosts in two network
namespaces joined by a veth pair (root and `ip` needed, else skipped): node 0 in one serves
clients with one replica of its own, the other host's `serve --data-parallel-rank 1` joins it
over TCP. The same greedy text as one engine, both replicas take work, status names the
remote's address. A joiner with another key, another dtype or a place already taken is
refused with one line (exit 2) and nothing else changes; the remote killed fails nothing that
could run elsewhere, and it joins again; `dsv4 stop` ends it too. Bad flags fail before loading."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.util import (CMD, Daemon, dsv4, env_for, free_port, reap, run_json,
                            short_dir, spawn, status, status_now, wait_until)

PROMPTS = ["Hamlet:", "To be, or not to be", "KING:", "O Romeo, Romeo"]
N = 16
KEY = "replica-test-key"
A, B = "10.231.77.1", "10.231.77.2"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces, each a 'host' with one address on a shared link."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 100000}"
    a, b = f"dsv4a{tag}", f"dsv4b{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            if _ip("netns", "add", ns).returncode != 0:
                pytest.skip("cannot create network namespaces here")
            made.append(ns)
        steps = [("link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b)]
        for ns, dev, addr in ((a, f"va{tag}", A), (b, f"vb{tag}", B)):
            steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot link the namespaces: ip {' '.join(step)}: {r.stderr.strip()}")
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def on(ns: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns)


def joiner(ns: str, model: Path, port: int, rank: int, *flags: str, key: str = KEY) -> subprocess.Popen:
    return subprocess.Popen([*on(ns), *CMD, "serve", "--model", str(model), "--data-parallel-size", "2",
                             "--data-parallel-rank", str(rank), "--data-parallel-address", A,
                             "--data-parallel-rpc-port", str(port), "--num-speculative-tokens", "1", *flags],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for(DSV4_API_KEY=key, DSV4_REPLICA_TIMEOUT="5"))


def test_a_replica_on_another_host_joins_serves_and_is_checked(hosts: tuple[str, str], daemon: Daemon,
                                                               tiny_model: Path, monkeypatch) -> None:
    a, b = hosts
    args = ("--max-tokens", str(N), "--ignore-eos", "--raw")
    refs = [run_json(*args, p, endpoint=daemon.endpoint)["text"] for p in PROMPTS]
    monkeypatch.setenv("DSV4_API_KEY", KEY)  # the clients' key (the daemon's, DSV4_API_KEY)
    port = free_port()
    node0 = Daemon(tiny_model, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                   "--data-parallel-address", A, "--data-parallel-rpc-port", str(port), "--num-speculative-tokens", "1",
                   env=env_for(DSV4_API_KEY=KEY, DSV4_REPLICA_TIMEOUT="5"), prefix=on(a))
    procs = [joiner(b, tiny_model, port, 1)]
    try:
        node0.wait_ready(timeout=180)
        runs = [spawn("run", "--json", *args, p, endpoint=node0.endpoint, env=env_for(node0.endpoint, DSV4_API_KEY=KEY))
                for p in PROMPTS]
        try:
            assert [json.loads(r.communicate(timeout=120)[0])["text"] for r in runs] == refs
        finally:
            for r in runs:
                reap(r)
        st = status(node0.endpoint)
        reps = st["replicas"]
        assert [r["state"] for r in reps] == ["serving"] * 2 and reps[0]["host"] is None and reps[1]["host"] == B
        assert reps[1]["pid"] == procs[0].pid and all(sum(r["routed"].values()) >= 1 for r in reps), reps
        line = dsv4("status", endpoint=node0.endpoint, env=env_for(node0.endpoint, DSV4_API_KEY=KEY)).stdout
        assert f"on {B}" in line, line

        # refused when they join, before loading: another key, another dtype, a place taken
        cases = (((), "another-key", "refused this host's key"),
                 (("--dtype", "bfloat16"), KEY, "its --dtype 'bfloat16' differs from this daemon's 'float32'"),
                 ((), KEY, "replica 1 is already serving"))
        refused = [(joiner(b, tiny_model, port, 1, *flags, key=key), words) for flags, key, words in cases]  # at once
        for p, words in refused:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 2 and words in err and len(err.strip().splitlines()) == 1, (p.returncode, err)
        assert "did not prove the key" in node0.log.read_text()
        assert [r["state"] for r in status(node0.endpoint)["replicas"]] == ["serving"] * 2

        # the remote killed: the other replica serves meanwhile, and it joins again
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        assert wait_until(lambda: status_now(node0.endpoint)["replicas"][1]["state"] == "away", timeout=30)
        out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPTS[1], endpoint=node0.endpoint)
        assert len(out["token_ids"]) == N
        procs.append(joiner(b, tiny_model, port, 1))

        def back() -> bool:
            r = status_now(node0.endpoint)["replicas"][1]
            return r["state"] == "serving" and r["restarts"] == 1 and r["pid"] == procs[-1].pid

        assert wait_until(back, timeout=120, every=0.5), status(node0.endpoint)["replicas"]
        r = dsv4("stop", endpoint=node0.endpoint, env=env_for(node0.endpoint, DSV4_API_KEY=KEY), timeout=60)
        assert r.returncode == 0, r.stderr
        assert node0.proc.wait(30) == 0
        assert procs[-1].wait(30) == 0, procs[-1].communicate()[1]
    finally:
        for p in procs:
            reap(p)
        node0.cleanup()


@pytest.mark.parametrize("flags, env, words", [
    (["--data-parallel-size", "2", "--data-parallel-rank", "1"], {},
     "--data-parallel-rank needs --data-parallel-address"),
    (["--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1"], {"DSV4_API_KEY": KEY},
     "--data-parallel-address needs --data-parallel-rpc-port"),
    (["--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "1"], {},
     "replicas of other hosts prove a shared key"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "2", "--data-parallel-address", "127.0.0.1",
      "--data-parallel-rpc-port", "1"], {"DSV4_API_KEY": KEY}, "no replica joins"),
    (["--data-parallel-size", "2", "--data-parallel-rank", "2", "--data-parallel-address", "127.0.0.1",
      "--data-parallel-rpc-port", "1"], {"DSV4_API_KEY": KEY}, "--data-parallel-rank 2 is out of range"),
    (["--data-parallel-size", "2", "--data-parallel-address", "192.0.2.7", "--data-parallel-rpc-port", "29555"],
     {"DSV4_API_KEY": KEY}, "--data-parallel-address 192.0.2.7 --data-parallel-rpc-port 29555: cannot listen there"),
    (["--data-parallel-size", "2", "--data-parallel-rank", "1", "--data-parallel-address", "127.0.0.1",
      "--data-parallel-rpc-port", str(free_port()), "--rendezvous-timeout", "1"], {"DSV4_API_KEY": KEY},
     "nothing answers at 127.0.0.1"),
])
def test_replica_host_settings_that_cannot_work_are_one_line(tiny_model: Path, flags: list[str],
                                                             env: dict[str, str], words: str) -> None:
    e = env_for(**env)
    e.pop("DSV4_API_KEY", None) if "DSV4_API_KEY" not in env else None
    r = dsv4("serve", "--model", str(tiny_model), "--socket", f"ipc://{short_dir()}/d.sock", *flags, env=e, timeout=60)
    assert r.returncode in (1, 2) and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loaded in" not in r.stderr and "serving (" not in r.stderr
