"""A context rank that an unmodified vLLM decode server reads through vLLM's NIXL connector.

One vLLM version is spoken, ``VLLM_VERSION`` (0.32.0; ``VllmInterop.version``, any other value
is refused in one line naming both). What that version's ``NixlConnector`` (pull mode, the
decode side a ``kv_consumer``) expects of a prefill server, and what this module gives it:

- **Side channel**: a ZMQ ROUTER on ``host:port`` (vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST`` /
  ``_PORT`` of a prefill server). The decode side's REQ socket sends msgpack
  ``(b"get_meta_msg", pp_rank, tp_rank)``; the answer is two frames: msgpack
  ``NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}`` and this process's
  ``time.perf_counter()`` (the decode side's clock-offset estimate). Requests are decoded with
  plain msgpack (no extension types, nothing executable).
- **Compatibility hash** (``compatibility_hash``): sha256 of the sorted-key JSON of the factors
  vLLM 0.32.0 hashes (its version, connector version 14, the model string the decode server
  was started with, dtype, total KV heads, head size, layers, attention backend, cache dtype,
  whether the hybrid KV cache manager is on, no speculative decoding, transfer mode ``pull``).
  The decode side compares it before it decodes anything else: ``VllmInterop.model`` must be
  the decode server's ``--model`` string.
- **Agent metadata**: every field of 0.32.0's ``NixlAgentMetadata``, one region per layer.
- **Layout** (``dwdp.worker.disagg.vllm_layout``, chosen by the cache's device): on a GPU
  vLLM's ``FLASH_ATTN`` (16-token blocks, per head and token K then V), staged in VRAM; on the
  host vLLM's ``CPU_ATTN`` (128-token blocks) with the ``vec`` kernels' bytes (K transposed
  then V) or, for bfloat16 on AMX decode hosts, the ``amx`` kernels' tiles
  (``VllmInterop.cpu_kernel``), staged in DRAM; KV layout ``LBHNC`` either way. dwdp's own
  cache is ``[slots, heads, head_dim]`` per K and V in ``kvCache.blockSize`` blocks, so a
  finished prefill is copied into a staging buffer in that layout, registered with NIXL, and
  the answer's ``remote_block_ids`` are staging blocks (one KV-cache group: ``[[...]]``).
- **Lease**: the staging blocks (and dwdp's blocks) are held until the decode side's
  notification ``"<request_id>:<n>"`` arrives ``n`` times, or the lease (``lease_s``) expires;
  heartbeats ``"HB:<id>,<id>"`` extend it by ``lease_s`` from their arrival.

The reverse direction, a dwdp generation server reading a vLLM prefill server, is
``dwdp.worker.disagg.vllm_reader`` (it shares this module's constants, layout and
``StagingAgent``: the NIXL agent over a staging buffer and the compatibility hash, set up
alike on both sides).

To move to the next vLLM: read the metadata module of its NIXL connector
(``vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata``: ``NIXL_CONNECTOR_VERSION``,
``NixlAgentMetadata``, ``compute_nixl_compatibility_hash``) and its base scheduler (the
listener), update the constants and fields here, add the version to ``VLLM_VERSIONS`` and run
``tests/unit/worker/test_vllm_interop.py`` against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from dwdp.api.defaults import VLLM_SIDE_CHANNEL_PORT, VLLM_VERSIONS
from dwdp.worker.disagg.agent import new_nixl_agent
from dwdp.worker.disagg.vllm_layout import (
    VllmLayout,
    check_cpu_kernel,
    layout_for,
    to_cpu_attn_blocks,  # noqa: F401 (its old home)
)
from dwdp.worker.engine.kv_connector import StagingFull, TransferError

log = logging.getLogger(__name__)

VLLM_VERSION = VLLM_VERSIONS[0]
NIXL_CONNECTOR_VERSION = 14
"""vLLM 0.32.0's ``NIXL_CONNECTOR_VERSION`` (part of the compatibility hash)."""
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
"""Bind addresses refused for the side channel: it authenticates no peer (vLLM's protocol has
no credentials), so it listens on one address only."""
GET_META_MSG = b"get_meta_msg"
CPU_ATTN = "CPU_ATTN"
TRANSFER_MODE = "pull"


class VllmInteropError(TransferError):
    """A vLLM peer this module cannot serve (one line naming what differs)."""


def check_version(version: str) -> str:
    """``version`` when it is one this module speaks; ``VllmInteropError`` otherwise."""
    if version not in VLLM_VERSIONS:
        raise VllmInteropError(
            f"vLLM {version}: not supported; dwdp speaks the NIXL connector of vLLM "
            f"{', '.join(VLLM_VERSIONS)} only"
        )
    return version


def check_model_config(config: Any, dtype: str, cpu_kernel: str = "auto") -> None:
    """The refusals a checkpoint's text ``config`` (transformers) shows before any weight
    loads, for KV cached on the host in ``dtype`` (``str(torch.dtype)``): multi-head latent
    attention (``kv_lora_rank``: vLLM decodes it from its MLA cache, not staged here), then
    what the CPU attention layout of ``cpu_kernel`` cannot hold (``VllmLayout.problem``:
    head size, dtype). Raises ``VllmInteropError`` (one line)."""
    lora = getattr(config, "kv_lora_rank", None)
    if lora:
        raise VllmInteropError(
            f"kvTransfer.vllm: the model uses multi-head latent attention (kv_lora_rank "
            f"{lora}); vLLM decodes it from its MLA cache, which dwdp does not stage: only "
            "models with a key and a value per KV head are served to vLLM"
        )
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    try:
        layout = layout_for("cpu", dtype, cpu_kernel)
    except ValueError as exc:
        raise VllmInteropError(f"kvTransfer.vllm: {str(exc).removeprefix(_PREFIX)}") from None
    problem = layout.problem(dtype, head_dim)
    if problem is not None:
        raise VllmInteropError(f"kvTransfer.vllm: the model's {problem.removeprefix(_PREFIX)}")


_PREFIX = "vLLM interop: "
"""How the layout table's lines begin (replaced by the setting's name in a launch refusal)."""


@dataclass(frozen=True, slots=True)
class VllmInterop:
    """The vLLM decode fleet a context rank serves: ``version`` (``VLLM_VERSIONS``), ``model``
    (the decode servers' ``--model`` string, hashed), ``hma`` (the decode servers run vLLM's
    hybrid KV cache manager: vLLM's default with the NIXL connector; False with
    ``--disable-hybrid-kv-cache-manager``), ``port`` (this rank's ZMQ side channel; vLLM's
    default is 5600), ``cache_dtype`` (the decode servers' ``--kv-cache-dtype``),
    ``cpu_kernel`` (a CPU cache only: the decode hosts' CPU attention kernel, ``vec`` or
    ``amx``, which vLLM picks by host and the handshake does not carry; ``auto``: the one vLLM
    picks on this host, AMX for bfloat16 where it has AMX tiles)."""

    model: str
    version: str = VLLM_VERSION
    port: int = VLLM_SIDE_CHANNEL_PORT
    hma: bool = True
    cache_dtype: str = "auto"
    cpu_kernel: str = "auto"

    def __post_init__(self) -> None:
        check_version(self.version)
        try:
            check_cpu_kernel(self.cpu_kernel)
        except ValueError as exc:
            raise VllmInteropError(str(exc)) from None
        if self.cache_dtype != "auto":
            raise VllmInteropError(
                f"vLLM --kv-cache-dtype {self.cache_dtype}: only 'auto' (the model's dtype) "
                "is supported"
            )


def compatibility_hash(
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    hma: bool = True,
    attn_backend: str = CPU_ATTN,
    cache_dtype: str = "auto",
    version: str = VLLM_VERSION,
) -> str:
    """vLLM 0.32.0's ``compute_nixl_compatibility_hash`` of a model without speculative
    decoding: ``dtype`` as ``str(torch.dtype)`` (``"torch.float32"``)."""
    factors = {
        "vllm_version": check_version(version),
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model,
        "dtype": dtype,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_layers,
        "attn_backend_name": attn_backend,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": hma,
        "speculative_config": None,
        "transfer_mode": TRANSFER_MODE,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def staging_layout(
    cache: Any, num_layers: int, cpu_kernel: str = "auto"
) -> tuple[VllmLayout, int, int]:
    """``(VllmLayout, heads, head_dim)`` a vLLM 0.32.0 decode server reads from ``cache`` (a
    ``PagedKVCache``, ``num_layers`` layers allocated, every layer's K and V [slots, heads,
    head_dim] like layer 0's). ``VllmInteropError`` (one line) for a device, dtype, head size or
    layer shape the decode side cannot share."""
    k0 = cache.layers[0][0]
    _, heads, head_dim = (int(d) for d in k0.shape)
    for i in range(num_layers):
        for t in cache.layers[i]:
            if tuple(t.shape[1:]) != (heads, head_dim):
                raise VllmInteropError(
                    f"vLLM interop: layer {i} caches {tuple(t.shape[1:])}, not "
                    f"(heads, head_dim) = {(heads, head_dim)} like layer 0"
                )
    try:
        layout = layout_for(k0.device.type, str(k0.dtype), cpu_kernel)
    except ValueError as exc:
        raise VllmInteropError(str(exc)) from None
    problem = layout.problem(str(k0.dtype), head_dim)
    if problem is not None:
        raise VllmInteropError(problem)
    return layout, heads, head_dim


@dataclass(slots=True)
class StagingAgent:
    """One side's NIXL agent over its staging buffer (one tensor a layer, registered), its
    engine id and the compatibility hash its handshakes carry: set up alike by the prefill
    side (``VllmProducer``) and the decode side (``vllm_reader.VllmReader``), so both hash
    the same factors (the cache dtype included, as vLLM does)."""

    engine_id: str
    agent: Any
    registered: Any
    hash: str

    @classmethod
    def start(cls, name: str, interop: VllmInterop, layout: VllmLayout, staging: list[Any], *,
              heads: int, head_dim: int) -> StagingAgent:
        """An agent named ``name`` plus a random suffix with ``staging`` registered (host
        memory when the layout's is DRAM), hashed for ``interop``'s fleet: ``staging``'s
        dtype and length (the layers), ``heads`` KV heads of ``head_dim``. Raises
        ``TransferError`` when NIXL cannot start."""
        engine_id = f"{name}-{uuid.uuid4().hex[:12]}"
        agent = new_nixl_agent(engine_id, host_memory=layout.mem_type == "DRAM")
        registered = agent.register_memory(staging)
        digest = compatibility_hash(
            model=interop.model,
            dtype=str(staging[0].dtype),
            num_kv_heads=heads,
            head_size=head_dim,
            num_layers=len(staging),
            hma=interop.hma,
            attn_backend=layout.backend,
            cache_dtype=interop.cache_dtype,
            version=interop.version,
        )
        return cls(engine_id, agent, registered, digest)

    def deregister(self) -> None:
        """Deregister the staging buffer (closing: a failure is ignored); safe to call
        twice."""
        if self.registered is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self.registered)
            self.registered = None


def staged_blocks(
    cache: Any, layer: int, blocks: list[int], num_tokens: int, layout: VllmLayout
) -> Any:
    """The first ``num_tokens`` tokens of dwdp's ``blocks`` of ``layer`` in ``layout``:
    [max(1, ceil(num_tokens / layout.block_size)), heads, 2 x layout.block_size x head_dim],
    zero past ``num_tokens``, on the cache's device (any device: gather, pad and permute)."""
    import torch

    keys, values = cache.layers[layer]
    slots = cache_slots(blocks, cache.block_size, num_tokens).to(keys.device)
    pad = max(1, math.ceil(num_tokens / layout.block_size)) * layout.block_size - num_tokens
    k, v = (t.index_select(0, slots) for t in (keys, values))
    if pad:
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (k, v))
    return layout.to_blocks(k, v, layout.block_size)


def zmq_path(host: str, port: int) -> str:
    """The ZMQ TCP address of a side channel (an IPv6 host in brackets)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port}"


def cache_slots(block_table: list[int], block_size: int, num_tokens: int) -> Any:
    """The slot index of each of the first ``num_tokens`` tokens of a dwdp block table
    (``block_size`` tokens a block): a [num_tokens] int64 tensor."""
    import torch

    blocks = torch.tensor(block_table, dtype=torch.int64)
    slots = blocks[:, None] * block_size + torch.arange(block_size)[None, :]
    return slots.reshape(-1)[:num_tokens]


@dataclass(slots=True)
class _Lease:
    staging: list[int]
    blocks: list[int]  # dwdp's, freed with the lease
    deadline: float  # time.monotonic()
    reads: int = 0


class VllmProducer:
    """The vLLM side of a context rank's ``KvTransfer``: staging buffer, NIXL agent, ZMQ side
    channel and leases (see the module docstring).

    ``cache``: the engine's ``PagedKVCache`` (every layer allocated); ``host``: the address the
    side channel binds and advertises (a wildcard is refused: the channel authenticates no
    peer); ``lease_s``: vLLM's ``kv_lease_duration``;
    ``staging_blocks``: blocks of the staging buffer in the layout's block size (each staged
    request takes whole blocks; ``staging_setting`` names what sized it, for the error of a
    full buffer); it lives on the cache's device.
    ``layout``: the ``VllmLayout`` staged (``vllm_layout.layout_for`` the cache's device).
    Raises ``VllmInteropError`` for a cache the decode side cannot share (device, head size,
    dtype; ``check_model_config`` refuses it earlier, from the checkpoint's config) and
    ``TransferError`` when NIXL or ZMQ cannot start.
    """

    def __init__(
        self,
        cache: Any,
        interop: VllmInterop,
        *,
        num_layers: int,
        host: str,
        lease_s: float,
        staging_blocks: int,
        staging_setting: str = "stagingTokens",
    ) -> None:

        import torch

        if host in WILDCARDS:
            raise VllmInteropError(
                f"vLLM interop: side channel host {host!r} is a wildcard; bind it to the pod's "
                "own address (vLLM's side channel authenticates no peer)"
            )
        layout, self.heads, self.head_dim = staging_layout(cache, num_layers, interop.cpu_kernel)
        self.layout = layout
        self.interop = interop
        self.cache = cache
        self.host = host
        self.lease_s = lease_s
        k0 = cache.layers[0][0]
        self.dtype = k0.dtype
        self.num_layers = num_layers
        self.num_staging = int(staging_blocks)
        self.staging_setting = staging_setting
        width = 2 * layout.block_size * self.head_dim
        self.staging = [
            torch.zeros(self.num_staging, self.heads, width, dtype=self.dtype, device=k0.device)
            for _ in range(num_layers)
        ]
        self.block_len = layout.block_bytes(self.heads, self.head_dim,
                                            self.staging[0].element_size())
        self.device_id = (k0.device.index or 0) if layout.mem_type == "VRAM" else 0
        self._free = list(range(self.num_staging - 1, -1, -1))
        self._nixl = StagingAgent.start("dwdp-vllm", interop, layout, self.staging,
                                        heads=self.heads, head_dim=self.head_dim)
        self.engine_id, self._agent, self.hash = (self._nixl.engine_id, self._nixl.agent,
                                                  self._nixl.hash)
        self._lock = threading.Lock()  # agent and leases
        self._leases: dict[str, _Lease] = {}
        self.handshake = self._handshake_payload()
        self.handshakes = 0
        self.expired = 0  # leases that ended unread (no final notification within lease_s)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._listen, name="vllm-nixl-side-channel",
                                         daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            self.close()
            raise TransferError(
                f"vLLM side channel tcp://{host}:{interop.port}: {self._error}"
            ) from self._error

    # -- handshake -------------------------------------------------------------------------------
    def agent_metadata(self) -> dict[str, Any]:
        """vLLM 0.32.0's ``NixlAgentMetadata`` of this rank, as the map msgspec decodes."""
        n = self.num_layers
        return {
            "engine_id": self.engine_id,
            "agent_metadata": self._agent.get_agent_metadata(),
            "kv_caches_base_addr": [t.data_ptr() for t in self.staging],
            "device_id": self.device_id,
            "num_blocks": self.num_staging,
            "block_lens": [self.block_len] * n,
            "block_strides": [self.block_len] * n,
            "kv_cache_layout": self.layout.kv_layout,
            "block_size": self.layout.block_size,
            "ssm_sizes": [0, 0],
            "attn_backend_name": self.layout.backend,
            "physical_blocks_per_logical_kv_block": 1,
            "region_num_blocks": [self.num_staging] * n,
            "region_group_ids": [0] * n,
            # None: the decode side skips its layer-name check (vLLM's names are its own)
            "region_names": None,
            "region_mem_types": [self.layout.mem_type] * n,
            "dcp_size": 1,
            "pcp_size": 1,
            "ple_block_len": None,
            "region_members": [],
            "packed_member_layouts": {},
        }

    def _handshake_payload(self) -> bytes:
        import msgpack

        meta = msgpack.packb(self.agent_metadata(), use_bin_type=True)
        return bytes(msgpack.packb(
            {"compatibility_hash": self.hash, "agent_metadata_bytes": meta}, use_bin_type=True
        ))

    def _listen(self) -> None:
        import msgpack
        import zmq

        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.RCVTIMEO, 200)
            sock.setsockopt(zmq.LINGER, 0)
            if ":" in self.host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(zmq_path(self.host, self.interop.port))
        except Exception as exc:  # bind errors, one line to the constructor
            self._error = exc
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                if len(frames) != 3:
                    log.warning("vLLM side channel: %d frames, expected 3; ignored", len(frames))
                    continue
                identity, _, body = frames
                try:
                    msg, pp_rank, tp_rank = msgpack.unpackb(body, raw=False, use_list=True,
                                                            strict_map_key=True)
                except Exception as exc:
                    log.warning("vLLM side channel: undecodable request: %s", exc)
                    continue
                if msg != GET_META_MSG or (pp_rank, tp_rank) != (0, 0):
                    log.warning("vLLM side channel: %r for pp rank %r tp rank %r: this rank "
                                "serves (get_meta_msg, 0, 0) only; ignored", msg, pp_rank, tp_rank)
                    continue
                self.handshakes += 1
                now = msgpack.packb(time.perf_counter())
                sock.send_multipart([identity, b"", self.handshake, now])
        finally:
            ctx.destroy(linger=0)

    # -- leases ----------------------------------------------------------------------------------
    @property
    def leases(self) -> int:
        """Requests whose staging blocks wait for the decode side."""
        return len(self._leases)

    @property
    def free_staging_blocks(self) -> int:
        """Staging blocks no lease holds (``num_staging`` when none is held)."""
        with self._lock:
            return len(self._free)

    def stage(self, request_id: str, blocks: list[int], num_tokens: int) -> list[int]:
        """Copy the KV of ``blocks`` (dwdp's, the first ``num_tokens`` tokens of a request)
        into staging blocks held under a lease; returns their ids. ``StagingFull`` when the
        staging buffer has too few blocks free now."""
        import torch

        need = max(1, math.ceil(num_tokens / self.layout.block_size))
        with self._lock:
            if need > len(self._free):
                raise StagingFull(
                    f"vLLM staging buffer full: request {request_id} needs {need} blocks of "
                    f"{self.layout.block_size} tokens, {len(self._free)} of {self.num_staging} "
                    f"are free (the others wait for vLLM decode servers to read them; "
                    f"{self.staging_setting} sizes the buffer)", retry_s=self.lease_s
                )
            staging = [self._free.pop() for _ in range(need)]
        index = torch.tensor(staging, device=self.staging[0].device)
        for i in range(self.num_layers):
            self.staging[i].index_copy_(
                0, index, staged_blocks(self.cache, i, blocks, num_tokens, self.layout))
        with self._lock:
            self._leases[request_id] = _Lease(staging, list(blocks),
                                              time.monotonic() + self.lease_s)
        return staging

    def cancel(self, request_id: str) -> None:
        """Forget a lease (the request goes on): its staging blocks are free, dwdp's are the
        request's again."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._free.extend(lease.staging)

    def finished_blocks(self) -> list[list[int]]:
        """dwdp block tables whose lease ended since the last call: read by every consumer
        the decode side announced, or expired (a WARNING, counted in ``expired``). Heartbeats
        extend leases."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        reads: Counter[str] = Counter()
        expected: dict[str, int] = {}
        now = time.monotonic()
        with self._lock:
            for messages in notifs.values():
                for raw in messages:
                    msg = bytes(raw).decode(errors="replace")
                    if msg.startswith("HB:"):
                        for rid in msg[3:].split(","):
                            if rid in self._leases:
                                lease = self._leases[rid]
                                lease.deadline = max(lease.deadline, now + self.lease_s)
                        continue
                    rid, _, n = msg.rpartition(":")
                    if rid not in self._leases or not n.isdigit():
                        log.warning("vLLM notification %r names no KV lease held here", msg)
                        continue
                    reads[rid] += 1
                    expected[rid] = int(n)
            out = []
            for rid, count in reads.items():
                lease = self._leases[rid]
                lease.reads += count
                if lease.reads >= expected[rid]:
                    out.append(self._end(rid))
            for rid in [r for r, lease in self._leases.items() if lease.deadline < now]:
                log.warning("KV lease of request %s expired after %.0f s unread (vLLM decode)",
                            rid, self.lease_s)
                self.expired += 1
                out.append(self._end(rid))
        return out

    def _end(self, request_id: str) -> list[int]:
        lease = self._leases.pop(request_id)
        self._free.extend(lease.staging)
        return lease.blocks

    def close(self) -> None:
        """Stop the side channel and deregister the staging buffer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            self._nixl.deregister()
