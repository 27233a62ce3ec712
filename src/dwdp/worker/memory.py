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
- ``kv_pool``: the KV cache pool's budget (``dwdp.worker.engine.kv_pool``); on the host its
  pages become resident as requests first fill them (the budget is what they may reach);
- ``kv_staging``: the buffer the KV of another tier's servers passes through (vLLM interop:
  a context rank's staging buffer in vLLM's layout, registered with NIXL, which holds
  ``kvTransfer.vllm.stagingTokens`` tokens; a generation rank's READ buffer); zero without;
- ``runtime``: the host resident set before the load (the interpreter, torch and the other
  libraries, the CUDA context's host side);
- ``api_process``: the resident set of the rank's API server process (HTTP, tokenizer,
  detokenizer), measured when the engine starts.

Bytes are integers; ``None`` means not measured. ``free_for_kv_bytes`` is the memory the pool
may take: on a GPU the device's total minus what this rank holds (weights, DWDP buffers,
headroom), so ranks sharing one GPU (tests) each size their pool as on a GPU of their own (a
warning says so when the pool exceeds what is free now); on the host the container's budget
(``dwdp.worker.host_memory``: its cgroup's limit less its working set, or the host's
``MemAvailable`` when that is less) less a safety margin (:data:`HOST_MARGIN_FRACTION` of the
limit, at least :data:`HOST_MARGIN_MIN`: the activations, the API process's growth, the
allocator's slack), split evenly among the pod's ranks. With CUDA graphs on, their estimate is
taken out of it too, and the staging buffer always, so neither comes on top of the KV pool.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dwdp.worker.engine.kv_pool import KvPool, kv_bytes_per_token, size_kv_pool
from dwdp.worker.engine.mtp_drafts import hidden_rows
from dwdp.worker.engine.piecewise import token_buckets
from dwdp.worker.host_memory import HostBudget, gib, host_budget
from dwdp.worker.status_source import DwdpStatusSource

if TYPE_CHECKING:
    from dwdp.api.launch import KvCacheConfig

log = logging.getLogger(__name__)

HOST, DEVICE = "host", "device"

HOST_MARGIN_FRACTION = 0.05
"""The share of a container's memory limit (of ``MemAvailable`` without one) a pod keeps out
of its ranks' host KV pools."""
HOST_MARGIN_MIN = 256 << 20
"""The smallest margin a pod keeps on the host, in bytes."""


@dataclass(frozen=True, slots=True)
class Placed:
    """Bytes on the host and on the device (``None``: not measured)."""

    host: int | None = 0
    device: int | None = 0

    def on_side(self, where: str) -> int:
        """The bytes on ``where`` (0 when not measured)."""
        return (self.host if where == HOST else self.device) or 0

    @classmethod
    def on(cls, where: str, nbytes: int) -> Placed:
        """``nbytes`` on ``where`` (``host`` or ``device``), nothing on the other."""
        return cls(host=nbytes, device=0) if where == HOST else cls(host=0, device=nbytes)


@dataclass(frozen=True, slots=True)
class Staging:
    """A staging buffer the KV transfer allocates beside the KV pool (on its side): ``tokens``
    tokens of KV (``bytes_per_token`` each, the pool's), ``setting`` the setting that sized it
    as the user writes it (``kvTransfer.vllm.stagingTokens 8192``)."""

    tokens: int
    setting: str


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
    kv_staging: Placed = Placed(0, 0)
    runtime: Placed = Placed(None, 0)
    api_process: Placed = Placed(None, 0)

    def with_api_process(self, pid: int) -> MemoryLedger:
        """The ledger with the resident set of the API server process ``pid`` measured now."""
        return replace(self, api_process=Placed(host=host_resident_bytes(pid), device=0))

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


def ledger_summary(parts: dict[str, Placed]) -> str:
    """One line for the termination message: ``memory GiB (host/device): part h/d, ...``."""
    shown = ", ".join(f"{k} {gib(v.host)}/{gib(v.device)}" for k, v in parts.items())
    return f"memory GiB (host/device): {shown}" if shown else ""


# -- host --------------------------------------------------------------------------------------
def _status_bytes(key: str, pid: int | str = "self") -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    return None


def host_resident_bytes(pid: int | str = "self") -> int | None:
    """The resident set of this process (or ``pid``) now (``VmRSS``, bytes); None off Linux
    or when the process is gone."""
    return _status_bytes("VmRSS", pid)


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


def host_margin(budget: HostBudget) -> int:
    """Bytes a pod keeps out of its ranks' host KV pools (module docstring)."""
    base = budget.limit if budget.limit is not None else budget.host_available
    return max(HOST_MARGIN_MIN, int(HOST_MARGIN_FRACTION * base))


def host_share(budget: HostBudget, host_sharers: int) -> int:
    """One rank's share of its pod's host budget, the margin kept out (bytes)."""
    return max(0, budget.available - host_margin(budget)) // max(1, host_sharers)


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
        """Reset the host and device peaks and record the resident set before the load (the
        ledger's ``runtime``); call just before the load."""
        self.parts["runtime"] = Placed(host=host_resident_bytes(), device=0)
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
    device: str, *, dwdp_device_bytes: int, headroom: int, host_sharers: int = 1,
    budget: HostBudget | None = None,
) -> int:
    """Memory the KV pool may take (bytes), measured now. GPU: the device's total minus
    what torch holds for this process (weights, slot rings), ``dwdp_device_bytes`` (the
    stores, VMM allocations outside torch's allocator) and the activation headroom; host:
    the container's budget less its margin, split evenly among the ``host_sharers`` ranks of
    the pod (``host_share``; ``budget``: the one measured now when None)."""
    if not device.startswith("cuda"):
        return host_share(budget or host_budget(), host_sharers)
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
    kv_staging: Placed | None = None,
    runtime: Placed | None = None,
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
        kv_staging=Placed(0, 0) if kv_staging is None else kv_staging,
        runtime=Placed(None, 0) if runtime is None else runtime,
    )


def _headroom(model: Any, watch: MemoryWatch, *, max_num_tokens: int, max_model_len: int,
              cuda_graphs: bool, max_batch_size: int, draft_tokens: int) -> tuple[Placed, Placed]:
    """``(activations_headroom, cuda_graphs)``: on a GPU one profiling forward of
    ``min(max_num_tokens, max_model_len)`` tokens, with ``cuda_graphs`` one more of the largest
    bucket's tokens (module docstring; a verify graph's bucket holds ``1 + draft_tokens`` a
    request); on the host neither is measured."""
    if not watch.on_gpu:
        return Placed(host=None, device=0), Placed(0, 0)
    tokens = min(max_num_tokens, max_model_len)
    headroom = Placed(host=None, device=activation_headroom(model, tokens))
    graphs = Placed(0, 0)
    if cuda_graphs:
        largest = max(max_batch_size * (1 + draft_tokens), token_buckets(tokens)[-1])
        graphs = Placed.on(DEVICE, activation_headroom(model, min(largest, max_model_len)))
    return headroom, graphs


def _budget_note(budget: HostBudget | None, free: int, staging: Staging | None, where: str,
                 staged: Placed, host_sharers: int) -> str:
    """What the pool's log line and a refusal say of the memory it was sized from: on the
    host the container's budget and every rank's share, and the staging buffer taken out."""
    parts = []
    if budget is not None:
        parts.append(f"{budget.describe()}, less a margin of "
                     f"{host_margin(budget) / 2**30:.2f} GiB, shared by {host_sharers} ranks")
    if staging is not None:
        parts.append(f"less the staging buffer of {staged.on_side(where) / 2**30:.2f} GiB "
                     f"({staging.setting}) from this rank's {free / 2**30:.2f} GiB")
    return "; ".join(parts)


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
    staging: Staging | None = None,
    draft_layers: int = 0,
    draft_tokens: int = 0,
) -> tuple[KvPool, MemoryLedger]:
    """After the commit, before the engine starts: the activation headroom (``_headroom``),
    the KV pool from the memory left (``dwdp.worker.engine.kv_pool.size_kv_pool``) after the
    ``staging`` buffer the KV transfer will allocate beside it (on the pool's side), and the
    ledger, which ``watch`` keeps. ``host_sharers``: the ranks of the pod, which share the
    host's memory (a pool on the host takes its share of the container's budget);
    ``draft_layers``: layers of a draft model whose KV cache each pooled token also holds (an
    MTP layer's; its buffer of a forward's hidden states joins the activation headroom);
    ``draft_tokens``: a verify step's draft tokens a request (``numSpeculativeTokens``).
    Raises ``KvPoolError`` for a pool below one ``max_model_len`` request; the termination
    message then lists every part measured."""
    _, expert, dense, _ = dwdp_buffers(dwdp.status())
    headroom, graphs = _headroom(model, watch, max_num_tokens=max_num_tokens,
                                 max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                                 max_batch_size=max_batch_size, draft_tokens=draft_tokens)
    config = model.config.get_text_config()
    if draft_layers and watch.on_gpu:  # dwdp.worker.engine.mtp_drafts: the hidden states
        rows = hidden_rows(max_num_tokens, max_batch_size, draft_tokens)
        buffer = draft_layers * rows * int(config.hidden_size) * model.dtype.itemsize
        headroom = Placed(host=None, device=(headroom.device or 0) + buffer)
    where = DEVICE if watch.on_gpu else HOST
    budget = None if watch.on_gpu else host_budget()
    per_token = kv_bytes_per_token(config, model.dtype.itemsize, draft_layers)
    staged = Placed.on(where, staging.tokens * per_token if staging else 0)
    free = free_for_kv_bytes(
        watch.device,
        # the stores are VMM allocations torch does not count; the slots are torch's
        dwdp_device_bytes=(expert.device or 0) + (dense.device or 0),
        headroom=(headroom.device or 0) + (graphs.device or 0),
        host_sharers=host_sharers,
        budget=budget,
    )
    peak_load = watch.parts.get("peak_load", Placed(None, None))
    before = measure_ledger(model, dwdp, peak_load=peak_load, headroom=headroom,
                            kv_pool=Placed(0, 0), cuda_graphs=graphs, kv_staging=staged,
                            runtime=watch.parts.get("runtime"))
    watch.record(before)  # a refused pool's termination message lists every part
    note = _budget_note(budget, free, staging, where, staged, host_sharers)
    pool = size_kv_pool(kv, free_bytes=free - staged.on_side(where), bytes_per_token=per_token,
                        max_model_len=max_model_len, where=where, note=note)
    warn_if_shared(watch.device, pool.nbytes, (headroom.device or 0) + (graphs.device or 0))
    ledger = replace(before, kv_pool=Placed.on(pool.where, pool.nbytes))
    watch.record(ledger)
    log.info(
        "KV cache pool: %d tokens (%s, %d bytes per token, %.2f GiB on the %s)%s; %s",
        pool.capacity_tokens,
        pool.limited_by,
        pool.bytes_per_token,
        pool.nbytes / 2**30,
        pool.where,
        f" [{note}]" if note else "",
        watch.summary(),
    )
    return pool, ledger
