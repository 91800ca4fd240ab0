"""What a request must pass before the API sees it: Host, Origin, Content-Type, and a JSON body it can hold.

`HostOriginGuard` (pure ASGI middleware) keeps web pages from driving a keyless loopback
server (a cross-origin POST, or DNS rebinding): Host must be loopback or in
--allowed-hosts for a loopback bind (400), Origin must be this server's own or in
--allowed-origins (403; allowed origins get CORS), a POST body must be application/json
(415); an unexpected exception is a 500 in OpenAI's shape, logged in one line.
`decode_json` turns a body into Python values only if every later stage can take them
(nesting at most MAX_DEPTH, 64-bit integers, no NaN or Infinity, valid Unicode), else a
400 naming what it got. Details: docs/security.md, 'dsv4/http/guard.py'.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import traceback
from typing import Any, Awaitable, Callable

from dsv4.http.openai_requests import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("dsv4.http")

MAX_DEPTH = 64  # nesting of arrays and objects in a body (OpenAI's own bodies need 4)
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack carries to the daemon
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "authorization, content-type"
CORS_MAX_AGE_S = "600"


def split_list(text: str | None) -> tuple[str, ...]:
    """A comma-separated option value as a tuple of its stripped, non-empty items."""
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


def host_name(header: str) -> str:
    """The name or address of a Host header value, without port or brackets, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostOriginGuard:
    """ASGI middleware: the Host, Origin and Content-Type checks and CORS (module docstring)."""

    def __init__(self, app: App, *, loopback: bool, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.loopback = loopback
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in allowed_hosts if h != "*"}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        origin = headers.get("origin")
        allowed: list[tuple[bytes, bytes]] = []  # CORS headers, once the origin is known to be allowed
        try:
            self._check_host(host)
            if origin is not None:
                self._check_origin(origin, host)
                allowed = self._cors(origin, preflight=False)
            if scope["method"] == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
                asked = headers.get("access-control-request-headers", "")
                await _respond(send, 204, b"", self._cors(origin, preflight=True, asked=asked))
                return
            if scope["method"] == "POST":
                _check_content_type(headers.get("content-type"))
        except ApiError as e:  # an allowed origin's page may read why (the CORS headers)
            body = json.dumps(e.body()).encode()
            await _respond(send, e.status, body, [(b"content-type", b"application/json"),
                                                  (b"x-should-retry", b"false"), *allowed])
            return
        if origin is not None:
            cors = self._cors(origin, preflight=False)
            plain_send = send

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *cors]}
                await plain_send(message)

        try:
            await self.app(scope, receive, send)
        except Exception as e:  # noqa: BLE001  (answered 500 already by the app's handler): one log line
            if os.environ.get("DSV4_DEBUG", "") not in ("", "0"):
                log.exception("HTTP %s %s failed", scope["method"], scope["path"])
            else:
                log.error("HTTP %s %s failed: %s", scope["method"], scope["path"], one_line(e))

    def _check_host(self, host: str) -> None:
        name = host_name(host)
        if not name or self.any_host or name in self.hosts:
            return
        if self.loopback and is_loopback_name(name):
            return
        if not self.loopback and not self.hosts:
            return  # a non-loopback bind has an API key; Host is checked only against an explicit list
        raise ApiError(400, f"the Host header {host!r:.80} is not this server's address; name it with "
                            f"--allowed-hosts to serve it", code="invalid_host")

    def _check_origin(self, origin: str, host: str) -> None:
        o = origin.strip().rstrip("/").lower()
        if self.any_origin or o in self.origins or o == f"http://{host.strip().lower()}":
            return
        raise ApiError(403, f"cross-origin requests from {origin!r:.80} are refused; allow the origin with "
                            f"--allowed-origins", etype="permission_error", code="origin_not_allowed")

    @staticmethod
    def _cors(origin: str, preflight: bool, asked: str = "") -> list[tuple[bytes, bytes]]:
        """CORS headers for an allowed `origin`; a preflight allows the request headers it
        `asked` for (browser clients send their own, e.g. openai-node's X-Stainless-*)."""
        out = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if preflight:
            names = sorted({*split_list(CORS_HEADERS), *(h.lower() for h in split_list(asked))})
            out += [(b"access-control-allow-methods", CORS_METHODS.encode()),
                    (b"access-control-allow-headers", ", ".join(names).encode("latin-1")),
                    (b"access-control-max-age", CORS_MAX_AGE_S.encode())]
        return out


def one_line(e: BaseException) -> str:
    """An exception as one line: its type, message and where it was raised (DSV4_DEBUG=1 logs the traceback)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {str(e)[:200]}{where}".replace("\n", " ")


def _check_content_type(value: str | None) -> None:
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json'; got "
                            f"{value or 'no Content-Type'!r:.80}", etype="invalid_request_error",
                       code="unsupported_media_type")


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------- the body
class _BadJson(ValueError):
    pass


def _parse_int(text: str) -> int:
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise _BadJson(f"the integer {text:.40} is out of range (integers must fit in 64 bits)")
    return value


def _parse_constant(name: str) -> Any:
    raise _BadJson(f"{name} is not a JSON number (send a number or null)")


def decode_json(raw: bytes) -> Any:
    """The body as Python values, or ApiError(400) naming the first thing no later stage could take."""
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except _BadJson as e:
        raise ApiError(400, f"the body is not acceptable JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the body nests arrays or objects deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    _check_values(value)
    return value


def _check_values(value: Any) -> None:
    """Depth at most MAX_DEPTH; every string (keys included) encodable as UTF-8."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, (list, dict)):
            if depth > MAX_DEPTH:
                raise ApiError(400, f"the body nests arrays or objects deeper than {MAX_DEPTH} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the body holds a string that is not valid Unicode (a lone surrogate "
                            f"{s[e.start]!r} at position {e.start}: \\ud800-\\udfff escapes must come in pairs)",
                       ) from None
