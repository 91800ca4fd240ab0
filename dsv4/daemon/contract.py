"""What the daemon needs of the engine it serves, and of a front end beside it: two Protocols.

`ServedEngine` is every member the daemon (`server.py`, `admission.py`, `process.py`) reads
of its engine; `dsv4.engine.engine.Engine` implements it, and so do the tests' fakes
(tests/unit/test_protocol.py `FakeEngine`), so the daemon never probes with getattr.
`FrontEnd` is what `run_daemon` starts beside the socket (the HTTP server, built above the
daemon by `dsv4 serve`): the daemon knows it only through this contract, so no module of
the daemon imports the HTTP package above it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ServedEngine(Protocol):
    """An engine the daemon can serve (the members `Server` and `run_daemon` use)."""

    tokenizer: Any  # None: token-id prompts only
    max_model_len: int  # the longest request (prompt + output), in tokens
    max_text_bytes: int | None  # the longest text prompt accepted before tokenizing (None: no limit)
    ranks: Any  # tensor-parallel ranks (with `.pids`), None for one process
    weight_bytes: int  # resident bytes of the weights (this rank)
    rank_weight_bytes: list[int]  # per rank, when there are several
    quant_note: str  # a banner line on the quantised paths ("" for none)
    compile_note: str  # a banner line on compiled buckets ("" when not compiling)
    calibration_note: str  # the banner's line on the auto-K step costs (timed, or from the cache)

    def make_params(self, fields: dict[str, Any]) -> Any:
        """Validated sampling parameters from a request's fields (raises ValueError)."""

    def check_text_size(self, prompt: str, system: str | None = None) -> None:
        """Refuse a text prompt too large to tokenize (raises ValueError), before tokenizing."""

    def encode_request(self, prompt: str, *, prompt_mode: str = "auto", system: str | None = None,
                       thinking: bool = False, tools: list[dict[str, Any]] | None = None) -> Any:
        """A text prompt's token ids (or the text, for an engine without a tokenizer)."""

    def submit_grammar(self, spec: dict[str, Any]) -> Future:
        """Compile a structured-output grammar off the loop; the future's result goes to add_request."""

    def add_request(self, prompt: Any, params: Any, **kw: Any) -> str:
        """Queue one request (raises ValueError with a one-line reason); returns its id."""

    def abort(self, request_id: str) -> bool:
        """Drop a request; True when it was queued or running."""

    def has_unfinished(self) -> bool:
        """Whether a step has work."""

    def step(self) -> list[Any]:
        """One engine step: the requests' deltas (`RequestOutput`)."""

    def status(self) -> dict[str, Any]:
        """Counters for `dsv4 status` (running, waiting, state bytes, ...)."""

    def build_in_background(self) -> str:
        """Start building what is missing (compiled buckets); a log line, "" for nothing."""

    def poll_compiled(self) -> None:
        """Install what a background build finished (called while idle and before steps)."""

    def close(self) -> None:
        """Stop the other ranks and flush profiles."""


class FrontEndError(Exception):
    """A front end that cannot start (its address in use): one line naming the flag."""


class FrontEnd(Protocol):
    """A server started beside the daemon's socket, talking to it over `endpoint` (inproc)."""

    endpoint: str  # the inproc address the daemon binds for it, in the context it is given

    def bind(self) -> None:
        """Take the listening address before the weights load; raises FrontEndError."""

    def start(self, zmq_ctx: Any, config: Any) -> None:
        """Serve (503 until the daemon answers on `endpoint`); `config` is the EngineConfig."""

    def descriptors_reserved(self) -> int:
        """File descriptors it may still open, kept from the daemon's connection limit."""

    def stop(self) -> None:
        """Stop serving and wait for its thread."""
