"""The OpenAI-compatible HTTP API (Starlette): /v1/models, /v1/completions, /v1/chat/completions,
/health, /metrics, and vLLM's /tokenize and /detokenize; and the chat page at / (`dsv4.http.page`).
What clients may rely on is in docs/http-api.md.

Each HTTP request becomes one daemon `generate` per prompt, sent through the `Bridge` (one
DEALER for the whole app); the reply queue is read until the final message. Errors take
OpenAI's shape `{"error": {message, type, param, code}}` (400, 401, 404, 413, 503, ...).
Streams start with their first text; one that fails later ends with `data: {"error": ...}`
and no `data: [DONE]`. A request in flight waits for the daemon however long its steps take
(never failed for a missed heartbeat); a client that disconnects cancels its requests.
Thinking mode: text before `</think>` is `reasoning_content`, the rest `content`.
Details (each status, streams, /tokenize): docs/http-api.md, 'dsv4/http/app.py'.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv4.http.bridge import Bridge, DaemonUnavailable
from dsv4.http.guard import decode_json
from dsv4.http.metrics import Metrics
from dsv4.http.page import routes as page_routes
from dsv4.http.openai_requests import ApiError, Parsed, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from dsv4.http.replies import Replies
from dsv4.http.submit import DEFAULT_MAX_PROMPTS, check_output_budget, client_of, submit

MAX_BODY_BYTES = 8 << 20
RELEASE_BYTES = 4 << 20  # after a larger answer the heap's free pages go back to the system
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if self.tokenizer is not None else len(text.encode())

    def _cancel(self, rids: list[str]) -> None:
        for rid in rids:
            if self.bridge is not None:
                self.bridge.cancel(rid)

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
        await check_output_budget(parsed, self.max_model_len, self._count_tokens)
        q, rids = await self._submit(parsed, client, chat)
        index = {rid: i for i, rid in enumerate(rids)}
        run = Replies(parsed, chat, index, t0, model_name=self.model_name, metrics=self.metrics)
        gone = asyncio.create_task(_disconnected(request))  # the body is read: what comes next is a disconnect
        try:
            return await self._reply(q, rids, run, parsed, gone)
        finally:
            gone.cancel()

    async def _reply(self, q: asyncio.Queue, rids: list[str], run: Replies, parsed: Parsed,
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
        if not parsed.stream:  # rendered once, to bytes; the replies' own copies go with `run`
            body = json.dumps(run.whole(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
            run.release()
            if len(body) > RELEASE_BYTES:
                asyncio.get_running_loop().call_soon(release_free_memory)  # after this reply goes out
            return Response(body, media_type="application/json")
        return StreamingResponse(self._sse(q, rids, run, chunks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _sse(self, q: asyncio.Queue, rids: list[str], run: Replies, chunks: list[dict[str, Any]]
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


def release_free_memory() -> None:
    """glibc: give the heap's free pages back to the system (a big answer's), so the daemon's
    memory returns to its level; a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
        *page_routes(),
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
