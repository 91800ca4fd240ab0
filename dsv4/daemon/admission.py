"""Admission of requests into the daemon: the gate before decoding, the request table, and
text prompts to token ids.

`Server` owns a `RequestTable` (clients, requests live in the engine, requests being
prepared) and an `Admission` gate that reads the server's socket, engine and limits:

    admit(client, frames)    API key (hmac.compare_digest, first), client limit (busy),
                             one frame, frame size (over the --max-model-len limit: too_large)
    early_pong(...)          on the step watch's thread during a slow step: right-key pings
    drop_client(...)         a client gone or silent: its requests cancelled
    generate(...)            request limit (busy), sampling params, text byte limit (before
                             tokenizing), then tokenize inline (small) or on the worker (big);
                             a structured request's grammar compiles in the engine's pool
    collect_prepared()       requests whose prompts and grammars are ready go to the engine
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from dsv4 import __version__
from dsv4.daemon import protocol as P
from dsv4.daemon.contract import ServedEngine
from dsv4.daemon.intake import INLINE_TOKENIZE_BYTES
from dsv4.engine.errors import RequestBusy

log = logging.getLogger("dsv4.daemon")

SHUTDOWN_MESSAGE = "the dsv4 daemon is shutting down; request cancelled"
EARLY_PING_BYTES = 1024  # the step watch decodes frames up to this size, looking for pings
DEAF_GRACE_S = 0.5  # the loop may go this long between reads of its socket before the gap counts as deaf


@dataclass
class Live:
    """A request in flight: who asked, under which id, and its per-token detokeniser (if wanted)."""

    client: bytes
    rid: str
    pieces: Any = None  # IncrementalDetokenizer when the client asked for per-token text
    end_client: str | None = None  # `Generate.client`: whom it counts for within its connection


@dataclass
class Pending:
    """A request waiting, off the loop, for its prompt's tokens and/or its grammar's compile."""

    client: bytes
    req: P.Generate
    params: Any
    prompt: str | list[int] | None = None  # once tokenized (or as sent)
    grammar: Any = None  # once compiled
    futures: list[Future] = field(default_factory=list)  # what it still waits for

    def cancel(self) -> None:
        """Drop what it waits for (a grammar's compile stops; a tokenization's result is ignored)."""
        for fut in self.futures:
            fut.cancel()


@dataclass
class ClientState:
    last_seen: float
    deaf_at_seen: float = 0.0  # the server's `deaf_s` then: deaf time since does not count as silence
    requests: dict[str, str] = field(default_factory=dict)  # client request id -> engine request id


@dataclass
class RequestTable:
    """Who is connected and which of their requests are in flight: owned by `Server`, read
    and written by its `Admission` gate and its loop (one thread: the daemon's loop)."""

    clients: dict[bytes, ClientState] = field(default_factory=dict)  # connection -> its state
    live: dict[str, Live] = field(default_factory=dict)  # engine request id -> a request in the engine
    pending: dict[str, Pending] = field(default_factory=dict)  # engine request id -> one being prepared
    next_id: int = 0  # the next engine request id's number

    def end_client(self, erid: str) -> str | None:
        """The end client (`Generate.client`) an engine request id counts for."""
        entry = self.live.get(erid) or self.pending.get(erid)
        return entry.end_client if isinstance(entry, Live) else entry.req.client if entry is not None else None


class Admission:
    """The gate of a `Server` (module docstring): it holds the server (whose socket, engine,
    limits and liveness it reads) and the server's `RequestTable`; the server calls `admit`,
    `generate`, `collect_prepared`, `early_pong`, `pong`, `drop_client`, `reap_silent_clients`."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.table: RequestTable = server.requests
        self.engine = server.engine
        self._last_reap = time.monotonic()  # when silent clients were last looked for

    def admit(self, client: bytes, body: list[bytes]) -> tuple[ClientState, bytes] | None:
        """The gate before a message is decoded: API key (constant time), client limit, one
        frame, frame size. Returns (client state, frame), or None after an error reply."""
        unkeyed = self._unkeyed(body)
        if unkeyed is None:
            self.server.send(client, P.error(None, P.ERR_UNAUTHORIZED, "missing or wrong API key: this daemon needs "
                                       "--api-key or DSV4_API_KEY"), reap=False)
            return
        body = unkeyed
        now = time.monotonic()
        state = self.table.clients.get(client)
        if state is None:
            if len(self.table.clients) >= self.server.max_clients:  # forget clients with nothing in flight first
                for idle in [c for c, st in self.table.clients.items() if not st.requests]:
                    del self.table.clients[idle]
            if len(self.table.clients) >= self.server.max_clients:
                self.server.send(client, P.error(P.request_id_of(body[-1]) if body else None, P.ERR_BUSY,
                                           f"the dsv4 daemon is busy: {len(self.table.clients)} "
                                           f"clients connected (the limit); try again later"), reap=False)
                return
            state = self.table.clients[client] = ClientState(last_seen=now)
        state.last_seen, state.deaf_at_seen = now, self.server.deaf_s
        if len(body) != 1:
            self.server.send(client, P.error(None, P.ERR_BAD_MESSAGE, f"expected one frame per message, got {len(body)}"))
            return
        if self.server.max_frame_bytes is not None and len(body[0]) > self.server.max_frame_bytes:
            self.server.send(client, P.error(P.request_id_of(body[0]), P.ERR_TOO_LARGE, f"message of {len(body[0])} bytes "
                                       f"exceeds the limit of {self.server.max_frame_bytes} bytes {self.server.frame_limit_reason}; "
                                       f"send a shorter prompt"))
            return
        return state, body[0]

    def _unkeyed(self, body: list[bytes]) -> list[bytes] | None:
        """The frames after the key frame (if any); None when this daemon's key is missing or
        wrong (compared in constant time). Reads no mutable state: the step watch calls it too."""
        if len(body) == 2 and body[0].startswith(P.KEY_PREFIX):
            key, body = body[0], body[1:]
        else:
            key = b""
        if self.server.key_frame is not None and not hmac.compare_digest(key, self.server.key_frame):
            return None
        return body

    def pong(self, rid: str) -> dict[str, Any]:
        limit = P.MAX_MESSAGE_BYTES if self.server.max_frame_bytes is None else min(self.server.max_frame_bytes, P.MAX_MESSAGE_BYTES)
        return P.pong(rid, pid=os.getpid(), version=__version__, protocol=P.PROTOCOL_VERSION, model=self.server.model_name,
                      endpoint=self.server.endpoint, settings=self.server.settings, state="stopping" if self.server.stop_reason else "ready",
                      max_message_bytes=limit, message_limit_reason=self.server.frame_limit_reason,
                      ranks=list(self.engine.ranks.pids) if self.engine.ranks is not None else [])

    def early_pong(self, client: bytes, body: list[bytes]) -> bool:
        """On the watch thread, during a step: answer a ping with the right key at once (True).
        Touches the socket (the watch holds it) and nothing the loop thread changes."""
        body = self._unkeyed(body)
        if body is None or len(body) != 1 or len(body[0]) > EARLY_PING_BYTES:
            return False
        try:
            req = P.decode_request(body[0])
        except P.ProtocolError:
            return False
        if not isinstance(req, P.Ping) or self.server.sock is None:
            return False
        pong = self.pong(req.id)
        step_s = self.server.watch.step_seconds() if self.server.watch is not None else None
        if step_s is not None:  # how long the step in progress has run: a client told nothing else sees a stuck one
            pong["step_s"] = round(step_s, 1)
        try:
            self.server.sock.send_multipart([client, P.encode(pong)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False  # the loop answers it after the step (or finds the client gone)
        return True

    def drop_client(self, client: bytes, why: str) -> None:
        state = self.table.clients.pop(client, None)
        if state is None:
            return
        if state.requests:
            log.info("client %s %s; cancelling %d request(s)", client.hex(), why, len(state.requests))
        for erid in list(state.requests.values()):
            # tell it too, in case it is alive after all (say, stopped for a while): best effort
            self.server.abort(erid, notify=True, error=f"request cancelled: client {why}")

    def reap_silent_clients(self) -> None:
        """Cancel the requests of clients not heard from for the heartbeat timeout, counting only
        time the daemon listened: not while it could not read its socket (`deaf_s`), and not at
        all while messages wait unread (a client's ping may be among them)."""
        now = time.monotonic()
        if now - self._last_reap < 0.5 or self.server.backlog or now - self.server.last_listen > DEAF_GRACE_S:
            return  # behind on reading, or held up since the last read: read first (the gap is deaf time)
        self._last_reap = now
        for client, state in list(self.table.clients.items()):
            silent = now - state.last_seen - (self.server.deaf_s - state.deaf_at_seen)
            if silent > self.server.heartbeat_timeout:
                self.drop_client(client, f"silent for {silent:.0f} s")

    def generate(self, client: bytes, state: ClientState, req: P.Generate) -> None:
        if self.server.stop_reason is not None:
            self.server.send(client, P.error(req.id, P.ERR_SHUTTING_DOWN, SHUTDOWN_MESSAGE))
            return
        if req.id in state.requests:
            self.server.send(client, P.error(req.id, P.ERR_DUPLICATE_ID, f"request id {req.id!r} is already in flight"))
            return
        try:
            params = self.engine.make_params(req.params)
        except (ValueError, TypeError) as e:  # RequestError is a ValueError
            self.server.send(client, P.error(req.id, P.ERR_INVALID_PARAMS, str(e)))
            return
        if len(self.table.live) + len(self.table.pending) >= self.server.max_requests:
            self.server.send(client, P.error(req.id, P.ERR_BUSY, f"the dsv4 daemon is busy: {self.server.max_requests} "
                                       f"requests in flight (the limit); try again later"))
            return
        mine = sum(1 for erid in state.requests.values() if self.table.end_client(erid) == req.client)
        if mine >= self.server.max_requests_per_client:
            who = f"client {req.client!r}" if req.client else "this connection"
            self.server.send(client, P.error(req.id, P.ERR_RATE_LIMITED, f"{who} has {mine} requests in flight, the "
                                       f"limit per client; wait for some to finish"))
            return
        erid = f"r{self.table.next_id}"
        self.table.next_id += 1
        prompt: str | list[int] = req.prompt
        structured = params.structured
        try:
            if req.tools and not isinstance(prompt, str):
                raise ValueError("tools are rendered into a text prompt; send the prompt as text, not token ids")
            if isinstance(prompt, str):
                self.engine.check_text_size(prompt, req.system)  # cheap: refuse before tokenizing
            big = isinstance(prompt, str) and len(prompt) + len(req.system or "") > INLINE_TOKENIZE_BYTES
            if not big:
                prompt = self._tokenize(req)  # a short text prompt (or ids): here
        except Exception as e:  # noqa: BLE001  (RequestError: this request only)
            self._reject(client, req, erid, e)
            return
        if not big and structured is None:
            self._add(client, state, req, params, erid, prompt)
            return
        # off the loop: tokenizing a big prompt (the intake's worker), compiling a grammar (the
        # engine's compile pool): the other requests' streams go on meanwhile
        pending = self.table.pending[erid] = Pending(client, req, params, prompt=None if big else prompt)
        state.requests[req.id] = erid
        if big:
            pending.futures.append(self.server.intake.submit(erid, self._tokenize, req))
        if structured is not None:
            fut = self.engine.submit_grammar(structured)
            pending.futures.append(fut)
            self.server.intake.watch(erid, "grammar", fut)

    def _tokenize(self, req: P.Generate) -> str | list[int]:
        """The prompt's ids (a text prompt with a tokenizer), else the prompt as sent; on the
        intake's worker for a big prompt, else inline."""
        prompt: str | list[int] = req.prompt
        if isinstance(prompt, str):
            prompt = self.engine.encode_request(prompt, prompt_mode=req.mode, system=req.system,
                                                thinking=req.thinking, tools=req.tools)
        return prompt

    def _reject(self, client: bytes, req: P.Generate, erid: str, e: BaseException) -> None:
        if not isinstance(e, ValueError):
            log.warning("request %s rejected: %s: %s", erid, type(e).__name__, e)
        self.server.send(client, P.error(req.id, *refusal(e)))

    def collect_prepared(self) -> None:
        """Queue the requests whose prompts are tokenized and grammars compiled (unless
        cancelled meanwhile); refuse those where either failed."""
        for erid, what, fut in self.server.intake.done():
            pending = self.table.pending.get(erid)
            if pending is None or fut.cancelled() or fut not in pending.futures:
                continue  # cancelled, or its client went away
            pending.futures.remove(fut)
            error = fut.exception()
            if error is None:
                if what == "prompt":
                    pending.prompt = fut.result()
                else:
                    pending.grammar = fut.result()
                if pending.futures:
                    continue  # still waiting for the other
            del self.table.pending[erid]
            pending.cancel()
            state = self.table.clients.get(pending.client)
            if state is not None:
                state.requests.pop(pending.req.id, None)
            if error is not None:
                self._reject(pending.client, pending.req, erid, error)
            elif state is not None:
                assert pending.prompt is not None
                self._add(pending.client, state, pending.req, pending.params, erid, pending.prompt, pending.grammar)

    def _add(self, client: bytes, state: ClientState, req: P.Generate, params: Any, erid: str,
             prompt: str | list[int], grammar: Any = None) -> None:
        """Hand one request to the engine (with its compiled grammar, if structured) and start tracking it."""
        if req.strict_length:
            why = _length_refusal(self.engine, prompt, params)
            if why:
                self.server.send(client, P.error(req.id, P.ERR_BAD_REQUEST, why))
                return
        try:
            # fair shares between connections, and between the end clients one connection names
            extra = {"grammar": grammar} if grammar is not None else {}
            leader = state.requests.get(req.follows) if req.follows else None
            if leader is not None and leader in self.table.live:  # a sibling sample: after its prefill
                extra["follows"] = leader
            self.engine.add_request(prompt, params, request_id=erid, prompt_mode=req.mode,
                                    system=req.system, thinking=req.thinking, client=(client, req.client), **extra)
        except Exception as e:  # noqa: BLE001  (RequestError, TokenizerError: this request only)
            self._reject(client, req, erid, e)
            return
        tokenizer = self.engine.tokenizer
        pieces = tokenizer.detokenizer() if req.pieces and tokenizer is not None else None
        self.table.live[erid] = Live(client, req.id, pieces, req.client)
        state.requests[req.id] = erid


def refusal(e: BaseException) -> tuple[str, str]:
    """The error code and line a refused request gets: busy (try again) or bad_request."""
    return P.ERR_BUSY if isinstance(e, RequestBusy) else P.ERR_BAD_REQUEST, str(e) or type(e).__name__


def _length_refusal(engine: ServedEngine, prompt: str | list[int], params: Any) -> str | None:
    """Why a request asking for `strict_length` cannot run ("max_tokens does not fit"), or None.

    As vLLM and OpenAI answer: prompt + max_tokens over max_model_len is refused. A prompt
    that alone leaves no room is left to the engine's own (more specific) refusal."""
    max_len, max_tokens = engine.max_model_len, params.max_tokens
    if not isinstance(prompt, list) or not isinstance(max_tokens, int):
        return None
    room = max_len - len(prompt)
    if room < 1 or max_tokens <= room:
        return None
    return (f"max_tokens {max_tokens} is too large: the context (--max-model-len {max_len}) leaves room for "
            f"{room} output tokens after the prompt's {len(prompt)}; send max_tokens <= {room}, or none "
            f"(generation then stops at the context's end with finish_reason 'length')")
