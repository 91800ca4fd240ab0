"""`dsv4 run` / `status` against one shared daemon: real processes, real socket."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from dsv4.daemon import protocol as P
from tests.e2e.util import Daemon, dsv4, run_json, spawn, status, status_now, wait_until

PROMPT = "To be, or not to be"
N = 8


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> Iterator[Any]:
    """The offline API on the same checkpoint (one torch thread, restored after)."""
    import torch

    from dsv4 import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=str(tiny_model))
    finally:
        torch.set_num_threads(threads)


def greedy(offline: Any, prompt: str, n: int = N, **kw: Any) -> Any:
    from dsv4 import SamplingParams

    return offline.generate([prompt], SamplingParams(max_tokens=n, **kw))[0]


def test_run_streams_the_offline_greedy_text(daemon: Daemon, offline: Any) -> None:
    want = greedy(offline, PROMPT)
    r = dsv4("run", "--max-tokens", str(N), PROMPT, endpoint=daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text  # nothing else on stdout, no newline added in a pipe
    assert r.stderr == ""  # no banner or progress when stderr is not a terminal
    out = run_json("--max-tokens", str(N), "--no-mtp", PROMPT, endpoint=daemon.endpoint)
    assert out["token_ids"] == want.token_ids and out["text"] == want.text  # MTP off: same greedy tokens


def test_run_local_matches_the_daemon(daemon: Daemon, tiny_model: Path) -> None:
    args = ("run", "--max-tokens", str(N), "--ignore-eos", PROMPT)
    local = dsv4(*args, "--local", "--model", str(tiny_model))
    assert local.returncode == 0, local.stderr
    assert local.stdout == dsv4(*args, endpoint=daemon.endpoint).stdout
    r = dsv4(*args, "--model", str(tiny_model), endpoint=daemon.endpoint)
    assert r.returncode == 2 and "only with --local" in r.stderr


def test_json_has_every_field(daemon: Daemon) -> None:
    out = run_json("--max-tokens", str(N), "--ignore-eos", "--raw", PROMPT, endpoint=daemon.endpoint)
    assert {"text", "token_ids", "finish_reason", "usage", "timings", "spec"} <= set(out)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == N
    assert out["usage"]["completion_tokens"] == N and out["usage"]["prompt_tokens"] > 0
    assert out["timings"]["ttft_s"] > 0 and out["timings"]["tpot_s"] > 0
    assert {"drafted", "accepted", "acceptance_rate", "mean_acceptance_length"} <= set(out["spec"])
    assert out["spec"]["drafted"] > 0  # the shared daemon runs K = 1
    assert 0 <= out["spec"]["accepted"] <= out["spec"]["drafted"]
    assert out["spec"]["num_speculative_tokens"] == 1 and out["spec"]["speculative_auto"] is False
    assert out["compiled"] is False and out["compiled_buckets"] == {"main": [], "mtp": []}  # no --compile


def test_auto_k_is_the_default_and_reported(tiny_model: Path) -> None:
    """Without --num-speculative-tokens a checkpoint with MTP weights runs auto K: run --json
    says so and which K was in use."""
    r = dsv4("run", "--local", "--model", str(tiny_model), "--json", "--max-tokens", "8", "--ignore-eos", PROMPT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    spec = out["spec"]
    assert spec["speculative_auto"] is True and spec["num_speculative_tokens"] in (0, 1, 2, 3)
    assert out["compiled"] is False and out["compiled_buckets"] == {"main": [], "mtp": []}  # --local too
    r = dsv4("run", "--local", "--model", str(tiny_model), "--num-speculative-tokens", "often", PROMPT)
    assert r.returncode == 2 and "--num-speculative-tokens must be an integer >= 0 (or auto)" in r.stderr


def test_prompt_from_stdin_dash_and_both(daemon: Daemon) -> None:
    ep = daemon.endpoint
    base = dsv4("run", "--max-tokens", "6", "--raw", "Hamlet:", endpoint=ep)
    piped = dsv4("run", "--max-tokens", "6", "--raw", input="Hamlet:", endpoint=ep)
    dash = dsv4("run", "--max-tokens", "6", "--raw", "-", input="Hamlet:", endpoint=ep)
    assert base.returncode == piped.returncode == dash.returncode == 0, (base.stderr, piped.stderr, dash.stderr)
    assert base.stdout == piped.stdout == dash.stdout
    combined = dsv4("run", "--json", "--max-tokens", "6", "--raw", "Speak.", input="Hamlet:", endpoint=ep)
    explicit = dsv4("run", "--json", "--max-tokens", "6", "--raw", "Hamlet:\nSpeak.", endpoint=ep)
    assert json.loads(combined.stdout)["usage"] == json.loads(explicit.stdout)["usage"]
    assert json.loads(combined.stdout)["token_ids"] == json.loads(explicit.stdout)["token_ids"]


def test_eight_concurrent_runs(daemon: Daemon) -> None:
    procs = [spawn("run", "--json", "--max-tokens", str(N), "--ignore-eos", f"Scene {i}:", endpoint=daemon.endpoint)
             for i in range(8)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == N for o in outs)
    # every request got its own answer: the same prompt alone gives the same greedy tokens
    alone = run_json("--max-tokens", str(N), "--ignore-eos", "Scene 3:", endpoint=daemon.endpoint)
    assert alone["token_ids"] == outs[3]["token_ids"]


def test_status(daemon: Daemon) -> None:
    st = status(daemon.endpoint)
    for key in ("model", "device", "dtype", "uptime_s", "running", "waiting", "totals", "pid", "in_flight"):
        assert key in st, key
    assert st["running"] == 0 and st["waiting"] == 0 and st["pid"] == daemon.proc.pid
    assert (st["num_speculative_tokens"], st["speculative_auto"], st["max_speculative_tokens"]) == (1, False, 1)
    assert st["compiled"] is False and st["compiled_buckets"] == {"main": [], "mtp": []}
    run_json("--max-tokens", "4", "--ignore-eos", "Status:", endpoint=daemon.endpoint)  # some MTP totals
    r = dsv4("status", endpoint=daemon.endpoint)
    assert r.returncode == 0 and f"pid {daemon.proc.pid}" in r.stdout
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert {"daemon", "model", "compiled", "requests", "throughput", "MTP", "memory"} <= set(lines)
    assert lines["compiled"].split(None, 1)[1] == "no (eager)"
    assert "%" in lines["MTP"] and "MiB resident" in lines["memory"] and "while busy" in lines["throughput"]


def test_status_watch_reports_the_last_interval(daemon: Daemon) -> None:
    """--watch --json: one object per poll; a run between two polls shows in the second's rates."""
    p = spawn("status", "--watch", "--json", "--interval", "6", "--count", "2", endpoint=daemon.endpoint)
    first = json.loads(p.stdout.readline())  # polled: the run below falls in the interval that follows
    run_json("--max-tokens", "6", "--ignore-eos", "Watch:", endpoint=daemon.endpoint)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    (second,) = (json.loads(ln) for ln in stdout.splitlines())
    assert first["watch"]["output_tokens_per_s"] == 0 and first["watch"]["requests_finished"] == 0
    w = second["watch"]
    assert w["requests_finished"] >= 1 and w["output_tokens_per_s"] > 0 and 5 < w["interval_s"] < 30
    assert 0 <= w["state_pool_used"] <= 1
    r = dsv4("status", "--watch", "--interval", "0.1", "--count", "2", endpoint=daemon.endpoint)  # to a pipe
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2 and all("output tok/s" in ln for ln in lines), r.stdout


def test_bad_frames_get_error_replies_then_run_works(daemon: Daemon) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    v = P.PROTOCOL_VERSION
    try:
        cases = [
            (b"\xde\xad\xbe\xef not msgpack", P.ERR_BAD_MESSAGE),
            (msgpack.packb({"v": v + 1, "type": "generate", "id": "a", "prompt": "x"}), P.ERR_BAD_VERSION),
            (msgpack.packb({"v": v, "type": "generate", "id": "b", "prompt": list(range(5, 4000))}),
             P.ERR_BAD_REQUEST),  # longer than max_model_len
            (msgpack.packb({"v": v, "type": "generate", "id": "c", "prompt": "x" * (P.MAX_MESSAGE_BYTES + 10)}),
             P.ERR_TOO_LARGE),
            (msgpack.packb({"v": v, "type": "generate", "id": "d", "prompt": "x", "params": {"top_p": "high"}}),
             P.ERR_INVALID_PARAMS),
        ]
        for data, code in cases:
            s.send(data)
            assert s.poll(10_000), f"no reply for {code}"
            reply = msgpack.unpackb(s.recv())
            assert reply["type"] == "error" and reply["code"] == code, reply
            assert reply["message"]
    finally:
        s.close()
    r = dsv4("run", "--max-tokens", "4", PROMPT, endpoint=daemon.endpoint)
    assert r.returncode == 0 and r.stdout, r.stderr


def test_prompt_too_long_fails_that_request_only(daemon: Daemon) -> None:
    r = dsv4("run", "--raw", "word " * 3000, endpoint=daemon.endpoint)
    assert r.returncode == 1 and "max_model_len" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = dsv4("run", "--temperature", "-1", PROMPT, endpoint=daemon.endpoint)  # refused by the CLI
    assert r.returncode == 2
    r = dsv4("run", "--top-p", "0", PROMPT, endpoint=daemon.endpoint)  # refused by the daemon
    assert r.returncode == 2 and "top_p" in r.stderr


def _start_long_run(daemon: Daemon) -> Any:
    p = spawn("run", "--max-tokens", "900", "--ignore-eos", "--raw", PROMPT, endpoint=daemon.endpoint)
    assert p.stdout is not None
    assert p.stdout.read(1), "no output from the long run"  # generating now: the caller acts at once
    return p                                                 # (900 tokens take a few seconds)


def _idle(daemon: Daemon) -> bool:
    st = status_now(daemon.endpoint)
    return st["running"] == 0 and st["waiting"] == 0 and st["in_flight"] == 0


def _generated(daemon: Daemon) -> int:
    return status(daemon.endpoint)["totals"]["usage"]["completion_tokens"]


def test_killed_client_frees_its_slot(daemon: Daemon) -> None:
    before = _generated(daemon)
    p = _start_long_run(daemon)
    p.kill()
    p.wait()
    assert wait_until(lambda: _idle(daemon), timeout=15), status(daemon.endpoint)
    assert _generated(daemon) - before < 900  # cut short, not run to the end


def test_ctrl_c_cancels_and_exits_130(daemon: Daemon) -> None:
    before = _generated(daemon)
    p = _start_long_run(daemon)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    assert p.wait(10) == 130
    assert time.monotonic() - t < 5
    assert wait_until(lambda: _idle(daemon), timeout=5), status(daemon.endpoint)
    assert _generated(daemon) - before < 900  # cancelled, not run to the end


@pytest.mark.parametrize("flag, what, local", [(["--system", "Be brief."], "system prompt", True),
                                               (["--think"], "thinking mode", False)])
def test_chat_flags_without_a_chat_template_are_refused(daemon: Daemon, tiny_model: Path, flag: list[str],
                                                        what: str, local: bool) -> None:
    """The tiny models have no chat template: --system and --think are refused (as the HTTP
    API refuses thinking there), not silently dropped; by the daemon and by --local alike."""
    runs = [dsv4("run", *flag, PROMPT, endpoint=daemon.endpoint)]
    if local:
        runs.append(dsv4("run", "--local", "--model", str(tiny_model), *flag, PROMPT))
    for r in runs:
        assert r.returncode == 1 and r.stdout == "", r.stderr  # a request this model cannot serve
        assert r.stderr.strip().endswith(f"this model has no chat template, so no {what}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
