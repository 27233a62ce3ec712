"""What a request must satisfy before a router sees it: the API key and the body's size.

- **API key** (like vLLM's ``--api-key``): when the rank has one (``DWDP_API_KEY``, which the
  operator fills from the Secret ``spec.server.apiKeySecretRef`` names), every ``/v1/*``
  request must carry ``Authorization: Bearer <key>``; otherwise 401 in the OpenAI error shape
  with ``WWW-Authenticate: Bearer``. The comparison takes constant time. ``/health``,
  ``/ready``, ``/metrics`` and ``/dwdp/status`` stay open for probes, scrapers and the
  operator.
- **Body size**: a request body over ``MAX_BODY_BYTES`` is refused with 413 naming the limit,
  from ``Content-Length`` when the client sends it, otherwise while the body streams in (the
  rest is never read).

Both are one ASGI middleware (``RequestGuard``), so they run before FastAPI parses a body.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 32 * 2**20
"""Largest request body, bytes (a prompt of 1,000,000 token ids as JSON fits)."""
PROTECTED_PREFIX = "/v1/"
"""Paths that need the API key when the rank has one."""


class ApiKeyError(ValueError):
    """The configured API key cannot be used (one line naming the variable)."""


def check_api_key(value: str | None, source: str) -> str | None:
    """The API key from ``value`` (``None`` or empty: no key). Raises ``ApiKeyError`` for a
    key made only of blanks or with blanks around it, which a client could not send back
    (``source`` names where the value came from)."""
    if not value:
        return None
    if value != value.strip() or not value.strip():
        raise ApiKeyError(
            f"{source}: the API key has leading or trailing blanks (or is only blanks); "
            f"store the key without them"
        )
    return value


class RequestGuard:
    """ASGI middleware: the API key on ``/v1/*`` and the body bound (module docstring)."""

    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _reply(send, 401, "missing or wrong API key: send Authorization: "
                         "Bearer <key>", "authentication_error",
                         [(b"www-authenticate", b"Bearer")])
            return
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, self._too_large(int(declared)), "invalid_request_error")
            return
        await self._bounded(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or not scope["path"].startswith(PROTECTED_PREFIX):
            return True
        return hmac.compare_digest(_header(scope, b"authorization"), self._expected)

    def _too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "more"
        return f"request body: {got}, at most {self.max_body_bytes} bytes"

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (at most the bound), then hand the app a receive that replays it."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                await _reply(send, 413, self._too_large(None), "invalid_request_error")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that returns ``messages`` first, then whatever ``receive`` gives."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return b""


async def _reply(
    send: Send,
    status: int,
    message: str,
    kind: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
