"""What stands between the daemon's socket and its engine loop: a tokenizing worker and a connection guard.

* `Tokenizer worker` (`Intake`): big text prompts are tokenized on one worker thread
  (the `tokenizers` library releases the GIL while it works), so a 4 MiB prompt does not
  stall the engine step loop and everyone's streams; finished jobs wake the loop through
  the server's wakeup socket and are collected with `done()`.
* `ConnectionGuard`: counts the ROUTER's open connections with a ZeroMQ socket monitor.
  libzmq aborts the whole process when accepting an ipc connection fails for lack of
  descriptors (EMFILE), so the daemon never lets it get there: at `limit` open
  connections it unbinds the endpoint (every connection of that listener is dropped,
  new ones are refused) and binds again after a pause. `connection_limit()` derives the
  limit from the descriptor limit, keeping headroom for the accepts that land before
  the loop sees the monitor's events.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("dsv4.daemon")

INLINE_TOKENIZE_BYTES = 16 << 10  # smaller text prompts are tokenized on the loop (cheaper than a hand-off)
MAX_CONNECTIONS = 4096
REBIND_PAUSE_S = 1.0


class Intake:
    """One worker thread running tokenization jobs; results come back through `done()`."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-tokenize")
        self._done: queue.SimpleQueue[tuple[str, Future]] = queue.SimpleQueue()
        self.pending = 0

    def submit(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run `fn(*args, **kwargs)` on the worker; `done()` later yields (key, future)."""
        self.pending += 1
        fut = self._pool.submit(fn, *args, **kwargs)
        fut.add_done_callback(lambda f: (self._done.put((key, f)), self._wake()))

    def done(self) -> list[tuple[str, Future]]:
        """The jobs finished since the last call (their future holds the result or the exception)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_descriptors() -> int:
    """Descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64  # no /proc: a typical count for a loaded engine


def connection_limit(maximum: int = MAX_CONNECTIONS) -> int:
    """Open connections allowed: the free descriptors minus headroom (max(64, limit / 8)), at most `maximum`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return maximum
    free = soft - open_descriptors()
    return max(1, min(maximum, free - max(64, soft // 8)))


class ConnectionGuard:
    """Watches the connections of a bound ROUTER socket; unbinds at `limit`, binds again after a pause."""

    def __init__(self, sock: zmq.Socket, endpoint: str, limit: int, on_bind: Callable[[], None]) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.limit = limit
        self._on_bind = on_bind
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.open = 0
        self.refusals = 0  # times the endpoint was unbound
        self._unbound_at: float | None = None

    def handle(self) -> None:
        """Count the monitor's events; unbind at the limit, bind again once the pause is over."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_ACCEPTED:
                self.open += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.open = max(0, self.open - 1)
        if self._unbound_at is None and self.open >= self.limit:
            log.warning("%d connections open (limit %d, from the descriptor limit): refusing connections "
                        "for %.0f s; every connection is dropped", self.open, self.limit, REBIND_PAUSE_S)
            self.sock.unbind(self.endpoint)  # also closes the listener's connections
            self.open = 0
            self.refusals += 1
            self._unbound_at = time.monotonic()
        elif self._unbound_at is not None and time.monotonic() - self._unbound_at >= REBIND_PAUSE_S:
            self.sock.bind(self.endpoint)
            self._on_bind()
            self._unbound_at = None
            log.info("accepting connections again on %s", self.endpoint)

    @property
    def refusing(self) -> bool:
        return self._unbound_at is not None

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
