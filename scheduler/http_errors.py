"""The HTTP doors' error: an answer other than 200 in the OpenAI error shape.

Its own module because every door and helper that refuses a request raises it (the OpenAI body
parser, the tool and Anthropic translations, the routes), and none of them should need another's
module to do so.
"""

from __future__ import annotations

from typing import Any


class HTTPError(Exception):
    """An answer other than 200: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def unsupported(name: str, why: str) -> HTTPError:
    """A 400 for a field the daemon does not take (``unsupported_parameter``), naming the field."""
    return HTTPError(400, f"'{name}' {why}", param=name, code="unsupported_parameter")
