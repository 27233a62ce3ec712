"""The error a request handler raises for a request the server refuses (one home: the serving
class and the pure request rules both raise it; the app maps it to OpenAI's error shape)."""

from __future__ import annotations


class ServingError(Exception):
    """A request the server refuses; ``status_code`` is 4xx or 503, the message one line."""

    def __init__(self, status_code: int, message: str, *, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.kind = kind
