"""The OpenAI-compatible HTTP API (Starlette): /v1/models, /v1/completions, /v1/chat/completions,
/health, /metrics, and vLLM's /tokenize and /detokenize. What clients may rely on is in the README,
"OpenAI-compatible HTTP API".

Each HTTP request becomes one daemon `generate` per prompt, sent through the `Bridge`
(one DEALER for the whole app); the reply queue is read until the final message.

* Errors: OpenAI's shape `{"error": {message, type, param, code}}`; 400 for bad bodies and
  parameters (the daemon's `SamplingParams.validate` message, fields dsv4 does not honour,
  a `max_tokens` that does not fit in --max-model-len after the prompt, as vLLM does),
  401 for a wrong key, 404 for unknown models and routes, 413 for bodies over
  MAX_BODY_BYTES and prompts over the daemon's message limit, 400 for more prompts than
  --max-prompts-per-request, 503 when the daemon does not answer a new request or its
  queue is full (`dsv4.http.submit`). Each request counts for a client (its `user`, else
  its peer address) in the engine's fair shares of slots.
* Streams start with their first text (so a request that fails before it still gets its
  HTTP status). A stream that fails after that ends with `data: {"error": ...}` and no
  `data: [DONE]`: the `openai` client raises `APIError` on that event, and a client that
  waits for `[DONE]` sees the stream cut, never a clean end to a partial answer.
* A request in flight waits for the daemon however long its steps take: only the daemon
  ends it (its final reply, an error, or the abort it sends when it stops), never a missed
  heartbeat (`Bridge.alive` only gates new requests and /health). A client that
  disconnects cancels its requests (the generator's `finally`, or the disconnect watch of
  non-streaming requests).
* Thinking mode: text before `</think>` is `reasoning_content`, the rest `content`.
* /tokenize answers `{count, max_model_len, tokens, token_strs}` with exactly the ids a chat
  (`messages`) or completion (`prompt`) request would send; /detokenize `{prompt}`. Both
  tokenize on a worker thread (a body may hold 8 MiB of text) and need the key like /v1/*.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv4.daemon import protocol as P
from dsv4.http.bridge import Bridge, DaemonUnavailable
from dsv4.http.guard import decode_json
from dsv4.http.metrics import Metrics
from dsv4.http.requests import ApiError, Parsed, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from dsv4.http.stream import ReasoningSplitter
from dsv4.http.submit import DEFAULT_MAX_PROMPTS, client_of, submit

MAX_BODY_BYTES = 8 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DAEMON_STATUS = {P.ERR_SHUTTING_DOWN: 503, P.ERR_BUSY: 503, P.ERR_INTERNAL: 500}


def error_response(e: ApiError) -> JSONResponse:
    headers = {"x-should-retry": "false"} if e.status < 500 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Api:
    """State of the HTTP app: the served model, the bridge, the metrics, the API key."""

    def __init__(self, *, model_name: str, model_path: str, max_model_len: int, tokenizer: Any,
                 ctx: Any, endpoint: str, api_key: str | None = None, max_prompts: int | None = None) -> None:
        self.model_name, self.model_path, self.max_model_len = model_name, model_path, max_model_len
        self.tokenizer, self.api_key = tokenizer, api_key
        self.max_prompts = max_prompts or DEFAULT_MAX_PROMPTS  # per request (--max-prompts-per-request)
        self._ctx, self._endpoint = ctx, endpoint
        self.bridge: Bridge | None = None
        self.metrics = Metrics(model_name)
        self.created = int(time.time())

    # ------------------------------------------------------------------ plumbing
    async def startup(self) -> None:
        import zmq.asyncio

        self.bridge = Bridge(zmq.asyncio.Context.shadow(self._ctx.underlying), self._endpoint,
                             self.api_key)  # in the loop
        await self.bridge.start()

    async def shutdown(self) -> None:
        if self.bridge is not None:
            await self.bridge.close()

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        body = decode_json(b"".join(chunks))  # 400 for what no later stage could take (dsv4.http.guard)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (self.model_name, self.model_path):
            raise ApiError(404, f"the model {model!r:.80} does not exist; this server serves "
                                f"{self.model_name!r}", "model", code="model_not_found")
        return body

    async def _submit(self, parsed: Parsed, client: str, chat: bool) -> tuple[asyncio.Queue, list[str]]:
        """The prompts to the daemon (dsv4.http.submit: cap, size, busy, fair-share client)."""
        assert self.bridge is not None
        return await submit(self.bridge, parsed, client=client, max_prompts=self.max_prompts,
                            param="messages" if chat else "prompt")

    def _cancel(self, rids: list[str]) -> None:
        for rid in rids:
            if self.bridge is not None:
                self.bridge.cancel(rid)

    @staticmethod
    def _daemon_error(msg: dict[str, Any]) -> ApiError:
        """An `error` reply, or a final that ended in error/abort, as an ApiError."""
        if msg["type"] == "error":
            return ApiError(_DAEMON_STATUS.get(str(msg.get("code")), 400), str(msg.get("message")))
        reason = msg.get("finish_reason")
        return ApiError(503 if reason == "abort" else 500, str(msg.get("error") or f"request ended: {reason}"))

    @staticmethod
    async def _next(q: asyncio.Queue, gone: asyncio.Task | None) -> dict[str, Any]:
        """The next reply, however long it takes (the daemon ends every request it accepted,
        and `Bridge.close` ends the rest); `_ClientGone` once the `gone` watch saw the client leave."""
        if gone is None:
            return await q.get()
        if gone.done():
            raise _ClientGone
        getter = asyncio.ensure_future(q.get())
        try:
            await asyncio.wait((getter, gone), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request's task was cancelled (shutdown): no getter left behind
            getter.cancel()
            raise
        if getter.done():
            return getter.result()
        getter.cancel()  # asyncio.Queue.get loses no item when cancelled
        raise _ClientGone

    # ------------------------------------------------------------------ endpoints
    async def models(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "dsv4",
            "root": self.model_path, "parent": None, "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        if self.bridge is None or not self.bridge.alive:
            loading = self.bridge is not None and self.bridge.last_pong is None
            return JSONResponse({"status": "loading" if loading else "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        self._auth(request)  # token counts and latencies are the key holder's; /health stays open and minimal
        if self.bridge is not None and self.bridge.alive:
            try:
                self.metrics.set_queue(await self.bridge.status())
            except DaemonUnavailable:
                pass
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        self._auth(request)
        body = await self._body(request)
        return await self._serve(request, parse_completion(body), chat=False, client=client_of(request, body))

    async def chat(self, request: Request) -> Response:
        self._auth(request)
        body = await self._body(request)
        return await self._serve(request, parse_chat(body, self.tokenizer), chat=True, client=client_of(request, body))

    async def tokenize(self, request: Request) -> Response:
        self._auth(request)
        body = await self._body(request)
        strs = body.get("return_token_strs")
        if strs is not None and not isinstance(strs, bool):
            raise ApiError(400, "return_token_strs must be true or false", "return_token_strs")
        ids = await asyncio.to_thread(parse_tokenize, body, self.tokenizer)
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": [self.tokenizer.id_to_token(i) for i in ids] if strs else None})

    async def detokenize(self, request: Request) -> Response:
        self._auth(request)
        body = await self._body(request)
        return JSONResponse({"prompt": await asyncio.to_thread(parse_detokenize, body, self.tokenizer)})

    # ------------------------------------------------------------------ generation
    async def _serve(self, request: Request, parsed: Parsed, chat: bool, client: str) -> Response:
        t0 = time.monotonic()
        q, rids = await self._submit(parsed, client, chat)
        index = {rid: i for i, rid in enumerate(rids)}
        run = _Run(self, parsed, chat, index, t0)
        gone = asyncio.create_task(_disconnected(request))  # the body is read: what comes next is a disconnect
        try:
            return await self._reply(q, rids, run, parsed, gone)
        finally:
            gone.cancel()

    async def _reply(self, q: asyncio.Queue, rids: list[str], run: "_Run", parsed: Parsed,
                     gone: asyncio.Task) -> Response:
        """The whole answer, or (streaming) the stream once its first chunk is ready: an error
        before then is an HTTP error status."""
        chunks: list[dict[str, Any]] = []
        try:
            while run.error is None and run.finished < len(rids) and not chunks:
                chunks = run.take(await self._next(q, gone))
                if not parsed.stream:
                    chunks = []
        except _ClientGone:
            self._cancel(rids)
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except BaseException:
            self._cancel(rids)
            raise
        if run.error is not None:
            self._cancel(rids)
            raise run.error
        if not parsed.stream:
            return JSONResponse(run.whole())
        return StreamingResponse(self._sse(q, rids, run, chunks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _sse(self, q: asyncio.Queue, rids: list[str], run: "_Run", chunks: list[dict[str, Any]]
                   ) -> AsyncIterator[bytes]:
        """The stream: chunks, then usage (if asked) and `[DONE]`; or, after a failure, the
        error event and no `[DONE]` (the module docstring)."""
        try:
            while True:
                for chunk in chunks:
                    yield _event(chunk)
                if run.error is not None:
                    yield _event(run.error.body())
                    return
                if run.finished == len(rids):
                    if run.parsed.include_usage:
                        yield _event(run.chunk([], usage=run.usage()))
                    yield b"data: [DONE]\n\n"
                    return
                chunks = run.take(await self._next(q, None))
        finally:  # a disconnect cancels the generator here
            self._cancel([r for r in rids if r not in run.done])


class _ClientGone(Exception):
    """The HTTP client disconnected while its request was waiting."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the ASGI receive after the whole body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Run:
    """The replies of one HTTP request folded into OpenAI objects (whole or as chunks)."""

    def __init__(self, api: Api, parsed: Parsed, chat: bool, index: dict[str, int], t0: float) -> None:
        self.api, self.parsed, self.chat, self.index, self.t0 = api, parsed, chat, index, t0
        n = len(index)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.content, self.reasoning = [""] * n, [""] * n
        self.splitters = [ReasoningSplitter(parsed.thinking) for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.prompt_tokens, self.completion_tokens = [0] * n, [0] * n
        self.started = [False] * n
        self.last_time: list[float | None] = [None] * n
        self.done: set[str] = set()
        self.finished = 0
        self.error: ApiError | None = None

    def take(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold in one reply; returns the stream chunks it makes."""
        rid = msg.get("id")
        i = self.index.get(rid) if isinstance(rid, str) else None
        if i is None or rid in self.done:
            if msg["type"] == "error" and rid is None:
                self.error = Api._daemon_error(msg)
            return []
        now = time.monotonic()
        m = self.api.metrics
        if msg["type"] == "error" or (msg["type"] == "final" and msg.get("finish_reason") in ("error", "abort")):
            self.error = Api._daemon_error(msg)
            self.done.add(rid)
            self.finished += 1
            return []
        chunks = []
        if msg["type"] == "delta":
            if self.last_time[i] is None:
                m.observe_first_token(now - self.t0)
            else:
                m.observe_gap(now - self.last_time[i])
            self.last_time[i] = now
            m.observe_tokens(len(msg.get("token_ids") or ()))
            reasoning, content = self.splitters[i].feed(msg.get("text") or "")
            chunks += self._delta(i, reasoning, content, None)
        else:  # final
            reasoning, content = self.splitters[i].flush()
            usage = msg.get("usage") or {}
            self.prompt_tokens[i] = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens[i] = int(usage.get("completion_tokens") or 0)
            self.reasons[i] = msg.get("finish_reason")
            m.observe_final(msg, now - self.t0)
            self.done.add(rid)
            self.finished += 1
            chunks += self._delta(i, reasoning, content, self.reasons[i], force=True)
        return chunks

    def _delta(self, i: int, reasoning: str, content: str, reason: str | None, force: bool = False
               ) -> list[dict[str, Any]]:
        self.reasoning[i] += reasoning
        self.content[i] += content
        if not (reasoning or content or force):
            return []
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.started[i]:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not reasoning:
                delta["content"] = content
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": i, "text": content, "logprobs": None, "finish_reason": reason}
        self.started[i] = True
        return [self.chunk([choice])]

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.api.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def usage(self) -> dict[str, int]:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def whole(self) -> dict[str, Any]:
        choices = []
        for i in range(len(self.index)):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": self.content[i]}
                if self.parsed.thinking:
                    message["reasoning_content"] = self.reasoning[i]
                choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": self.reasons[i]})
            else:
                choices.append({"index": i, "text": self.content[i], "logprobs": None,
                                "finish_reason": self.reasons[i]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.api.model_name, "choices": choices, "usage": self.usage()}


def build_app(api: Api) -> Starlette:
    """The Starlette app over `api`, with OpenAI-shaped errors for every failure."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"))

    async def on_internal_error(request: Request, exc: Exception) -> Response:  # logged in one line by guard.HostOriginGuard
        return error_response(ApiError(500, "internal error in the HTTP server; see the daemon's log"))

    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_endpoint, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.startup()
        try:
            yield
        finally:
            await api.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, Exception: on_internal_error})
    app.router.redirect_slashes = False  # /v1/models/ is a 404, not a redirect to whatever Host the client sent
    return app
