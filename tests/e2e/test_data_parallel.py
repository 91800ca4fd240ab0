"""`dsv4 serve --data-parallel-size 2` as a real daemon (two engine replica processes, each
pinned to its own cores): the same greedy text as one engine (also with two tensor-parallel
ranks per replica), the work shared between the replicas, a conversation's turns routed to one replica by their cached prefix, `status`
listing each replica. Faults: a replica killed mid-request fails that request alone (one line
naming it), the other serves meanwhile, and it is started again; a frozen replica is killed
after DSV4_REPLICA_TIMEOUT and the request it held runs elsewhere (nothing lost). Settings that
cannot work are refused before loading."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.test_parallel import alive, descendants
from tests.e2e.util import (Daemon, dsv4, env_for, free_port, reap, run_json,
                            short_dir, spawn, status, status_now, wait_until)

PROMPTS = ["Hamlet:", "To be, or not to be", "KING:", "O Romeo, Romeo"]
N = 16
TIMEOUT = {"DSV4_REPLICA_TIMEOUT": "5"}  # a replica silent this long counts as frozen


@pytest.fixture(scope="module")
def two(tiny_model: Path) -> Iterator[Daemon]:
    port = free_port()
    d = Daemon(tiny_model, "--data-parallel-size", "2", "--num-speculative-tokens", "1", "--http",
               f"127.0.0.1:{port}", env=env_for(**TIMEOUT)).wait_ready(timeout=180)
    d.http = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield d
    d.cleanup()


def routed(st: dict[str, Any]) -> list[dict[str, int]]:
    return [r["routed"] for r in st["replicas"]]


def test_replicas_give_one_engines_text_and_share_the_work(daemon: Daemon, two: Daemon) -> None:
    args = ("--max-tokens", str(N), "--ignore-eos", "--raw")
    refs = [run_json(*args, p, endpoint=daemon.endpoint)["text"] for p in PROMPTS]
    runs = [spawn("run", "--json", *args, p, endpoint=two.endpoint) for p in PROMPTS]  # at once
    try:
        outs = [json.loads(r.communicate(timeout=120)[0])["text"] for r in runs]
    finally:
        for r in runs:
            reap(r)
    assert outs == refs
    st = status(two.endpoint)
    assert st["data_parallel_size"] == 2 and [r["state"] for r in st["replicas"]] == ["serving"] * 2
    assert all(sum(r.values()) >= 1 for r in routed(st)), routed(st)  # both replicas took requests
    cores = [set(r["cores"]) for r in st["replicas"]]
    assert all(cores) and not cores[0] & cores[1]
    assert st["totals"]["usage"]["completion_tokens"] >= len(PROMPTS) * N
    r = dsv4("status", endpoint=two.endpoint)
    assert r.returncode == 0 and "replica 0" in r.stdout and "replica 1" in r.stdout, r.stdout
    with urllib.request.urlopen(f"{two.http}/metrics", timeout=30) as resp:  # type: ignore[attr-defined]
        metrics = resp.read().decode()
    for i in (0, 1):
        assert f'dsv4:engine_requests_running{{engine="{i}",model_name=' in metrics, metrics
        n = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("dsv4:engine_routed_requests{") and f'engine="{i}"' in line)
        assert n == sum(routed(st)[i].values())


def test_replicas_of_two_ranks_give_one_engines_text(daemon: Daemon, tiny_model: Path) -> None:
    """N x T: two replicas, each a tensor-parallel group of two ranks (four processes)."""
    args = ("--max-tokens", str(N), "--ignore-eos", "--raw")
    refs = [run_json(*args, p, endpoint=daemon.endpoint)["text"] for p in PROMPTS[:2]]
    d = Daemon(tiny_model, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--num-speculative-tokens", "1",
               env=env_for(**TIMEOUT)).wait_ready(timeout=240)
    try:
        runs = [spawn("run", "--json", *args, p, endpoint=d.endpoint) for p in PROMPTS[:2]]
        try:
            assert [json.loads(r.communicate(timeout=120)[0])["text"] for r in runs] == refs
        finally:
            for r in runs:
                reap(r)
        st = status(d.endpoint)
        assert st["tensor_parallel_size"] == 2 and len(st["rank_weight_bytes"]) == 2
        assert [r["state"] for r in st["replicas"]] == ["serving"] * 2
    finally:
        d.cleanup()


def post(two: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{two.http}/v1/completions", data=json.dumps(body).encode(),  # type: ignore[attr-defined]
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_structured_outputs_compile_in_the_replica_and_bad_grammars_are_400(two: Daemon) -> None:
    name = status(two.endpoint)["model"].rstrip("/").rsplit("/", 1)[-1]
    code, body = post(two, {"model": name, "prompt": "Who", "max_tokens": 8, "temperature": 0,
                            "guided_choice": ["ay", "nay"]})
    assert code == 200 and body["choices"][0]["text"] in ("ay", "nay"), body
    code, body = post(two, {"model": name, "prompt": "Who", "max_tokens": 4, "guided_regex": "(unclosed"})
    msg = body.get("message") or body.get("error", {}).get("message", "")
    assert code == 400 and "regex" in msg and "\n" not in msg, body  # refused as one engine refuses it


def test_a_conversations_turns_land_on_one_replica(two: Daemon) -> None:
    first = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
             "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\nJULIET:")
    before = routed(status(two.endpoint))
    answer = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", first, endpoint=two.endpoint)["text"]
    mid = routed(status(two.endpoint))
    took = [i for i in (0, 1) if sum(mid[i].values()) > sum(before[i].values())]
    assert len(took) == 1, (before, mid)
    run_json("--max-tokens", "4", "--raw", first + answer + "\nROMEO: I take thee at thy word.", endpoint=two.endpoint)
    after = routed(status(two.endpoint))
    assert after[took[0]]["prefix"] == mid[took[0]]["prefix"] + 1, (mid, after)  # the second turn followed the first


def test_a_killed_replica_fails_its_request_alone_and_comes_back(tiny_model: Path) -> None:
    d = Daemon(tiny_model, "--data-parallel-size", "2", env=env_for(**TIMEOUT)).wait_ready(timeout=180)
    long = spawn("run", "--max-tokens", "4000", "--ignore-eos", "--raw", PROMPTS[0], endpoint=d.endpoint)
    try:
        kids = descendants(d.proc.pid)
        assert wait_until(lambda: any(r["running"] for r in status_now(d.endpoint)["replicas"]), timeout=60)
        victim = next(r for r in status(d.endpoint)["replicas"] if r["running"])
        os.kill(victim["pid"], signal.SIGKILL)
        _, err = long.communicate(timeout=60)
        assert long.returncode != 0 and f"engine replica {victim['index']} (pid {victim['pid']})" in err, err
        assert len(err.strip().splitlines()) == 1, err
        out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPTS[1], endpoint=d.endpoint)
        assert len(out["token_ids"]) == N  # the other replica serves meanwhile

        def back() -> bool:
            r = status_now(d.endpoint)["replicas"][victim["index"]]
            return r["state"] == "serving" and r["restarts"] == 1 and r["pid"] != victim["pid"]

        assert wait_until(back, timeout=120, every=0.5), status(d.endpoint)["replicas"]
        # a frozen replica: its request has streamed nothing, so it runs on the other one
        frozen = status(d.endpoint)["replicas"][0]
        os.kill(frozen["pid"], signal.SIGSTOP)
        runs = [spawn("run", "--json", "--max-tokens", str(N), "--ignore-eos", "--raw", p, endpoint=d.endpoint)
                for p in PROMPTS[:2]]
        for r in runs:
            o, e = r.communicate(timeout=120)
            assert r.returncode == 0, e
            assert len(json.loads(o)["token_ids"]) == N
        rep = status(d.endpoint)["replicas"][0]
        assert rep["restarts"] >= 1 and "stopped answering" in (rep["error"] or ""), rep
        assert "stopped answering" in d.log.read_text()
        r = dsv4("stop", endpoint=d.endpoint, timeout=60)
        assert r.returncode == 0, r.stderr
        assert d.proc.wait(30) == 0
        assert wait_until(lambda: not any(alive(k) for k in kids), timeout=15), [k for k in kids if alive(k)]
    finally:
        reap(long)
        d.cleanup()


@pytest.mark.parametrize("flags, env, words", [
    (["--data-parallel-size", "999"], {}, "--data-parallel-size 999 needs a core per engine"),
    (["--data-parallel-size", "2", "--threads", "999"], {}, "--data-parallel-size 2 x --threads 999"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
      "--master-port", "1"], {}, "with ranks on 2 hosts is not supported yet"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--master-port", "29999"], {},
     "--data-parallel-size 2 with --master-port: each replica's ranks meet on a port of their own"),
    (["--data-parallel-size", "2"], {"DSV4_ROUTING": "fastest"}, "DSV4_ROUTING: routing mode 'fastest'"),
])
def test_settings_that_cannot_work_are_one_line(tiny_model: Path, flags: list[str], env: dict[str, str],
                                                words: str) -> None:
    r = dsv4("serve", "--model", str(tiny_model), "--socket", f"ipc://{short_dir()}/d.sock", *flags,
             env=env_for(**env), timeout=60)
    assert r.returncode in (1, 2) and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loaded in" not in r.stderr


def test_an_engine_in_process_is_one_replica(tiny_model: Path) -> None:
    """`LLM` (and run/bench --local) run one engine: asking it for replicas is refused before loading."""
    from dsv4 import LLM
    from dsv4.engine.checks import EngineConfigError

    with pytest.raises(EngineConfigError, match="replicas run behind 'dsv4 serve'"):
        LLM(tiny_model, data_parallel_size=2)
