"""What stands between the daemon's socket and its engine loop: a tokenizing worker and a connection guard.

* `Intake`: big text prompts are tokenized on one worker thread (the `tokenizers` library
  releases the GIL), so a huge prompt does not stall the engine loop and everyone's streams;
  a structured request's grammar compiles in the engine's pool (`Engine.submit_grammar`),
  whose future it watches the same way. Finished ones wake the loop through the server's
  wakeup socket and are collected with `done()`.
* `ConnectionGuard`: libzmq aborts the whole process when accepting an ipc connection fails
  for lack of descriptors (EMFILE), so this counts the ROUTER's open connections with a
  socket monitor, on its own thread, and at `limit` (or when free descriptors run low)
  unbinds the endpoint (dropping its connections) and binds again after a pause.
  `connection_limit()` derives the limit from the descriptor limit, keeping headroom for
  accepts that land before the unbind and for the HTTP front end's share. For an ipc endpoint
  a sentinel process (sentinel.py) is the backstop for a guard thread kept off the CPU.
Details (the race it must win, as measured): docs/security.md, 'dsv4/daemon/intake.py'.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .sentinel import Sentinel
from .threads import start_thread

log = logging.getLogger("dsv4.daemon")

INLINE_TOKENIZE_BYTES = 16 << 10  # smaller text prompts are tokenized on the loop (cheaper than a hand-off)
MAX_CONNECTIONS = 4096
REBIND_PAUSE_S = 1.0
CHECK_EVERY = 8  # monitor events between two looks at the free descriptors


class Intake:
    """One worker thread running tokenization jobs, and the other futures a request waits for
    (its grammar's compile); finished ones come back through `done()`."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-tokenize")
        self._done: queue.SimpleQueue[tuple[str, str, Future]] = queue.SimpleQueue()
        self.pending = 0

    def submit(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run `fn(*args, **kwargs)` on the worker; `done()` later yields (key, "prompt", future)."""
        fut = self._pool.submit(fn, *args, **kwargs)
        self.watch(key, "prompt", fut)
        return fut

    def watch(self, key: str, what: str, fut: Future) -> None:
        """`done()` yields (key, what, fut) once `fut` is done (or cancelled), waking the loop."""
        self.pending += 1
        fut.add_done_callback(lambda f: (self._done.put((key, what, f)), self._wake()))

    def done(self) -> list[tuple[str, str, Future]]:
        """The futures finished since the last call (each holds its result or exception)."""
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


def descriptor_limit() -> int | None:
    """This process's soft limit on open descriptors (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_descriptors() -> int:
    """Descriptors this process has open now (every one allowed, when listing them needs one
    more than is free: the count must read "full" exactly then)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except FileNotFoundError:
        return 64  # no /proc: a typical count for a loaded engine
    except OSError:  # EMFILE/ENFILE: no descriptor left to list them with
        limit = descriptor_limit()
        return 1 << 20 if limit is None else limit


def free_descriptors() -> int | None:
    """Descriptors this process may still open (None: no limit)."""
    limit = descriptor_limit()
    return None if limit is None else limit - open_descriptors()


def headroom(soft: int) -> int:
    """Descriptors kept free of connections: files, ZeroMQ's own, and the accepts that land
    before the guard reacts (libzmq accepts faster than Python reads its events: a flood of
    2,000 local connects brought the last free descriptor within 5 of the limit at 64)."""
    return max(128, soft // 8)


def low_water(soft: int | None) -> int | None:
    """Free descriptors under which the endpoint stops accepting (None: no limit)."""
    return None if soft is None else 3 * headroom(soft) // 4


def connection_limit(maximum: int = MAX_CONNECTIONS, reserved: int = 0) -> int:
    """Open connections allowed: the free descriptors minus `headroom` and minus `reserved`
    (the HTTP front end's share), at most `maximum`."""
    soft = descriptor_limit()
    if soft is None:
        return maximum
    return max(1, min(maximum, soft - open_descriptors() - headroom(soft) - reserved))


class ConnectionGuard:
    """Watches the connections of a bound ROUTER socket; unbinds at `limit` (or when free
    descriptors fall under 3/4 of the headroom, or its `sentinel` shut the door), binds again
    after a pause.

    The monitor is read by a thread of its own ("dsv4-guard"), so the count follows the
    accepts at once whatever the loop is doing. Only the socket's holder may unbind it:
    the guard thread takes `lock` (the step watch's hand-off lock, free while the engine
    steps) when it can, and otherwise wakes the loop (`wake`), whose `handle()` unbinds;
    the step watch calls `handle_watch()` while it holds the socket during a slow step.
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, limit: int, on_bind: Callable[[], None],
                 lock: Any = None, wake: Callable[[], None] | None = None, sentinel: Sentinel | None = None) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.limit = limit
        self._on_bind = on_bind
        self._lock, self._wake = lock, wake
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.open = 0
        self.refusals = 0  # times the endpoint was unbound
        self._unbound_at: float | None = None
        self._over = threading.Event()  # the limit is reached: unbind at the next chance
        self._unbound = threading.Event()  # set while unbound
        soft = descriptor_limit()
        self._low_water = low_water(soft)
        self._near = False  # free descriptors under twice the low water mark when last looked at
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._sentinel = sentinel  # the backstop a Python thread cannot be (sentinel.py)
        self._sentinel_alive = sentinel is not None
        self._poller = zmq.Poller()
        self._poller.register(self.monitor, zmq.POLLIN)
        if self._sentinel is not None:
            self._poller.register(self._sentinel.fd, zmq.POLLIN)
        if lock is not None:
            self._thread = start_thread(self._run, "dsv4-guard")

    # ------------------------------------------------------------------ counting
    def _count(self, timeout_ms: int) -> None:
        """Read the monitor's events (waiting up to `timeout_ms` for the first) and flag the limit:
        `limit` connections counted, or free descriptors under the low water mark. The count
        lags the accepts (libzmq accepts faster than Python reads events), so the descriptors
        themselves are looked at every CHECK_EVERY events, and at every event once fewer than
        twice the low water mark are free (the events come slower than the accepts when
        another thread holds the GIL: each read waits for its turn)."""
        n = 0
        while True:
            if n == 0:
                try:
                    ready = dict(self._poller.poll(timeout_ms))
                except zmq.ZMQError:  # closed while stopping
                    return
                if not ready:
                    return
                if self._sentinel is not None and self._sentinel.fd in ready and self._sentinel_said_low():
                    return
            # the descriptors first, before the event that woke us is read: under a flood every
            # read waits for the GIL, and libzmq accepts meanwhile
            if (n % CHECK_EVERY == 0 or self._near) and self._unbound_at is None and self._low_water is not None:
                free = free_descriptors()
                if free is not None:
                    self._near = free < 2 * self._low_water  # near the mark: look before every event
                    if free < self._low_water:
                        self._over.set()
                        return
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed while stopping
                return
            n += 1
            if event == zmq.EVENT_ACCEPTED:
                self.open += 1
                if self._sentinel is not None:
                    self._sentinel.arm()
                if self.open >= self.limit and self._unbound_at is None:
                    self._over.set()
            elif event == zmq.EVENT_DISCONNECTED:
                self.open = max(0, self.open - 1)
            if self._over.is_set():
                return  # act now; the rest of the events can wait

    def _sentinel_said_low(self) -> bool:
        """Read the sentinel's reports (in the thread that polls, once its pipe is readable):
        True when it shut the door (unbind now). One that exited is left out of the poll; the
        guard works alone."""
        if self._sentinel is None or not self._sentinel_alive:
            return False
        said = self._sentinel.said_low()
        if said is None:
            self._sentinel_alive = False
            self._poller.unregister(self._sentinel.fd)
            log.warning("the connection sentinel exited (status %s): the connection guard works alone",
                        self._sentinel.proc.poll())
            return False
        if said and self._unbound_at is None:
            log.warning("free descriptors ran low: the connection sentinel shut %s (connects are "
                        "refused) before the guard could unbind it", self.endpoint)
            self._over.set()  # unbind (and bind a new socket file later)
            return True
        return False

    def _run(self) -> None:
        while not self._closed.is_set():
            self._count(100)
            if self._over.is_set() and self._unbound_at is None:
                if self._lock.acquire(blocking=False):  # the engine is stepping: the socket is free
                    try:
                        self._unbind()
                    except zmq.ZMQError as e:  # the loop tries again when it next holds the socket
                        log.warning("could not stop accepting connections: %s", e)
                    finally:
                        self._lock.release()
                elif self._wake is not None:
                    self._wake()  # the loop (or the step watch) holds it and unbinds
                    self._unbound.wait(0.05)  # and without waiting for this thread to give up the GIL

    # ------------------------------------------------------------------ the socket's holder
    def _unbind(self) -> None:
        if self._unbound_at is not None or self._closed.is_set():
            return
        log.warning("%d connections open (limit %d, from the descriptor limit): refusing connections "
                    "for %.0f s; every connection is dropped", self.open, self.limit, REBIND_PAUSE_S)
        if self._sentinel is not None:
            self._sentinel.unbound()
        self.sock.unbind(self.endpoint)  # also closes the listener's connections
        self.open = 0
        self.refusals += 1
        self._unbound_at = time.monotonic()
        self._unbound.set()
        self._over.clear()

    def handle_watch(self) -> None:
        """The step watch, holding the socket: unbind if the limit is reached."""
        if self._over.is_set():
            self._unbind()

    def handle(self) -> None:
        """The loop, holding the socket: count (without a guard thread), unbind at the limit,
        bind again once the pause is over and descriptors are free again."""
        if self._thread is None:
            self._count(0)
        if self._over.is_set():
            self._unbind()
        elif self._unbound_at is not None and time.monotonic() - self._unbound_at >= REBIND_PAUSE_S:
            free = free_descriptors()
            if free is not None and self._low_water is not None and free < 2 * self._low_water:
                self._unbound_at = time.monotonic()  # the dropped connections are not closed yet: wait more
                return
            self._unbound_at = None  # first: the guard thread watches the accepts from the bind on
            self._unbound.clear()
            try:
                self.sock.bind(self.endpoint)
            except zmq.ZMQError as e:  # descriptors gone again, or (tcp) the port taken meanwhile
                log.warning("cannot accept connections again on %s yet: %s; retrying in %.0f s",
                            self.endpoint, e, REBIND_PAUSE_S)
                self._unbound_at = time.monotonic()
                self._unbound.set()
                return
            self._on_bind()
            if self._sentinel is not None:
                self._sentinel.bound()  # after _on_bind: its chmod changes the file's ctime
            log.info("accepting connections again on %s", self.endpoint)

    @property
    def threaded(self) -> bool:
        """Its own thread reads the monitor (the loop must not poll it)."""
        return self._thread is not None

    @property
    def refusing(self) -> bool:
        return self._unbound_at is not None

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self._sentinel is not None:
            self._sentinel.close()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
