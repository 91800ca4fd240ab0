"""One engine replica as the pool sees it (`Replica`: its process or link, its state, the
requests it holds, what it last reported) and one request it was sent (`Sent`)."""

from __future__ import annotations

import pickle
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_REMOTE_MESSAGE = 1 << 30  # bytes: a longer message from another host's replica loses that replica
LINGER_S = 5.0  # a remote replica told to stop has this long to close its end before ours closes
INBOX_MESSAGES = 64  # a remote replica's messages read ahead of the pool, at most


class Unreadable(Exception):
    """A message from another host's replica that this daemon cannot unpickle."""


@dataclass
class Replica:
    index: int
    cores: list[int]
    remote: bool = False  # on another host: joins node 0's desk (remote.py), is not spawned here
    host: str | None = None  # a remote one's address, once joined
    pid: int | None = None
    proc: Any = None
    conn: Any = None
    outbox: "queue.Queue[bytes | None]" = field(default_factory=queue.Queue)  # its sender thread's
    sender: threading.Thread | None = None
    # a remote one's messages are read whole by a thread of its own (a host that sends half a
    # message holds up only that thread): the messages, then the error that ended the link;
    # `wake` is readable while the inbox may hold some (the pool waits on it)
    inbox: "queue.Queue[bytes | BaseException]" = field(default_factory=queue.Queue)
    wake: socket.socket | None = None
    unread: threading.Event = field(default_factory=threading.Event)  # set: the pool reads it no more
    # starting, serving, dead (restarts used up), stopped; away: a remote one not joined (again) yet
    state: str = "starting"
    restarts: int = 0
    heard: float = 0.0  # when it last spoke (time.monotonic)
    requests: set[str] = field(default_factory=set)
    counters: dict[str, Any] = field(default_factory=dict)  # its latest beat (`Engine.counters`)
    facts: dict[str, Any] = field(default_factory=dict)  # what it said once loaded
    crash: str = ""  # what it said before exiting (a start failure, a step that raised)
    error: str = ""  # why it last died (status)

    def attach(self, conn: Any) -> None:
        """Talk over `conn` from now on (a pipe to its process, or a remote's link), sending
        from a thread of its own: a busy or frozen replica never holds up the pool."""
        self.conn, self.outbox, self.state, self.heard, self.counters, self.crash = (
            conn, queue.Queue(), "starting", time.monotonic(), {}, "")
        receiver = None
        if self.remote:
            self.inbox, (self.wake, bell) = queue.Queue(INBOX_MESSAGES), socket.socketpair()
            self.wake.setblocking(False)
            bell.setblocking(False)
            self.unread = threading.Event()
            receiver = threading.Thread(target=_receiver, args=(conn, self.inbox, bell, self.unread),
                                        name=f"dsv4-replica-{self.index}-recv", daemon=True)
            receiver.start()
        self.sender = threading.Thread(target=_sender, args=(conn, self.outbox, receiver),
                                       name=f"dsv4-replica-{self.index}-send", daemon=True)
        self.sender.start()

    @property
    def waitable(self) -> Any:
        """What the pool waits on for its messages: its pipe, or a remote one's `wake`."""
        return self.wake if self.remote else self.conn

    def message(self) -> tuple | None:
        """Its next message, or None when none has arrived whole. Raises EOFError or OSError
        when its connection ended, `Unreadable` for a remote message that does not unpickle."""
        if not self.remote:
            return self.conn.recv() if self.conn.poll() else None
        try:  # the wake bytes first: one written after this comes with a message still queued
            while self.wake.recv(4096):
                pass
        except OSError:  # nothing more to read (or closed)
            pass
        try:
            item = self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        try:
            return pickle.loads(item)
        except Exception as e:  # noqa: BLE001  (another host's bytes: anything may fail)
            raise Unreadable(f"{type(e).__name__}: {e}") from None

    def cut(self) -> None:
        """Stop talking to it: the connection is shut down now (a send blocked on it fails,
        a remote replica sees its end close) and closed by its sender thread."""
        _shutdown(self.conn)
        self.outbox.put(None)
        self.close_wake()

    def close_wake(self) -> None:
        """The pool reads no more from a remote one: its reader stops waiting for room, and
        `wake` is closed (the reader's bell then rings nowhere)."""
        self.unread.set()
        if self.wake is not None:
            self.wake.close()
            self.wake = None

    def row(self, routed: dict[str, int]) -> dict[str, Any]:
        """Its line of the pool's status."""
        return {"index": self.index, "pid": self.pid, "host": self.host, "cores": self.cores, "state": self.state,
                "restarts": self.restarts, "error": self.error or None, "in_flight": len(self.requests),
                **{k: self.counters.get(k, 0) for k in ("running", "waiting", "prefix_cache_queries",
                                                         "prefix_cache_hits", "prefix_cache_hit_rate")},
                "routed": dict(routed), "output_tokens": self.counters.get("completion_tokens", 0)}


@dataclass
class Sent:
    replica: int
    add: tuple  # the message that queued it, kept to send it elsewhere if its replica is lost
    streamed: bool = False
    resent: bool = False  # at most once



def _sender(conn: Any, outbox: "queue.Queue[bytes | None]", receiver: threading.Thread | None) -> None:
    """Send what the pool queued for one replica, in order, until None; then close the
    connection (only here, once its `receiver` has ended: the pool stops reading it before it
    queues None, so its descriptor cannot be reused while a thread still uses it)."""
    broken = False
    while (data := outbox.get()) is not None:
        if not broken:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):
                broken = True  # it died: the pool's next pump finds out
    if receiver is not None:  # closed with nothing unread, so that what was sent (a stop) arrives
        _shutdown(conn, socket.SHUT_WR)  # after it, our end: the replica stops and closes its end
        receiver.join(LINGER_S)  # which ends the reader (at once after `cut`)
        _shutdown(conn)
        receiver.join()
    conn.close()


def _shutdown(conn: Any, how: int = socket.SHUT_RDWR) -> None:
    """Shut `conn`'s socket down (both ways: a blocked send or read on it ends); a pipe, or a
    connection closed already, is left alone."""
    try:
        s = socket.socket(fileno=conn.fileno())
        try:
            s.shutdown(how)
        finally:
            s.detach()
    except (OSError, ValueError):
        pass


def _receiver(conn: Any, inbox: "queue.Queue[bytes | BaseException]", bell: socket.socket,
              unread: threading.Event) -> None:
    """Read a remote replica's messages whole into `inbox` (bounded: a host that sends faster
    than the pool reads waits, as TCP made it before), a byte on `bell` after each, until
    its link ends; then the error that ended it, as EOFError or OSError (what the pool takes
    as the link's end). Once `unread` is set (the pool reads no more) nothing waits for room."""
    def put(item: "bytes | BaseException") -> None:
        while not unread.is_set():
            try:
                inbox.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def ring() -> None:
        try:
            bell.send(b"\0")
        except OSError:  # full (a byte waits already), or the pool closed its end
            pass
    try:
        while not unread.is_set():
            put(conn.recv_bytes(MAX_REMOTE_MESSAGE))
            ring()
    except (EOFError, OSError) as e:  # closed, cut, too long
        put(e)
    except Exception as e:  # noqa: BLE001  (MemoryError, ...: this link ends, not the daemon)
        put(OSError(f"{type(e).__name__}: {e}"))
    finally:
        ring()
        bell.close()
