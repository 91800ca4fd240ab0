"""A slow engine step is not a dead engine: a real `dsv4 serve --http` whose every step is made
slower than the HTTP front end's liveness window (the test hooks $DSV4_TEST_STEP_DELAY_S and
$DSV4_TEST_ALIVE_WINDOW_S), driven by the real `openai` client. Streams finish whole and
/health stays 200; `dsv4 status` counts tokens while a request runs; a stream cut by the
daemon stopping ends in an error the client sees, never in `[DONE]`."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.e2e.test_http import _get
from tests.e2e.util import Daemon, free_port, status, status_now, wait_until

STEP_S = 1.3  # every engine step sleeps this long inside the step ...
WINDOW_S = 1.0  # ... longer than the front end waits for a pong before calling the daemon dead


def _slow_daemon(model: Path) -> tuple[Daemon, int]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV4_TEST_STEP_DELAY_S", str(STEP_S))
        mp.setenv("DSV4_TEST_ALIVE_WINDOW_S", str(WINDOW_S))
        d = Daemon(model, "--http", f"127.0.0.1:{port}", "--num-speculative-tokens", "0").wait_ready()
    assert wait_until(lambda: _get(port, "/health")[0] == 200, timeout=30), d.log.read_text()
    return d, port


@pytest.fixture(scope="module")
def slow(tiny_model: Path) -> Iterator[tuple[Daemon, int]]:
    d, port = _slow_daemon(tiny_model)
    yield d, port
    d.cleanup()


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, prompt: str, max_tokens: int) -> openai.Stream:
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


def test_four_streams_finish_through_steps_slower_than_the_liveness_window(slow):
    d, port = slow
    client = _client(port)
    results: dict[int, tuple[str, int, str | None]] = {}
    errors: list[BaseException] = []
    health: list[int] = []
    running = threading.Event()
    running.set()

    def one(i: int) -> None:
        text, tokens, reason = "", 0, None
        try:
            for c in _stream(client, f"Line {i}:", 2):
                for ch in c.choices:
                    text, reason = text + ch.text, ch.finish_reason or reason
                tokens = c.usage.completion_tokens if c.usage else tokens
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)
        results[i] = (text, tokens, reason)

    def watch_health() -> None:
        while running.is_set():
            health.append(_get(port, "/health")[0])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    running.clear()
    watcher.join(30)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    assert all(text and tokens == 2 and reason == "length" for text, tokens, reason in results.values()), results
    assert health and set(health) == {200}, health  # polled all through the slow steps
    assert "cancelled" not in d.log.read_text()


def test_status_counts_tokens_while_the_request_runs(slow):
    d, port = slow
    before = status(d.endpoint)["totals"]["usage"]["completion_tokens"]
    stream = _stream(_client(port), "Long", 60)  # about 80 s at this step time: cancelled below
    chunks = 0
    for c in stream:
        chunks += bool(c.choices)
        if chunks == 2:
            break
    st = status(d.endpoint)
    assert st["running"] == 1
    assert st["totals"]["usage"]["completion_tokens"] - before >= 2  # each chunk carries at least one token
    assert st["totals"]["throughput"]["output_tokens_per_busy_s"] > 0
    stream.close()  # the disconnect cancels the generation
    assert wait_until(lambda: status_now(d.endpoint)["in_flight"] == 0, timeout=30)


def test_a_stream_cut_by_the_daemon_stopping_ends_in_an_error_not_done(tiny_model):
    d, port = _slow_daemon(tiny_model)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Raw", "max_tokens": 60, "stream": True, "ignore_eos": True}).encode(),
                     {"Content-Type": "application/json"})
        raw = conn.getresponse()
        assert raw.status == 200
        assert raw.readline().startswith(b"data: ")  # the stream has started
        stream = iter(_stream(_client(port), "Client", 60))
        next(stream)
        d.proc.terminate()  # `dsv4 serve` stops: the requests in flight are aborted
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        rest = raw.read().decode()
        events = [e for e in rest.split("\n\n") if e.strip()]
        assert "[DONE]" not in rest and "shutting down" in json.loads(events[-1][len("data: "):])["error"]["message"]
        assert d.proc.wait(30) == 0
    finally:
        d.cleanup()
