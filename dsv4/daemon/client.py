"""A client of the daemon: one DEALER socket, any number of requests in flight.

`Client.connect()` checks, before a byte is sent, that the socket directory can be trusted
(`paths.check_socket_dir`, else `UnsafePathError`), then the pid file's lock, that the
socket is a socket of ours, then pings with a timeout (ZeroMQ's `connect` succeeds with
nobody listening); failures raise `DaemonUnreachable` with the hint to start the daemon.
While waiting it pings every HEARTBEAT_INTERVAL_S and checks the daemon still lives. With
an API key (`api_key`, default `$DSV4_API_KEY`) a message is two frames: KEY_PREFIX + key.

    with Client(endpoint) as c:
        c.connect()
        rid = c.generate("Hello", {"max_tokens": 16})
        for msg in c.stream(rid):      # delta ... final (or error)
            ...
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from dsv4.daemon import protocol as P
from dsv4.daemon.paths import check_socket_dir, check_socket_file, daemon_pid, ipc_path

PING_TIMEOUT_S = 3.0
BUSY_PING_TIMEOUT_S = 30.0  # a live local daemon answers mid-step too (its step watch); margin for a loaded CPU
SILENCE_TIMEOUT_S = 60.0  # tcp only: no word from the daemon for this long means it is gone
NOT_RUNNING = "dsv4 daemon is not running; start it with 'dsv4 serve --detach'"
DROPPED = ("the dsv4 daemon dropped this connection (it refuses connections for a second when too many "
           "are open, or it stopped); the request was lost: run it again")


class DaemonUnreachable(Exception):
    """No daemon answers on the endpoint (exit status 69)."""


class DaemonTimeout(Exception):
    """The daemon did not answer in time (exit status 75)."""


class DaemonDropped(DaemonUnreachable):
    """The daemon dropped the connection with a request in flight (exit status 69)."""


class DaemonError(Exception):
    """The daemon answered with an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def new_id() -> str:
    return uuid.uuid4().hex[:16]


class Client:
    """A DEALER connection to the daemon at `endpoint`."""

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        self.endpoint = endpoint
        key = api_key if api_key is not None else os.environ.get("DSV4_API_KEY", "")
        self._key_frame = P.KEY_PREFIX + key.encode() if key else None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # the daemon drops every connection while it refuses them (a connection flood): a
        # request in flight on a dropped connection is lost, so `call` sends it again and a
        # stream ends with `DROPPED` instead of waiting out its timeout
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()  # a reply, or the monitor's word of a dropped connection
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(endpoint)
        self._last_sent = 0.0
        self._last_heard = time.monotonic()
        self._pending: list[dict[str, Any]] = []
        self.daemon: dict[str, Any] = {}  # the pong: pid, version, model, endpoint

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, linger_ms: int | None = None) -> None:
        if linger_ms is not None:
            self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close()
        self._ctx.term()

    # ------------------------------------------------------------------ basics
    def send(self, msg: dict[str, Any]) -> None:
        frame = P.encode(msg)
        if len(frame) > P.MAX_MESSAGE_BYTES:  # the daemon would drop it without a reply
            raise DaemonError(P.ERR_TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of "
                                               f"{P.MAX_MESSAGE_BYTES}; send a shorter prompt")
        if self._key_frame is not None:
            self._sock.send_multipart([self._key_frame, frame])
        else:
            self._sock.send(frame)
        self._last_sent = time.monotonic()

    def recv(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next message from the daemon, or None after `timeout_s` (None = wait forever).
        Raises `DaemonDropped` when the daemon dropped the connection meanwhile."""
        if self._pending:
            return self._pending.pop(0)
        ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        ready = dict(self._poller.poll(ms))
        if self._sock in ready:
            msg = P.decode_reply(self._sock.recv())
            self._last_heard = time.monotonic()
            return msg
        if self._monitor in ready and self._dropped():
            raise DaemonDropped(DROPPED)
        return None

    def _dropped(self) -> bool:
        """Read the monitor's disconnect events: whether there was one."""
        seen = False
        while True:
            try:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return seen
            seen = True

    def call(self, req: P.Request, timeout_s: float = PING_TIMEOUT_S) -> dict[str, Any]:
        """Send one request and wait for the reply with its id; keeps other messages for later.
        The requests sent this way (ping, status, shutdown, cancel) may be repeated: one lost on
        a dropped connection goes again (ZeroMQ queues it until the daemon accepts again)."""
        self._dropped()  # a drop before this request (reconnected since) did not lose it
        self.send(req.to_wire())
        deadline = time.monotonic() + timeout_s
        held = []
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    msg = self.recv(left) if left > 0 else None
                except DaemonDropped:
                    req = dataclasses.replace(req, id=new_id())  # a late answer to the first is not this one
                    self.send(req.to_wire())
                    continue
                if msg is None:
                    raise DaemonTimeout(f"the dsv4 daemon at {self.endpoint} did not answer '{req.TYPE}' "
                                        f"within {timeout_s:g} s")
                if msg.get("id") == req.id or (msg["type"] == "error" and msg.get("id") is None):
                    if msg["type"] == "error":
                        raise DaemonError(str(msg.get("code")), str(msg.get("message")))
                    return msg
                held.append(msg)
        finally:
            self._pending.extend(held)

    # ------------------------------------------------------------------ commands
    def connect(self, timeout_s: float = PING_TIMEOUT_S, deadline: float | None = None) -> dict[str, Any]:
        """Make sure a daemon answers; returns its pong. Raises `DaemonUnreachable`, or
        `DaemonTimeout` when the `deadline` (monotonic, e.g. `run --timeout`) passes first."""
        path = ipc_path(self.endpoint)
        if path is not None and not check_socket_dir(path.parent, create=False):
            raise DaemonUnreachable(NOT_RUNNING)
        if path is not None:
            pid = daemon_pid(self.endpoint)
            if pid is None:
                raise DaemonUnreachable(f"{NOT_RUNNING} (found a stale socket {path})" if path.exists()
                                        else NOT_RUNNING)
            if not check_socket_file(path):
                raise DaemonUnreachable(f"the dsv4 daemon (pid {pid}) is still starting (loading the model); "
                                        f"try again shortly")
            timeout_s = max(timeout_s, BUSY_PING_TIMEOUT_S)  # its pid is alive: it may be mid-step
        if deadline is not None and deadline - time.monotonic() < timeout_s:
            try:
                self.daemon = self.call(P.Ping(new_id()), max(0.0, deadline - time.monotonic()))
            except DaemonTimeout:
                raise DaemonTimeout(f"the dsv4 daemon at {self.endpoint} did not answer before the timeout "
                                    f"(see --timeout)") from None
            return self.daemon
        try:
            self.daemon = self.call(P.Ping(new_id()), timeout_s)
        except DaemonTimeout:
            pid = daemon_pid(self.endpoint)
            if pid is not None and pid > 0:
                stopped = stopped_ranks(spawned_ranks(pid))
                why = (f"a tensor-parallel rank is not answering ({stopped})" if stopped else
                       "it is stuck (its socket is bound: the model is loaded)" if path is not None else
                       "is it still loading the model?")
                raise DaemonUnreachable(f"the dsv4 daemon (pid {pid}) does not answer on {self.endpoint} "
                                        f"within {timeout_s:g} s; {why}") from None
            raise DaemonUnreachable(NOT_RUNNING if path is not None else
                                    f"no dsv4 daemon answers on {self.endpoint}; start it with "
                                    f"'dsv4 serve --detach --socket {self.endpoint}'") from None
        return self.daemon

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The daemon's status; `DaemonTimeout` saying why when it is stuck in a step (a pong
        answered mid-step gives the step's age and the daemon's tensor-parallel ranks)."""
        try:
            return dict(self.call(P.Status(new_id()), timeout_s).get("status") or {})
        except DaemonTimeout as e:
            try:
                pong = self.call(P.Ping(new_id()), PING_TIMEOUT_S)
            except (DaemonTimeout, DaemonError):
                raise e from None
            if pong.get("step_s") is None:
                raise
            line = (f"the dsv4 daemon (pid {pong.get('pid')}) did not answer 'status' within {timeout_s:g} s: "
                    f"its engine step has run for {pong['step_s']:g} s")
            ranks = [r for r in pong.get("ranks") or [] if isinstance(r, int)]
            if ranks:
                stopped = stopped_ranks(ranks)
                line += f"; a tensor-parallel rank is not answering{f' ({stopped})' if stopped else ''}"
            raise DaemonTimeout(line) from None

    def shutdown(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self.call(P.Shutdown(new_id()), timeout_s)

    def generate(self, prompt: str | list[int], params: dict[str, Any], *, mode: str = "auto",
                 system: str | None = None, thinking: bool = False, pieces: bool = False,
                 request_id: str | None = None, tools: list[Any] | None = None) -> str:
        """Submit a generate request; returns its id. Replies come through `recv` / `stream`."""
        rid = request_id or new_id()
        self._dropped()  # a drop before this request (reconnected since) did not lose it
        self.send(P.Generate(rid, prompt=prompt, mode=mode, system=system, thinking=thinking,
                             params=params, pieces=pieces, tools=tools).to_wire())
        return rid

    def cancel(self, rid: str, wait_s: float = 1.0) -> None:
        """Ask the daemon to cancel `rid`; waits briefly for its answer."""
        try:
            self.call(P.Cancel(new_id(), target=rid), wait_s)
        except (DaemonTimeout, DaemonError):
            pass

    # ------------------------------------------------------------------ streaming
    def heartbeat(self) -> None:
        """Ping if nothing was sent for a heartbeat interval; raise if the daemon died."""
        now = time.monotonic()
        if now - self._last_sent >= P.HEARTBEAT_INTERVAL_S:
            self.send(P.Ping(new_id()).to_wire())
        if now - self._last_heard > 2 * P.HEARTBEAT_INTERVAL_S + 1:
            if ipc_path(self.endpoint) is not None:
                if daemon_pid(self.endpoint) is None:
                    raise DaemonUnreachable("the dsv4 daemon went away")
            elif now - self._last_heard > SILENCE_TIMEOUT_S:
                raise DaemonUnreachable(f"no word from the dsv4 daemon for {SILENCE_TIMEOUT_S:g} s")

    def events(self, deadline: float | None = None) -> Iterator[dict[str, Any]]:
        """All replies other than pongs, heartbeating meanwhile; DaemonTimeout past `deadline` (monotonic)."""
        while True:
            wait = P.HEARTBEAT_INTERVAL_S / 2
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise DaemonTimeout("timed out waiting for the dsv4 daemon")
            msg = self.recv(wait)
            self.heartbeat()
            if msg is not None and msg["type"] != "pong":
                yield msg

    def stream(self, rid: str, deadline: float | None = None) -> Iterator[dict[str, Any]]:
        """Deltas of `rid`, then its final message; an error reply raises `DaemonError`."""
        for msg in self.events(deadline):
            if msg.get("id") != rid and msg.get("id") is not None:
                continue
            if msg["type"] == "error":
                raise DaemonError(str(msg.get("code")), str(msg.get("message")))
            if msg["type"] in ("delta", "final"):
                yield msg
                if msg["type"] == "final":
                    return


def wait_for_release(endpoint: str, timeout_s: float, pid: int | None = None) -> bool:
    """Wait until no process holds the pid lock of `endpoint` (the daemon removed its files)
    and, for a local (ipc) daemon with a known `pid`, until that process is gone; False on timeout.

    A daemon that exited but was not yet reaped by its parent (a zombie) counts as gone.
    """
    deadline = time.monotonic() + timeout_s
    while daemon_pid(endpoint) is not None or (pid and ipc_path(endpoint) is not None and _alive(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to a signal probe
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def spawned_ranks(pid: int) -> list[int]:
    """The pids of `pid`'s tensor-parallel ranks on this host (its `multiprocessing` spawn
    children, read from /proc; empty elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"multiprocessing.spawn" in f.read():
                    found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def stopped_ranks(pids: list[int]) -> str:
    """'rank process N is stopped' for those of `pids` that are stopped (SIGSTOP) or traced; '' if none."""
    stopped = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in (b"T", b"t"):
            stopped.append(pid)
    if not stopped:
        return ""
    return f"rank process{'es' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} " \
           f"{'are' if len(stopped) > 1 else 'is'} stopped"
