"""The HTTP front end's connection to the daemon: one zmq.asyncio DEALER, replies routed by id.

    bridge = Bridge(ctx, "inproc://dsv4-http")   # created inside the running event loop
    await bridge.start()                         # reader task + heartbeat task
    rid, q = await bridge.generate(prompt, params, ...)  # q: an asyncio.Queue of delta/final/error messages
    bridge.cancel(rid)                           # fire and forget (safe in a `finally`), never lost

Only the event loop's thread touches the socket; the reader task puts each reply on its
request's unbounded queue, so a slow HTTP client only grows its own. Every message is
checked against the daemon's message limit before it goes (`MessageTooLarge`, 413); a full
send queue makes a generate fail after SEND_WAIT_S (`DaemonBusy`, 503), never a cancel.
`alive` (a pong within ALIVE_WINDOW_S) gates only new requests and /health: a request in
flight is never failed for a missed pong. Details: docs/http-api.md, 'dsv4/http/bridge.py'.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any

import zmq
import zmq.asyncio

from dsv4.daemon import protocol as P

log = logging.getLogger("dsv4.http")

ALIVE_WINDOW_S = 10.0  # no pong for this long: new requests get 503
SEND_HWM = 1000  # messages queued for the daemon before a send waits (inproc adds the daemon's receive queue)
SEND_WAIT_S = 10.0  # a generate waits this long for room in a full send queue, then DaemonBusy


def alive_window() -> float:
    """ALIVE_WINDOW_S, or $DSV4_TEST_ALIVE_WINDOW_S (the liveness tests shorten it)."""
    text = os.environ.get("DSV4_TEST_ALIVE_WINDOW_S", "").strip()
    return float(text) if text else ALIVE_WINDOW_S


class DaemonUnavailable(Exception):
    """The daemon did not answer (503)."""


class DaemonBusy(Exception):
    """The queue of messages to the daemon stayed full (503)."""


class MessageTooLarge(ValueError):
    """A request over the daemon's message limit (413)."""


class Bridge:
    """A DEALER on `endpoint` shared by every HTTP request of this process."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, api_key: str | None = None,
                 alive_window_s: float | None = None, send_hwm: int = SEND_HWM, send_wait_s: float = SEND_WAIT_S
                 ) -> None:
        self.alive_window_s = alive_window_s if alive_window_s is not None else alive_window()
        self.ping_interval_s = min(P.HEARTBEAT_INTERVAL_S, self.alive_window_s / 4)
        self._key_frame = P.KEY_PREFIX + api_key.encode() if api_key else None  # the daemon's key, if any
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        self.send_hwm, self.send_wait_s = send_hwm, send_wait_s
        self._sock.connect(endpoint)
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.last_pong: float | None = None
        self.daemon: dict[str, Any] = {}

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._heartbeat())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for q in self._queues.values():
            q.put_nowait(P.error(None, P.ERR_SHUTTING_DOWN, "the HTTP server is shutting down"))
        self._sock.close(0)

    @property
    def alive(self) -> bool:
        return self.last_pong is not None and time.monotonic() - self.last_pong < self.alive_window_s

    def new_id(self) -> str:
        return f"h{next(self._ids)}"

    @property
    def message_limit(self) -> int:
        """The largest message the daemon takes (its pong says; the protocol's limit until then)."""
        limit = self.daemon.get("max_message_bytes")
        return limit if isinstance(limit, int) and 0 < limit <= P.MAX_MESSAGE_BYTES else P.MAX_MESSAGE_BYTES

    # ------------------------------------------------------------------ sending
    def _frames(self, msg: dict[str, Any]) -> list[bytes]:
        """The frames of `msg`; MessageTooLarge over the daemon's limit (which it would refuse)."""
        frame = P.encode(msg)
        if len(frame) > self.message_limit:
            reason = self.daemon.get("message_limit_reason")
            raise MessageTooLarge(f"the request makes a message of {len(frame)} bytes to the engine, over its limit "
                                  f"of {self.message_limit} bytes{' ' + reason if reason else ''}; send a shorter "
                                  f"prompt")
        return [self._key_frame, frame] if self._key_frame is not None else [frame]

    async def _send(self, msg: dict[str, Any], wait_s: float) -> None:
        """Send `msg`, waiting up to `wait_s` for room in a full queue (then DaemonBusy; nothing sent)."""
        frames = self._frames(msg)
        try:
            await asyncio.wait_for(self._sock.send_multipart(frames), wait_s)
        except asyncio.TimeoutError:
            raise DaemonBusy(f"the dsv4 daemon is busy: the queue of messages to it is full ({self.send_hwm} and "
                             f"more waiting); try again later") from None

    async def generate(self, prompt: str | list[int], params: dict[str, Any], *, mode: str = "auto",
                       system: str | None = None, thinking: bool = False, queue: asyncio.Queue | None = None,
                       strict_length: bool = False, client: str | None = None, follows: str | None = None
                       ) -> tuple[str, asyncio.Queue]:
        """Submit a generate request; its replies (delta..., final, or error) arrive on `queue`
        (a new one unless given: several requests may share one). `strict_length`: the daemon
        refuses a max_tokens that does not fit in max_model_len after the prompt. `client`: the
        end client it counts for in the engine's fair shares. `follows`: the id of an earlier
        generate of the same prompt (a sibling sample; the engine shares its prefill). Raises DaemonUnavailable,
        MessageTooLarge or DaemonBusy, with nothing sent."""
        if not self.alive:
            raise DaemonUnavailable("the dsv4 engine is not answering (loading, busy or stopped)")
        rid = self.new_id()
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        msg = P.Generate(rid, prompt=prompt, mode=mode, system=system, thinking=thinking, params=params,
                         strict_length=strict_length, client=client, follows=follows).to_wire()
        self._queues[rid] = q  # before the send: a reply may come before this task resumes
        try:
            await self._send(msg, self.send_wait_s)
        except asyncio.CancelledError:  # it may have gone out just as this task was cancelled: cancel it too
            self.cancel(rid)
            raise
        except BaseException:  # refused or timed out: not sent
            self._queues.pop(rid, None)
            raise
        return rid, q

    def cancel(self, rid: str) -> None:
        """Cancel `rid` if it is still running; never raises, never awaits. The cancel waits in
        the send queue as long as it is full: it is never dropped."""
        if self._queues.pop(rid, None) is None:
            return
        try:
            sent = self._sock.send_multipart(self._frames(P.Cancel(self.new_id(), target=rid).to_wire()))
        except Exception:  # noqa: BLE001  (socket closed at shutdown)
            return
        sent.add_done_callback(_log_failed_cancel)

    def done(self, rid: str) -> None:
        """The request finished: forget its queue."""
        self._queues.pop(rid, None)

    async def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        if not self.alive:
            raise DaemonUnavailable("the dsv4 engine is not answering")
        rid = self.new_id()
        fut = asyncio.get_running_loop().create_future()
        self._calls[rid] = fut
        try:
            await self._send(P.Status(rid).to_wire(), timeout_s)
            msg = await asyncio.wait_for(fut, timeout_s)
        except (asyncio.TimeoutError, DaemonBusy):
            raise DaemonUnavailable("the dsv4 engine did not answer 'status'") from None
        finally:
            self._calls.pop(rid, None)
        return dict(msg.get("status") or {})

    # ------------------------------------------------------------------ tasks
    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._send(P.Ping(self.new_id()).to_wire(), self.ping_interval_s)
            except DaemonBusy:
                log.debug("ping skipped: the send queue is full")  # the next one follows; `alive` tells
            except zmq.ZMQError as e:
                log.warning("ping failed: %s", e)
                await asyncio.sleep(self.ping_interval_s)
                continue
            await asyncio.sleep(self.ping_interval_s)

    async def _reader(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = P.decode_reply(frame)
            except P.ProtocolError as e:
                log.warning("bad reply from the daemon: %s", e.message)
                continue
            rid = msg.get("id")
            if msg["type"] == "pong":
                self.last_pong = time.monotonic()
                self.daemon = msg
                continue
            self.last_pong = time.monotonic()  # any reply shows the daemon is alive
            fut = self._calls.get(rid)
            if fut is not None:
                if not fut.done():
                    fut.set_result(msg)
                continue
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(msg)
                if msg["type"] in ("final", "error"):
                    self._queues.pop(rid, None)
            elif msg["type"] == "error" and rid is None:  # the daemon names the request whenever it can
                log.warning("the daemon refused a message: %s: %s", msg.get("code"), msg.get("message"))


def _log_failed_cancel(sent: "asyncio.Future[Any]") -> None:
    """Done callback of a cancel's send: a failure is logged, never left unretrieved."""
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("a cancel could not be sent: %s", sent.exception())
