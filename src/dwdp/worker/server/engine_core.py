"""The engine core's end of the link: the rank's engine served to its API server process.

A thread of the rank runs one asyncio loop with a ZMQ ``ROUTER`` socket bound to the link's
``ipc://`` address (``dwdp.worker.server.wire``: the messages). Each ``Generate`` becomes an
engine request (``EngineBase.add_request``) whose updates the engine thread hands over in bursts:
every update a step produces is appended to one buffer, and one wake-up of this loop sends them
all as one ``Outs`` per API process. A ``Generate`` that does not decode is refused (``Failed``)
when its id can be read, so no API process's stream waits for it. ``Abort`` stops the request;
calls (``Score``, ``Health``, ``Release``) are answered by one ``Reply`` each. One task writes
the socket, in order.

Why a process boundary: the API server's HTTP parsing, JSON and streaming share no interpreter
lock with the engine thread's step launches any more; only this loop's small messages do.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from dwdp.worker.engine.protocol import (
    EngineClient,
    RequestError,
    RequestOutput,
    SharedPrefill,
    TokenLogprob,
)
from dwdp.worker.server.wire import (
    MAX_MESSAGE_BYTES,
    Abort,
    Answer,
    Call,
    Failed,
    Generate,
    Health,
    Out,
    Outs,
    Release,
    Reply,
    Score,
    WireError,
    decode_request,
    encode,
    error_fields,
    generate_id,
)

if TYPE_CHECKING:
    from dwdp.worker.engine.base import EngineBase

log = logging.getLogger(__name__)

Peer = bytes
"""A ``ROUTER`` peer's routing id (one per API server process)."""
Key = tuple[Peer, str]
"""A request: its API process and its id."""


class EngineCoreServer:
    """Serves ``engine`` on ``address`` (``ipc://<path>``) from a thread of its own.

    ``start`` returns once the socket is bound (raises ``zmq.ZMQError`` when it cannot bind);
    ``stop`` aborts every request in flight and joins the thread.
    """

    def __init__(self, engine: EngineBase, address: str) -> None:
        self.engine = engine
        self.address = address
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._requests: dict[Key, Any] = {}
        """A request's ``RequestState`` once queued, its adding task before."""
        self._remote: dict[Key, str] = {}
        """Remote prefills whose first update has not gone yet: the context server's id."""
        self._shared: dict[Key, tuple[SharedPrefill, int]] = {}
        """The choices of one remote prefill, by API process and ``shared`` name: users."""
        self._shared_of: dict[Key, str] = {}
        """A request's ``shared`` name, when it has one."""
        self._updates: collections.deque[tuple[Key, RequestOutput | BaseException]] = (
            collections.deque())
        self._flush_due = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: asyncio.Queue[list[bytes]] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> EngineCoreServer:
        """Bind and serve in a thread; returns once bound. Raises what the bind raised."""
        self._thread = threading.Thread(target=self._run, name="dwdp-engine-core", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (idempotent): requests in flight are aborted."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(self._cancel_all)
            thread.join(timeout)

    def _cancel_all(self) -> None:
        for task in asyncio.all_tasks():
            task.cancel()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # a bind failure, before ready
            self._failure = exc
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        self._outbox = asyncio.Queue()
        writer: asyncio.Task[None] | None = None
        try:
            sock.bind(self.address)
            writer = asyncio.ensure_future(self._write(sock, self._outbox))
            self._ready.set()
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 2:
                    log.warning("engine core: a message of %d frames dropped", len(frames))
                    continue
                self._dispatch(frames[0], frames[1])
        except asyncio.CancelledError:
            pass
        finally:
            for request in list(self._requests.values()):
                self._abort(request)
            if writer is not None:
                writer.cancel()
            sock.close(0)
            context.term()

    @staticmethod
    async def _write(sock: Any, outbox: asyncio.Queue[list[bytes]]) -> None:
        while True:
            await sock.send_multipart(await outbox.get())

    def _send(self, peer: Peer, message: Answer) -> None:
        assert self._outbox is not None
        self._outbox.put_nowait([peer, encode(message)])

    # -- messages ----------------------------------------------------------------------------
    def _dispatch(self, peer: Peer, frame: bytes) -> None:
        try:
            message = decode_request(frame)
        except WireError as exc:  # a malformed message never stops the core
            request_id = generate_id(frame)
            if request_id is None:
                log.warning("engine core: a message dropped: %s", exc)
            else:
                self._generate((peer, request_id), exc)
            return
        if isinstance(message, Generate):
            self._generate((peer, message.id), message)
        elif isinstance(message, Abort):
            request = self._requests.get((peer, message.id))
            if request is not None:
                self._abort(request)
        else:
            self._spawn(self._call(peer, message))

    def _generate(self, key: Key, message: Generate | WireError) -> None:
        """Start request ``key``, or refuse it: its id is running (the refusal ends the stream
        that sent it), or its message did not decode (a 400 naming the field)."""
        if key in self._requests:
            self._refuse(key, RequestError(f"request id {key[1]!r} is already running"))
        elif isinstance(message, WireError):
            self._refuse(key, RequestError(str(message)))
        else:
            self._requests[key] = self._spawn(self._add(key, message))

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def _abort(request: Any) -> None:
        if isinstance(request, asyncio.Task):
            request.cancel()  # still being added: nothing queued yet
        else:
            request.aborted = True  # the engine drops it at its next step

    async def _add(self, key: Key, message: Generate) -> None:
        peer, request_id = key
        try:
            kv = message.kv
            if kv is not None and kv.do_remote_prefill:
                self._remote[key] = str(kv.remote_engine_id)
            shared = None
            if message.shared:
                self._shared_of[key] = message.shared
                shared = self._share(peer, message.shared)
            self._requests[key] = await self.engine.add_request(
                request_id, message.prompt, message.params, kv,
                shared=shared, emit=lambda update: self._hand_over(key, update))
        except asyncio.CancelledError:
            self._forget(key)
        except Exception as exc:
            # a ValueError the engine raised is the request's fault: a 400
            self._forget(key)
            self._refuse(key, RequestError(str(exc)) if isinstance(exc, ValueError) else exc)

    def _refuse(self, key: Key, error: BaseException) -> None:
        """End request ``key`` in its API process with ``error``."""
        self._send(key[0], Outs(outs=[Failed(id=key[1], error=error_fields(error))]))

    def _forget(self, key: Key) -> None:
        """The request ended (or never started): drop what the core keeps of it."""
        self._requests.pop(key, None)
        self._remote.pop(key, None)
        shared_key = self._shared_of.pop(key, None)
        if shared_key:
            self._unshare(key[0], shared_key)

    def _hand_over(self, key: Key, update: RequestOutput | BaseException) -> None:
        """The engine's ``emit`` (engine thread): buffer the update; wake the loop once."""
        self._updates.append((key, update))
        if not self._flush_due and self._loop is not None:
            self._flush_due = True
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        """Send every buffered update, one ``outs`` message per API process."""
        self._flush_due = False
        batches: dict[Peer, list[Out | Failed]] = {}
        while self._updates:
            key, update = self._updates.popleft()
            batches.setdefault(key[0], []).append(self._update_message(key, update))
        for peer, outs in batches.items():
            self._send(peer, Outs(outs=outs))

    def _update_message(self, key: Key, update: RequestOutput | BaseException) -> Out | Failed:
        if isinstance(update, BaseException):
            self._forget(key)
            return Failed(id=key[1], error=error_fields(update))
        server = None
        remote = self._remote.pop(key, None)
        if remote is not None and self.engine.kv is not None:
            server = self.engine.kv.server_of(remote) or None
        if update.finished:
            self._forget(key)
        return Out(output=update, server=server)

    def _share(self, peer: Peer, key: str) -> SharedPrefill:
        """The ``SharedPrefill`` of the choices sent under ``key``, counted per request."""
        shared, users = self._shared.get((peer, key), (SharedPrefill(), 0))
        self._shared[(peer, key)] = (shared, users + 1)
        return shared

    def _unshare(self, peer: Peer, key: str) -> None:
        shared, users = self._shared.get((peer, key), (None, 0))
        if shared is None or users <= 1:
            self._shared.pop((peer, key), None)
        else:
            self._shared[(peer, key)] = (shared, users - 1)

    async def _call(self, peer: Peer, call: Call) -> None:
        try:
            reply = Reply(call=call.call, value=await _answer(self.engine, call))
        except Exception as exc:
            reply = Reply(call=call.call, error=error_fields(exc))
        self._send(peer, reply)


async def _answer(engine: EngineClient, call: Call) -> list[TokenLogprob] | None:
    """What ``call`` returns (its ``Reply``'s ``value``); raises what the engine raised."""
    if isinstance(call, Score):
        return await engine.score_prompt(call.prompt, call.top)
    if isinstance(call, Health):
        await engine.check_health()
    elif isinstance(call, Release) and engine.kv is not None:
        await engine.kv.release(call.kv)
    return None
