"""Liveness is not silence: time the daemon's loop could not read its socket (held up outside
a step, where no watch listens) never counts against a client's heartbeat, so a client that
kept pinging keeps its request through the stall; a client that is really silent is still reaped."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from tests.unit.test_protocol import FakeEngine, Harness, frame, wait_until

STALL_S = 2.0  # the loop is held up this long, over three heartbeat timeouts


class StallingEngine(FakeEngine):
    """A fake engine with text prompts, whose `add_request` of a prompt starting 'stall' holds
    the loop thread. A big prompt is tokenized on the intake's worker and added after the
    loop's poll, outside any drain: where a grammar lock taken on the loop once held it up."""

    def check_text_size(self, prompt: str, system: Any = None) -> None:
        pass

    def encode_request(self, prompt: str, **_: Any) -> str:
        return prompt

    def add_request(self, prompt: Any, params: Any, *, request_id: str, **kw: Any) -> str:
        if prompt.startswith("stall"):
            time.sleep(STALL_S)
            prompt = "stall"
        return super().add_request(prompt, params, request_id=request_id, **kw)


def _pinging(endpoint: str, stop: threading.Event, got: list[dict]) -> None:
    """A DEALER with one long request that pings every 0.1 s, as the HTTP bridge does."""
    import msgpack

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(frame(type="generate", id="long", prompt="p", params={"max_tokens": 100000}))
    n = 0
    while not stop.is_set():
        sock.send(frame(type="ping", id=f"p{n}"))
        n += 1
        while sock.poll(100):
            msg = msgpack.unpackb(sock.recv(), raw=False)
            if msg.get("id") == "long":
                got.append(msg)
    sock.close()


def test_a_stalled_loop_does_not_make_a_pinging_client_silent() -> None:
    h = Harness(StallingEngine(step_delay=0.02), heartbeat_timeout=0.6)
    stop, got = threading.Event(), []
    t = threading.Thread(target=_pinging, args=(h.endpoint, stop, got), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(got) > 3)
        c = h.client()
        c.generate("stall" + "x" * (32 << 10), {"max_tokens": 1})  # holds the loop STALL_S, after its poll
        before = len(got)
        assert wait_until(lambda: len(got) > before + 20, timeout=STALL_S + 10), got[-2:]  # streaming again after it
        assert h.server.deaf_s >= STALL_S * 0.9
        assert not any(m.get("type") in ("final", "error") for m in got), got[-3:]  # never cancelled
        c.close()
    finally:
        stop.set()
        t.join(5)
        h.close()


def test_one_client_holds_at_most_its_share_of_the_request_table() -> None:
    """Per end client in flight: the third request of a client at a limit of 2 is refused
    `rate_limited` (HTTP 429) naming the limit; another end client on the same connection,
    and the first once one of its requests ends, go on."""
    import msgpack

    from dsv4.daemon import protocol as P

    h = Harness(FakeEngine(step_delay=0.02), max_requests_per_client=2)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(h.endpoint)

    def send(rid: str, who: str, max_tokens: int) -> None:
        sock.send(frame(type="generate", id=rid, prompt="p", params={"max_tokens": max_tokens}, client=who))

    def until_end(rid: str) -> dict:
        while sock.poll(10_000):
            msg = msgpack.unpackb(sock.recv(), raw=False)
            if msg.get("id") == rid and msg["type"] in ("final", "error"):
                return msg
        raise AssertionError(f"no end for {rid}")

    try:
        send("a1", "alice", 100000)
        send("a2", "alice", 100000)
        send("a3", "alice", 2)
        refused = until_end("a3")
        assert refused["type"] == "error" and refused["code"] == P.ERR_RATE_LIMITED, refused
        assert "client 'alice' has 2 requests in flight, the limit per client" in refused["message"]
        send("b1", "bob", 2)
        assert until_end("b1")["type"] == "final"
        sock.send(frame(type="cancel", id="c", target="a1"))
        assert until_end("a1")["type"] == "final"
        send("a4", "alice", 2)
        assert until_end("a4")["type"] == "final"
    finally:
        sock.close()
        h.close()
