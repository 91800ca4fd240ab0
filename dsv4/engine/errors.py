"""`RequestError`, the error that fails one request alone, below every module that raises
it: `request` (which re-exports it), `sampling` (parameter checks), `scheduler`, `engine`."""


class RequestError(ValueError):
    """A request that cannot be served; fails that request alone. One-line message."""


class RequestBusy(RequestError):
    """A request refused for now because something it needs is full (e.g. the grammar
    compiler's queue); the daemon answers `busy` (HTTP 503): try again later."""
