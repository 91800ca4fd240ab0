"""The client on a connection the daemon drops (its connection guard unbinds under a
connection flood, dropping every connection): a repeatable request (status) goes again and
is answered, a stream ends at once with the reason instead of waiting out its timeout.
The daemon here is a real ZeroMQ ROUTER that drops the connection on cue."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from dsv4.daemon import protocol as P
from dsv4.daemon.client import Client, DaemonDropped

def _serve(ep: str, script: list[str], seen: list[dict]) -> threading.Thread:
    """A ROUTER on `ep` that, for each message received, follows the next `script` step:
    "drop" unbinds (dropping the connection) and binds again 0.3 s later, "answer" replies,
    "answer+drop" replies and then drops the idle connection, "final" ends a generate."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ep)

    def run() -> None:
        try:
            for step in script:
                if not router.poll(10_000):
                    return
                ident, frame = router.recv_multipart()
                msg = msgpack.unpackb(frame, raw=False)
                seen.append(msg)
                if step == "final":
                    router.send_multipart([ident, P.encode(P._reply("final", msg["id"], finish_reason="stop"))])
                elif step != "drop":  # "answer", or "answer+drop": answer, then drop the idle connection
                    router.send_multipart([ident, P.encode(P._reply(msg["type"], msg["id"], status={"ok": 1}))])
                    time.sleep(0.2)
                if step in ("drop", "answer+drop"):
                    router.unbind(ep)
                    time.sleep(0.3)
                    router.bind(ep)
        finally:
            router.close(0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_status_lost_on_a_dropped_connection_goes_again(tmp_path: Path) -> None:
    ep, seen = f"ipc://{tmp_path}/d.sock", []
    t = _serve(ep, ["drop", "answer"], seen)
    with Client(ep, api_key="") as c:
        assert c.status(timeout_s=10) == {"ok": 1}  # not DaemonTimeout
    t.join(5)
    assert [m["type"] for m in seen] == ["status", "status"]
    assert seen[0]["id"] != seen[1]["id"]  # a late answer to the first would not be taken for the second


def test_a_stream_on_a_dropped_connection_ends_with_the_reason(tmp_path: Path) -> None:
    ep, seen = f"ipc://{tmp_path}/d.sock", []
    t = _serve(ep, ["drop"], seen)
    with Client(ep, api_key="") as c:
        rid = c.generate("Hello", {"max_tokens": 4})
        with pytest.raises(DaemonDropped, match="dropped this connection.*run it again"):
            for _ in c.stream(rid, deadline=time.monotonic() + 20):  # not DaemonTimeout
                pass
    t.join(5)
    assert [m["type"] for m in seen] == ["generate"]


def test_a_drop_between_requests_loses_nothing(tmp_path: Path) -> None:
    """A connection dropped while idle (and made again) is not taken for a lost request:
    the next generate streams to its end."""
    ep, seen = f"ipc://{tmp_path}/d.sock", []
    t = _serve(ep, ["answer+drop", "final"], seen)
    with Client(ep, api_key="") as c:
        assert c.status(timeout_s=10) == {"ok": 1}
        time.sleep(1.0)  # the drop and the reconnection happen while nothing is in flight
        rid = c.generate("Hello", {"max_tokens": 4})
        msgs = list(c.stream(rid, deadline=time.monotonic() + 20))
    t.join(5)
    assert [m["type"] for m in msgs] == ["final"]
    assert [m["type"] for m in seen] == ["status", "generate"]
