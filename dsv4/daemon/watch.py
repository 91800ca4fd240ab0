"""Pings answered while the engine steps, so that liveness does not depend on step latency.

Clients judge the daemon alive from its pongs, and a step may take minutes on a slow CPU,
so `StepWatch` lends the loop's ROUTER socket to a second thread for each slow step
(docs/daemon.md, 'dsv4/daemon/watch.py'):

    loop thread                          watch thread ("dsv4-watch")
    with watch.stepping():               every CHECK_S: has a step run for GRACE_S? then take
        engine.step()                      the socket (the lock), answer each ping at once,
    for held in watch.take_held(): ...     and hold every message for the loop (after the step)

One thread touches the socket at a time (the lock is the hand-off); a step under GRACE_S
never wakes the watch; held messages go through the normal admission path after the step,
in arrival order. A pong says the process lives, not that the step ends soon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import zmq

from .threads import start_thread

log = logging.getLogger("dsv4.daemon")

CHECK_S = 0.1  # how often the watch looks at the step in progress
GRACE_S = 0.2  # a step younger than this keeps the socket on the loop thread
POLL_MS = 10  # the watch's poll: the most a slow step's end waits for the socket to come back
HOLD_MESSAGES = 4096  # held beyond this (or HOLD_BYTES), the rest waits in ZeroMQ's queue
HOLD_BYTES = 16 << 20  # (two big prompts); a flood beyond waits, and so do pings behind it


@dataclass
class Held:
    """A message the watch received during a step; `answered`: its pong went out already."""

    client: bytes
    body: list[bytes]
    answered: bool


class StepWatch:
    """Answers pings on `sock` during slow steps (module docstring). Created by the thread
    that binds the socket; `stepping()` and `take_held()` are for the loop thread."""

    def __init__(self, sock: zmq.Socket, answer: Callable[[bytes, list[bytes]], bool]) -> None:
        self._sock = sock
        self._answer = answer  # on the watch thread: reply to a ping now (True) or leave it (False)
        self._lock = threading.Lock()
        self._lock.acquire()  # the loop thread holds the socket, except inside stepping()
        self.on_turn: Callable[[], None] | None = None  # called while the watch holds the socket (the guard)
        self._since: float | None = None  # when the step in progress began
        self._held: list[Held] = []
        self._held_bytes = 0
        self._closed = threading.Event()
        self._thread = start_thread(self._run, "dsv4-watch")

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The engine steps inside this block; the socket is the watch's to take meanwhile."""
        self._since = time.monotonic()
        self._lock.release()
        try:
            yield
        finally:
            self._since = None
            self._lock.acquire()  # waits at most POLL_MS for a watch that holds the socket

    @property
    def lock(self) -> threading.Lock:
        """Whoever holds it may use the socket (the connection guard's thread takes it while free)."""
        return self._lock

    def step_seconds(self) -> float | None:
        """How long the step in progress has run (None between steps); any thread may ask."""
        since = self._since
        return None if since is None else time.monotonic() - since

    def take_held(self) -> list[Held]:
        """The messages received during the last step, oldest first (loop thread, after the step)."""
        held, self._held, self._held_bytes = self._held, [], 0
        return held

    def close(self) -> None:
        """Stop the watch thread (the loop thread holds the socket: no step is in progress)."""
        self._closed.set()
        self._thread.join(1.0)

    # ------------------------------------------------------------------ the watch thread
    def _run(self) -> None:
        while not self._closed.wait(CHECK_S):
            since = self._since
            if since is None or time.monotonic() - since < GRACE_S:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # the step ended meanwhile: the loop thread has the socket again
            try:
                self._watch()
            except Exception:  # noqa: BLE001  (the loop handles whatever the watch could not)
                log.exception("the step watch failed")
            finally:
                self._lock.release()

    def _watch(self) -> None:
        """Holding the socket: receive until the step ends or the hold is full."""
        while self._since is not None and not self._closed.is_set():
            if self.on_turn is not None:
                self.on_turn()
            if len(self._held) >= HOLD_MESSAGES or self._held_bytes >= HOLD_BYTES:
                return
            if not self._sock.poll(POLL_MS, zmq.POLLIN):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            client, body = frames[0], frames[1:]
            held = Held(client, body, False)  # held first: an answer that fails loses nothing
            self._held.append(held)
            self._held_bytes += sum(len(f) for f in frames)
            held.answered = self._answer(client, body)


def rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def log_finished(out: Any) -> None:
    """One log line for a finished request: tokens, TTFT, TPOT, drafts accepted, error."""
    m = out.metrics or {}
    u, t, sp = m.get("usage") or {}, m.get("timings") or {}, m.get("spec") or {}
    ms = lambda v: "-" if not isinstance(v, (int, float)) else f"{v * 1000:.0f} ms"  # noqa: E731
    log.info("%s finished (%s): %s prompt + %s output tokens, ttft %s, tpot %s, drafts accepted %s/%s%s",
             out.request_id, out.finish_reason, u.get("prompt_tokens"), u.get("completion_tokens"),
             ms(t.get("ttft_s")), ms(t.get("tpot_s")), sp.get("accepted", 0), sp.get("drafted", 0),
             f", error: {out.error}" if out.error else "")
