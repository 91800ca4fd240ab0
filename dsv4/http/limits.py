"""Connection limits of the HTTP front end, so that no number of clients can use up the daemon's descriptors.

The HTTP server shares its process with the daemon's ZeroMQ socket, and libzmq aborts the
whole process when it cannot get a descriptor for a new connection. So HTTP connections get
a fixed share of the descriptor limit (`http_budget`), and `GuardedH11Protocol` refuses a
connection beyond it at once (a 503, then close; `LimitedServer` lets the kernel queue more,
LISTEN_QUEUE, without descriptors) and closes one whose request head does not arrive within
`header_timeout_s` (slowloris). uvicorn's own `limit_concurrency` answers 503 only once a
request arrives, on a connection it already accepted and keeps; hence this protocol class.
Details: docs/http-api.md, 'dsv4/http/limits.py'.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsv4.daemon.intake import headroom, open_descriptors

log = logging.getLogger("dsv4.http")

MAX_HTTP_CONNECTIONS = 1024
MAX_BACKLOG = 128
LISTEN_QUEUE = 1024  # connections the kernel holds before they are accepted (no descriptor of ours yet)
HEADER_TIMEOUT_S = 10.0  # a request head must arrive within this (or $DSV4_TEST_HTTP_HEADER_TIMEOUT_S)
KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 16 << 10
WARN_EVERY_S = 10.0


def header_timeout() -> float:
    """HEADER_TIMEOUT_S, or $DSV4_TEST_HTTP_HEADER_TIMEOUT_S (the slowloris test shortens it)."""
    text = os.environ.get("DSV4_TEST_HTTP_HEADER_TIMEOUT_S", "").strip()
    return float(text) if text else HEADER_TIMEOUT_S


def http_budget(soft: int, open_now: int | None = None) -> tuple[int, int]:
    """(connections, accept backlog) for HTTP: a third of the descriptors free beyond `headroom`
    (the rest is for ZeroMQ connections), at most MAX_HTTP_CONNECTIONS; at least 1 connection."""
    used = open_descriptors() if open_now is None else open_now
    share = max(2, (soft - used - headroom(soft)) // 3)
    backlog = max(1, min(MAX_BACKLOG, share // 4))
    return max(1, min(MAX_HTTP_CONNECTIONS, share - backlog)), backlog


class LimitedServer(uvicorn.Server):
    """uvicorn's server with a long kernel listen queue: asyncio accepts at most `backlog` (the
    Config's) connections per wakeup, its listen() queue is that short too, and a burst of
    clients beyond it waits a second for SYN retransmits; queued connections hold no descriptor."""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        for sock in sockets or ():
            sock.listen(LISTEN_QUEUE)


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"too many HTTP connections (limit {limit}); retry later",
                                 "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
    return (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: 1\r\nconnection: close\r\n\r\n{body}").encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a request-head timeout (module docstring).
    `configure` sets the class-wide limit; uvicorn creates one instance per connection."""

    limit: int = MAX_HTTP_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    refused_total = 0
    timed_out_total = 0
    _last_warning = 0.0

    @classmethod
    def configure(cls, limit: int, header_timeout_s: float) -> type["GuardedH11Protocol"]:
        """A subclass with these settings (each server gets its own counters)."""
        return type("GuardedH11Protocol", (cls,), {"limit": limit, "header_timeout_s": header_timeout_s,
                                                    "refused_total": 0, "timed_out_total": 0})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._head_timer: Any = None
        self._waiting_cycle: Any = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limit:
            self._refused = True
            self.transport = transport
            cls = type(self)
            cls.refused_total += 1
            now = time.monotonic()
            if now - cls._last_warning >= WARN_EVERY_S:
                cls._last_warning = now
                log.warning("%d HTTP connections open (the limit, from the descriptor limit): refusing new ones "
                            "with 503 (%d refused so far)", len(self.connections), cls.refused_total)
            transport.write(_refusal(self.limit))
            transport.close()
            return
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._waiting_cycle:
            self._cancel_head_timer()  # a request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._await_head()  # the next request's head has header_timeout_s too

    # ------------------------------------------------------------------ the request-head timer
    def _await_head(self) -> None:
        self._cancel_head_timer()
        self._waiting_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            type(self).timed_out_total += 1
            self.transport.close()  # no request head in time: nobody is waiting for an answer
