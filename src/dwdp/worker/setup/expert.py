"""Expert DWDP setup: handshake, allocation vote, peer mapping, final vote (docs/design.md §6.3).

1. handshake: every rank sends its range (from ``dwdp.api.partition.expert_partition``,
   the only source of ranges) and its chunk shapes; every rank checks that all agree on
   the partition table, on every layer's chunk shapes and dtypes, and that each rank holds
   exactly its range.
2. allocate: a ring that does not fit in free memory is refused before any allocation;
   then the expert store (this rank's chunks) and ``num_slots`` prefetch slots; every rank
   agrees that every allocation succeeded before any rank maps a peer (seed 004).
3. map: map every peer's store; build a copy plan per (MoE layer, slot).
4. commit: the final vote.
Each step ends with one collective carrying every rank's status (see [Note:
fail-together] in ``phases``): a failure anywhere releases everything on every rank and
raises :class:`SetupError` naming the step and the failing ranks.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dwdp.api.partition import ExpertPartition
from dwdp.worker.backend.base import (
    Backend,
    Buffer,
    CopyPlan,
    GatherHandle,
    PeerView,
    Store,
    Stream,
)
from dwdp.worker.expert.layout import (
    ChunkSpec,
    ExpertLayerWeights,
    ExpertStoreLayout,
    chunk_specs,
    expert_plan,
    expert_store_layout,
)
from dwdp.worker.resident import ResidentBytes
from dwdp.worker.settings import CopySettings
from dwdp.worker.setup.group_vote import vote
from dwdp.worker.setup.phases import (
    ExpertPhase,
    FailureInjector,
    SetupError,
    describe,
    run_phase,
)
from dwdp.worker.transport.base import GroupTransport
from dwdp.worker.transport.codec import wire_record

__all__ = ["ExpertDwdp", "ExpertLayerWeights", "PrefetchRingMemoryError", "setup_experts"]

log = logging.getLogger(__name__)


class PrefetchRingMemoryError(RuntimeError):
    """The expert store and the prefetch ring do not fit in the free memory."""


class ExpertState(enum.StrEnum):
    SETTING_UP = "setting_up"
    COMMITTED = "committed"
    RELEASED = "released"


@wire_record("expert.handshake")
@dataclass(frozen=True, slots=True)
class Handshake:
    """What a rank sends at the handshake: the partition table it computed, its range,
    and per layer the chunk of every tensor plus how many experts it holds."""

    table: tuple[tuple[int, int], ...]
    held: tuple[int, ...]
    chunks: tuple[tuple[ChunkSpec, ...], ...]
    layer_names: tuple[str, ...]


class ExpertDwdp:
    """One rank's expert DWDP: expert store, peer views, prefetch slots, copy plans.

    ``launch(layer, slot, stream)`` is the callback of the expert prefetch schedule (layer:
    MoE order); :meth:`slot_views` gives a slot's full expert tables by tensor name.
    """

    def __init__(self, *, backend: Backend, layout: ExpertStoreLayout, rank: int,
                 num_slots: int, settings: CopySettings,
                 gather: GatherHandle | None = None) -> None:
        self.backend = backend
        self.layout = layout
        self.rank = rank
        self.num_slots = num_slots
        self.settings = settings
        self.gather = gather
        """The gather kernel resolved once for this manager (``backend.resolve_gather``),
        passed to every ``launch_copies``; set at the allocate step."""
        self.state = ExpertState.SETTING_UP
        self.store: Store | None = None
        self.slots: tuple[Buffer, ...] = ()
        self.peers: list[PeerView | None] = []
        self.plans: dict[tuple[int, int], CopyPlan] = {}

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self.layout.ranges

    def plan(self, layer: int, slot: int) -> CopyPlan:
        return self.plans[(layer, slot)]

    def launch(self, layer: int, slot: int, stream: Stream) -> None:
        """Enqueue layer ``layer``'s expert copies into ``slot`` on ``stream``."""
        self.backend.launch_copies(self.plan(layer, slot), stream, mode=self.settings.copy_mode,
                                   gather=self.gather)

    def slot_views(self, slot: int, layer: int = 0) -> dict[str, torch.Tensor]:
        """Slot ``slot`` as ``name -> [num_experts, *chunk_shape]`` tensors (layer
        ``layer``'s shapes; every MoE layer of a model has the same)."""
        data = self.slots[slot].tensor()
        out = {}
        for chunk, offset in zip(self.layout.chunks[layer], self.layout.slot_offsets[layer],
                                 strict=True):
            dtype = getattr(torch, chunk.dtype.removeprefix("torch."))
            size = self.layout.num_experts * chunk.chunk_bytes
            out[chunk.name] = data[offset : offset + size].view(dtype).view(
                self.layout.num_experts, *chunk.chunk_shape)
        return out

    def status(self) -> ResidentBytes:
        n = len(self.layout.ranges)
        full = sum(self.layout.num_experts * c.chunk_bytes for layer in self.layout.chunks
                   for c in layer)
        start, end = self.layout.ranges[self.rank]
        mine = sum((end - start) * c.chunk_bytes for layer in self.layout.chunks for c in layer)
        return ResidentBytes(
            kind="expert", rank=self.rank, world_size=n,
            store_bytes=self.layout.store_bytes[self.rank],
            store_allocated_bytes=self.store.nbytes if self.store is not None else 0,
            slot_bytes=sum(s.nbytes for s in self.slots), replicated_bytes=0,
            sharded_bytes=full, padding_bytes=self.layout.store_bytes[self.rank] - mine)

    def release(self) -> None:
        """Close plans, peer views, slots and the store; safe to call twice."""
        self.plans.clear()
        for view in self.peers:
            if view is not None:
                view.close()
        self.peers = []
        for slot in self.slots:
            slot.close()
        self.slots = ()
        if self.store is not None:
            self.store.close()
            self.store = None
        self.state = ExpertState.RELEASED


def setup_experts(
    layers: Sequence[ExpertLayerWeights],
    *,
    partition: ExpertPartition,
    backend: Backend,
    transport: GroupTransport,
    num_slots: int = 2,
    settings: CopySettings | None = None,
    injector: FailureInjector | None = None,
) -> ExpertDwdp:
    """Set expert DWDP up on this rank; a collective over ``transport``.

    ``layers``: the MoE layers in order, each with this rank's range of every expert
    tensor; ``partition``: the ``ExpertPartition`` of ``dwdp.api.partition`` (``ranges``,
    one ``[start, end)`` per rank); ``settings``: the effective copy settings
    (``dwdp.worker.settings``; ``None``: the defaults), the gather resolved from them once,
    at the allocate step. Returns the committed :class:`ExpertDwdp`; raises
    :class:`SetupError` on every rank alike.
    """
    injector = injector if injector is not None else FailureInjector()
    copy = settings if settings is not None else CopySettings()
    rank = transport.rank
    experts: ExpertDwdp | None = None
    try:
        layout = _handshake(layers, partition, transport, injector)
        experts = ExpertDwdp(backend=backend, layout=layout, rank=rank, num_slots=num_slots,
                             settings=copy)
        undo = experts.release
        run_phase(ExpertPhase.ALLOCATE, transport, injector,
                  lambda: _allocate(experts, layers), undo)
        run_phase(ExpertPhase.MAP, transport, injector, lambda: _map(experts, transport), undo)
        run_phase(ExpertPhase.COMMIT, transport, injector, lambda: None, undo)
    except BaseException:
        if experts is not None and experts.state is ExpertState.SETTING_UP:
            experts.release()
        raise
    experts.state = ExpertState.COMMITTED
    log.info("expert DWDP rank %d of %d committed: range %s, store %d bytes, %d slots",
             rank, transport.world_size, layout.ranges[rank], layout.store_bytes[rank],
             num_slots)
    return experts


def _handshake(layers: Sequence[ExpertLayerWeights], partition: ExpertPartition,
               transport: GroupTransport,
               injector: FailureInjector) -> ExpertStoreLayout:
    phase = ExpertPhase.HANDSHAKE
    rank = transport.rank
    error: str | None = None
    mine: Handshake | None = None
    try:
        table = tuple((start, end) for start, end in partition.ranges)
        if len(table) != transport.world_size:
            raise ValueError(f"the partition has {len(table)} ranges for "
                             f"{transport.world_size} ranks")
        held = tuple(_held(layer) for layer in layers)
        mine = Handshake(table, held, tuple(chunk_specs(layer) for layer in layers),
                         tuple(layer.name for layer in layers))
        start, end = table[rank]
        wrong = [layers[i].name for i, h in enumerate(held) if h != end - start]
        if wrong:
            raise ValueError(f"rank {rank} holds another number of experts than its range "
                             f"[{start}, {end}) in {wrong[:4]}")
        injector.check(phase, rank)
    except Exception as exc:
        error = describe(exc)
    exchange = vote(transport, f"expert.{phase}", error, mine)
    errors = dict(exchange.errors) or _handshake_disagreements(exchange.payloads)
    if errors:
        raise SetupError(phase, phase.what, errors, restored=True)
    assert mine is not None
    num_experts = max(end for _, end in mine.table)
    return expert_store_layout(mine.chunks, mine.table, num_experts)


def _held(layer: ExpertLayerWeights) -> int:
    counts = {int(t.shape[0]) for t in layer.tensors.values()}
    if len(counts) != 1:
        raise ValueError(f"{layer.name}: expert tensors hold different expert counts {counts}")
    for name, t in layer.tensors.items():
        if not t.is_contiguous() or t.is_meta:
            raise ValueError(f"{layer.name}.{name} is not a contiguous materialized tensor")
    return counts.pop()


def _handshake_disagreements(payloads: Sequence[Handshake]) -> dict[int, str]:
    for attr, what in (("table", "the expert partition"), ("layer_names", "the MoE layers"),
                       ("chunks", "the chunk shapes or dtypes")):
        values = [getattr(p, attr) for p in payloads]
        common = max(set(values), key=values.count)
        odd = [r for r, v in enumerate(values) if v != common]
        if odd:
            return dict.fromkeys(odd, f"disagrees with the other ranks on {what}")
    return {}


def _allocate(experts: ExpertDwdp, layers: Sequence[ExpertLayerWeights]) -> None:
    layout, rank, backend = experts.layout, experts.rank, experts.backend
    experts.gather = backend.resolve_gather(experts.settings.gather_kernel,
                                            experts.settings.gather_blocks)
    need = layout.store_bytes[rank] + experts.num_slots * layout.slot_bytes
    free = backend.free_bytes()
    if need > free:
        raise PrefetchRingMemoryError(
            f"the expert store ({layout.store_bytes[rank]} bytes) and {experts.num_slots} "
            f"prefetch slots of {layout.slot_bytes} bytes need {need} bytes but {free} bytes "
            "are free: lower dwdp.numPrefetchSlots (at least 2), raise dwdp.dwdpSize (a "
            "smaller range of experts per rank), or free the device memory other processes "
            "hold")
    experts.store = backend.allocate_store(layout.store_bytes[rank], tag="experts")
    data = experts.store.tensor()
    for index, layer in enumerate(layers):
        for t, chunk in enumerate(layout.chunks[index]):
            source = layer.tensors[chunk.name].reshape(-1).view(torch.uint8)
            offset = layout.store_offsets[rank][index][t]
            data[offset : offset + source.numel()].copy_(source)
    backend.current_stream().synchronize()  # setup only: peers read the store after the vote
    experts.slots = tuple(backend.allocate(layout.slot_bytes, tag=f"expert-slot{i}")
                          for i in range(experts.num_slots))


def _map(experts: ExpertDwdp, transport: GroupTransport) -> None:
    assert experts.store is not None
    experts.peers = experts.backend.map_peers(experts.store, transport)
    for layer in range(len(experts.layout.chunks)):
        for slot_index, slot in enumerate(experts.slots):
            experts.plans[(layer, slot_index)] = expert_plan(
                experts.layout, layer, rank=experts.rank, store=experts.store,
                peers=experts.peers, slot=slot)
