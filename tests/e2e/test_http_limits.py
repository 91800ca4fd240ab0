"""Issue 21, items 3 and 4, against one real `dsv4 serve --http` (--max-num-seqs 2): every request
is answered (oversized prompts 413, too many prompts 400, a large allowed list finishes), and one
client's flood does not delay another client's single request past the next free slot."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from dsv4.daemon import protocol as P
from tests.e2e.util import Daemon, free_port, wait_until

MAX_PROMPTS = 40
SLOTS = 2



def _call(port: int, method: str, path: str, body: Any = None, timeout: float = 60) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)  # nothing may hang: a bounded wait
    try:
        data = None if body is None else json.dumps(body).encode()
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        c.close()


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DSV4_API_KEY", raising=False)
        d = Daemon(tiny_model, "--http", f"127.0.0.1:{port}", "--max-num-seqs", str(SLOTS),
                   "--max-prompts-per-request", str(MAX_PROMPTS)).wait_ready()
        assert wait_until(lambda: _call(port, "GET", "/health", timeout=5)[0] == 200, timeout=30), d.log.read_text()
        yield d, port
        d.cleanup()


@pytest.mark.parametrize("body", [
    {"prompt": "To be, or not to be. " * 15_000},  # 300 KB of text
    {"prompt": list(range(5, 1_000_005))},  # a million token ids
], ids=["300KB-text", "1M-token-ids"])
def test_oversized_prompts_are_413_naming_the_limit(server, body):
    _, port = server
    t0 = time.monotonic()
    status, reply = _call(port, "POST", "/v1/completions", {**body, "max_tokens": 1})
    assert status == 413, reply
    msg = reply["error"]["message"]
    assert "limit of" in msg and "--max-model-len" in msg and reply["error"]["param"] == "prompt"
    assert time.monotonic() - t0 < 30  # answered, not left to the client's timeout


def test_a_conversation_over_the_limit_is_413(server):
    _, port = server
    msgs = [{"role": "user", "content": "hello there"}] * 100_000
    status, reply = _call(port, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert status == 413 and reply["error"]["param"] == "messages", reply


def test_too_many_prompts_is_400_and_an_allowed_list_finishes(server):
    d, port = server
    status, reply = _call(port, "POST", "/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    assert f"limit of {MAX_PROMPTS}" in reply["error"]["message"] and "--max-prompts-per-request" in \
        reply["error"]["message"]
    status, reply = _call(port, "POST", "/v1/completions", {"prompt": ["To be"] * MAX_PROMPTS, "max_tokens": 2,
                                                            "ignore_eos": True})
    assert status == 200, reply
    assert sorted(c["index"] for c in reply["choices"]) == list(range(MAX_PROMPTS))
    assert all(c["finish_reason"] == "length" for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] == 2 * MAX_PROMPTS


def test_a_flood_does_not_delay_another_clients_request_past_the_next_free_slot(server):
    """One connection, two end clients (the protocol's `client` field, as the HTTP front end
    sends them): 8 long requests of 'flood', then 1 one-token request of 'probe'. The daemon
    reads them in order, so the probe waits behind 6 of the flood's; admitted fairly, it
    takes the next free slot, and at most 2 * SLOTS flood requests start before it ends
    (first come first served: all 8)."""
    d, _ = server
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)

    def gen(rid: str, client: str, max_tokens: int) -> None:
        s.send(P.encode(P.Generate(rid, prompt="To be", mode="raw", client=client, params={
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).to_wire()))

    def recv() -> dict[str, Any]:
        assert s.poll(60_000), "no reply from the daemon within 60 s"
        return msgpack.unpackb(s.recv(), raw=False)

    flood = [f"f{i}" for i in range(8)]
    try:
        for rid in flood:
            gen(rid, "flood", 64)
        started: list[str] = []
        while len(started) < 1:
            msg = recv()
            assert msg["type"] == "delta", msg
            started.append(msg["id"])
        gen("probe", "probe", 1)
        while True:
            msg = recv()
            assert msg["type"] in ("delta", "final"), msg
            if msg["id"] == "probe":
                if msg["type"] == "final":
                    break
            elif msg["type"] == "delta" and msg["id"] not in started:
                started.append(msg["id"])
        assert msg["finish_reason"] == "length"
        assert len(started) <= 2 * SLOTS, f"flood requests started before the probe ended: {started}"
    finally:
        for rid in flood:
            s.send(P.encode(P.Cancel(f"c-{rid}", target=rid).to_wire()))
        s.close()
    assert wait_until(lambda: _in_flight(d) == 0, timeout=30)


def _in_flight(d: Daemon) -> int:
    from dsv4.daemon.client import Client

    with Client(d.endpoint, api_key="") as c:
        c.connect()
        return int(c.status()["in_flight"])
