"""The HTTP front end's Bridge over real ZeroMQ sockets, with the test playing the daemon (a
ROUTER on inproc): a full send queue is `DaemonBusy` with nothing lost, cancels queued behind
it all arrive once the daemon reads again, and a message over the daemon's limit (from its
pong) is `MessageTooLarge` before anything is sent (issue 21, item 3); and the client an HTTP
request counts for in the engine's fair shares (item 4)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from dsv4.daemon import protocol as P
from dsv4.http.bridge import Bridge, DaemonBusy, MessageTooLarge

ENDPOINT = "inproc://test-bridge"


def _messages(router: zmq.Socket, wait_ms: int = 0) -> list[dict[str, Any]]:
    out = []
    while router.poll(wait_ms):
        _, frame = router.recv_multipart()
        out.append(msgpack.unpackb(frame, raw=False))
        wait_ms = 0
    return out


@contextlib.asynccontextmanager
async def _daemon_and_bridge(limit: int, rcvhwm: int | None = None) -> AsyncIterator[tuple[zmq.Socket, Bridge]]:
    """(the test's ROUTER playing the daemon, a Bridge that has seen its pong with `limit`),
    closed again after the block."""
    ctx = zmq.asyncio.Context()
    router = zmq.Context.shadow(ctx.underlying).socket(zmq.ROUTER)  # the daemon: plain blocking calls
    if rcvhwm is not None:
        router.setsockopt(zmq.RCVHWM, rcvhwm)
    router.bind(ENDPOINT)
    bridge = None
    try:
        bridge = await _bridge_with_pong(ctx, router, limit)
        yield router, bridge
    finally:
        if bridge is not None:
            await bridge.close()
        router.close(0)
        ctx.term()


async def _bridge_with_pong(ctx: zmq.asyncio.Context, router: zmq.Socket, limit: int) -> Bridge:
    bridge = Bridge(ctx, ENDPOINT, alive_window_s=60, send_hwm=8, send_wait_s=0.3)
    await bridge.start()
    for _ in range(200):  # the heartbeat's first ping: answer it as the daemon would
        if router.poll(0):
            client, frame = router.recv_multipart()
            ping = msgpack.unpackb(frame, raw=False)
            router.send_multipart([client, P.encode(P.pong(ping["id"], max_message_bytes=limit,
                                                           message_limit_reason="for --max-model-len 64"))])
            break
        await asyncio.sleep(0.01)
    for _ in range(200):
        if bridge.alive:
            return bridge
        await asyncio.sleep(0.01)
    raise AssertionError("the bridge never saw the pong")


def test_full_queue_is_busy_and_no_cancel_is_lost() -> None:
    async def main() -> None:
        async with _daemon_and_bridge(1 << 20, rcvhwm=8) as (router, bridge):
            rids = []
            with pytest.raises(DaemonBusy, match="busy"):
                for _ in range(1000):  # bounded: the queue holds 8 + 8 (and some in flight)
                    rid, _ = await bridge.generate("x", {"max_tokens": 1})
                    rids.append(rid)
            assert 8 <= len(rids) < 1000
            for rid in rids:  # the queue is full: each cancel waits in it, none is dropped
                bridge.cancel(rid)
            got: list[dict[str, Any]] = []
            for _ in range(500):  # the daemon reads again
                got += _messages(router)
                if sum(m["type"] == "cancel" for m in got) == len(rids):
                    break
                await asyncio.sleep(0.01)
            generated = [m["id"] for m in got if m["type"] == "generate"]
            cancelled = [m["target"] for m in got if m["type"] == "cancel"]
            assert sorted(cancelled) == sorted(rids) and set(generated) <= set(rids)

    asyncio.run(main())


def test_a_message_over_the_daemons_limit_is_refused_before_sending() -> None:
    async def main() -> None:
        async with _daemon_and_bridge(1000) as (router, bridge):
            assert bridge.message_limit == 1000
            with pytest.raises(MessageTooLarge, match=r"limit of 1000 bytes for --max-model-len 64"):
                await bridge.generate("y" * 2000, {})
            rid, _ = await bridge.generate("y" * 100, {})
            await asyncio.sleep(0.05)
            assert [m["id"] for m in _messages(router, 1000) if m["type"] == "generate"] == [rid]

    asyncio.run(main())


def test_the_client_a_request_counts_for() -> None:
    from starlette.requests import Request

    from dsv4.http.submit import client_of

    req = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "client": ("10.1.2.3", 4567)})
    assert client_of(req, {"user": "alice"}) == "user:alice"
    assert client_of(req, {"user": ""}) == client_of(req, {"user": 5}) == client_of(req, {}) == "peer:10.1.2.3"
    assert len(client_of(req, {"user": "u" * 10_000})) < P.MAX_CLIENT_LEN  # fits the protocol's field
