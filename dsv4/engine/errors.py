"""`RequestError`, the error that fails one request alone, below every module that raises
it: `request` (which re-exports it), `sampling` (parameter checks), `scheduler`, `engine`."""


class RequestError(ValueError):
    """A request that cannot be served; fails that request alone. One-line message."""
