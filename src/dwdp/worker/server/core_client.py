"""The API server process's end of the link: an ``EngineClient`` that is the rank's engine core.

``EngineCoreClient`` holds a ZMQ ``DEALER`` connected to the core's ``ROUTER``
(``dwdp.worker.server.engine_core``) and one reader task that hands every ``Out`` and
``Failed`` (``dwdp.worker.server.wire``) to its request's queue and every ``Reply`` to its
call's future. What the
server reads without asking (the model's name and limits, the KV endpoint) comes once, with
the process's launch (``dwdp.worker.server.api_process``); the tokenizer is the API process's
own copy, loaded from the checkpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import msgspec

from dwdp.worker.engine.kv_connector import KvEndpoint, KvTransferParams
from dwdp.worker.engine.protocol import (
    EngineDeadError,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
    SharedPrefill,
    TokenLogprob,
)
from dwdp.worker.server.wire import (
    MAX_MESSAGE_BYTES,
    Abort,
    Call,
    ErrorInfo,
    Failed,
    Generate,
    Health,
    Out,
    Release,
    Reply,
    Request,
    Score,
    decode_answer,
    encode,
    error_of,
)

KNOWN_SERVERS = 1024
"""Context servers whose identity the client remembers (most recently seen first out)."""


class RemoteKv:
    """What the API server needs of the rank's KV connector: its endpoint (for the ``dwdp``
    field of answers), the identities of the context servers its requests read from (told by
    the core with a remote prefill's first update) and the release of a refused request's
    lease. The side channel's routes (``describe``, ``release_lease``) and the counters are
    served by the rank itself."""

    def __init__(self, client: EngineCoreClient, endpoint: KvEndpoint) -> None:
        self._client = client
        self._endpoint = endpoint
        self._servers: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @property
    def endpoint(self) -> KvEndpoint:
        """This server's NIXL engine id and advertised side-channel address."""
        return self._endpoint

    def learn(self, engine_id: str, server: dict[str, Any]) -> None:
        """Remember the identity the context server ``engine_id`` gave of itself."""
        self._servers[engine_id] = server
        self._servers.move_to_end(engine_id)
        while len(self._servers) > KNOWN_SERVERS:
            self._servers.popitem(last=False)

    def server_of(self, engine_id: str) -> dict[str, Any]:
        """The identity of context server ``engine_id`` as last told (empty if never)."""
        return dict(self._servers.get(engine_id, {}))

    async def release(self, params: KvTransferParams) -> None:
        """End the lease ``params`` name on their context server (the core does it)."""
        await self._client.call(Release(kv=params))


class EngineCoreClient:
    """The ``EngineClient`` of an API server process (module docstring). ``connect`` before
    use, from the event loop that serves; ``close`` at shutdown."""

    def __init__(
        self,
        address: str,
        *,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        kv_endpoint: KvEndpoint | None = None,
    ) -> None:
        self.address = address
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.kv: RemoteKv | None = RemoteKv(self, kv_endpoint) if kv_endpoint else None
        self._streams: dict[str, asyncio.Queue[Out | Failed]] = {}
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._call_ids = itertools.count()
        self._socket: Any = None
        self._context: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._lost: BaseException | None = None

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer."""
        return self._tokenizer

    async def connect(self) -> None:
        """Connect to the core and start reading its messages."""
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._socket = sock
        self._reader = asyncio.ensure_future(self._read())

    async def close(self) -> None:
        """Stop reading and close the socket (requests in flight fail with ``EngineDeadError``)."""
        self.fail("the API server is shutting down")
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close(0)
            self._context.term()
            self._socket = None

    async def _read(self) -> None:
        try:
            while True:
                message = decode_answer(await self._socket.recv())
                if isinstance(message, Reply):
                    future = self._calls.pop(message.call, None)
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                for update in message.outs:
                    queue = self._streams.get(update.id)
                    if queue is not None:
                        queue.put_nowait(update)
        except asyncio.CancelledError:
            self.fail("the API server is shutting down")
        except Exception as exc:  # a broken link: nothing can be served any more
            self.fail(f"the link to the engine core failed: {exc}")

    def fail(self, reason: str) -> None:
        """Declare the core lost: every open stream and call ends with ``EngineDeadError``
        (``reason`` its message) and every later one is refused with it. The first reason
        stays; calling it again does nothing."""
        if self._lost is not None:
            return
        self._lost = EngineDeadError(reason)
        lost = ErrorInfo("EngineDeadError", reason)
        for request_id, queue in self._streams.items():
            queue.put_nowait(Failed(id=request_id, error=lost))
        for call, future in self._calls.items():
            if not future.done():
                future.set_result(Reply(call=call, error=lost))

    async def _send(self, message: Request) -> None:
        if self._lost is not None or self._socket is None:
            raise EngineDeadError(str(self._lost or "not connected to the engine core"))
        await self._socket.send(encode(message))

    async def call(self, request: Call) -> list[TokenLogprob] | None:
        """Send ``request`` (numbered here) and return its reply's value; raises the error it
        carries."""
        call = next(self._call_ids)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        try:
            await self._send(msgspec.structs.replace(request, call=call))
            reply = await future
        finally:
            self._calls.pop(call, None)
        if reply.error is not None:
            raise error_of(reply.error)
        return reply.value

    # -- the EngineClient interface ----------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_transfer: KvTransferParams | None = None,
        *,
        shared: SharedPrefill | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``EngineClient.generate`` through the core; closing the stream early aborts."""
        params.check()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already running")
        if shared is not None and shared.claim is None:  # names the choices for the core
            shared.claim = uuid.uuid4().hex
        queue: asyncio.Queue[Out | Failed] = asyncio.Queue()
        self._streams[request_id] = queue
        done = False
        try:
            await self._send(Generate(
                id=request_id, prompt=list(prompt_token_ids), params=params, kv=kv_transfer,
                shared=None if shared is None else str(shared.claim),
            ))
            while True:
                message = await queue.get()
                if isinstance(message, Failed):
                    done = True
                    raise error_of(message.error)
                out = message.output
                if message.server and self.kv is not None and kv_transfer is not None:
                    self.kv.learn(str(kv_transfer.remote_engine_id), message.server)
                done = out.finished
                yield out
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done and self._lost is None:
                await self._send(Abort(id=request_id))

    async def score_prompt(self, prompt_token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
        """``EngineClient.score_prompt`` through the core."""
        return await self.call(Score(prompt=list(prompt_token_ids), top=top)) or []

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the core (unknown ids are ignored there)."""
        await self._send(Abort(id=request_id))

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the core's engine cannot serve or the link is lost."""
        try:
            await self.call(Health())
        except EngineError as exc:
            raise EngineDeadError(str(exc)) from exc

    def snapshot(self) -> None:
        """None: the rank's own app publishes its engine's state (``/dwdp/status`` and the
        engine families of ``/metrics`` are passed on to it)."""
        return None
