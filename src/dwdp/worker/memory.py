"""The memory ledger of one rank: where its bytes are, on the host and on the device.

A platform engineer sizes nodes and containers from these numbers, so each one is measured,
not estimated:

- ``peak_load``: the process's peak during the checkpoint load: host ``VmHWM`` (the resident
  set's high-water mark, reset just before the load through ``/proc/self/clear_refs``; it
  includes the interpreter and its libraries), device ``torch.cuda.max_memory_allocated``;
- ``expert_store``/``dense_store``/``slot_rings``: the DWDP buffers the backend allocated
  (VMM or shared memory; the cpu backend's live on the host, the CUDA backends' on the
  device), from the attachment's status;
- ``replicated_weights``: the parameters and buffers the model itself holds (unique storages,
  meta tensors and views into DWDP buffers left out), by where they live;
- ``activations_headroom``: on a GPU, the peak a forward of ``maxNumTokens`` tokens adds
  above the weights (``max_memory_allocated`` around one profiling forward); not measured on
  the host (``None``);
- ``cuda_graphs``: with ``engine.cudaGraphs`` on, the device memory of the graphs' pool
  (decode and piecewise graphs share it): before the capture, the estimate the KV pool is
  sized without (the peak one forward of the largest bucket's tokens adds, ``maxBatchSize``
  for decode or ``piecewise.token_buckets(maxNumTokens)[-1]``: that bucket holds that many
  tokens' activations, and every bucket shares its pool), then the pool's measured bytes
  (``GraphStats.pool_bytes``, :meth:`MemoryLedger.with_cuda_graphs`); zero when off;
- ``kv_pool``: the KV cache pool's budget (``dwdp.worker.engine.kv_pool``).

Bytes are integers; ``None`` means not measured. ``free_for_kv_bytes`` is the memory the pool
may take: on a GPU the device's total minus what this rank holds (weights, DWDP buffers,
headroom), so ranks sharing one GPU (tests) each size their pool as on a GPU of their own (a
warning says so when the pool exceeds what is free now); on the host the kernel's
``MemAvailable``. With CUDA graphs on, their estimate is taken out of it too, so the graphs'
memory comes out of the KV pool, never on top of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dwdp.worker.engine.kv_pool import KvPool, kv_bytes_per_token, size_kv_pool
from dwdp.worker.engine.piecewise import token_buckets
from dwdp.worker.server.status import DwdpStatusSource

if TYPE_CHECKING:
    from dwdp.api.launch import KvCacheConfig

log = logging.getLogger(__name__)

HOST, DEVICE = "host", "device"


@dataclass(frozen=True, slots=True)
class Placed:
    """Bytes on the host and on the device (``None``: not measured)."""

    host: int | None = 0
    device: int | None = 0

    @classmethod
    def on(cls, where: str, nbytes: int) -> Placed:
        """``nbytes`` on ``where`` (``host`` or ``device``), nothing on the other."""
        return cls(host=nbytes, device=0) if where == HOST else cls(host=0, device=nbytes)


@dataclass(frozen=True, slots=True)
class MemoryLedger:
    """One rank's bytes by purpose (module docstring); ``as_dict`` is what
    ``/dwdp/status`` shows under ``memory`` and the metrics export."""

    peak_load: Placed
    replicated_weights: Placed
    expert_store: Placed
    dense_store: Placed
    slot_rings: Placed
    activations_headroom: Placed
    cuda_graphs: Placed
    kv_pool: Placed

    def with_cuda_graphs(self, pool_bytes: int) -> MemoryLedger:
        """The ledger with the graphs' measured pool (``GraphStats.pool_bytes``, device bytes)
        in place of the estimate the KV pool was sized with."""
        return replace(self, cuda_graphs=Placed.on(DEVICE, pool_bytes))

    def as_dict(self) -> dict[str, dict[str, int | None]]:
        """``{part: {"host": bytes, "device": bytes}}``."""
        return {
            f.name: {HOST: getattr(self, f.name).host, DEVICE: getattr(self, f.name).device}
            for f in fields(self)
        }


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What the server shows about memory: the ledger and the KV pool it sized."""

    ledger: MemoryLedger
    kv_pool: KvPool

    def status(self, tokens_in_use: int) -> dict[str, Any]:
        """``memory`` (the ledger) and ``kv_cache`` (the pool, ``tokens_in_use`` the tokens
        the running requests reserve) for ``/dwdp/status``."""
        return {
            "memory": self.ledger.as_dict(),
            "kv_cache": {**self.kv_pool.as_dict(), "tokens_in_use": tokens_in_use},
        }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def ledger_summary(parts: dict[str, Placed]) -> str:
    """One line for the termination message: ``memory GiB (host/device): part h/d, ...``."""
    shown = ", ".join(f"{k} {_gib(v.host)}/{_gib(v.device)}" for k, v in parts.items())
    return f"memory GiB (host/device): {shown}" if shown else ""


# -- host --------------------------------------------------------------------------------------
def _status_bytes(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    return None


def host_peak_bytes() -> int | None:
    """This process's resident high-water mark (``VmHWM``, bytes); None off Linux."""
    return _status_bytes("VmHWM")


def reset_host_peak() -> None:
    """Reset ``VmHWM`` to the current resident set (``/proc/self/clear_refs`` value 5);
    a no-op where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        log.debug("cannot reset VmHWM; the load peak includes earlier peaks")


def host_available_bytes() -> int:
    """The kernel's estimate of memory available to new work (``MemAvailable``, bytes)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


# -- the load peak -----------------------------------------------------------------------------
class MemoryWatch:
    """Measures the peak of the checkpoint load on ``device`` (``cpu`` or ``cuda:N``) and
    keeps every part measured so far, for the termination message of a rank that fails."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.parts: dict[str, Placed] = {}

    @property
    def on_gpu(self) -> bool:
        """True when the model lives on a CUDA device."""
        return self.device.startswith("cuda")

    def start(self) -> None:
        """Reset the host and device peaks; call just before the load."""
        reset_host_peak()
        if self.on_gpu:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> Placed:
        """The peaks since ``start`` (host ``VmHWM``, device ``max_memory_allocated``)."""
        device = 0
        if self.on_gpu:
            import torch

            device = int(torch.cuda.max_memory_allocated(self.device))
        return Placed(host=host_peak_bytes(), device=device)

    def end(self) -> Placed:
        """Record and return the load's peak; call right after the load."""
        self.parts["peak_load"] = self.peak()
        return self.parts["peak_load"]

    def record(self, ledger: MemoryLedger) -> None:
        """Keep every part of ``ledger`` (the summary then shows them all)."""
        self.parts = {f.name: getattr(ledger, f.name) for f in fields(ledger)}

    def summary(self) -> str:
        """The parts measured so far, one line (empty before the load ended)."""
        return ledger_summary(self.parts)


# -- after the commit --------------------------------------------------------------------------
def dwdp_buffers(status: dict[str, Any]) -> tuple[str, Placed, Placed, Placed]:
    """``(where, expert_store, dense_store, slot_rings)`` from a DWDP status (zeros when DWDP
    is off); ``where`` is ``host`` for the cpu backend, else ``device``."""
    where = HOST if status.get("backend") == "cpu" else DEVICE
    resident = status.get("resident") or {}

    def allocated(kind: str) -> int:
        return int((resident.get(kind) or {}).get("store_allocated_bytes", 0))

    return (
        where,
        Placed.on(where, allocated("expert")),
        Placed.on(where, allocated("dense")),
        Placed.on(where, int(status.get("bytes_slots", 0))),
    )


def weight_bytes(model: Any, skip: Iterable[tuple[int, int]] = ()) -> Placed:
    """Bytes of the model's own parameters and buffers: unique storages by where they live;
    meta tensors and storages starting inside a ``skip`` range ``[ptr, ptr + nbytes)`` (the
    DWDP buffers the repointed weights view) are left out."""
    ranges = [(p, p + n) for p, n in skip]
    seen: set[tuple[str, int]] = set()
    host = device = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = (str(t.device), ptr)
        if key in seen or any(lo <= ptr < hi for lo, hi in ranges):
            continue
        seen.add(key)
        if t.device.type == "cpu":
            host += storage.nbytes()
        else:
            device += storage.nbytes()
    return Placed(host=host, device=device)


def activation_headroom(model: Any, tokens: int) -> int:
    """Device bytes one forward of ``tokens`` tokens (one sequence, no KV cache, last
    logits only) adds above what is allocated now: the peak ``max_memory_allocated`` of a
    profiling forward. The model must be on a CUDA device."""
    import torch

    device = model.device
    vocab = int(model.config.get_text_config().vocab_size)
    ids = (torch.arange(tokens, device=device) % vocab).unsqueeze(0)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - int(before))


def free_for_kv_bytes(
    device: str, *, dwdp_device_bytes: int, headroom: int, host_sharers: int = 1
) -> int:
    """Memory the KV pool may take (bytes), measured now. GPU: the device's total minus
    what torch holds for this process (weights, slot rings), ``dwdp_device_bytes`` (the
    stores, VMM allocations outside torch's allocator) and the activation headroom; host:
    ``MemAvailable`` split evenly among the ``host_sharers`` ranks of the pod."""
    if not device.startswith("cuda"):
        return host_available_bytes() // max(1, host_sharers)
    import torch

    total = int(torch.cuda.get_device_properties(device).total_memory)
    return total - int(torch.cuda.memory_allocated(device)) - dwdp_device_bytes - headroom


def warn_if_shared(device: str, pool_bytes: int, headroom: int) -> bool:
    """Warn (and return True) when a GPU pool of ``pool_bytes`` would not fit in what the
    driver reports free now beside one forward's ``headroom``: other processes hold the GPU
    (or the fraction leaves no room for the CUDA context)."""
    if not device.startswith("cuda"):
        return False
    import torch

    free_now, _ = torch.cuda.mem_get_info(device)
    if pool_bytes <= free_now - headroom:
        return False
    log.warning(
        "%s: the KV cache pool (%.2f GiB, sized from this rank's own use) is more than the "
        "%.2f GiB free now beside the activations: other processes use this GPU",
        device,
        pool_bytes / 2**30,
        (free_now - headroom) / 2**30,
    )
    return True


def measure_ledger(
    model: Any,
    dwdp: DwdpStatusSource,
    *,
    peak_load: Placed,
    headroom: Placed,
    kv_pool: Placed,
    cuda_graphs: Placed | None = None,
) -> MemoryLedger:
    """The ledger after the commit (module docstring); ``dwdp``'s ``buffer_ranges`` are
    left out of the weights."""
    _, expert, dense, slots = dwdp_buffers(dwdp.status())
    return MemoryLedger(
        peak_load=peak_load,
        replicated_weights=weight_bytes(model, dwdp.buffer_ranges()),
        expert_store=expert,
        dense_store=dense,
        slot_rings=slots,
        activations_headroom=headroom,
        cuda_graphs=Placed(0, 0) if cuda_graphs is None else cuda_graphs,
        kv_pool=kv_pool,
    )


def size_rank_memory(
    model: Any,
    dwdp: DwdpStatusSource,
    watch: MemoryWatch,
    *,
    kv: KvCacheConfig,
    max_num_tokens: int,
    max_model_len: int,
    host_sharers: int = 1,
    cuda_graphs: bool = False,
    max_batch_size: int = 1,
) -> tuple[KvPool, MemoryLedger]:
    """After the commit, before the engine starts: the activation headroom (on a GPU, one
    profiling forward of ``min(max_num_tokens, max_model_len)`` tokens), with ``cuda_graphs``
    the graphs' estimate (one more profiling forward, of the largest bucket's tokens: module
    docstring), the KV pool from the memory left
    (``dwdp.worker.engine.kv_pool.size_kv_pool``) and the ledger, which ``watch`` keeps.
    ``host_sharers``: the ranks of the pod, which share the host's memory (a pool on the
    host takes its share). Raises ``KvPoolError`` for a pool below one ``max_model_len``
    request; the termination message then lists every part measured."""
    _, expert, dense, _ = dwdp_buffers(dwdp.status())
    headroom = Placed(host=None, device=0)
    graphs = Placed(0, 0)
    if watch.on_gpu:
        tokens = min(max_num_tokens, max_model_len)
        headroom = Placed(host=None, device=activation_headroom(model, tokens))
        if cuda_graphs:
            largest = max(max_batch_size, token_buckets(tokens)[-1])
            graphs = Placed.on(DEVICE, activation_headroom(model, min(largest, max_model_len)))
    free = free_for_kv_bytes(
        watch.device,
        # the stores are VMM allocations torch does not count; the slots are torch's
        dwdp_device_bytes=(expert.device or 0) + (dense.device or 0),
        headroom=(headroom.device or 0) + (graphs.device or 0),
        host_sharers=host_sharers,
    )
    peak_load = watch.parts.get("peak_load", Placed(None, None))
    before = measure_ledger(model, dwdp, peak_load=peak_load, headroom=headroom,
                            kv_pool=Placed(0, 0), cuda_graphs=graphs)
    watch.record(before)  # a refused pool's termination message lists every part
    pool = size_kv_pool(
        kv,
        free_bytes=free,
        bytes_per_token=kv_bytes_per_token(model.config.get_text_config(), model.dtype.itemsize),
        max_model_len=max_model_len,
        where=DEVICE if watch.on_gpu else HOST,
    )
    warn_if_shared(watch.device, pool.nbytes, (headroom.device or 0) + (graphs.device or 0))
    ledger = replace(before, kv_pool=Placed.on(pool.where, pool.nbytes))
    watch.record(ledger)
    log.info(
        "KV cache pool: %d tokens (%s, %d bytes per token, %.2f GiB on the %s); %s",
        pool.capacity_tokens,
        pool.limited_by,
        pool.bytes_per_token,
        pool.nbytes / 2**30,
        pool.where,
        watch.summary(),
    )
    return pool, ledger
