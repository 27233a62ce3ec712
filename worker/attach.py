"""DWDP attached to a transformers model: setup, hooks H0-H3, expert bind/finish, guards.

``setup_dwdp`` runs on a loaded model, after every weight transform: dense DWDP first (its
commit returns the replicated dense memory), then expert DWDP (store, prefetch ring, copy
plans), then the module tensors of every MoE layer are pointed into the prefetch slots for
good and the hooks are registered. From then on the model runs its ordinary forward; the
hooks tell the two schedules where the forward is:

====================  ==================================  ===================================
hook                  module                              call
====================  ==================================  ===================================
H0                    the causal LM, forward pre-hook     dense ``h0_forward_entry`` (it starts
                                                          the expert prefetch), or expert
                                                          ``start_forward`` without dense
H1                    each MoE decoder layer, pre-hook    dense ``h1_layer_entry``
H2                    its attention, post-hook            dense ``h2_after_attention``
bind / finish         its experts, pre- / post-hook       expert ``bind`` / ``finish``
H3                    its MoE block, post-hook            dense ``h3_after_moe``
abort                 the causal LM, always-call hook     both schedules' ``abort`` when the
                                                          forward raised
====================  ==================================  ===================================

[Note: one slot per MoE order] MoE order ``o`` reads expert slot ``o % num_prefetch_slots``
and dense slots ``o % 2`` (attention) and ``o % 3`` (MoE-dense), in both schedules and in the
module tensors, so the schedules' layer ids are MoE orders, not decoder-layer indices.

[Note: weight guards] Once DWDP has sharded the weights, ``load_state_dict`` on the model or
on any module DWDP manages raises ``WeightsShardedError``. With dense DWDP every update is
refused (the replicated originals are gone). With expert DWDP alone, ``update_weights``
writes this rank's range of an expert table into its store (every rank calls it with the same
tensors) or copies a replicated tensor in place, then calls ``invalidate_prefetch`` so that no
stale copy in a slot is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dwdp.worker.server.status import PHASE_COMMITTED, NoDwdp

log = logging.getLogger(__name__)

ENV_GROUP = "DWDP_GROUP"
ENV_INCARNATION = "DWDP_INCARNATION"


class WeightsShardedError(RuntimeError):
    """A weight reload or update on a model whose weights DWDP has sharded."""


class DwdpConfigError(ValueError):
    """A DWDP setting this worker cannot run; the message names the field and the fix."""


# -- group and backend ---------------------------------------------------------------------


def dwdp_active(cfg: Any) -> bool:
    """True when the launch asks for expert or dense DWDP."""
    return bool(cfg.dwdp.expert_dwdp or cfg.dwdp.enable_dense)


def join_group(cfg: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Join this rank's DWDP group (a collective), or return ``None`` without DWDP.

    TCP store (``DWDP_RENDEZVOUS``, rank 0 hosts it) or MPI, from ``cfg.transport``. Raises
    ``DwdpConfigError`` when ``DWDP_WORLD_SIZE`` is not ``dwdp.dwdpSize``, and the transport's
    errors (rendezvous timeout naming the missing ranks).
    """
    if not dwdp_active(cfg):
        return None
    from dwdp.api.enums import Transport as TransportKind
    from dwdp.worker.transport.base import RendezvousConfig

    rendezvous = RendezvousConfig.from_env(environ)
    if rendezvous.world_size != cfg.dwdp.dwdp_size:
        raise DwdpConfigError(
            f"dwdp.dwdpSize is {cfg.dwdp.dwdp_size} but DWDP_WORLD_SIZE is "
            f"{rendezvous.world_size}: the group's rank count must equal dwdpSize"
        )
    if cfg.transport == TransportKind.MPI:
        from mpi4py import MPI

        from dwdp.worker.transport.mpi import MpiTransport

        world = MPI.COMM_WORLD
        if world.Get_size() != rendezvous.world_size or world.Get_rank() != rendezvous.rank:
            raise DwdpConfigError(
                f"transport mpi: this worker runs one DWDP group per MPI world; MPI rank "
                f"{world.Get_rank()} of {world.Get_size()} but DWDP_RANK={rendezvous.rank} of "
                f"DWDP_WORLD_SIZE={rendezvous.world_size}"
            )
        return MpiTransport.split(timeout_s=rendezvous.timeout_s)
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    return TcpStoreTransport(rendezvous)


def make_backend(cfg: Any, transport: Any, environ: Mapping[str, str] | None = None) -> Any:
    """The device backend for ``cfg.handle_type``: ``shm`` -> the cpu backend (store files
    named after ``DWDP_GROUP``/``DWDP_INCARNATION``), ``posixFd``/``fabric`` -> cuda."""
    from dwdp.api.enums import HandleType

    env = os.environ if environ is None else environ
    if cfg.handle_type == HandleType.SHM:
        from dwdp.worker.backend.cpu import CpuBackend

        return CpuBackend(
            group=env.get(ENV_GROUP, "local"),
            incarnation=env.get(ENV_INCARNATION, "0"),
            rank=transport.rank,
        )
    from dwdp.worker.backend.cuda import CudaBackend

    kwargs: dict[str, Any] = {
        "device": int(env.get("DWDP_LOCAL_RANK", "0")),
        "handle_type": cfg.handle_type,
        "contention_opt": cfg.dwdp.contention_opt,
    }
    if cfg.dwdp.gather_kernel is not None:
        kwargs["gather_kernel"] = cfg.dwdp.gather_kernel
    return CudaBackend(**kwargs)


def setup_dwdp(model: Any, adapter: Any, cfg: Any, *, group: Any) -> Any:
    """Set DWDP up on ``model`` as the launch asks; returns the status source the server
    reads (``DwdpAttachment``, or ``NoDwdp`` when DWDP is off).

    Raises ``DwdpConfigError`` (a setting this worker cannot run), ``SetupError`` (on every
    rank alike), ``UnsupportedArchitectureError``.
    """
    if not dwdp_active(cfg):
        return NoDwdp()
    from dwdp.api.enums import CopyMode
    from dwdp.api.launch import dense_mode

    d = cfg.dwdp
    if d.enable_dense and str(dense_mode(cfg)) != "attached":
        raise DwdpConfigError(
            "dwdp.enableDense: this worker runs dense DWDP attached to expert DWDP only "
            "(enableExperts true, dwdpSize > 1); standalone dense DWDP needs a "
            "tensor-parallel engine"
        )
    backend = make_backend(cfg, group)
    copy_mode = CopyMode(d.copy_mode) if d.copy_mode is not None else CopyMode.PER_SLICE
    if backend.name == "cpu" and copy_mode == CopyMode.GATHER:
        raise DwdpConfigError(
            "dwdp.copyMode: gather needs a CUDA gather kernel; the cpu backend (handleType "
            "shm) runs per_slice or batched"
        )
    partition = d.partition(_num_experts(model, adapter)) if d.expert_dwdp else None
    from dwdp.worker.models.validate import read_headers

    headers = read_headers(Path(cfg.model.path))
    return attach(
        model,
        adapter,
        backend=backend,
        transport=group,
        partition=partition,
        enable_dense=d.enable_dense,
        num_slots=d.num_prefetch_slots,
        copy_mode=copy_mode,
        gather_kernel=d.gather_kernel,
        checkpoint_dtypes={name: dtype for name, (_shape, dtype) in headers.items()},
    )


def _num_experts(model: Any, adapter: Any) -> int:
    layers = adapter.moe_layers(model)
    return layers[0].num_experts if layers else 0


# -- the attachment ------------------------------------------------------------------------


@dataclass(slots=True)
class _Counters:
    bytes_moved: int = 0
    bytes_moved_remote: int = 0
    copies: int = 0


@dataclass(frozen=True, slots=True)
class _SetupFacts:
    """What setup found beside the stores: MoE layers kept whole (reason -> count), the
    repeated MoE orders, and the scalar exchange's report (as ``/dwdp/status`` shows them)."""

    unmanaged: dict[str, int] = field(default_factory=dict)
    repeated: tuple[int, ...] = ()
    scalars: dict[str, object] = field(default_factory=dict)


class DwdpAttachment:
    """DWDP state, schedules and hooks of one rank's model (a ``DwdpStatusSource``).

    Built by :func:`attach`. ``close()`` removes the hooks and releases stores, views and
    slots (the model cannot run afterwards: its tensors pointed into the slots).
    """

    def __init__(
        self,
        *,
        model: Any,
        layers: list[Any],
        backend: Any,
        transport: Any,
        partition: Any,
        dense: Any,
        experts: Any,
        expert_schedule: Any,
        dense_schedule: Any,
        counters: _Counters,
        expert_freed: int,
        expert_leaks: int,
        facts: _SetupFacts | None = None,
    ) -> None:
        self.model = model
        self.layers = layers
        self.backend = backend
        self.transport = transport
        self.partition = partition
        self.dense = dense
        self.experts = experts
        self.expert_schedule = expert_schedule
        self.dense_schedule = dense_schedule
        self.counters = counters
        self.expert_freed = expert_freed
        self.expert_leaks = expert_leaks
        self.facts = facts or _SetupFacts()
        self.phase = PHASE_COMMITTED
        self._handles: list[Any] = []
        self._guards: list[Any] = []
        """The reload guards: they outlive ``close()`` (the weights stay sharded)."""
        self._in_forward = False

    # -- DwdpStatusSource ----------------------------------------------------------------
    @property
    def committed(self) -> bool:
        """True while the committed DWDP state serves."""
        return self.phase == PHASE_COMMITTED

    def status(self) -> dict[str, Any]:
        """See ``DwdpStatusSource.status``; bytes are integers, per rank."""
        resident: dict[str, Any] = {}
        stored = slot_bytes = freed = 0
        leaks = self.expert_leaks
        if self.dense is not None and self.phase == PHASE_COMMITTED:
            r = self.dense.status()
            resident["dense"] = r.as_dict()
            stored += r.store_bytes
            slot_bytes += r.slot_bytes
            freed += r.sharded_bytes
            leaks += r.leaks
        if self.experts is not None and self.phase == PHASE_COMMITTED:
            r = self.experts.status()
            resident["expert"] = r.as_dict()
            stored += r.store_bytes
            slot_bytes += r.slot_bytes
            freed += self.expert_freed
        slots: dict[str, int] = {}
        if self.expert_schedule is not None:
            slots["expert"] = self.expert_schedule.num_slots
        if self.dense is not None:
            slots["attention"] = self.dense.rings.attention
            slots["moe_dense"] = self.dense.rings.moe_dense
        return {
            "phase": self.phase,
            "rank": self.transport.rank,
            "dwdp_size": self.transport.world_size,
            "backend": self.backend.name,
            "layout_digest": self.dense.layout.digest if self.dense is not None else None,
            "partition": self.partition.to_dict() if self.partition is not None else None,
            "moe_layers": [m.layer_index for m in self.layers],
            "bytes_stored": stored,
            "bytes_slots": slot_bytes,
            "bytes_moved": self.counters.bytes_moved,
            "bytes_moved_remote": self.counters.bytes_moved_remote,
            "bytes_freed": freed,
            "leaks": leaks,
            "slots": slots,
            "slot_waits": self.slot_waits,
            "copies": self.counters.copies,
            "resident": resident,
            "unmanaged_moe_layers": dict(self.facts.unmanaged),
            "repeated_moe_layers": list(self.facts.repeated),
            "scalars": dict(self.facts.scalars),
        }

    @property
    def slot_waits(self) -> int:
        """Binds and layer entries that found their copy not issued and issued it on
        demand (compute then waits for a copy that did not overlap anything)."""
        waits = 0
        if self.expert_schedule is not None:
            waits += self.expert_schedule.stats.demand_copies
        if self.dense_schedule is not None:
            waits += self.dense_schedule.stats.demand_fills
        return waits

    # -- hooks -----------------------------------------------------------------------------
    def _register(self, handle: Any) -> None:
        self._handles.append(handle)

    def install_hooks(self) -> None:
        """Register H0-H3, bind/finish and the abort hook (see the module docstring)."""
        model, dense_s, expert_s = self.model, self.dense_schedule, self.expert_schedule

        def h0(_module: Any, _args: Any) -> None:
            self._in_forward = True
            if dense_s is not None:
                dense_s.h0_forward_entry()
            elif expert_s is not None:
                expert_s.start_forward()

        def done(_module: Any, _args: Any, _out: Any) -> None:
            self._in_forward = False

        def settle(_module: Any, _args: Any, _out: Any) -> None:
            if self._in_forward:  # the forward raised: its read windows stay open
                self._in_forward = False
                if dense_s is not None:
                    dense_s.abort()
                elif expert_s is not None:
                    expert_s.abort()

        self._register(model.register_forward_pre_hook(h0))
        self._register(model.register_forward_hook(done))
        self._register(model.register_forward_hook(settle, always_call=True))
        for m in self.layers:
            o = m.moe_index
            if dense_s is not None:
                self._register(
                    m.decoder_layer.register_forward_pre_hook(_call0(dense_s.h1_layer_entry, o))
                )
                self._register(
                    m.attention.register_forward_hook(_call1(dense_s.h2_after_attention, o))
                )
                self._register(m.moe_block.register_forward_hook(_call1(dense_s.h3_after_moe, o)))
            if expert_s is not None:
                self._register(m.experts.register_forward_pre_hook(_call0(expert_s.bind, o)))
                self._register(m.experts.register_forward_hook(_call1(expert_s.finish, o)))

    def install_guards(self) -> None:
        """Refuse ``load_state_dict`` on the model and every module DWDP manages, for good:
        ``close()`` leaves these guards in place (the original weights are gone)."""

        def refuse(module: Any, *_args: Any, **_kwargs: Any) -> None:
            raise WeightsShardedError(self._refusal())

        modules = {id(self.model): self.model}
        for m in self.layers:
            for mod in m.decoder_layer.modules():
                modules[id(mod)] = mod
        for mod in modules.values():
            self._guards.append(mod.register_load_state_dict_pre_hook(refuse))
        self.model._dwdp_sharded = True

    def _refusal(self) -> str:
        kind = "dense and expert" if self.dense is not None else "expert"
        if self.phase != PHASE_COMMITTED:
            return (
                f"{kind} DWDP sharded this model's weights and was torn down: reloading them "
                "is refused (load the checkpoint again into a new model)"
            )
        return (
            f"{kind} DWDP has sharded this model's weights: reloading them is refused "
            "(restart the worker with the new checkpoint"
            + (")" if self.dense is not None else ", or use update_weights on every rank)")
        )

    # -- weight changes --------------------------------------------------------------------
    def invalidate_prefetch(self) -> None:
        """Forget every prefetched expert copy (after any weight change)."""
        if self.expert_schedule is not None:
            self.expert_schedule.invalidate_prefetch()

    def update_weights(self, named: Mapping[str, Any]) -> int:
        """Update weights in place on this rank; a group-wide action: every rank calls it
        with the same tensors. Returns the number of tensors written.

        Expert tables (``...experts.gate_up_proj`` [E, 2I, H], ``...down_proj`` [E, H, I]):
        this rank's range goes into its store. Other tensors: copied in place. Ends with one
        collective (every rank's writes are done before any rank reads a peer's store) and
        ``invalidate_prefetch``. Raises ``WeightsShardedError`` with dense DWDP (every update
        refused, nothing changed) and ``ValueError`` on every rank when any rank failed
        (an unknown name, a shape or dtype mismatch).
        """
        import torch

        if self.dense is not None or self.phase != PHASE_COMMITTED:
            raise WeightsShardedError(self._refusal().replace("reloading", "updating"))
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        expert_names = {
            name: (m.moe_index, p)
            for name, tensor in params.items()
            for m in self.layers
            for p in ("gate_up_proj", "down_proj")
            if tensor is getattr(m.experts, p)
        }
        from dwdp.worker.setup.vote import vote

        written = 0
        error: str | None = None
        try:
            for name, value in named.items():
                if name in expert_names:
                    order, pname = expert_names[name]
                    self._write_expert_range(order, pname, value)
                else:
                    target = params[name]
                    if target.shape != value.shape or target.dtype != value.dtype:
                        raise ValueError(
                            f"{name}: got {tuple(value.shape)} {value.dtype}, expected "
                            f"{tuple(target.shape)} {target.dtype}"
                        )
                    with torch.no_grad():
                        target.copy_(value)
                written += 1
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            # Every rank's range must be in its store before any rank copies from it: one
            # collective (write-after-write across ranks), then no stale slot is read.
            self.backend.current_stream().synchronize()
            verdict = vote(self.transport, "update_weights", error)
            self.invalidate_prefetch()
        if not verdict.ok:
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(verdict.errors.items()))
            raise ValueError(f"update_weights failed on rank(s) {verdict.failed_ranks}: {detail}")
        return written

    def _write_expert_range(self, order: int, name: str, value: Any) -> None:
        import torch

        layout, rank = self.experts.layout, self.experts.rank
        index = next(i for i, c in enumerate(layout.chunks[order]) if c.name == name)
        chunk = layout.chunks[order][index]
        want = (layout.num_experts, *chunk.chunk_shape)
        if tuple(value.shape) != want or str(value.dtype) != chunk.dtype:
            raise ValueError(
                f"{name} of MoE layer {order}: got {tuple(value.shape)} {value.dtype}, "
                f"expected {want} {chunk.dtype}"
            )
        start, end = layout.ranges[rank]
        source = value[start:end].contiguous().reshape(-1).view(torch.uint8)
        offset = layout.store_offsets[rank][order][index]
        self.experts.store.tensor()[offset : offset + source.numel()].copy_(source)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and release every DWDP resource; safe to call twice. The reload
        guards stay: the model's weights are still sharded (see [Note: weight guards])."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.phase == "released":
            return
        self.phase = "released"
        if self.experts is not None:
            self.experts.release()
        if self.dense is not None:
            self.dense.release()


def _call0(fn: Any, arg: int) -> Any:
    def pre_hook(_module: Any, _args: Any) -> None:
        fn(arg)

    return pre_hook


def _call1(fn: Any, arg: int) -> Any:
    def post_hook(_module: Any, _args: Any, _out: Any) -> None:
        fn(arg)

    return post_hook


def attach(
    model: Any,
    adapter: Any,
    *,
    backend: Any,
    transport: Any,
    partition: Any,
    enable_dense: bool,
    num_slots: int = 2,
    copy_mode: Any = None,
    gather_kernel: Any = None,
    checkpoint_dtypes: Mapping[str, str] | None = None,
) -> DwdpAttachment:
    """Set DWDP up on ``model`` over ``transport`` (a collective: every rank calls it with
    the same arguments) and attach the schedules; returns the committed attachment.

    ``partition``: the expert partition (``None``: no expert DWDP; dense DWDP alone is the
    standalone mode this worker does not run); ``gather_kernel``: the ``GatherKernel``
    each manager (dense, expert) resolves once and passes to every copy launch (``None``:
    the backend's default); ``checkpoint_dtypes``: tensor name -> checkpoint dtype name, for
    the scalar exchange's one-ULP rule (``None``: unknown, every scalar bitwise). MoE layers
    DWDP cannot manage keep their full expert table (``expert.managed``); the adapter's
    repeated layers keep their slot across repeats. Raises ``SetupError`` on every rank alike,
    ``UnsupportedArchitectureError`` when ``enable_dense`` and the architecture declares no
    dense roots, ``DwdpConfigError`` for a model without MoE layers.
    """
    from dwdp.api.enums import CopyMode
    from dwdp.worker.expert.managed import log_unmanaged, select_layers
    from dwdp.worker.models import require_adapter
    from dwdp.worker.schedule.dense import DenseSlotSchedule
    from dwdp.worker.schedule.expert import ExpertPrefetchSchedule
    from dwdp.worker.setup.scalars import exchange_scalars

    require_adapter(model, dense=enable_dense)
    # Dense tensors are checked for their device and contiguity, not for one dtype: the
    # DeepSeek-V3 router keeps float32 weights in a bfloat16 model.
    copy_mode = copy_mode or CopyMode.PER_SLICE
    selection = select_layers(
        model, adapter, partition.num_experts if partition is not None else None
    )
    layers = list(selection.managed)
    if not layers:
        raise DwdpConfigError(
            "dwdp: the model has no fused-experts MoE layer; DWDP has nothing to distribute"
        )
    if partition is None:
        raise DwdpConfigError(
            "dwdp.enableExperts: this worker runs dense DWDP attached to expert DWDP only"
        )
    counters = _Counters()
    log_unmanaged(selection.unmanaged, transport.rank)
    scalars = exchange_scalars(layers, transport, checkpoint_dtypes or {})

    dense, experts, freed, leaks = _setup_and_repoint(
        model,
        layers,
        backend=backend,
        transport=transport,
        partition=partition,
        enable_dense=enable_dense,
        num_slots=num_slots,
        copy_mode=copy_mode,
        gather_kernel=gather_kernel,
    )

    # 4. Schedules on one copy stream; attached dense starts the expert prefetch at H0.
    copy_stream = backend.new_stream("dwdp-copy")
    orders = [m.moe_index for m in layers]

    def expert_launch(order: int, slot: int, stream: Any) -> None:
        plan = experts.plan(order, slot)
        counters.bytes_moved += plan.nbytes
        counters.bytes_moved_remote += sum(d.nbytes for d in plan.remote)
        counters.copies += 1
        experts.launch(order, slot, stream)

    expert_schedule = ExpertPrefetchSchedule(
        backend=backend,
        copy_stream=copy_stream,
        moe_layers=orders,
        num_slots=num_slots,
        launch=expert_launch,
        repeated_layers=selection.repeated,
    )
    dense_schedule = None
    if dense is not None:

        def dense_launch(order: int, segment: Any, slot: int, stream: Any) -> None:
            from dwdp.worker.dense.layout import Segment as LayoutSegment

            seg = LayoutSegment(segment.value)
            plan = dense.plan(order, seg, slot)
            counters.bytes_moved += plan.nbytes
            counters.bytes_moved_remote += sum(d.nbytes for d in plan.remote)
            counters.copies += 1
            dense.launch(order, seg, slot, stream)

        dense_schedule = DenseSlotSchedule(
            backend=backend,
            copy_stream=copy_stream,
            layers=orders,
            launch=dense_launch,
            attached=True,
            attention_slots=dense.rings.attention,
            moe_slots=dense.rings.moe_dense,
            expert_schedule=expert_schedule,
        )
        if num_slots > 2:
            log.info(
                "DWDP: %d expert prefetch slots: each expert copy runs ahead of its "
                "layer's dense copy on the shared copy stream",
                num_slots,
            )

    attachment = DwdpAttachment(
        model=model,
        layers=layers,
        backend=backend,
        transport=transport,
        partition=partition,
        dense=dense,
        experts=experts,
        expert_schedule=expert_schedule,
        dense_schedule=dense_schedule,
        counters=counters,
        expert_freed=freed,
        expert_leaks=leaks.count,
        facts=_SetupFacts(
            unmanaged=selection.unmanaged_counts(),
            repeated=tuple(sorted(selection.repeated)),
            scalars=scalars.as_dict(),
        ),
    )
    attachment.install_hooks()
    attachment.install_guards()
    log.info(
        "DWDP rank %d of %d attached: %d MoE layers, partition %s, dense %s, %d expert slots",
        transport.rank,
        transport.world_size,
        len(layers),
        partition.describe(),
        "on" if dense is not None else "off",
        num_slots,
    )
    return attachment


def _setup_and_repoint(
    model: Any,
    layers: list[Any],
    *,
    backend: Any,
    transport: Any,
    partition: Any,
    enable_dense: bool,
    num_slots: int,
    copy_mode: Any,
    gather_kernel: Any = None,
) -> tuple[Any, Any, int, Any]:
    """Dense setup, expert setup, the expert gather check and the repoint (see ``attach``).
    Returns ``(dense, experts, expert bytes freed, leak report)``."""
    import torch

    from dwdp.worker.dense.repoint import count_leaks, watch_storages
    from dwdp.worker.expert.layout import ExpertLayerWeights
    from dwdp.worker.setup.dense import DenseSetupOptions, setup_dense
    from dwdp.worker.setup.expert import setup_experts
    from dwdp.worker.setup.phases import ExpertPhase, SetupError, setup_stream
    from dwdp.worker.setup.vote import vote

    device = layers[0].experts.gate_up_proj.device
    # 1. Dense first: its commit returns the replicated dense memory before the ring exists.
    dense = None
    if enable_dense:
        dense = setup_dense(
            model,
            layers,
            backend=backend,
            transport=transport,
            enable_dense=True,
            options=DenseSetupOptions(
                copy_mode=copy_mode, device=device, gather_kernel=gather_kernel
            ),
        )

    # 2. Experts: this rank's range of every MoE layer's tables into its store.
    start, end = partition.ranges[transport.rank]
    weights = [
        ExpertLayerWeights(
            name=m.prefix,
            tensors={p: t.detach()[start:end].contiguous() for p, t in m.expert_tensors().items()},
        )
        for m in layers
    ]
    try:
        experts = setup_experts(
            weights,
            partition=partition,
            backend=backend,
            transport=transport,
            num_slots=num_slots,
            copy_mode=copy_mode,
            gather_kernel=gather_kernel,
        )
    except SetupError as exc:
        if dense is None:
            raise
        dense.release()  # past the dense commit: no fallback, the process must exit
        raise SetupError(
            exc.phase, ExpertPhase(exc.phase).what, exc.errors, restored=False
        ) from exc
    except BaseException:
        if dense is not None:
            dense.release()
        raise
    del weights

    # 3. Check every layer's gather against the original tables, then point the experts
    #    modules into their slots for good and drop the originals (one vote: all or none).
    originals = {m.moe_index: m.expert_tensors() for m in layers}
    error = None
    try:
        stream = setup_stream(backend, "expert-setup")  # [Note: setup stream] in phases
        for m in layers:
            slot = m.moe_index % num_slots
            experts.launch(m.moe_index, slot, stream)
            stream.synchronize()  # setup only: the host compares the bytes below
            views = experts.slot_views(slot, m.moe_index)
            for p, original in originals[m.moe_index].items():
                if not torch.equal(views[p], original.detach()):
                    raise RuntimeError(
                        f"{m.prefix} {p}: the gathered slot differs from the original"
                    )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    verdict = vote(transport, "attach.expert_check", error)
    if not verdict.ok:
        experts.release()
        if dense is not None:
            dense.release()
        raise SetupError(
            "attach", "check the expert gather", verdict.errors, restored=dense is None
        )
    watched = watch_storages(
        [(f"{m.prefix}.experts.{p}", t) for m in layers for p, t in originals[m.moe_index].items()]
    )
    freed = sum(t.untyped_storage().nbytes() for d in originals.values() for t in d.values())
    for m in layers:
        views = experts.slot_views(m.moe_index % num_slots, m.moe_index)
        for p in ("gate_up_proj", "down_proj"):
            getattr(m.experts, p).data = views[p]
    originals.clear()
    leaks = count_leaks(watched)
    if leaks.count:
        log.warning(
            "expert DWDP rank %d: %d original expert table(s) still alive (leaks=%d): %s",
            transport.rank,
            leaks.count,
            leaks.count,
            ", ".join(leaks.names[:8]),
        )

    return dense, experts, freed, leaks
