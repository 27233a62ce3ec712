"""The dense slot schedule (docs/design.md §6.5): two slot rings, 2 attention slots for blob A(l)
and 3 MoE-dense slots for blob D(l), filled in layer order from hooks H0-H3.

The schedule decides when the copy of a layer's dense blobs (``L(l)``: A(l) then D(l)) is
issued into which slots and which stream waits for what; the caller's ``launch`` callback
enqueues the copies (its copy plan). Invariant: every dependency is an event on a stream;
between setup and teardown the schedule never blocks the host.

[Note: read windows]
All reads of A(l) happen on the compute stream between H1 and H2 of layer l (the attention
read window), all reads of D(l) between H1 and H3 (the MoE-dense read window). H1 makes
the compute stream wait for the fill events of the layer's slots (read-after-write); H2
and H3 record the close event of the slot whose window ends; a copy into a slot waits for
the close event of the layer that held it before (write-after-read).

[Note: fill]
Layer index ``i`` (its place in ``layers``) uses attention slot ``i % attention_slots`` and
MoE-dense slot ``i % moe_slots`` for good (the module tensors point at them). After H0, H2
and H3 the schedule issues, in layer order, every next layer whose slots are all free: in a
pass L(first) and L(second) at H0 and L(l + 2) at H2 of layer l (with the default rings
nothing at H3). Standalone, the fill stops at the end of the pass. In attached mode
(dense DWDP attached to expert DWDP, sharing its copy stream) the fill goes on into the next
pass, so the end of a pass enqueues the first two layers of the next one and H0 finds them
enqueued; H0 then starts the expert prefetch.

[Note: abort]
A forward abandoned by an exception (``abort()``, or noticed at the next H0 or executor
start because the previous forward never reached the last layer's H3) may have left read
windows open, with reads on the compute stream that no close event covers. Recovery at
the next forward entry: a write-after-read barrier (an event recorded on the compute stream
there, which the copy stream waits on, so no later copy overtakes any read enqueued
before), then every prefetched copy of the abandoned forward is discarded (copies still in
flight precede later copies into their slots on the one copy stream) and the first layers
are issued again. A layer entered out of order (H1 of a layer the sequence does not expect)
restarts the sequence there the same way.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dwdp.worker.backend.base import Backend, Event, Stream
from dwdp.worker.dense.layout import Segment
from dwdp.worker.schedule.errors import ScheduleStateError
from dwdp.worker.schedule.expert import ExpertPrefetchSchedule

__all__ = [
    "DenseLaunch",
    "DensePassPhase",
    "DenseScheduleStats",
    "DenseSlotSchedule",
    "WindowState",
]

_log = logging.getLogger(__name__)


DenseLaunch = Callable[[int, Segment, int, Stream], None]
"""``launch(layer, segment, slot, stream)``: enqueue the copy of ``layer``'s blob
(``segment``) from every rank's row store into slot ``slot`` of that segment's slot ring,
on ``stream`` (the caller's copy plan); must not block the host."""


class WindowState(enum.Enum):
    """The state of one dense slot."""

    FREE = "free"
    """No copy pending and no read window open; the next copy may be issued (it waits for
    the close event)."""
    FILLED = "filled"
    """A copy for one sequence position is enqueued (fill event recorded); not entered yet."""
    OPEN = "open"
    """Its layer passed H1: the read window is open until H2 (attention) or H3
    (MoE-dense)."""


class DensePassPhase(enum.Enum):
    """Where the current forward is, as the dense slot schedule sees it."""

    IDLE = "idle"
    """No forward in progress: before the first, after the last layer's H3."""
    PRIMED = "primed"
    """H0 or ``start_forward`` ran; no layer entered yet."""
    IN_ATTENTION = "in_attention"
    """H1 ran: the layer's attention and MoE-dense read windows are open."""
    IN_MOE = "in_moe"
    """H2 ran: the attention read window is closed, the MoE-dense one is open."""
    BETWEEN = "between"
    """H3 ran for a layer that is not the last of the forward."""
    ABORTED = "aborted"
    """``abort()`` ran: the forward was abandoned; the next entry recovers."""


class _DenseSlot:
    """One slot of a slot ring: its state, the position it holds, and its two events."""

    __slots__ = ("close_event", "fill_event", "index", "layer", "position", "segment", "state")

    def __init__(self, segment: Segment, index: int, backend: Backend) -> None:
        self.segment = segment
        self.index = index
        self.state = WindowState.FREE
        self.position: int | None = None
        self.layer: int | None = None
        self.fill_event: Event = backend.new_event()
        """Recorded on the copy stream after the copy into this slot; the compute stream
        waits on it at H1 (read-after-write)."""
        self.close_event: Event = backend.new_event()
        """Recorded on the compute stream where the read window closes (H2 or H3); the copy
        stream waits on it before the next copy into this slot (write-after-read)."""

    def _move(self, to: WindowState, *allowed: WindowState) -> None:
        if self.state not in allowed:
            raise ScheduleStateError(
                f"{self.segment.value} slot {self.index}: no transition "
                f"{self.state.value} -> {to.value}"
            )
        self.state = to

    def fill(self, position: int, layer: int) -> None:
        """FREE -> FILLED: a copy of ``layer``'s blob for ``position`` was enqueued."""
        self._move(WindowState.FILLED, WindowState.FREE)
        self.position, self.layer = position, layer

    def open(self) -> None:
        """FILLED -> OPEN: H1 of its layer."""
        self._move(WindowState.OPEN, WindowState.FILLED)

    def close(self) -> None:
        """OPEN -> FREE: H2 or H3 recorded the close event after the window's reads."""
        self._move(WindowState.FREE, WindowState.OPEN)
        self.position = self.layer = None

    def drop(self) -> None:
        """FILLED or OPEN -> FREE: the forward was abandoned; the barrier covers the reads."""
        self._move(WindowState.FREE, WindowState.FILLED, WindowState.OPEN)
        self.position = self.layer = None


@dataclass(frozen=True, slots=True)
class DenseScheduleStats:
    """Counters of one dense slot schedule (for status and tests)."""

    layer_copies: int
    """Layers whose blobs were copied (L(l) counts once for both segments)."""
    demand_fills: int
    """H1 calls that found their layer not issued and issued it."""
    barriers: int
    """Write-after-read barriers taken (recovery after an abort or an out-of-order entry)."""
    restarts: int
    """H1 calls of a layer the sequence did not expect."""
    aborts: int
    """Forwards found or declared abandoned."""


class DenseSlotSchedule:
    """The dense slot schedule of one rank: slot rings for A(l) and D(l) driven by H0-H3.

    ``layers``: the MoE decoder layer ids in forward order. ``copy_stream``: the stream the
    copies run on, so that they overlap the compute of earlier layers (attached: the expert
    prefetch's copy stream). ``launch``: see ``DenseLaunch``. ``attached``: dense DWDP
    attached to expert DWDP (fill into the next pass, H0 starts ``expert_schedule``).
    ``segments``: the blobs this schedule moves (both by default). The compute stream is
    ``backend.current_stream()`` at each hook. Raises ``ValueError`` for an empty or
    duplicated layer list, an empty slot ring, no segment, or an expert schedule without
    attached mode.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        copy_stream: Stream,
        layers: Sequence[int],
        launch: DenseLaunch,
        attached: bool,
        attention_slots: int = 2,
        moe_slots: int = 3,
        segments: Collection[Segment] = (Segment.ATTENTION, Segment.MOE_DENSE),
        expert_schedule: ExpertPrefetchSchedule | None = None,
    ) -> None:
        layer_ids = tuple(layers)
        if not layer_ids:
            raise ValueError("DenseSlotSchedule needs at least one MoE decoder layer")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layers has duplicates: {list(layer_ids)}")
        if attention_slots < 1 or moe_slots < 1:
            raise ValueError(
                f"each slot ring needs a slot (attention_slots={attention_slots}, "
                f"moe_slots={moe_slots})"
            )
        order = tuple(s for s in Segment if s in set(segments))
        if not order:
            raise ValueError("DenseSlotSchedule needs at least one segment")
        if expert_schedule is not None and not attached:
            raise ValueError("an expert schedule is started by H0 only in attached mode")
        self._backend = backend
        self._copy_stream = copy_stream
        self._layers = layer_ids
        self._index = {layer: i for i, layer in enumerate(layer_ids)}
        self._launch = launch
        self._attached = attached
        self._segments = order
        self._expert = expert_schedule
        self._rings: dict[Segment, tuple[_DenseSlot, ...]] = {
            Segment.ATTENTION: tuple(
                _DenseSlot(Segment.ATTENTION, k, backend) for k in range(attention_slots)
            ),
            Segment.MOE_DENSE: tuple(
                _DenseSlot(Segment.MOE_DENSE, k, backend) for k in range(moe_slots)
            ),
        }
        self._barrier_event: Event = backend.new_event()
        """Recorded on the compute stream when a forward is recovered; the copy stream waits
        on it (write-after-read for the read windows the abandoned forward left open)."""
        self._phase = DensePassPhase.IDLE
        self._pass_base = 0
        """Sequence position of the current pass's first layer."""
        self._next_enter = 0
        """Sequence position the next H1 expects."""
        self._next_issue = 0
        """Sequence position of the next layer copy; positions in [next_enter, next_issue)
        are FILLED."""
        self._current: int | None = None
        """Position of the layer between its H1 and H3."""
        self._copies = self._demand = self._barriers = self._restarts = self._aborts = 0

    # -- queries ----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """The MoE decoder layer ids in forward order."""
        return self._layers

    @property
    def attached(self) -> bool:
        """Attached mode: the fill continues into the next pass."""
        return self._attached

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments this schedule moves, in copy order."""
        return self._segments

    @property
    def phase(self) -> DensePassPhase:
        """Where the current forward is."""
        return self._phase

    def slot_of(self, layer: int, segment: Segment) -> int:
        """The slot of ``segment``'s ring that ``layer`` reads. Raises ``KeyError`` for a
        layer this schedule does not manage."""
        return self._index_of(layer) % len(self._rings[segment])

    def slot_state(self, segment: Segment, slot: int) -> WindowState:
        """The state of slot ``slot`` of ``segment``'s ring."""
        return self._rings[segment][slot].state

    def pending(self) -> tuple[int, ...]:
        """Layers whose copies are issued and not entered yet, in sequence order."""
        return tuple(self._layer_at(p) for p in range(self._next_enter, self._next_issue))

    @property
    def stats(self) -> DenseScheduleStats:
        """The schedule's counters."""
        return DenseScheduleStats(
            layer_copies=self._copies,
            demand_fills=self._demand,
            barriers=self._barriers,
            restarts=self._restarts,
            aborts=self._aborts,
        )

    # -- hooks ------------------------------------------------------------------------
    def start_forward(self) -> None:
        """The executor's start of a forward: the same as H0; H0 then finds the forward
        primed and does nothing. Safe to call twice."""
        self._enter_forward()

    def h0_forward_entry(self) -> None:
        """H0, model forward entry: recover an aborted forward (write-after-read barrier,
        see [Note: abort]), make sure the first two layers are enqueued (attached: the
        previous pass's end usually did it) and, attached, start the expert prefetch."""
        self._enter_forward()

    def h1_layer_entry(self, layer: int) -> None:
        """H1, decoder layer entry: the compute stream waits for the fill events of
        ``layer``'s slots (read-after-write) and its read windows open. A layer the
        sequence does not expect restarts it there (see [Note: abort]). Raises ``KeyError``
        for an unmanaged layer."""
        index = self._index_of(layer)
        if self._phase in (DensePassPhase.IDLE, DensePassPhase.ABORTED):
            self._enter_forward()  # a forward that skipped H0
        p = self._next_enter
        in_order = self._phase in (DensePassPhase.PRIMED, DensePassPhase.BETWEEN)
        if not in_order or self._layer_at(p) != layer:
            p = self._restart(index, f"H1 of layer {layer} in phase {self._phase.value}")
        slots = self._slots_at(p)
        if not all(s.state is WindowState.FILLED and s.position == p for s in slots):
            self._demand += 1
            self._fill()
        for slot in slots:
            self._wait_for_copy(slot)
        for slot in slots:
            slot.open()
        self._current = p
        self._next_enter = p + 1
        self._phase = DensePassPhase.IN_ATTENTION

    def h2_after_attention(self, layer: int) -> None:
        """H2, after the attention call: close the attention read window (its close event
        is recorded on the compute stream) and enqueue the next layers whose slots are
        free. Raises ``ScheduleStateError`` unless ``layer`` passed H1 and not H2."""
        p = self._expect_current(layer, DensePassPhase.IN_ATTENTION, "h2_after_attention")
        if Segment.ATTENTION in self._segments:
            self._close(self._slot_at(p, Segment.ATTENTION))
        self._phase = DensePassPhase.IN_MOE
        self._fill()

    def h3_after_moe(self, layer: int) -> None:
        """H3, after the MoE block: close the MoE-dense read window and enqueue the next
        layers whose slots are free (attached, after the last layer: the next pass's first
        layers). Raises ``ScheduleStateError`` unless ``layer`` passed H2 and not H3."""
        p = self._expect_current(layer, DensePassPhase.IN_MOE, "h3_after_moe")
        if Segment.MOE_DENSE in self._segments:
            self._close(self._slot_at(p, Segment.MOE_DENSE))
        self._current = None
        last = p % len(self._layers) == len(self._layers) - 1
        self._phase = DensePassPhase.IDLE if last else DensePassPhase.BETWEEN
        self._fill()

    def abort(self) -> None:
        """The forward was abandoned by an exception; the next forward entry recovers (see
        [Note: abort]). Attached, also settles the expert schedule. Optional: the next
        entry notices an unfinished forward anyway. Idempotent."""
        if self._expert is not None:
            self._expert.abort()
        if self._phase is not DensePassPhase.IDLE:
            self._phase = DensePassPhase.ABORTED

    # -- transitions ------------------------------------------------------------------
    def _enter_forward(self) -> None:
        if self._phase is DensePassPhase.PRIMED:
            return
        if self._phase is not DensePassPhase.IDLE:
            self._aborts += 1
            self._recover()
        self._pass_base = self._next_enter
        self._fill()
        if self._expert is not None:
            self._expert.start_forward()
        self._phase = DensePassPhase.PRIMED  # only once primed: a failed launch is retried

    def _recover(self) -> None:
        """Barrier and discard after an abandoned forward; the sequence restarts at the
        first layer of a new pass."""
        self._drop_in_flight()
        n = len(self._layers)
        base = max(self._next_issue, self._next_enter)
        self._next_enter = self._next_issue = -(-base // n) * n
        self._current = None
        self._phase = DensePassPhase.IDLE

    def _restart(self, index: int, why: str) -> int:
        """Restart the sequence at layer index ``index``; returns its new position."""
        self._drop_in_flight()
        base = max(self._next_issue, self._next_enter)
        position = base + (index - base) % len(self._layers)
        self._pass_base = position - index
        self._next_enter = self._next_issue = position
        self._current = None
        self._restarts += 1
        if self._restarts & (self._restarts - 1) == 0:
            _log.warning(
                "dense DWDP restarts its slot schedule at layer %d (%s); restarts so far: %d",
                self._layers[index],
                why,
                self._restarts,
            )
        self._fill()
        return position

    def _drop_in_flight(self) -> None:
        # [Note: abort]: the barrier orders every later copy after every read enqueued so
        # far on the compute stream, open read windows included (write-after-read).
        self._barrier_event.record(self._backend.current_stream())
        self._copy_stream.wait_event(self._barrier_event)
        self._barriers += 1
        for ring in self._rings.values():
            for slot in ring:
                if slot.state is not WindowState.FREE:
                    slot.drop()

    def _close(self, slot: _DenseSlot) -> None:
        slot.close_event.record(self._backend.current_stream())
        slot.close()

    def _fill(self) -> None:
        """Issue, in layer order, every next layer whose slots are all free (standalone:
        within the current pass)."""
        limit = None if self._attached else self._pass_base + len(self._layers)
        while limit is None or self._next_issue < limit:
            p = self._next_issue
            slots = self._slots_at(p)
            # A slot already FILLED for p: its segment was issued before a launch failed.
            if not all(
                s.state is WindowState.FREE or (s.state is WindowState.FILLED and s.position == p)
                for s in slots
            ):
                return
            layer = self._layer_at(p)
            for slot in slots:
                if slot.state is WindowState.FREE:
                    self._issue(slot, p, layer)
            self._copies += 1
            self._next_issue = p + 1

    def _issue(self, slot: _DenseSlot, position: int, layer: int) -> None:
        stream = self._copy_stream
        self._wait_for_readers(slot)
        self._launch(layer, slot.segment, slot.index, stream)
        slot.fill_event.record(stream)
        slot.fill(position, layer)

    def _wait_for_readers(self, slot: _DenseSlot) -> None:
        """Write-after-read: the copy into ``slot`` waits for the end of the read window of
        the layer that held it."""
        self._copy_stream.wait_event(slot.close_event)

    def _wait_for_copy(self, slot: _DenseSlot) -> None:
        """Read-after-write: the compute stream waits for the copy that filled ``slot``."""
        self._backend.current_stream().wait_event(slot.fill_event)

    # -- helpers ----------------------------------------------------------------------
    def _expect_current(self, layer: int, phase: DensePassPhase, hook: str) -> int:
        p = self._current
        if self._phase is not phase or p is None or self._layer_at(p) != layer:
            at = "none" if p is None else f"layer {self._layer_at(p)}"
            raise ScheduleStateError(
                f"{hook}({layer}) in phase {self._phase.value} (current: {at}); the hooks of "
                "a layer run in the order H1, H2, H3"
            )
        return p

    def _index_of(self, layer: int) -> int:
        try:
            return self._index[layer]
        except KeyError:
            raise KeyError(
                f"layer {layer} is not a MoE decoder layer of the dense slot schedule "
                f"(managed: {list(self._layers)})"
            ) from None

    def _layer_at(self, position: int) -> int:
        return self._layers[position % len(self._layers)]

    def _slot_at(self, position: int, segment: Segment) -> _DenseSlot:
        ring = self._rings[segment]
        return ring[(position % len(self._layers)) % len(ring)]

    def _slots_at(self, position: int) -> tuple[_DenseSlot, ...]:
        return tuple(self._slot_at(position, s) for s in self._segments)
