"""The gate's ASGI app: forward authenticated requests to the router child, restart the child
when the key changes.

Placement: ``RequestGuard`` (``dwdp.worker.server.guard``) in front of ``Gate`` checks the key on
every path but ``OPEN_PATHS`` (the probes) and bounds the body; ``Gate`` forwards what passed,
streaming the answer (server-sent events pass through as they come) with the child's key as
``Authorization`` in place of the client's: vllm-router sends its own key on the requests it
makes (completions, chat), but passes the client's header on where it proxies a request as it
came (``GET /v1/models``), and the servers behind it check the key there too. While no ready
child exists (start, or a rotation) a request waits up to ``wait_s`` seconds for one, then gets
503.

Failover: a completion or chat request the router answers with a 5xx (a prefill or decode
server that died or failed; vllm-router 0.1.17 retries no PD request itself) is sent again,
before a byte of the answer reaches the client, up to once per prefill server of the router's
list (vllm-router's round robin then tries the others) with a short pause between attempts: a
dead group costs its requests latency, not errors. Other paths and methods are not retried.

Rotation (``Gate.rotate``): new requests wait; the requests in flight finish (at most
``drain_s`` seconds); the child stops; a child with the new key starts and, once ready, takes
the waiting requests. A client sees a pause of the new child's start (about a second plus its
first health check of the workers), not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from dwdp.worker.apikey import ApiKey
from dwdp.worker.gate.child import GateError, RouterChild
from dwdp.worker.server.guard import Receive, Scope, Send, openai_error

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness"})
"""Paths that need no key: the kubelet's probes (they answer no model output)."""
LIVENESS_PATH = "/liveness"
HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host",
    }
)
"""Headers that describe one connection, never forwarded."""
DROPPED_REQUEST = HOP_BY_HOP | {b"authorization", b"content-length"}
"""Request headers not forwarded: the gate puts the child's key in place of the client's
(module docstring); httpx sets the length."""
RETRIED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The requests the gate sends again when the router answers ``RETRIED_STATUSES`` (they change
nothing on a server: sending one twice is safe)."""
RETRIED_STATUSES = frozenset({500, 502, 503, 504})
RETRY_PAUSE_S = 0.1
"""The pause before the n-th retry is n times this."""


def prefill_servers(argv: Sequence[str]) -> int:
    """How many ``--prefill`` servers the router's arguments list."""
    return sum(1 for arg in argv if arg == "--prefill")


def needs_key(path: str) -> bool:
    """Every path of the router but the probes needs the key (its admin paths too)."""
    return path not in OPEN_PATHS


class Gate:
    """The forwarding app over a vllm-router child (module docstring).

    ``argv``: vllm-router and its arguments (no ``--host``/``--port``); ``api_key``: the
    deployment's key, the child's ``OPENAI_API_KEY``; ``wait_s``: how long a request waits
    for a ready child; ``drain_s``: how long a rotation waits for requests in flight;
    ``retries``: how often a failed completion is sent again (default: once per prefill
    server of ``argv``, module docstring).
    """

    def __init__(
        self, argv: Sequence[str], api_key: ApiKey, *, wait_s: float = 60.0,
        drain_s: float = 30.0, retries: int | None = None,
    ) -> None:
        self.argv = list(argv)
        self.retries = prefill_servers(argv) if retries is None else retries
        self.api_key = api_key
        self.wait_s = wait_s
        self.drain_s = drain_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.child: RouterChild | None = None
        self.child_key: str | None = None
        self.ready = asyncio.Event()
        self.inflight = 0
        self.rotations = 0
        self._rotation: asyncio.Future[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start a child with the current key; return once it is ready (``GateError``)."""
        self.child_key = self.api_key.current()
        self.child = RouterChild(self.argv, self.child_key)
        await self.child.wait_ready(self.client)
        self.ready.set()
        log.info("router ready behind the gate")

    def key_changed(self) -> bool:
        """Whether the key changed since the running child started; if so, its rotation is
        started (once): from then on requests wait for the new child, so a request the new
        key admitted is never forwarded by a child holding the old one."""
        if not self.ready.is_set() or self.api_key.current() == self.child_key:
            return False
        self.ready.clear()
        self._rotation = asyncio.ensure_future(self.rotate())
        return True

    async def rotate(self) -> None:
        """Replace the child by one with the current key (module docstring)."""
        self.ready.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.child is not None:
            await asyncio.to_thread(self.child.stop)
        self.rotations += 1
        log.info("API key changed: restarting the router with the new key")
        await self.start()

    async def watch(self, *, every_s: float = 0.5) -> None:
        """Until cancelled: rotate when the key changes; raise ``GateError`` when the child
        exits on its own or a new child cannot start (the container then ends and the kubelet
        restarts it)."""
        while True:
            await asyncio.sleep(every_s)
            self.key_changed()
            if self._rotation is not None:
                if not self._rotation.done():
                    continue
                rotation, self._rotation = self._rotation, None
                rotation.result()  # a child that could not start ends the gate
            if self.child is not None and self.child.exited is not None:
                raise GateError(f"vllm-router exited with status {self.child.exited}")

    async def close(self) -> None:
        """Stop the child and the client (the gate is stopping)."""
        if self.child is not None:
            await asyncio.to_thread(self.child.stop, 5.0)
        await self.client.aclose()

    # -- requests ----------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == LIVENESS_PATH and not self.ready.is_set():
            # starting or rotating: alive, and the child is being (re)started on purpose
            await _json(send, 200, b'{"status":"starting"}')
            return
        self.key_changed()
        try:
            await asyncio.wait_for(self.ready.wait(), self.wait_s)
        except TimeoutError:
            await openai_error(send, 503, f"router: not ready after {self.wait_s:.0f} s "
                               "(starting, or restarting with a new API key)",
                               "service_unavailable")
            return
        self.inflight += 1
        try:
            await self._forward(scope, receive, send)
        finally:
            self.inflight -= 1

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.child is not None
        body = await _body(receive)
        query = scope.get("query_string") or b""
        url = self.child.base + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if query:
            url += "?" + query.decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED_REQUEST]
        if self.child_key is not None:
            headers.append((b"authorization", f"Bearer {self.child_key}".encode()))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        retried = scope["method"] == "POST" and scope["path"] in RETRIED_PATHS
        try:
            response = await self._send(request, self.retries if retried else 0)
        except httpx.HTTPError as exc:
            await openai_error(send, 502, f"router: {type(exc).__name__}: {exc}", "bad_gateway")
            return
        pump = asyncio.ensure_future(_relay(response, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            await response.aclose()


    async def _send(self, request: httpx.Request, retries: int) -> httpx.Response:
        """The child's answer to ``request`` (streamed), sent again up to ``retries`` times
        while the answer is one of ``RETRIED_STATUSES`` (module docstring: failover)."""
        response = await self.client.send(request, stream=True)
        for attempt in range(1, retries + 1):
            if response.status_code not in RETRIED_STATUSES:
                break
            reason = (await response.aread())[:300].decode(errors="replace")
            await response.aclose()
            log.warning("router answered %d (%s); sending %s again (%d of %d)",
                        response.status_code, reason, request.url.path, attempt, retries)
            await asyncio.sleep(RETRY_PAUSE_S * attempt)
            response = await self.client.send(request, stream=True)
        return response


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _relay(response: httpx.Response, send: Send) -> None:
    """The child's answer to the client as it comes (status, headers, raw body chunks)."""
    headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json(send: Send, status: int, body: bytes) -> None:
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
