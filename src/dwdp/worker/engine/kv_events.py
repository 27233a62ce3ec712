"""KV cache events in vLLM's wire format, for prefix-cache-aware routers (llm-d's precise
prefix-cache scorer, Dynamo's KV router, vllm-router's ``kv_aware`` policy).

What vLLM's ``--kv-events-config`` publisher sends, and what this module sends: over a ZMQ PUB
socket, one message of three frames per engine step that changed the prefix cache: the topic,
an 8-byte big-endian sequence number (0, 1, 2, ...), and a msgpack ``KVEventBatch``: the array
``[ts, events]`` (``ts`` in seconds since the epoch). Each event is an array whose first item
names its kind (msgspec's tagged, array-like structs):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``:
  blocks just cached, in chain order; ``parent_block_hash`` is the block before the first one
  (``None`` for a prompt's first block); ``token_ids`` are the blocks' tokens, ``block_size``
  each; ``lora_id`` is ``None``; ``medium`` ``"GPU"`` or ``"CPU"``.
- ``["BlockRemoved", block_hashes, medium]``: blocks evicted from the cache.
- ``["AllBlocksCleared"]``: the cache is empty (sent once when a rank starts, so a subscriber
  forgets what an earlier process at the same address held).

Block hashes are integers: the last 8 bytes of the engine's SHA-256 chain hash, big-endian (as
vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` gives them). Messages go out from a thread; a
slow subscriber loses messages past ZMQ's high-water mark (it sees a gap in the sequence
numbers), never blocks a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

QUEUE_BATCHES = 10_000
"""Batches waiting for the sender thread at most (more are dropped and counted)."""
SEND_HWM = 100_000
"""ZMQ's send high-water mark: messages queued per subscriber before ZMQ drops."""


class KvEventsError(RuntimeError):
    """The events endpoint cannot be used (the message names the setting)."""


def external_hash(block_hash: bytes) -> int:
    """The integer a subscriber sees for an engine block hash: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks cached in chain order (module docstring)."""

    block_hashes: Sequence[bytes]
    parent: bytes | None
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted."""

    block_hashes: Sequence[bytes]


def encode_batch(events: Sequence[BlockStored | BlockRemoved], *, block_size: int,
                 medium: str, ts: float) -> bytes:
    """One ``KVEventBatch`` as msgpack bytes (module docstring); an empty ``events`` is the
    ``AllBlocksCleared`` batch."""
    import msgpack

    items: list[list[Any]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = None if ev.parent is None else external_hash(ev.parent)
            items.append(["BlockStored", [external_hash(h) for h in ev.block_hashes], parent,
                          list(ev.token_ids), block_size, None, medium])
        else:
            items.append(["BlockRemoved", [external_hash(h) for h in ev.block_hashes], medium])
    if not events:
        items.append(["AllBlocksCleared"])
    return msgpack.packb([ts, items])


class KvEventPublisher:
    """Sends the engine's event batches from a thread over one ZMQ PUB socket.

    ``endpoint``: ``tcp://HOST:PORT``, bound when ``bind`` (a loopback address), else
    connected to (a subscriber's address); ``topic``: the first frame. Raises
    ``KvEventsError`` naming ``kvCache.events.endpoint`` when it cannot bind or connect.
    """

    def __init__(self, endpoint: str, topic: str, *, bind: bool, block_size: int,
                 medium: str) -> None:
        import zmq

        self.endpoint, self.topic = endpoint, topic.encode()
        self.block_size, self.medium = block_size, medium
        self.dropped = 0
        """Batches dropped because the sender thread fell behind."""
        self.sent = 0
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            (self._socket.bind if bind else self._socket.connect)(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._ctx.term()
            verb = "bind" if bind else "connect to"
            raise KvEventsError(
                f"kvCache.events.endpoint: cannot {verb} {endpoint} ({exc})") from exc
        self._queue: queue.Queue[tuple[float, list[BlockStored | BlockRemoved]] | None] = (
            queue.Queue(maxsize=QUEUE_BATCHES))
        self._thread = threading.Thread(target=self._run, name="dwdp-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: %s %s, topic %r", "bound" if bind else "connected to", endpoint,
                 topic)

    def publish(self, events: list[BlockStored | BlockRemoved]) -> None:
        """Queue one step's events (an empty list: ``AllBlocksCleared``); never blocks."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the socket."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close()
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while (item := self._queue.get()) is not None:
            ts, events = item
            payload = encode_batch(events, block_size=self.block_size, medium=self.medium, ts=ts)
            self._socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            seq += 1
            self.sent = seq
