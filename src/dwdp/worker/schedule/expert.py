"""The expert prefetch schedule (docs/design.md §6.4): one cyclic schedule over the MoE layers of
consecutive forward passes, filling a slot ring of ``num_prefetch_slots`` prefetch slots.

The schedule decides which layer's remote experts are copied into which prefetch slot and
when; the caller's ``launch`` callback enqueues the copies (its copy plan). Invariant:
every dependency is an event on a stream (a bind waits for its slot's fill event, a copy
for its slot's consume event); the schedule never blocks the host.

[Note: cyclic schedule]
MoE order ``o`` (the layer's index in ``moe_layers``) always uses prefetch slot
``o % num_slots``: the module tensors point at that slot for good. Copies are issued in
sequence order over consecutive passes (sequence position ``p`` is MoE order ``p % n``),
each once every earlier copy is issued and its slot was released by the layer that last
read it. The release is the consume event, recorded right after the layer's MoE is
enqueued (``finish``). So the last layers of a pass already copy the first layers of the
next pass, and in steady state ``start_forward`` enqueues nothing.

[Note: restart]
A pass that binds a layer the sequence does not expect (a pass that stopped early, a bind
out of order, a pass after invalidation or after an abandoned one) restarts the sequence
at that layer: copies issued for the abandoned positions are discarded (they may still be
in flight; every later copy into their slot follows them on the one copy stream, so
write-after-write is ordered) and the copies from that layer on are issued again. A pass
without ``start_forward`` whose first layer is the expected one binds what the previous
pass prefetched; on a cold start its first bind issues the copies. Restarts are logged at
counts 1, 2, 4, ...

[Note: abandoned layer]
A layer bound and never finished (an exception inside its MoE) left reads of its slot on
the compute stream without a consume event after them. The next call that notices it
(``start_forward``, ``bind``, ``invalidate_prefetch`` or ``abort``) records the slot's
consume event on the compute stream there, after every read the abandoned layer enqueued;
the next copy into the slot waits for it. The device orders the reuse; the host never
synchronizes.

[Note: repeated layers]
A layer declared repeated (a draft layer bound several times in a row) keeps its slot
when it finishes (HELD): its consume event is recorded, but the slot is released only by
the next call that is not a repeat of it, so every repeat binds the copy still resident.
The copy into that slot for the next position waits for that release.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dwdp.worker.backend.base import Backend, Event, Stream
from dwdp.worker.schedule.errors import ScheduleStateError

__all__ = [
    "ExpertLaunch",
    "ExpertPrefetchSchedule",
    "ExpertScheduleStats",
    "PassPhase",
    "SlotState",
]

_log = logging.getLogger(__name__)

ExpertLaunch = Callable[[int, int, Stream], None]
"""``launch(layer, slot, stream)``: enqueue the copies of ``layer``'s remote experts into
prefetch slot ``slot`` on ``stream`` (the caller's copy plan); must not block the host."""


class SlotState(enum.Enum):
    """The state of one prefetch slot."""

    FREE = "free"
    """Released: no copy pending, no reader. The next copy may be issued (it waits for the
    consume event)."""
    FILLED = "filled"
    """A copy for one sequence position is enqueued (fill event recorded); not bound yet."""
    BOUND = "bound"
    """Its layer is bound: the compute stream reads it until ``finish``."""
    HELD = "held"
    """A repeated layer finished and keeps the slot for its next repeat."""


class PassPhase(enum.Enum):
    """Where the current forward pass is, as the schedule sees it."""

    IDLE = "idle"
    """No pass in progress: before the first, after the last MoE layer finished, after
    ``invalidate_prefetch`` or ``abort``."""
    STARTED = "started"
    """``start_forward`` ran; no layer bound yet."""
    BOUND = "bound"
    """A layer is bound; its ``finish`` is expected."""
    BETWEEN = "between"
    """A layer finished and the pass has more MoE layers."""


class _Slot:
    """One prefetch slot: its state, the sequence position it holds, and its two events."""

    __slots__ = ("consume_event", "fill_event", "index", "layer", "position", "state")

    def __init__(self, index: int, backend: Backend) -> None:
        self.index = index
        self.state = SlotState.FREE
        self.position: int | None = None
        self.layer: int | None = None
        self.fill_event: Event = backend.new_event()
        """Recorded on the copy stream after the copy into this slot; the compute stream
        waits on it at ``bind`` (read-after-write)."""
        self.consume_event: Event = backend.new_event()
        """Recorded on the compute stream after the last read of this slot (``finish``, or
        where its layer is found abandoned); the copy stream waits on it before the next
        copy into this slot (write-after-read)."""

    def _move(self, to: SlotState, *allowed: SlotState) -> None:
        if self.state not in allowed:
            raise ScheduleStateError(
                f"prefetch slot {self.index}: no transition {self.state.value} -> {to.value}"
            )
        self.state = to

    def fill(self, position: int, layer: int) -> None:
        """FREE -> FILLED: a copy of ``layer`` for ``position`` was enqueued."""
        self._move(SlotState.FILLED, SlotState.FREE)
        self.position, self.layer = position, layer

    def bind(self) -> None:
        """FILLED -> BOUND (a bind), or HELD -> BOUND (a repeat)."""
        self._move(SlotState.BOUND, SlotState.FILLED, SlotState.HELD)

    def hold(self) -> None:
        """BOUND -> HELD: a repeated layer finished and keeps its copy."""
        self._move(SlotState.HELD, SlotState.BOUND)

    def release(self) -> None:
        """BOUND or HELD -> FREE: the consume event covers every read of the slot."""
        self._move(SlotState.FREE, SlotState.BOUND, SlotState.HELD)
        self.position = self.layer = None

    def discard(self) -> None:
        """FILLED -> FREE: the copy was issued for a position the sequence abandoned."""
        self._move(SlotState.FREE, SlotState.FILLED)
        self.position = self.layer = None


@dataclass(frozen=True, slots=True)
class ExpertScheduleStats:
    """Counters of one expert prefetch schedule (for status and tests)."""

    copies: int
    """Layer copies issued (one ``launch`` call each)."""
    demand_copies: int
    """Binds that found their copy not issued and issued it (cold start, after
    invalidation)."""
    restarts: int
    """Times the sequence restarted (see [Note: restart])."""
    abandoned: int
    """Bound layers found abandoned (see [Note: abandoned layer])."""
    repeats: int
    """Binds of a repeated layer that reused its resident copy."""
    invalidations: int
    """``invalidate_prefetch`` calls."""


class ExpertPrefetchSchedule:
    """The cyclic expert prefetch schedule of one rank over a slot ring of prefetch slots.

    ``moe_layers``: the MoE layer ids in forward order (MoE order ``o`` is the index).
    ``num_slots``: ``num_prefetch_slots`` (at least 2). ``copy_stream``: the stream the
    copies run on, so that they overlap the compute of earlier layers. ``launch``: see
    ``ExpertLaunch``. ``repeated_layers``: layers that may be bound several times in a row
    (see [Note: repeated layers]). The compute stream is ``backend.current_stream()`` at
    each call. Raises ``ValueError`` for an empty or duplicated layer list, fewer than two
    slots, or a repeated layer that is not a MoE layer.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        copy_stream: Stream,
        moe_layers: Sequence[int],
        num_slots: int,
        launch: ExpertLaunch,
        repeated_layers: Collection[int] = frozenset(),
    ) -> None:
        layers = tuple(moe_layers)
        if not layers:
            raise ValueError("ExpertPrefetchSchedule needs at least one MoE layer")
        if len(set(layers)) != len(layers):
            raise ValueError(f"moe_layers has duplicates: {list(layers)}")
        if num_slots < 2:
            raise ValueError(
                f"num_prefetch_slots must be at least 2, got {num_slots}: with one slot a "
                "copy could never overlap the MoE that reads the previous one"
            )
        unknown = sorted(set(repeated_layers) - set(layers))
        if unknown:
            raise ValueError(f"repeated layers {unknown} are not MoE layers of this schedule")
        self._backend = backend
        self._copy_stream = copy_stream
        self._layers = layers
        self._order = {layer: o for o, layer in enumerate(layers)}
        self._launch = launch
        self._repeated = frozenset(repeated_layers)
        self._slots = tuple(_Slot(s, backend) for s in range(num_slots))
        self._update_event: Event = backend.new_event()
        """Recorded on the compute stream by ``invalidate_prefetch``; the next copy waits on
        it (read-after-write on the stores the control action rewrote there)."""
        self._update_pending = False
        self._phase = PassPhase.IDLE
        self._next_bind = 0
        """Sequence position the next bind expects."""
        self._next_issue = 0
        """Sequence position of the next copy; positions in [next_bind, next_issue) are
        FILLED."""
        self._bound: _Slot | None = None
        self._held: _Slot | None = None
        self._copies = self._demand = self._restarts = 0
        self._abandoned = self._repeats = self._invalidations = 0

    # -- queries ----------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layer ids in forward order."""
        return self._layers

    @property
    def num_slots(self) -> int:
        """The number of prefetch slots (``num_prefetch_slots``)."""
        return len(self._slots)

    @property
    def phase(self) -> PassPhase:
        """Where the current pass is."""
        return self._phase

    def slot_of(self, layer: int) -> int:
        """The prefetch slot ``layer`` binds: MoE order % ``num_slots``. Raises
        ``KeyError`` for a layer this schedule does not manage."""
        return self._order_of(layer) % len(self._slots)

    def slot_state(self, slot: int) -> SlotState:
        """The state of prefetch slot ``slot``."""
        return self._slots[slot].state

    def pending(self) -> tuple[int, ...]:
        """Layers whose copies are issued and not bound yet, in sequence order."""
        return tuple(self._layer_at(p) for p in range(self._next_bind, self._next_issue))

    @property
    def stats(self) -> ExpertScheduleStats:
        """The schedule's counters."""
        return ExpertScheduleStats(
            copies=self._copies,
            demand_copies=self._demand,
            restarts=self._restarts,
            abandoned=self._abandoned,
            repeats=self._repeats,
            invalidations=self._invalidations,
        )

    # -- the protocol -----------------------------------------------------------------
    def start_forward(self) -> None:
        """Start a forward pass (the executor, before the model runs).

        Releases a held repeated layer, settles an abandoned one, restarts the sequence at
        the first MoE layer if the previous pass stopped early, and issues every copy whose
        slot is free. In steady state the previous pass already issued the first copies
        and this enqueues nothing. Safe to call twice."""
        self._settle()
        if self._next_bind % len(self._layers) != 0:
            self._restart(0, "the previous pass stopped before its last MoE layer")
        self._phase = PassPhase.STARTED
        self._pump()

    def bind(self, layer: int) -> int:
        """Bind ``layer`` before its MoE reads its prefetch slot; returns the slot.

        The compute stream waits for the slot's fill event (read-after-write). A layer the
        sequence does not expect restarts it there (see [Note: restart]); a copy not yet
        issued is issued now. Raises ``KeyError`` for an unmanaged layer."""
        order = self._order_of(layer)
        held = self._held
        if held is not None and held.layer == layer:
            return self._bind_repeat(held)
        self._settle()
        p = self._next_bind
        if self._layer_at(p) != layer:
            p = self._restart(order, f"bind of layer {layer}, expected {self._layer_at(p)}")
        slot = self._slot_at(p)
        if not (slot.state is SlotState.FILLED and slot.position == p):
            # Nothing is issued from p on (cold start, after invalidation): issue now.
            self._demand += 1
            self._pump()
        self._wait_for_copy(slot)
        slot.bind()
        self._bound = slot
        self._next_bind = p + 1
        self._phase = PassPhase.BOUND
        return slot.index

    def finish(self, layer: int) -> None:
        """Finish ``layer`` right after its MoE is enqueued on the compute stream.

        Records the slot's consume event there (the next copy into the slot waits on it),
        releases the slot (a repeated layer holds it) and issues every next copy whose slot
        is free. Raises ``ScheduleStateError`` if ``layer`` is not the bound layer."""
        slot = self._bound
        if slot is None or slot.layer != layer:
            bound = "none" if slot is None else f"layer {slot.layer}"
            raise ScheduleStateError(
                f"finish({layer}): layer {layer} is not bound (bound: {bound}); call "
                "bind(layer) before the layer's MoE and finish(layer) right after it"
            )
        slot.consume_event.record(self._backend.current_stream())
        self._bound = None
        if layer in self._repeated:
            slot.hold()
            self._held = slot
        else:
            slot.release()
        last = self._order[layer] == len(self._layers) - 1
        self._phase = PassPhase.IDLE if last else PassPhase.BETWEEN
        self._pump()

    def invalidate_prefetch(self) -> None:
        """Forget every prefetched copy after a control action that changed the weights.

        Call it after the action's writes are enqueued on the compute stream: the next copy
        waits for them (an event recorded here). The next pass gathers its first layers
        again; nothing is issued here."""
        self._settle()
        for slot in self._slots:
            if slot.state is SlotState.FILLED:
                slot.discard()
        self._next_issue = self._next_bind
        self._update_event.record(self._backend.current_stream())
        self._update_pending = True
        self._invalidations += 1
        self._phase = PassPhase.IDLE

    def abort(self) -> None:
        """The pass was abandoned by an exception: settle a bound layer now (see
        [Note: abandoned layer]). Optional: the next call notices it anyway. Idempotent."""
        if self._bound is not None:
            self._abandon(self._bound)
        self._phase = PassPhase.IDLE

    # -- transitions ------------------------------------------------------------------
    def _bind_repeat(self, slot: _Slot) -> int:
        self._held = None
        self._wait_for_copy(slot)
        slot.bind()
        self._bound = slot
        self._repeats += 1
        self._phase = PassPhase.BOUND
        return slot.index

    def _settle(self) -> None:
        """Release a held repeated layer and settle an abandoned bound one."""
        if self._held is not None:
            self._held.release()  # its consume event was recorded at its last finish
            self._held = None
        if self._bound is not None:
            self._abandon(self._bound)

    def _abandon(self, slot: _Slot) -> None:
        # [Note: abandoned layer]: the reads it enqueued are all before this point of the
        # compute stream; the next copy into the slot waits for it (write-after-read).
        slot.consume_event.record(self._backend.current_stream())
        slot.release()
        self._bound = None
        self._abandoned += 1

    def _restart(self, order: int, why: str) -> int:
        """Restart the sequence at MoE order ``order``; returns its new position."""
        for slot in self._slots:
            if slot.state is SlotState.FILLED:
                slot.discard()
        base = max(self._next_issue, self._next_bind)
        position = base + (order - base) % len(self._layers)
        self._next_bind = self._next_issue = position
        self._restarts += 1
        if self._restarts & (self._restarts - 1) == 0:
            _log.warning(
                "expert prefetch restarts its sequence at layer %d (%s); restarts so far: %d",
                self._layers[order],
                why,
                self._restarts,
            )
        return position

    def _pump(self) -> None:
        """Issue copies in sequence order while the next one's slot is free."""
        while True:
            position = self._next_issue
            slot = self._slot_at(position)
            if slot.state is not SlotState.FREE:
                return
            self._issue(slot, position, self._layer_at(position))
            self._next_issue = position + 1

    def _issue(self, slot: _Slot, position: int, layer: int) -> None:
        stream = self._copy_stream
        if self._update_pending:
            # Read-after-write on the stores: the control action's writes come first.
            stream.wait_event(self._update_event)
            self._update_pending = False
        self._wait_for_readers(slot)
        self._launch(layer, slot.index, stream)
        slot.fill_event.record(stream)
        slot.fill(position, layer)
        self._copies += 1

    def _wait_for_readers(self, slot: _Slot) -> None:
        """Write-after-read: the copy into ``slot`` waits for the last read of its previous
        occupant."""
        self._copy_stream.wait_event(slot.consume_event)

    def _wait_for_copy(self, slot: _Slot) -> None:
        """Read-after-write: the compute stream waits for the copy that filled ``slot``."""
        self._backend.current_stream().wait_event(slot.fill_event)

    # -- helpers ----------------------------------------------------------------------
    def _order_of(self, layer: int) -> int:
        try:
            return self._order[layer]
        except KeyError:
            raise KeyError(
                f"layer {layer} is not a MoE layer of the expert prefetch schedule "
                f"(managed: {list(self._layers)})"
            ) from None

    def _layer_at(self, position: int) -> int:
        return self._layers[position % len(self._layers)]

    def _slot_at(self, position: int) -> _Slot:
        return self._slots[(position % len(self._layers)) % len(self._slots)]
