"""The daemon's serving loop: one ROUTER socket in front of one engine.

    while not stopping:
        poll the socket (and the signal pipe): 0 ms while the engine has work, else up to 1 s
        handle every message waiting (ping, status, generate, cancel, shutdown)
        if the engine has work: outputs = engine.step(); stream each to its client
        handle the messages the step watch held during the step
        cancel the requests of clients that went silent

One thread owns the engine and, except during a slow step (`watch.StepWatch`), the socket.
A request is known by (client routing id, its id) and gets an engine request id of its
own; a client gone or silent has its requests aborted. Nothing raised while handling one
message reaches the loop, and untrusted input is refused cheaply (docs/security.md).
Details: docs/daemon.md, 'dsv4/daemon/server.py'.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import time
from typing import Any

import zmq

from dsv4 import __version__
from dsv4.daemon import protocol as P
from dsv4.daemon.admission import DEAF_GRACE_S, SHUTDOWN_MESSAGE, Admission, Live, RequestTable, refusal
from dsv4.daemon.contract import ServedEngine
from dsv4.daemon.intake import ConnectionGuard, Intake, connection_limit, descriptor_limit, low_water
from dsv4.daemon.sentinel import start as start_sentinel
from dsv4.daemon.paths import ipc_path
from dsv4.daemon.watch import StepWatch, log_finished, rss_bytes
from dsv4.engine.errors import EngineFailed

IDLE_POLL_MS = 1000
MAX_MESSAGES_PER_TURN = 256
MAX_BYTES_PER_TURN = 1 << 20  # while the engine has work: then the next step runs
FRAME_SLACK_BYTES = 64 << 10  # a request's fields besides prompt and system (params, stop strings, ids)
SEND_HWM = 100_000
LISTEN_BACKLOG = 16
HANDSHAKE_IVL_MS = 5000  # connections that do not complete the ZeroMQ handshake are closed after this
MAX_CLIENTS = 256  # with requests in flight (idle ones are forgotten when the table is full)
MAX_REQUESTS = 1024  # in flight (running, waiting, being tokenized) over all clients
MAX_REQUESTS_PER_CLIENT = 256  # in flight for one client (a connection, or an end client it names)

log = logging.getLogger("dsv4.daemon")


RANK_FAILURE = "engine failure"  # stop reason (a broken tensor-parallel group, no replica left): exit non-zero


class Server:
    """Serve `engine` on `endpoint` until `request_stop` (a signal, or a `shutdown` message)."""

    def __init__(self, engine: ServedEngine, endpoint: str, *, model_name: str = "",
                 heartbeat_timeout: float = P.HEARTBEAT_TIMEOUT_S, also_bind: tuple[str, ...] = (),
                 context: zmq.Context | None = None, api_key: str | None = None,
                 settings: dict[str, Any] | None = None, max_clients: int = MAX_CLIENTS,
                 max_requests: int = MAX_REQUESTS, max_connections: int | None = None,
                 max_requests_per_client: int = MAX_REQUESTS_PER_CLIENT,
                 test_step_delay_s: float | None = None) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.also_bind = also_bind  # more endpoints for the same ROUTER (the HTTP front end's inproc://)
        self._given_ctx = context  # inproc:// peers need the ROUTER's context; it is terminated by close()
        self.model_name = model_name
        self.heartbeat_timeout = heartbeat_timeout
        self.started = time.time()
        self.stop_reason: str | None = None
        self.requests = RequestTable()  # clients and their requests in flight (the gate's too)
        # Time the daemon could not read its socket (its loop held up outside a step, whose watch
        # listens): it never counts against a client's heartbeat (`Admission.reap_silent_clients`).
        self.deaf_s = 0.0
        self.last_listen = time.monotonic()
        self.backlog = False  # the last drain left messages unread (its turn's budget ran out)
        self._ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._signals = False
        self.key_frame = P.KEY_PREFIX + api_key.encode() if api_key else None
        self.settings = dict(settings or {})
        self.max_clients = max_clients
        self.max_requests = max_requests
        self.max_requests_per_client = max_requests_per_client
        self.max_connections = max_connections or connection_limit()
        # Frames larger than any acceptable request are refused before decoding (cheap):
        # text up to the byte limit (prompt + system), or max_model_len token ids, plus room for the rest.
        if engine.max_text_bytes:
            self.max_frame_bytes: int | None = engine.max_text_bytes + 9 * engine.max_model_len + FRAME_SLACK_BYTES
            self.frame_limit_reason = f"for --max-model-len {engine.max_model_len}"
        else:
            self.max_frame_bytes, self.frame_limit_reason = None, ""
        self.intake = Intake(lambda: self._wake_w.send(b"\0"))
        self._guard: ConnectionGuard | None = None
        self.watch: StepWatch | None = None
        # tests only: every step this much slower, as on a busy machine (default: $DSV4_TEST_STEP_DELAY_S)
        self.test_step_delay_s = test_step_delay_s if test_step_delay_s is not None else _test_step_delay()
        self.admission = Admission(self)  # the gate: key, floods, sampling parameters, tokenizing, grammars

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Create and bind the ROUTER socket (socket file mode 0600 for ipc)."""
        self._ctx = self._given_ctx or zmq.Context()
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, SEND_HWM)
        s.setsockopt(zmq.MAXMSGSIZE, 2 * P.MAX_MESSAGE_BYTES)  # beyond this the peer is dropped
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        s.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)  # the most accepts in one burst (a flood meeting a rebind)
        soft = descriptor_limit()  # the sentinel runs before the door opens; its path is the one
        # libzmq binds, unnormalised (what /proc/net/unix shows)
        sentinel = (start_sentinel(self.endpoint[len("ipc://"):], soft, low_water(soft))
                    if ipc_path(self.endpoint) is not None else None)
        try:
            s.bind(self.endpoint)
            for extra in self.also_bind:
                s.bind(extra)
        except zmq.ZMQError:
            if sentinel is not None:
                sentinel.close()
            s.close(0)
            if self._given_ctx is None:  # a given context is its owner's to end
                self._ctx.term()
            self._ctx = None
            raise
        self.sock = s
        try:
            self._private_socket_file()
            if sentinel is not None:
                sentinel.bound()
            self.watch = StepWatch(s, self.admission.early_pong)
            self._guard = ConnectionGuard(s, self.endpoint, self.max_connections, self._private_socket_file,
                                          lock=self.watch.lock, wake=self._wake, sentinel=sentinel)
        except BaseException:
            if sentinel is not None:
                sentinel.close()
            raise
        self.watch.on_turn = self._guard.handle_watch

    def _private_socket_file(self) -> None:
        path = ipc_path(self.endpoint)
        if path is not None:
            os.chmod(path, 0o600)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop; the wakeup pipe makes a blocking poll return at once."""
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._signals = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda n, _f: self.request_stop(signal.Signals(n).name))

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._wake()

    def _wake(self) -> None:
        """Make the loop's poll return now (any thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def close(self) -> None:
        """Cancel what is in flight (telling clients), close the socket, remove the socket file."""
        self.intake.close()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self.sock is not None:
            self._cancel_all(SHUTDOWN_MESSAGE)
            self.sock.close()  # LINGER lets the final messages go out
            self.sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        path = ipc_path(self.endpoint)
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if self._signals:
            signal.set_wakeup_fd(-1)
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ the loop
    def serve_forever(self) -> str:
        """Run until stopped; returns the reason."""
        assert self.sock is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._guard is not None and not self._guard.threaded:
            poller.register(self._guard.monitor, zmq.POLLIN)
        while self.stop_reason is None:
            busy = self._has_work()
            self._listening()  # a long gap since the last read is deaf time
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            self.last_listen = time.monotonic()  # the poll itself listened (an idle wait is not deaf time)
            if self._guard is not None:
                self._guard.handle()
            if self._wake_r.fileno() in events or self._wake_r in events:
                self._drain_wake()
            self.admission.collect_prepared()
            self.backlog = False
            if self.sock in events:
                self._drain_socket()
            self.admission.reap_silent_clients()  # after draining: a long step must not make everyone look silent
            if self.stop_reason is None and self._has_work():
                self._listening()
                self._step()
                self.last_listen = time.monotonic()  # the step watch listened meanwhile
                self._handle_held()
            elif not busy:
                self._idle_tick()
        self._handle_held()  # requests sent during the last step get their refusal
        log.info("stopping (%s); cancelling %d request(s) in flight", self.stop_reason, len(self.requests.live))
        self._cancel_all(SHUTDOWN_MESSAGE)
        return self.stop_reason

    def _idle_tick(self) -> None:
        """While idle: let the engine install compiled buckets a background build finished
        (it also does so before each step)."""
        try:
            self.engine.poll_compiled()
        except Exception:  # noqa: BLE001 (a failed load leaves the bucket eager; serving goes on)
            log.exception("installing compiled buckets failed")

    def _cancel_all(self, error: str, reason: str = "abort") -> None:
        for erid in [*self.requests.live, *self.requests.pending]:
            self.abort(erid, notify=True, error=error, reason=reason)

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished())
        except Exception:  # noqa: BLE001
            log.exception("engine.has_unfinished failed")
            return False

    def _listening(self) -> None:
        """Mark a point where the daemon reads its socket: a gap longer than DEAF_GRACE_S since
        the previous one was time no client could be heard, added to `deaf_s`."""
        now = time.monotonic()
        gap = now - self.last_listen
        if gap > DEAF_GRACE_S:
            self.deaf_s += gap
            log.warning("the daemon did not read its socket for %.1f s; not counted against clients", gap)
        self.last_listen = now

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _drain_socket(self) -> None:
        """Handle waiting messages: up to MAX_MESSAGES_PER_TURN, and while the engine has work
        up to MAX_BYTES_PER_TURN, so a flood of big messages cannot starve the streams."""
        assert self.sock is not None
        budget = MAX_BYTES_PER_TURN if self._has_work() else None
        for _ in range(MAX_MESSAGES_PER_TURN):
            if budget is not None and budget <= 0:
                self.backlog = True
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if budget is not None:
                budget -= sum(len(f) for f in frames)
            self._handle_safely(frames[0], frames[1:])
        self.backlog = True  # messages may wait still: their senders are not silent

    def _handle_held(self) -> None:
        """The messages the step watch received during the last step, oldest first."""
        if self.watch is not None:
            for held in self.watch.take_held():
                self._handle_safely(held.client, held.body, answered=held.answered)

    def _handle_safely(self, client: bytes, body: list[bytes], answered: bool = False) -> None:
        try:
            self._handle(client, body, answered)
        except Exception:  # noqa: BLE001  (a bug here must not take the daemon down)
            log.exception("error while handling a message")
            rid = P.request_id_of(body[-1]) if body else None  # the request's own error, when it names one
            self.send(client, P.error(rid, P.ERR_INTERNAL, "internal error in the daemon; see its log"))

    # ------------------------------------------------------------------ messages
    def _handle(self, client: bytes, body: list[bytes], answered: bool = False) -> None:
        """One message; `answered`: a ping the step watch has answered already."""
        admitted = self.admission.admit(client, body)
        if admitted is None:
            return
        state, frame = admitted
        try:
            req = P.decode_request(frame)
        except P.ProtocolError as e:
            log.warning("rejected a message: %s: %s", e.code, e.message)
            self.send(client, P.error(e.request_id, e.code, e.message))
            return
        if isinstance(req, P.Ping):
            if not answered:
                self.send(client, self.admission.pong(req.id))
        elif isinstance(req, P.Status):
            self.send(client, P.status_reply(req.id, self.status()))
        elif isinstance(req, P.Shutdown):
            self.send(client, P.ok(req.id, pid=os.getpid()))
            self.request_stop("stop requested by a client")
        elif isinstance(req, P.Cancel):
            erid = state.requests.get(req.target)
            if erid is not None:
                self.abort(erid, notify=True)
            self.send(client, P.ok(req.id, cancelled=erid is not None))
        elif isinstance(req, P.Generate):
            self.admission.generate(client, state, req)

    # ------------------------------------------------------------------ engine
    def _step(self) -> None:
        try:
            if self.watch is None:
                outputs = self.engine.step()
            else:
                with self.watch.stepping():
                    if self.test_step_delay_s:
                        time.sleep(self.test_step_delay_s)
                    outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed; failing the requests in flight")
            self._cancel_all(f"engine step failed: {type(e).__name__}: {e}", reason="error")
            if self.engine.ranks is not None or isinstance(e, EngineFailed):  # a broken group, no replica left
                self.stop_reason = RANK_FAILURE
            return
        for out in outputs:
            live = self.requests.live.get(out.request_id)
            if live is None:
                continue  # cancelled meanwhile
            if out.refusal is not None:  # refused where it was queued (an engine replica): as admission refuses
                self._forget(out.request_id)
                self.send(live.client, P.error(live.rid, *refusal(out.refusal)))
                continue
            for msg in P.output_messages(live.rid, out, live.pieces):
                if msg["type"] == "final":
                    self._forget(out.request_id)
                    self.send(live.client, msg)
                    log_finished(out)
                elif not self.send(live.client, msg):
                    break  # the client is gone; its requests are cancelled

    def abort(self, erid: str, *, notify: bool, error: str | None = None, reason: str = "abort") -> None:
        pending = self.requests.pending.pop(erid, None)
        if pending is not None:  # still being tokenized or compiled: dropped (a compile's worker is stopped)
            pending.cancel()
            state = self.requests.clients.get(pending.client)
            if state is not None:
                state.requests.pop(pending.req.id, None)
            live: Live | None = Live(pending.client, pending.req.id)
        else:
            live = self._forget(erid)
            try:
                self.engine.abort(erid)
            except Exception:  # noqa: BLE001
                log.exception("engine.abort(%s) failed", erid)
        if live is not None:
            log.info("%s %s%s", erid, "cancelled" if reason == "abort" else "failed", f": {error}" if error else "")
        if notify and live is not None:
            self.send(live.client, P.final(live.rid, reason, error), reap=False)

    def _forget(self, erid: str) -> Live | None:
        live = self.requests.live.pop(erid, None)
        if live is not None:
            state = self.requests.clients.get(live.client)
            if state is not None:
                state.requests.pop(live.rid, None)
        return live

    def send(self, client: bytes, msg: dict[str, Any], reap: bool = True) -> bool:
        """Send one message; on an unreachable client cancel its requests and return False."""
        if self.sock is None:
            return False
        try:
            self.sock.send_multipart([client, P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                log.warning("send failed: %s", e)
            if reap:
                self.admission.drop_client(client, "unreachable" if e.errno == errno.EHOSTUNREACH else "not reading")
            return False

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Engine status plus the daemon's own facts."""
        try:
            engine_status = dict(self.engine.status())
        except Exception as e:  # noqa: BLE001
            engine_status = {"engine_error": f"{type(e).__name__}: {e}"}
        return {
            **engine_status,
            "pid": os.getpid(),
            "version": __version__,
            "protocol": P.PROTOCOL_VERSION,
            "endpoint": self.endpoint,
            "uptime_s": round(time.time() - self.started, 3),
            "clients": sum(1 for c in self.requests.clients.values() if c.requests),  # with requests in flight
            "in_flight": len(self.requests.live) + len(self.requests.pending),
            "connections": self._guard.open if self._guard is not None else None,
            "max_connections": self.max_connections,
            "memory_rss_bytes": rss_bytes(),
        }


def _test_step_delay() -> float:
    """$DSV4_TEST_STEP_DELAY_S: seconds added to every engine step, for the liveness tests."""
    text = os.environ.get("DSV4_TEST_STEP_DELAY_S", "").strip()
    return float(text) if text else 0.0

