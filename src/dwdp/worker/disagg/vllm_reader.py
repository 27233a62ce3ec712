"""A generation server that reads the KV an unmodified vLLM prefill server computed, through
vLLM's NIXL connector (the reverse of ``dwdp.worker.disagg.vllm_nixl``, whose constants,
staging agent with its compatibility hash, and CPU attention layout it shares).

What vLLM 0.32.0's ``NixlConnector`` (pull mode, the prefill side a ``kv_producer``) gives a
decode server, and what this module does with it:

- **The prefill answer**: ``kv_transfer_params`` with ``do_remote_prefill``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids`` (one list per KV-cache
  group: one here), ``remote_host``/``remote_port`` (vLLM's ZMQ side channel, not its HTTP
  port), ``tp_size`` 1, ``remote_num_tokens`` (the prompt tokens prefilled) and
  ``transfer_mode`` ``pull``; no dwdp lease token (vLLM's protocol has none).
- **Handshake**, once per remote engine (``connect``): a ZMQ REQ on the side channel sends
  msgpack ``(b"get_meta_msg", 0, 0)``; the answer's two frames are msgpack
  ``NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}`` and the prefill server's
  clock. Both are decoded with plain msgpack (no extension types are turned into objects,
  nothing executable). The hash must equal the one this server computes for itself
  (``compatibility_hash``: ``VllmInterop.model`` must be the prefill servers' ``--model``
  string); a mismatch is refused in one line naming what the metadata shows to differ
  (attention backend, layers, block bytes) or, when it shows nothing, the factors it cannot
  show. Then ``NixlAgentMetadata`` is checked (engine id, ``CPU_ATTN``/``LBHNC``, one DRAM
  region per layer of ``heads x 2 x block_size x head_dim`` elements) and its NIXL agent added.
- **Read** (``load``): the blocks are READ, every layer, into a staging buffer registered with
  NIXL (``staging_tokens`` tokens a layer; longer prompts are read in chunks), converted from
  the CPU attention layout (per KV head K transposed ``[head_dim][block_size]`` then V
  ``[block_size][head_dim]``) into dwdp's paged pool (``[slots, heads, head_dim]`` per K and
  V), and then vLLM's completion notification ``"<remote_request_id>:1"`` is sent: the
  prefill server frees the blocks (one reader: this rank).
- **Heartbeats**: while a prepared request waits for its read (at most ``PENDING_MAX_S``),
  ``heartbeat`` sends vLLM's ``"HB:<id>,<id>"`` to its engine every ``heartbeat_s`` so the
  prefill server's lease (``kv_lease_duration``, 30 s by default) does not expire under it.
- **Refusal** (``release``): a request this server refuses after its prefill still sends the
  notification, so the prefill server frees the blocks at once.

Errors: ``TransferError`` (the server answers 502) when the side channel does not answer within
``timeout_s``, or a READ fails or outlasts ``timeout_s``; ``VllmInteropError`` for a prefill
server whose cache this server cannot read; ``LeaseError`` 400 for params that contradict what
the side channel said. None of them hangs the request.

The side channel authenticates no peer (vLLM's protocol has no credentials): a generation
server reads what the ``remote_host`` of its requests names, so only a router of the deployment
should reach it (the NetworkPolicy).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dwdp.worker.disagg.agent import PULL_TIMEOUT_S
from dwdp.worker.disagg.vllm_nixl import (
    GET_META_MSG,
    StagingAgent,
    VllmInterop,
    VllmInteropError,
    cache_slots,
    staging_layout,
    zmq_path,
)
from dwdp.worker.engine.kv_connector import KvTransferParams, LeaseError, TransferError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
"""How long the side channel may take to answer (vLLM's own decode side waits 5 s)."""
STAGING_TOKENS = 2048
"""Tokens a layer of the staging buffer holds: one READ chunk."""
HEARTBEAT_S = 5.0
"""vLLM's heartbeat interval for its default 30 s lease (``kv_lease_duration // 6``)."""
PENDING_MAX_S = 600.0
"""A prepared request neither read nor released after this long gets no more heartbeats."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(slots=True)
class VllmEngine:
    """A connected vLLM prefill engine: its NIXL agent's name and each layer's region."""

    name: str
    host: str
    port: int
    bases: list[int]  # per layer, the address of block 0
    strides: list[int]  # per layer, bytes from one block to the next
    block_len: int  # bytes of one block of one layer
    num_blocks: list[int]  # per layer
    block_size: int  # tokens a block
    device_id: int
    pending: dict[str, float] = field(default_factory=dict)  # remote request id -> since


class VllmReader:
    """The generation side of vLLM interop over ``cache`` (see the module docstring).

    ``cache``: the engine's ``PagedKVCache`` (every layer allocated, on the host);
    ``interop``: the prefill servers' vLLM version, ``--model`` string and hybrid KV cache
    manager setting (``port`` unused: each answer names its side channel);
    ``staging_tokens``: tokens a layer of the staging buffer holds (one READ); ``timeout_s``:
    the longest one READ may take, ``handshake_timeout_s`` a side channel's answer (seconds);
    ``heartbeat_s``: seconds between heartbeats. Raises ``VllmInteropError`` for a cache vLLM's
    CPU layout cannot hold and ``TransferError`` when NIXL cannot start.
    """

    def __init__(
        self,
        cache: Any,
        interop: VllmInterop,
        *,
        num_layers: int,
        staging_tokens: int = STAGING_TOKENS,
        timeout_s: float = PULL_TIMEOUT_S,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        import torch

        self.layout, self.heads, self.head_dim = staging_layout(cache, num_layers,
                                                                interop.cpu_kernel)
        if self.layout.mem_type != "DRAM":
            raise VllmInteropError(
                f"vLLM interop: this server's KV cache is on {cache.layers[0][0].device}; "
                "reading vLLM prefill servers is implemented for host caches (CPU_ATTN) only"
            )
        self.cache = cache
        self.interop = interop
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.heartbeat_s = heartbeat_s
        self.dtype = cache.layers[0][0].dtype
        self.staging_tokens = int(staging_tokens)
        width = self.staging_tokens * self.heads * 2 * self.head_dim
        self.staging = [torch.zeros(width, dtype=self.dtype) for _ in range(num_layers)]
        self._nixl = StagingAgent.start("dwdp-vllm-reader", interop, self.layout, self.staging,
                                        heads=self.heads, head_dim=self.head_dim)
        self.engine_id, self._agent, self.hash = (self._nixl.engine_id, self._nixl.agent,
                                                  self._nixl.hash)
        self._lock = threading.Lock()  # the agent and the engine table
        self._connecting = threading.Lock()  # one handshake at a time
        self._engines: dict[str, VllmEngine] = {}
        self._last_beat = time.monotonic()
        self.handshakes = 0
        self.reads = 0
        self.notifications = 0

    # -- handshake -------------------------------------------------------------------------------
    def connect(self, params: KvTransferParams) -> VllmEngine:
        """The engine of ``params`` (handshaking on its side channel the first time) with the
        request noted for heartbeats. Raises ``TransferError``, ``VllmInteropError`` or
        ``LeaseError`` (see the module docstring)."""
        engine_id = str(params.remote_engine_id)
        with self._connecting:
            engine = self._engines.get(engine_id)
            if engine is None:
                engine = self._handshake(str(params.remote_host), int(params.remote_port or 0),
                                         engine_id)
                with self._lock:
                    self._engines[engine_id] = engine
        tokens = params.remote_num_tokens
        if tokens is not None and len(params.block_ids) * engine.block_size < tokens:
            raise LeaseError(
                400,
                f"kv_transfer_params.remote_block_ids: {len(params.block_ids)} blocks of "
                f"{engine.block_size} tokens hold fewer than remote_num_tokens {tokens}",
            )
        limit = min(engine.num_blocks)
        bad = next((b for b in params.block_ids if b >= limit), None)
        if bad is not None:
            raise LeaseError(
                400,
                f"kv_transfer_params.remote_block_ids: block {bad}, but {engine_id} has "
                f"{limit} blocks",
            )
        with self._lock:
            engine.pending[str(params.remote_request_id)] = time.monotonic()
        return engine

    def _handshake(self, host: str, port: int, engine_id: str) -> VllmEngine:
        import msgpack
        import zmq

        where = zmq_path(host, port)
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(self.handshake_timeout_s * 1000))
            sock.setsockopt(zmq.SNDTIMEO, int(self.handshake_timeout_s * 1000))
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(where)
            sock.send(msgpack.packb([GET_META_MSG, 0, 0], use_bin_type=True))
            frames = sock.recv_multipart()
        except zmq.Again as exc:
            raise TransferError(
                f"vLLM side channel {where}: no answer in {self.handshake_timeout_s:g} s"
            ) from exc
        except zmq.ZMQError as exc:
            raise TransferError(f"vLLM side channel {where}: {exc}") from exc
        finally:
            ctx.destroy(linger=0)
        self.handshakes += 1
        try:
            payload = _unpack(frames[0])
            theirs = str(payload["compatibility_hash"])
            meta = _unpack(payload["agent_metadata_bytes"])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise VllmInteropError(
                f"vLLM side channel {where}: not a NixlHandshakePayload of vLLM "
                f"{self.interop.version} ({exc!r})"
            ) from exc
        if not isinstance(meta, dict):
            raise VllmInteropError(f"vLLM side channel {where}: agent metadata is no map")
        if theirs != self.hash:
            raise VllmInteropError(
                f"vLLM compatibility hash of {where} differs from this server's: "
                f"{self._hash_differences(meta)}"
            )
        return self._add(meta, host, port, engine_id, where)

    def _block_len(self, block_size: int) -> int:
        return self.heads * 2 * block_size * self.head_dim * self.staging[0].element_size()

    def _hash_differences(self, meta: dict[str, Any]) -> str:
        """What the remote metadata shows to differ from this server, else the factors it
        cannot show."""
        seen = []
        backend = meta.get("attn_backend_name")
        if backend != self.layout.backend:
            seen.append(f"attention backend {backend!r} there, {self.layout.backend} here")
        regions = meta.get("kv_caches_base_addr") or []
        if len(regions) != self.num_layers:
            seen.append(f"{len(regions)} layers there, {self.num_layers} here")
        lens, bs = meta.get("block_lens") or [], meta.get("block_size")
        if isinstance(bs, int) and lens and lens[0] != self._block_len(bs):
            seen.append(
                f"{lens[0]} bytes a block of {bs} tokens there, {self._block_len(bs)} here "
                f"({self.heads} KV heads x {self.head_dim} x {self.dtype})"
            )
        if seen:
            return "; ".join(seen)
        return (
            f"the handshake does not show which of the hashed factors differ: the --model "
            f"string (here {self.interop.model!r}: kvTransfer.vllm.model must be the prefill "
            f"servers' --model), dtype (here {self.dtype}), vLLM version (here "
            f"{self.interop.version}), hybrid KV cache manager (here "
            f"{'on' if self.interop.hma else 'off'}) or --kv-cache-dtype (here "
            f"{self.interop.cache_dtype})"
        )

    def _add(self, meta: dict[str, Any], host: str, port: int, engine_id: str,
             where: str) -> VllmEngine:
        """Check the remote ``NixlAgentMetadata`` and add its NIXL agent."""
        if meta.get("engine_id") != engine_id:
            raise LeaseError(
                400,
                f"kv_transfer_params.remote_engine_id: {engine_id!r}, but the side channel "
                f"{where} is engine {meta.get('engine_id')!r}",
            )
        bs = meta.get("block_size")
        regions = list(meta.get("kv_caches_base_addr") or [])
        want = {
            "attn_backend_name": self.layout.backend,
            "kv_cache_layout": self.layout.kv_layout,
            "physical_blocks_per_logical_kv_block": 1,
            "dcp_size": 1,
            "pcp_size": 1,
        }
        for key, value in want.items():
            if meta.get(key, value) != value:
                raise VllmInteropError(
                    f"vLLM engine {engine_id}: {key} {meta.get(key)!r}; this server reads "
                    f"{value!r} only"
                )
        if not isinstance(bs, int) or bs <= 0 or self.staging_tokens < bs:
            raise VllmInteropError(
                f"vLLM engine {engine_id}: block_size {bs!r}; this server reads blocks of 1 "
                f"to {self.staging_tokens} tokens"
            )
        lens = list(meta.get("block_lens") or [])
        if len(regions) != self.num_layers or lens != [self._block_len(bs)] * self.num_layers:
            raise VllmInteropError(
                f"vLLM engine {engine_id}: regions of {lens} bytes a block; this server reads "
                f"{self.num_layers} of {self._block_len(bs)} (one a layer)"
            )
        mems = meta.get("region_mem_types") or ["DRAM"] * self.num_layers
        names = meta.get("region_names") or []
        for i, name in enumerate(names):
            m = _LAYER.search(str(name))
            if m is not None and int(m.group(1)) != i:
                raise VllmInteropError(
                    f"vLLM engine {engine_id}: region {i} is layer {name!r}"
                )
        if set(mems) != {"DRAM"}:
            raise VllmInteropError(
                f"vLLM engine {engine_id}: regions in {sorted(set(mems))}; this server reads "
                "host memory (DRAM) only"
            )
        blocks = meta.get("region_num_blocks") or [meta.get("num_blocks")] * self.num_layers
        if not isinstance(meta.get("agent_metadata"), bytes) or not all(
                isinstance(n, int) for n in blocks):
            raise VllmInteropError(
                f"vLLM engine {engine_id}: no NIXL agent_metadata bytes or block counts"
            )
        try:
            with self._lock:
                name = self._agent.add_remote_agent(meta["agent_metadata"])
        except Exception as exc:  # NIXL's own errors, one line
            raise TransferError(f"vLLM engine {engine_id}: NIXL metadata refused: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        log.info("vLLM prefill engine %s at %s: NIXL agent %s, %d-token blocks", engine_id,
                 where, name, bs)
        return VllmEngine(
            name=name, host=host, port=port,
            bases=[int(a) for a in regions],
            strides=[int(s) for s in meta.get("block_strides") or lens],
            block_len=lens[0], num_blocks=[int(n) for n in blocks], block_size=bs,
            device_id=int(meta.get("device_id") or 0),
        )

    def known(self, engine_id: str) -> VllmEngine | None:
        """The connected engine of that id, if any."""
        return self._engines.get(engine_id)

    # -- read ------------------------------------------------------------------------------------
    def load(self, params: KvTransferParams, blocks: list[int]) -> int:
        """Read the prefilled KV of ``params`` (after ``connect``) into the dwdp blocks
        ``blocks`` (the prompt's, in token order), then notify the prefill server. Returns
        the tokens written; raises ``TransferError``."""
        engine = self._engines.get(str(params.remote_engine_id))
        if engine is None:
            raise TransferError(f"vLLM engine {params.remote_engine_id}: not connected")
        rid = str(params.remote_request_id)
        remote = params.block_ids
        tokens = min(len(blocks) * self.cache.block_size, len(remote) * engine.block_size)
        if params.remote_num_tokens is not None:
            tokens = min(tokens, params.remote_num_tokens)
        slots = cache_slots(blocks, self.cache.block_size, tokens)
        bs = engine.block_size
        per_read = self.staging_tokens // bs
        needed = remote[: math.ceil(tokens / bs)]
        try:
            for start in range(0, len(needed), per_read):
                chunk = needed[start : start + per_read]
                self._read(engine, chunk)
                self._convert(len(chunk), bs, slots[start * bs : (start + len(chunk)) * bs])
        finally:  # read or failed: no more heartbeats (a failed read's lease expires there)
            with self._lock:
                engine.pending.pop(rid, None)
        self.notify(engine, rid)
        self.reads += 1
        return tokens

    def _read(self, engine: VllmEngine, chunk: list[int]) -> None:
        """READ ``chunk`` (remote block ids) of every layer into the staging buffer's first
        ``len(chunk)`` blocks."""
        local, far = [], []
        size = engine.block_len
        for i, staging in enumerate(self.staging):
            for j, rb in enumerate(chunk):
                far.append((engine.bases[i] + rb * engine.strides[i], size, engine.device_id))
                local.append((staging.data_ptr() + j * size, size, 0))
        with self._lock:
            src = self._agent.get_xfer_descs(far, "DRAM")
            dst = self._agent.get_xfer_descs(local, "DRAM")
            handle = None
            try:
                handle = self._agent.initialize_xfer("READ", dst, src, engine.name)
                state = self._agent.transfer(handle)
                deadline = time.monotonic() + self.timeout_s
                while state not in ("DONE", "ERR"):
                    if time.monotonic() > deadline:
                        raise TransferError(
                            f"KV read from vLLM engine {engine.name} timed out after "
                            f"{self.timeout_s:g} s"
                        )
                    time.sleep(0.0005)
                    state = self._agent.check_xfer_state(handle)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(
                    f"KV read from vLLM engine {engine.name} failed: {exc}"
                ) from exc
            finally:
                if handle is not None:
                    with contextlib.suppress(Exception):  # an unfinished READ: NIXL aborts it
                        self._agent.release_xfer_handle(handle)
        if state == "ERR":
            raise TransferError(f"KV read from vLLM engine {engine.name} failed")

    def _convert(self, n: int, block_size: int, slots: Any) -> None:
        """Write the staging buffer's first ``n`` blocks (CPU attention layout) into dwdp's
        pool at ``slots`` (the first ``len(slots)`` of their tokens); the blocks are in
        ``self.layout`` (the prefill hosts' CPU attention kernel: ``cpu_kernel``)."""
        import torch

        count = len(slots)
        with torch.inference_mode():  # the pool's tensors are inference tensors
            for i, staging in enumerate(self.staging):
                blocks = staging[: n * self.heads * 2 * block_size * self.head_dim].view(
                    n, self.heads, 2 * block_size * self.head_dim)
                keys, values = self.layout.from_blocks(blocks, self.head_dim, block_size)
                k_cache, v_cache = self.cache.layers[i]
                k_cache.index_copy_(0, slots, keys[:count])
                v_cache.index_copy_(0, slots, values[:count])

    # -- notifications ---------------------------------------------------------------------------
    def notify(self, engine: VllmEngine, remote_request_id: str) -> None:
        """vLLM's completion notification (``"<id>:1"``: this rank is its one reader): the
        prefill server frees the request's blocks. Raises ``TransferError``."""
        try:
            with self._lock:
                self._agent.send_notif(engine.name, f"{remote_request_id}:1".encode())
        except Exception as exc:
            raise TransferError(
                f"vLLM engine {engine.name}: notification of {remote_request_id} failed: {exc}"
            ) from exc
        self.notifications += 1

    def release(self, params: KvTransferParams) -> None:
        """This server refused the request of ``params``: notify its prefill server so the
        blocks are freed now (handshaking first when needed). Raises ``TransferError``."""
        engine = self.connect(params)
        with self._lock:
            engine.pending.pop(str(params.remote_request_id), None)
        self.notify(engine, str(params.remote_request_id))

    def heartbeat(self) -> None:
        """Every ``heartbeat_s``: vLLM's ``"HB:<id>,<id>"`` to each engine with prepared
        requests not read yet (extends their leases there); failures are logged."""
        now = time.monotonic()
        if now - self._last_beat < self.heartbeat_s:
            return
        self._last_beat = now
        with self._lock:
            for e in self._engines.values():  # never read nor released (a lost request)
                for rid in [r for r, since in e.pending.items() if now - since > PENDING_MAX_S]:
                    del e.pending[rid]
            beats = [(e.name, ",".join(e.pending)) for e in self._engines.values() if e.pending]
        for name, ids in beats:
            try:
                with self._lock:
                    self._agent.send_notif(name, f"HB:{ids}".encode())
            except Exception as exc:
                log.warning("vLLM engine %s: heartbeat failed: %s", name, exc)

    def close(self) -> None:
        """Forget the remote agents and deregister the staging buffer."""
        with self._lock:
            for engine in self._engines.values():
                with contextlib.suppress(Exception):  # closing: nothing left to do
                    self._agent.remove_remote_agent(engine.name)
            self._engines.clear()
            self._nixl.deregister()


def _unpack(data: Any) -> Any:
    """Plain msgpack: maps with string keys, bin as bytes, extension types left as data."""
    import msgpack

    return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
