"""`dsv4 serve --http HOST:PORT`: uvicorn in a thread of the daemon, a client of its ROUTER.

    address = parse_address("127.0.0.1:8000", api_key)   # at startup: bad address or key -> HttpError
    http = HttpServer(address, api_key)
    http.bind()                    # before the weights load: a port in use fails at once
    http.start(zmq_ctx, config)    # uvicorn's event loop in a thread; 503 while loading
    ... engine loaded, ROUTER bound (in zmq_ctx) on the daemon endpoint and on INPROC_ENDPOINT ...
    ... serve_forever ...
    http.stop()                    # before the shared context is terminated

The HTTP side talks to the engine only through ZeroMQ messages on the in-process
endpoint (same context, no socket file, no key), like any other client, so the engine
loop keeps a single owner.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

from dsv4.daemon.contract import FrontEndError

log = logging.getLogger("dsv4.http")

INPROC_ENDPOINT = "inproc://dsv4-http"
LOOPBACK_NAMES = ("localhost",)


class HttpError(FrontEndError):
    """A --http setting that cannot work (one line naming the flag)."""


@dataclass
class Address:
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, api_key: str | None) -> Address:
    """HOST:PORT (or just PORT, on 127.0.0.1); a non-loopback host needs an API key."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise HttpError(f"--http: expected HOST:PORT with a port in 1..65535, got {text!r}")
    try:
        import prometheus_client, starlette, uvicorn  # noqa: F401
    except ImportError as e:
        raise HttpError(f"--http needs the http extra ({e.name} is missing): pip install 'dsv4[http]'") from None
    addr = Address(host, int(port))
    if not addr.loopback and not api_key:
        raise HttpError(f"--http {text}: serving beyond this machine (host {host}) needs --api-key "
                        f"(or DSV4_API_KEY); or use 127.0.0.1")
    return addr


def model_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer for chat prompts (None when it has none: token ids only)."""
    from dsv4.engine.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_dir(model_dir)
    except TokenizerError:
        return None


class HttpServer:
    """One uvicorn server on `address`, run in a daemon thread (a `dsv4.daemon.contract.FrontEnd`)."""

    endpoint = INPROC_ENDPOINT

    max_prompts: int | None = None  # --max-prompts-per-request (None: dsv4.http.submit's default)

    def __init__(self, address: Address, api_key: str | None, *, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = ()) -> None:
        self.address, self.api_key = address, api_key
        self.allowed_hosts, self.allowed_origins = allowed_hosts, allowed_origins
        self.max_connections, self.backlog = 0, 0  # set by start() from the descriptor limit
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        """Bind the listening socket now (before the weights load); raises HttpError."""
        family = socket.AF_INET6 if ":" in self.address.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.address.host, self.address.port))
        except OSError as e:
            s.close()
            raise HttpError(f"--http {self.address}: cannot listen there: {e.strerror or e}") from None
        self._sock = s

    def start(self, zmq_ctx: Any, config: Any) -> None:
        """Serve `config`'s model (an EngineConfig) in a thread; requests get 503 until the daemon
        binds INPROC_ENDPOINT in `zmq_ctx` and answers."""
        import uvicorn

        from dsv4.daemon.intake import descriptor_limit
        from dsv4.http.app import Api, build_app
        from dsv4.http.guard import HostOriginGuard
        from dsv4.http.limits import (KEEP_ALIVE_S, MAX_HEADER_BYTES, GuardedH11Protocol, LimitedServer,
                                       header_timeout, http_budget)

        assert self._sock is not None, "bind() first"
        api = Api(model_name=config.served_model_name, model_path=str(config.model),
                  max_model_len=config.max_model_len, tokenizer=model_tokenizer(config.model),
                  ctx=zmq_ctx, endpoint=INPROC_ENDPOINT, api_key=self.api_key, max_prompts=self.max_prompts)
        app = HostOriginGuard(build_app(api), loopback=self.address.loopback, allowed_hosts=self.allowed_hosts,
                              allowed_origins=self.allowed_origins)
        soft = descriptor_limit()
        self.max_connections, self.backlog = http_budget(soft if soft is not None else 1 << 20)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=3, ws="none", backlog=self.backlog,
                                http=GuardedH11Protocol.configure(self.max_connections, header_timeout()),
                                timeout_keep_alive=int(KEEP_ALIVE_S), h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self._server = LimitedServer(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="dsv4-http", daemon=True)
        self._thread.start()
        log.info("OpenAI-compatible HTTP API on http://%s/v1 (%s), chat page at http://%s/; at most %d HTTP "
                 "connections", self.address, "API key required" if self.api_key else "no API key", self.address,
                 self.max_connections)

    def descriptors_reserved(self) -> int:
        """Descriptors HTTP may still take beyond those it has open now (its cap plus an accept burst)."""
        open_now = len(self._server.server_state.connections) if self._server is not None else 0
        return max(0, self.max_connections + self.backlog - open_now)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop uvicorn and wait for its thread (its ZeroMQ socket closes with it)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the HTTP server did not stop within %.0f s", timeout_s)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
