"""The dense DWDP state of one rank: row store, peer views, prefetch slots and copy plans.

Slot rings: ``attention_slots`` slots for blobs A(l) and ``moe_dense_slots`` for blobs
D(l) (2 and 3 by default, docs/design.md §6.5). The module tensors of MoE layer l are repointed
once, at setup, into slot ``l % slots`` of each segment (:meth:`DenseDwdp.home_slot`), so
the dense slot schedule must fill layer l into that slot; plans into every slot exist for
schedules that want them.

States: ``SETTING_UP`` -> ``COMMITTED`` -> ``RELEASED``, or ``SETTING_UP`` -> ``RESTORED``
(a failure in P1-P5: originals back, resources released) or -> ``RELEASED`` (a failed
commit). Transitions only through :meth:`commit`, :meth:`restore_and_release` and
:meth:`release`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from dwdp.worker.backend.base import (
    Backend,
    Buffer,
    CopyPlan,
    GatherHandle,
    PeerView,
    Store,
    Stream,
)
from dwdp.worker.dense.layout import DenseLayout, Segment
from dwdp.worker.dense.repoint import LeakReport, Originals
from dwdp.worker.dense.rows import RowStoreLayout, blob_plan
from dwdp.worker.resident import ResidentBytes
from dwdp.worker.settings import CopySettings


class DenseState(enum.StrEnum):
    SETTING_UP = "setting_up"
    COMMITTED = "committed"
    RESTORED = "restored"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class SlotRings:
    """Slots per segment (counts of prefetch slots)."""

    attention: int = 2
    moe_dense: int = 3

    def count(self, segment: Segment) -> int:
        return self.attention if segment is Segment.ATTENTION else self.moe_dense


class DenseDwdp:
    """One rank's dense DWDP: what setup built and what the schedule launches.

    ``launch(layer, segment, slot, stream)`` is the callback the dense slot schedule calls
    (layer: MoE order; segment: :class:`Segment`); it enqueues the copy plan without
    waiting (the cpu backend runs it at once).
    """

    def __init__(self, *, backend: Backend, layout: DenseLayout, rows: RowStoreLayout,
                 rank: int, rings: SlotRings, settings: CopySettings,
                 gather: GatherHandle | None = None) -> None:
        self.backend = backend
        self.layout = layout
        self.rows = rows
        self.rank = rank
        self.rings = rings
        self.settings = settings
        self.gather = gather
        """The gather kernel resolved once for this manager, passed to every launch."""
        self.state = DenseState.SETTING_UP
        self.store: Store | None = None
        self.peers: list[PeerView | None] = []
        self.slots: dict[Segment, tuple[Buffer, ...]] = {}
        self.plans: dict[tuple[int, Segment, int], CopyPlan] = {}
        self.originals = Originals()
        self.leaks = LeakReport(0, (), 0)
        self._blob_index = {(b.layer, b.segment): i for i, b in enumerate(layout.blobs)}

    # -- setup steps (P2, P3) -------------------------------------------------------------
    def allocate(self) -> None:
        """P2: the row store and the slot rings (slots sized for the largest blob)."""
        self.store = self.backend.allocate_store(self.rows.nbytes, tag="dense")
        for segment in Segment:
            size = self.rows.slot_bytes[segment]
            self.slots[segment] = tuple(
                self.backend.allocate(size, tag=f"dense-{segment}-slot{i}")
                for i in range(self.rings.count(segment))
            )

    def build_plans(self, peers: Sequence[PeerView | None]) -> None:
        """P3: a copy plan per (layer, segment, slot)."""
        assert self.store is not None
        self.peers = list(peers)
        for i, blob in enumerate(self.layout.blobs):
            for slot_index, slot in enumerate(self.slots[blob.segment]):
                self.plans[(blob.layer, blob.segment, slot_index)] = blob_plan(
                    blob, self.rows.offsets[i], rank=self.rank, store=self.store,
                    peers=self.peers, slot=slot)

    # -- what the schedule uses -----------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layout.blobs) // len(Segment)

    def home_slot(self, layer: int, segment: Segment) -> int:
        """The slot MoE layer ``layer``'s module tensors point into: ``layer % slots``."""
        return layer % self.rings.count(segment)

    def plan(self, layer: int, segment: Segment, slot: int) -> CopyPlan:
        """The copy plan that gathers blob ``segment`` of MoE layer ``layer`` (0-based MoE
        order: pass ``layers=range(num_layers)`` to the dense slot schedule) into ``slot``."""
        return self.plans[(layer, segment, slot)]

    def slot_buffers(self, segment: Segment) -> tuple[Buffer, ...]:
        return self.slots[segment]

    def launch(self, layer: int, segment: Segment, slot: int, stream: Stream) -> None:
        """Enqueue the copies of (layer, segment) into ``slot`` on ``stream``."""
        if self.state not in (DenseState.SETTING_UP, DenseState.COMMITTED):
            raise RuntimeError(f"dense DWDP is {self.state}: nothing to launch")
        self.backend.launch_copies(self.plan(layer, segment, slot), stream,
                                   mode=self.settings.copy_mode,
                                   gather=self.gather)

    def status(self) -> ResidentBytes:
        """Per-rank resident bytes (store, slots, replicated)."""
        n = self.layout.world_size
        return ResidentBytes(
            kind="dense",
            rank=self.rank,
            world_size=n,
            store_bytes=self.rows.nbytes,
            store_allocated_bytes=self.store.nbytes if self.store is not None else 0,
            slot_bytes=sum(b.nbytes for bufs in self.slots.values() for b in bufs),
            replicated_bytes=sum(r.nbytes for r in self.layout.replicated),
            sharded_bytes=self.layout.sharded_bytes,
            padding_bytes=(self.layout.padded_bytes - self.layout.sharded_bytes) // n,
            leaks=self.leaks.count,
        )

    # -- transitions ----------------------------------------------------------------------
    def commit(self, leaks: LeakReport) -> None:
        self.leaks = leaks
        self.state = DenseState.COMMITTED

    def restore_and_release(self) -> int:
        """A failure in P1-P5: originals back into the modules, then release everything.
        Returns how many tensors were restored."""
        restored = self.originals.restore()
        self.release()
        self.state = DenseState.RESTORED
        return restored

    def release(self) -> None:
        """Close the plans, peer views, slots and the store; safe to call twice."""
        self.plans.clear()
        for view in self.peers:
            if view is not None:
                view.close()
        self.peers = []
        for buffers in self.slots.values():
            for buffer in buffers:
                buffer.close()
        self.slots = {}
        if self.store is not None:
            self.store.close()
            self.store = None
        self.state = DenseState.RELEASED
