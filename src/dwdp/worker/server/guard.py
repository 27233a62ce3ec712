"""What a request must satisfy before a router sees it: the API key and the body's size.

- **API key** (like vLLM's ``--api-key``): when the server has one (``DWDP_API_KEY_FILE`` or
  ``DWDP_API_KEY``; the operator mounts the Secret ``spec.server.apiKeySecretRef`` names, see
  ``dwdp.worker.apikey``), every protected request (a rank: ``/v1/*``) must carry
  ``Authorization: Bearer <key>``; otherwise 401 in the OpenAI error shape with
  ``WWW-Authenticate: Bearer``. The comparison takes constant time and uses the key current
  at that moment (a rotated key file is re-read). On a rank ``/health``, ``/ready``,
  ``/metrics`` and ``/dwdp/status`` stay open for probes, scrapers and the operator.
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

from dwdp.worker.apikey import ApiKey, ApiKeyError, check_api_key

__all__ = [
    "MAX_BODY_BYTES",
    "PROTECTED_PREFIX",
    "ApiKey",
    "ApiKeyError",
    "RequestGuard",
    "check_api_key",
    "openai_error",
    "v1_path",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 32 * 2**20
"""Largest request body, bytes (a prompt of 1,000,000 token ids as JSON fits)."""
PROTECTED_PREFIX = "/v1/"
"""Paths that need the API key when the rank has one."""


def v1_path(path: str) -> bool:
    """A rank's protected paths: the OpenAI API and the KV side channel (``/v1/*``)."""
    return path.startswith(PROTECTED_PREFIX)


class RequestGuard:
    """ASGI middleware: the API key on protected paths and the body bound (module docstring).

    ``api_key``: an ``ApiKey`` (asked on every request), a fixed key, or ``None`` (no key);
    ``protected``: which paths need the key (default ``v1_path``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: ApiKey | str | None,
        max_body_bytes: int = MAX_BODY_BYTES,
        protected: Callable[[str], bool] = v1_path,
    ) -> None:
        self.app = app
        self.api_key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        self.max_body_bytes = max_body_bytes
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await openai_error(send, 401, "missing or wrong API key: send Authorization: "
                               "Bearer <key>", "authentication_error",
                               [(b"www-authenticate", b"Bearer")])
            return
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await openai_error(send, 413, self._too_large(int(declared)),
                               "invalid_request_error")
            return
        await self._bounded(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        key = self.api_key.current()
        if key is None or not self.protected(scope["path"]):
            return True
        return hmac.compare_digest(_header(scope, b"authorization"), f"Bearer {key}".encode())

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
                await openai_error(send, 413, self._too_large(None), "invalid_request_error")
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


async def openai_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer ``status`` with OpenAI's error body ``{"error": {"message", "type", "code"}}``."""
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
