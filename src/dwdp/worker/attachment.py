"""The DWDP attachment of one rank's model: hooks H0-H3, expert bind/finish, weight guards,
weight updates and the status the server reads (a ``DwdpStatusSource``).

Built by :func:`dwdp.worker.bringup.attach` once setup committed. The hooks tell the two
schedules where the ordinary forward of the model is:

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

[Note: weight guards] Once DWDP has sharded the weights, ``load_state_dict`` on the model or
on any module DWDP manages raises ``WeightsShardedError``. With dense DWDP every update is
refused (the replicated originals are gone). With expert DWDP alone, ``update_weights``
writes this rank's range of an expert table into its store (every rank calls it with the same
tensors) or copies a replicated tensor in place, then calls ``invalidate_prefetch`` so that no
stale copy in a slot is read. The guards outlive ``close()``: the model's weights stay sharded
(its module tensors pointed into slots that are gone), so a reload or an update after the
teardown is refused as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dwdp.api.contract import RankStatus, StatusPhase
from dwdp.api.partition import ExpertPartition
from dwdp.worker.backend.base import Backend, Buffer
from dwdp.worker.dense.state import DenseDwdp
from dwdp.worker.models.base import MoeLayer
from dwdp.worker.schedule.dense import DenseSlotSchedule
from dwdp.worker.schedule.expert import ExpertPrefetchSchedule
from dwdp.worker.setup.expert import ExpertDwdp
from dwdp.worker.transport.base import GroupTransport

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle



class WeightsShardedError(RuntimeError):
    """A weight reload or update on a model whose weights DWDP has sharded."""


@dataclass(slots=True)
class CopyCounters:
    """What the copy launches moved since the commit: bytes (all, and from peers), copies."""

    bytes_moved: int = 0
    bytes_moved_remote: int = 0
    copies: int = 0


@dataclass(frozen=True, slots=True)
class SetupFacts:
    """What setup found beside the stores, as ``/dwdp/status`` reports it: ``unmanaged``,
    MoE layers kept whole by reason (``dwdp.worker.expert.managed``); ``repeated``, the MoE
    orders declared repeated; ``scalars``, the scalar exchange's report."""

    unmanaged: dict[str, int] = field(default_factory=dict)
    repeated: tuple[int, ...] = ()
    scalars: dict[str, object] = field(default_factory=dict)


class DwdpAttachment:
    """DWDP state, schedules and hooks of one rank's model (a ``DwdpStatusSource``).

    Built by :func:`dwdp.worker.bringup.attach`. ``close()`` removes the hooks and releases
    stores, views and slots (the model cannot run afterwards: its tensors point into the
    slots).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        layers: list[MoeLayer],
        backend: Backend,
        transport: GroupTransport,
        partition: ExpertPartition,
        dense: DenseDwdp | None,
        experts: ExpertDwdp,
        expert_schedule: ExpertPrefetchSchedule,
        dense_schedule: DenseSlotSchedule | None,
        counters: CopyCounters,
        expert_freed: int,
        expert_leaks: int,
        facts: SetupFacts | None = None,
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
        self.facts = facts or SetupFacts()
        self.phase = StatusPhase.COMMITTED
        self._handles: list[RemovableHandle] = []
        self._guards: list[RemovableHandle] = []
        """The reload guards: kept after ``close()`` (see [Note: weight guards])."""
        self._in_forward = False
        self._sms_before: int | None = None
        """The backend's SM reserve before ``reserve_model_sms`` (restored by ``close``)."""
        self.model_sm_reserve = 0
        """SMs the model's GEMMs leave free while attached (``reserve_model_sms``; 0: none)."""

    # -- DwdpStatusSource ----------------------------------------------------------------
    @property
    def committed(self) -> bool:
        """True while the committed DWDP state serves."""
        return self.phase == StatusPhase.COMMITTED

    def status(self) -> dict[str, Any]:
        """See ``DwdpStatusSource.status``; bytes are integers, per rank."""
        resident: dict[str, Any] = {}
        stored = slot_bytes = freed = 0
        leaks = self.expert_leaks
        if self.dense is not None and self.phase == StatusPhase.COMMITTED:
            r = self.dense.status()
            resident["dense"] = r.as_dict()
            stored += r.store_bytes
            slot_bytes += r.slot_bytes
            freed += r.sharded_bytes
            leaks += r.leaks
        if self.phase == StatusPhase.COMMITTED:
            r = self.experts.status()
            resident["expert"] = r.as_dict()
            stored += r.store_bytes
            slot_bytes += r.slot_bytes
            freed += self.expert_freed
        slots: dict[str, int] = {}
        slots["expert"] = self.expert_schedule.num_slots
        if self.dense is not None:
            slots["attention"] = self.dense.rings.attention
            slots["moe_dense"] = self.dense.rings.moe_dense
        return RankStatus.build(
            phase=self.phase,
            rank=self.transport.rank,
            dwdp_size=self.transport.world_size,
            backend=self.backend.name,
            layout_digest=self.dense.layout.digest if self.dense is not None else None,
            partition=self.partition.to_dict(),
            moe_layers=[m.layer_index for m in self.layers],
            bytes_stored=stored,
            bytes_slots=slot_bytes,
            bytes_moved=self.counters.bytes_moved,
            bytes_moved_remote=self.counters.bytes_moved_remote,
            bytes_freed=freed,
            leaks=leaks,
            slots=slots,
            slot_waits=self.slot_waits,
            copies=self.counters.copies,
            copy_mode=self.experts.settings.copy_mode.value,
            sm_reserve=self.sm_reserve,
            sm_reserve_model=self.model_sm_reserve,
            resident=resident,
            unmanaged_moe_layers=dict(self.facts.unmanaged),
            repeated_moe_layers=list(self.facts.repeated),
            scalars=dict(self.facts.scalars),
        ).wire()

    def buffer_ranges(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the stores and slots this rank allocated (expert and
        dense); empty once released. The weights that view them are DWDP's, not replicated."""
        if self.phase != StatusPhase.COMMITTED:
            return []
        buffers: list[Buffer] = [*self.experts.slots]
        stores = [self.experts.store]
        if self.dense is not None:
            buffers += [b for ring in self.dense.slots.values() for b in ring]
            stores.append(self.dense.store)
        buffers += [s for s in stores if s is not None]
        return [(b.tensor().data_ptr(), b.nbytes) for b in buffers]

    @property
    def sm_reserve(self) -> int:
        """SMs the managers' gather kernels hold while they run (the larger of the dense
        and the expert one; 0 on a backend without a gather kernel)."""
        gathers = [m.gather for m in (self.dense, self.experts) if m is not None]
        return max((g.sm_reserve for g in gathers if g is not None), default=0)

    @property
    def slot_waits(self) -> int:
        """Binds and layer entries that found their copy not issued and issued it on
        demand (compute then waits for a copy that did not overlap anything)."""
        waits = self.expert_schedule.stats.demand_copies
        if self.dense_schedule is not None:
            waits += self.dense_schedule.stats.demand_fills
        return waits

    # -- hooks -----------------------------------------------------------------------------
    def _register(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def install_hooks(self) -> None:
        """Register H0-H3, bind/finish and the abort hook (see the module docstring)."""
        model, dense_s, expert_s = self.model, self.dense_schedule, self.expert_schedule

        def h0(_module: nn.Module, _args: tuple[object, ...]) -> None:
            self._in_forward = True
            if dense_s is not None:
                dense_s.h0_forward_entry()
            else:
                expert_s.start_forward()

        def done(_module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
            self._in_forward = False

        def settle(_module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
            if self._in_forward:  # the forward raised: its read windows stay open
                self._in_forward = False
                if dense_s is not None:
                    dense_s.abort()
                else:
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
            self._register(m.experts.register_forward_pre_hook(_call0(expert_s.bind, o)))
            self._register(m.experts.register_forward_hook(_call1(expert_s.finish, o)))

    def install_guards(self) -> None:
        """Refuse ``load_state_dict`` on the model and every module DWDP manages, for good:
        ``close()`` leaves these guards in place."""

        def refuse(module: nn.Module, *_args: object, **_kwargs: object) -> None:
            raise WeightsShardedError(self._refusal())

        modules: dict[int, nn.Module] = {id(self.model): self.model}
        for m in self.layers:
            for mod in m.decoder_layer.modules():
                modules[id(mod)] = mod
        for mod in modules.values():
            self._guards.append(mod.register_load_state_dict_pre_hook(refuse))
        self.model._dwdp_sharded = True  # type: ignore[assignment]

    def _refusal(self) -> str:
        kind = "dense and expert" if self.dense is not None else "expert"
        if self.phase != StatusPhase.COMMITTED:
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
        self.expert_schedule.invalidate_prefetch()

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> int:
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

        if self.dense is not None or self.phase != StatusPhase.COMMITTED:
            raise WeightsShardedError(self._refusal().replace("reloading", "updating"))
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        expert_names = {
            name: (m.moe_index, p)
            for name, tensor in params.items()
            for m in self.layers
            for p in ("gate_up_proj", "down_proj")
            if tensor is getattr(m.experts, p)
        }
        from dwdp.worker.setup.group_vote import vote

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

    def _write_expert_range(self, order: int, name: str, value: torch.Tensor) -> None:
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
        assert self.experts.store is not None
        self.experts.store.tensor()[offset : offset + source.numel()].copy_(source)

    # -- teardown --------------------------------------------------------------------------
    def reserve_model_sms(self, sms: int | None = None) -> None:
        """Leave ``sms`` SMs (``None``: the gather's SM reserve; nothing without a gather
        kernel) free of the model's persistent GEMM grids until ``close``
        (``Backend.reserve_sms``)."""
        sms = self.sm_reserve if sms is None else sms
        if sms and self._sms_before is None:
            self._sms_before = self.backend.reserve_sms(sms)
            self.model_sm_reserve = sms

    def close(self) -> None:
        """Remove the hooks and release every DWDP resource; safe to call twice. The reload
        guards stay: the model's weights are still sharded (see [Note: weight guards])."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._sms_before is not None:
            self.backend.reserve_sms(self._sms_before)
            self._sms_before = None
            self.model_sm_reserve = 0
        if self.phase == StatusPhase.RELEASED:
            return
        self.phase = StatusPhase.RELEASED
        self.experts.release()
        if self.dense is not None:
            self.dense.release()


PreHook = Callable[["nn.Module", tuple[object, ...]], None]
PostHook = Callable[["nn.Module", tuple[object, ...], object], None]


def _call0(fn: Callable[[int], object], arg: int) -> PreHook:
    def pre_hook(_module: nn.Module, _args: tuple[object, ...]) -> None:
        fn(arg)

    return pre_hook


def _call1(fn: Callable[[int], object], arg: int) -> PostHook:
    def post_hook(_module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
        fn(arg)

    return post_hook
