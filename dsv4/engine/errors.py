"""`RequestError`, the error that fails one request alone, below every module that raises
it: `request` (which re-exports it), `sampling` (parameter checks), `scheduler`, `engine`;
and `EngineFailed`, the error after which an engine cannot go on."""


class RequestError(ValueError):
    """A request that cannot be served; fails that request alone. One-line message."""


class RequestBusy(RequestError):
    """A request refused for now because something it needs is full (e.g. the grammar
    compiler's queue); the daemon answers `busy` (HTTP 503): try again later."""


class EngineFailed(RuntimeError):
    """The engine cannot go on (a broken tensor-parallel group, every replica lost): the
    daemon fails what is in flight and exits non-zero. One-line message."""
