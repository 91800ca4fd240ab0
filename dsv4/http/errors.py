"""The HTTP layer's error: a status and a one-line message, answered in OpenAI's shape (`bad`:
a 400 naming the field; `short`: a value quoted in such a message)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, etype: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.etype = etype or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                               413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request field (`param`) that cannot be taken."""
    return ApiError(400, message, param)


def short(value: Any) -> str:
    """`value` as it may appear in a one-line message (repr, at most 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
