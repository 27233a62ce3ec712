"""A recording fake backend and a happens-before checker for the schedule protocol tests.

The fake implements ``dwdp.worker.backend.base.Backend`` without a device: every stream
operation, event record and wait, copy and simulated slot read is appended to one trace
in host issue order, and nothing executes. ``check_happens_before`` replays the trace with
vector clocks (one component per stream, plus the host) and reports every hazard on a
prefetch slot: a read not ordered after the copy that filled the slot (read-after-write),
a copy not ordered after the reads of the slot's previous occupant (write-after-read), two
copies into one slot not ordered (write-after-write), a read of content the slot does not
hold, and any host synchronization between setup and teardown.

Invariant: the fake never reorders or drops an operation; the checker decides orderings
from the trace alone, so a schedule is judged by what it enqueued, not by its own state.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dwdp.api.enums import CopyMode, HandleType
from dwdp.worker.backend.base import (
    Backend,
    BackendError,
    Buffer,
    CopyPlan,
    Event,
    PeerView,
    Store,
    Stream,
)

__all__ = [
    "CopyOp",
    "FakeBackend",
    "FakeBuffer",
    "FakeEvent",
    "FakePeerView",
    "FakeStore",
    "FakeStream",
    "Hazard",
    "HazardKind",
    "HbReport",
    "HostSyncOp",
    "ReadOp",
    "RecordOp",
    "ServingOp",
    "WaitOp",
    "check_happens_before",
    "content_of",
]

_ids = itertools.count()


# --------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------


class FakeBuffer(Buffer):
    """A byte buffer with a size and a tag and no bytes; slots and stores of the fake."""

    def __init__(self, nbytes: int, *, tag: str) -> None:
        if nbytes < 0:
            raise BackendError(f"allocate {tag!r}: negative size {nbytes}")
        self.nbytes = nbytes
        self.tag = tag
        self.closed = False

    def tensor(self) -> Any:
        raise BackendError(f"tensor of {self.tag!r}: the recording fake has no tensors")

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tag!r}, {self.nbytes} B)"


class FakeStore(FakeBuffer, Store):
    """This rank's store in the fake (no bytes, no sharing)."""


class FakePeerView(FakeBuffer, PeerView):
    """A peer's store as the fake maps it: a tag and a rank, nothing to read."""

    def __init__(self, nbytes: int, *, tag: str, rank: int) -> None:
        super().__init__(nbytes, tag=tag)
        self.rank = rank


def content_of(plan: CopyPlan, dst: Hashable) -> tuple[tuple[str, int, int, int], ...]:
    """What ``plan`` writes into ``dst``: ``(src tag, src offset, dst offset, bytes)`` per
    descriptor whose destination is ``dst``, in plan order. Two plans that move the same
    source bytes to the same places have equal content."""
    out = []
    for d in (*plan.remote, *plan.local):
        if d.dst is dst:
            tag = getattr(d.src, "tag", None)
            src = tag if isinstance(tag, str) else repr(d.src)
            out.append((src, d.src_offset, d.dst_offset, d.nbytes))
    return tuple(out)


# --------------------------------------------------------------------------------------
# Trace operations (one per host call, in issue order)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class CopyOp:
    """A copy enqueued on ``stream`` that writes ``content`` into ``resource`` (a slot)."""

    stream: FakeStream
    resource: Hashable
    content: Hashable
    label: str


@dataclass(frozen=True, slots=True, eq=False)
class ReadOp:
    """A read of ``resource`` enqueued on ``stream`` that expects it to hold ``content``."""

    stream: FakeStream
    resource: Hashable
    content: Hashable
    label: str


@dataclass(frozen=True, slots=True, eq=False)
class RecordOp:
    """``event`` captures the current end of ``stream``'s work."""

    event: FakeEvent
    stream: FakeStream


@dataclass(frozen=True, slots=True, eq=False)
class WaitOp:
    """Later work on ``stream`` waits for ``event`` as last recorded (no host wait)."""

    stream: FakeStream
    event: FakeEvent


@dataclass(frozen=True, slots=True, eq=False)
class HostSyncOp:
    """The host blocked until ``event`` (or all of ``stream``'s work) completed."""

    event: FakeEvent | None
    stream: FakeStream | None
    label: str


@dataclass(frozen=True, slots=True, eq=False)
class ServingOp:
    """The serving window opens (``active``: setup is done) or closes (teardown starts)."""

    active: bool


TraceOp = CopyOp | ReadOp | RecordOp | WaitOp | HostSyncOp | ServingOp


# --------------------------------------------------------------------------------------
# Streams, events, backend
# --------------------------------------------------------------------------------------


class FakeStream(Stream):
    """A stream of the fake: its calls append to the backend's trace."""

    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.name = name
        self.sid = next(_ids)
        self._backend = backend

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, FakeEvent):
            raise BackendError(f"wait_event on {self.name!r}: not an event of the fake")
        self._backend.trace.append(WaitOp(self, event))

    def synchronize(self) -> None:
        self._backend.trace.append(HostSyncOp(None, self, f"stream {self.name!r}.synchronize"))
        self._backend._complete_stream(self)

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class FakeEvent(Event):
    """An event of the fake. Nothing executes, so recorded work completes only when the
    host synchronizes on it (or on its stream) or calls ``FakeBackend.drain``."""

    def __init__(self, backend: FakeBackend) -> None:
        self.eid = next(_ids)
        self._backend = backend
        self.recorded_on: FakeStream | None = None
        self._pending = False

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, FakeStream):
            raise BackendError("event.record: not a stream of the fake")
        self._backend.trace.append(RecordOp(self, stream))
        self.recorded_on = stream
        self._pending = True

    def query(self) -> bool:
        return not self._pending

    def synchronize(self) -> None:
        self._backend.trace.append(HostSyncOp(self, None, f"event {self.eid}.synchronize"))
        self._pending = False

    def __repr__(self) -> str:
        return f"FakeEvent({self.eid})"


class FakeBackend(Backend):
    """A recording backend of one rank: allocations are tags, streams and events append
    to ``trace``, ``launch_copies`` records one ``CopyOp`` per destination buffer, and
    ``read`` records a simulated slot read (the model's use of a slot).

    ``modes`` are the copy modes the fake accepts (all by default); ``world`` the DWDP
    group size ``map_peers`` pretends to map. Call ``begin_serving()`` when setup is done
    and ``end_serving()`` when teardown starts: the checker reports every host
    synchronization in between.
    """

    name = "fake"
    handle_type = HandleType.SHM

    def __init__(
        self,
        *,
        rank: int = 0,
        world: int = 2,
        free: int = 1 << 40,
        modes: Iterable[CopyMode] = tuple(CopyMode),
    ) -> None:
        self.rank = rank
        self.world = world
        self._free = free
        self.modes = frozenset(modes)
        self.trace: list[TraceOp] = []
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.buffers: list[FakeBuffer] = []
        self.compute = self.new_stream("compute")
        """The compute stream: ``current_stream()`` always returns it."""

    # -- memory ---------------------------------------------------------------------
    def allocate_store(self, nbytes: int, *, tag: str) -> Store:
        store = FakeStore(nbytes, tag=tag)
        self.buffers.append(store)
        return store

    def allocate(self, nbytes: int, *, tag: str) -> Buffer:
        buf = FakeBuffer(nbytes, tag=tag)
        self.buffers.append(buf)
        return buf

    def peer_view(self, rank: int, nbytes: int, *, tag: str | None = None) -> FakePeerView:
        """A peer view of ``rank``'s store without a transport (test helper)."""
        view = FakePeerView(nbytes, tag=tag or f"peer{rank}", rank=rank)
        self.buffers.append(view)
        return view

    def map_peers(self, store: Store, transport: Any) -> list[PeerView | None]:
        return [
            None if r == self.rank else self.peer_view(r, store.nbytes) for r in range(self.world)
        ]

    def free_bytes(self) -> int:
        return self._free

    # -- streams and events ------------------------------------------------------------
    def new_stream(self, name: str) -> FakeStream:
        stream = FakeStream(self, name)
        self.streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self.compute

    def new_event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event

    # -- copies and reads --------------------------------------------------------------
    def launch_copies(
        self, plan: CopyPlan, stream: Stream, *, mode: CopyMode, gather: Any = None
    ) -> None:
        if mode not in self.modes:
            raise BackendError(f"launch_copies: copy mode {mode!s} is not available on the fake")
        if not isinstance(stream, FakeStream):
            raise BackendError("launch_copies: not a stream of the fake")
        seen: list[Hashable] = []
        for d in (*plan.remote, *plan.local):
            if not any(d.dst is s for s in seen):
                seen.append(d.dst)
        for dst in seen:
            label = f"copy into {getattr(dst, 'tag', dst)!s}"
            self.trace.append(CopyOp(stream, dst, content_of(plan, dst), label))

    def record_copy(
        self, resource: Hashable, content: Hashable, stream: Stream, *, label: str = ""
    ) -> None:
        """Record a copy that writes ``content`` into ``resource`` on ``stream``."""
        if not isinstance(stream, FakeStream):
            raise BackendError("record_copy: not a stream of the fake")
        self.trace.append(CopyOp(stream, resource, content, label or f"copy into {resource!s}"))

    def read(
        self,
        resource: Hashable,
        *,
        expect: Hashable,
        stream: Stream | None = None,
        label: str = "",
    ) -> None:
        """Record a read of ``resource`` on ``stream`` (default: the compute stream) that
        expects ``expect``; a ``CopyPlan`` stands for what it writes into ``resource``."""
        s = stream or self.compute
        if not isinstance(s, FakeStream):
            raise BackendError("read: not a stream of the fake")
        content = content_of(expect, resource) if isinstance(expect, CopyPlan) else expect
        self.trace.append(ReadOp(s, resource, content, label or f"read of {resource!s}"))

    # -- the serving window ------------------------------------------------------------
    def begin_serving(self) -> None:
        """Setup is done: from here until ``end_serving`` the host must never synchronize."""
        self.trace.append(ServingOp(True))

    def end_serving(self) -> None:
        """Teardown starts: host synchronization is allowed again."""
        self.trace.append(ServingOp(False))

    def drain(self) -> None:
        """Pretend the device finished everything (a test helper; records no host sync)."""
        for event in self.events:
            event._pending = False

    def _complete_stream(self, stream: FakeStream) -> None:
        for event in self.events:
            if event.recorded_on is stream:
                event._pending = False

    def check(self) -> HbReport:
        """``check_happens_before`` over this backend's trace."""
        return check_happens_before(self.trace)


# --------------------------------------------------------------------------------------
# The happens-before checker
# --------------------------------------------------------------------------------------


class HazardKind(enum.StrEnum):
    """What a hazard breaks."""

    READ_AFTER_WRITE = "read-after-write"
    """A read is not ordered after the copy that filled the slot."""
    WRONG_CONTENT = "wrong-content"
    """At the read, the latest copy into the slot is not the content the read expects
    (or the slot was never filled): the right copy was never enqueued before the read."""
    WRITE_AFTER_READ = "write-after-read"
    """A copy is not ordered after a read of the slot's previous occupant."""
    WRITE_AFTER_WRITE = "write-after-write"
    """Two copies into one slot are not ordered."""
    HOST_SYNC = "host-sync"
    """The host synchronized between setup and teardown."""


@dataclass(frozen=True, slots=True)
class Hazard:
    """One hazard: its kind, the trace index of the offending operation, and what."""

    kind: HazardKind
    index: int
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] op {self.index}: {self.message}"


@dataclass(frozen=True, slots=True)
class HbReport:
    """The checker's verdict over one trace."""

    hazards: tuple[Hazard, ...]
    reads: int
    copies: int
    host_syncs: int

    @property
    def ok(self) -> bool:
        """No hazard found."""
        return not self.hazards

    def kinds(self) -> set[HazardKind]:
        """The kinds of the hazards found."""
        return {h.kind for h in self.hazards}

    def __str__(self) -> str:
        head = (
            f"{len(self.hazards)} hazard(s) over {self.copies} copies, {self.reads} reads, "
            f"{self.host_syncs} host syncs"
        )
        return "\n".join([head, *(str(h) for h in self.hazards[:20])])


_VClock = dict[int, int]


def _merge(into: _VClock, other: _VClock) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


@dataclass(slots=True)
class _Stamp:
    """A replayed device operation: its stream, its own tick and its vector clock."""

    sid: int
    tick: int
    clock: _VClock
    index: int
    label: str

    def before(self, later: _Stamp) -> bool:
        """True when this operation happens before ``later`` on the device."""
        return self.tick <= later.clock.get(self.sid, 0)


@dataclass(slots=True)
class _SlotHistory:
    last_copy: _Stamp | None = None
    content: Hashable = None
    reads: list[_Stamp] = field(default_factory=list)


def check_happens_before(trace: Sequence[TraceOp]) -> HbReport:
    """Replay ``trace`` with vector clocks and report every hazard (see ``HazardKind``).

    Ordering rules, as on a device: operations of one stream are ordered; ``record``
    captures the stream's clock; ``wait`` merges the event's clock as last recorded at the
    time of the wait (a never-recorded event orders nothing); a host synchronization merges
    the completed clock into the host, and every later operation on any stream happens
    after it. For each slot (resource), every read must happen after the latest copy
    into it and that copy must carry the expected content; every copy must happen after
    the previous copy and after every read since that copy.
    """
    clocks: dict[int, _VClock] = {}
    events: dict[int, _VClock] = {}
    host: _VClock = {}
    slots: dict[Hashable, _SlotHistory] = {}
    hazards: list[Hazard] = []
    serving = False
    reads = copies = syncs = 0

    def clock_of(stream: FakeStream) -> _VClock:
        vc = clocks.setdefault(stream.sid, {})
        if host:
            _merge(vc, host)
        return vc

    def tick(stream: FakeStream, index: int, label: str) -> _Stamp:
        vc = clock_of(stream)
        vc[stream.sid] = vc.get(stream.sid, 0) + 1
        return _Stamp(stream.sid, vc[stream.sid], dict(vc), index, label)

    for i, op in enumerate(trace):
        if isinstance(op, RecordOp):
            events[op.event.eid] = dict(clock_of(op.stream))
        elif isinstance(op, WaitOp):
            _merge(clock_of(op.stream), events.get(op.event.eid, {}))
        elif isinstance(op, HostSyncOp):
            syncs += 1
            if op.event is not None:
                _merge(host, events.get(op.event.eid, {}))
            if op.stream is not None:
                _merge(host, clock_of(op.stream))
            if serving:
                hazards.append(
                    Hazard(HazardKind.HOST_SYNC, i, f"{op.label} between setup and teardown")
                )
        elif isinstance(op, ServingOp):
            serving = op.active
        elif isinstance(op, CopyOp):
            copies += 1
            w = tick(op.stream, i, op.label)
            h = slots.setdefault(op.resource, _SlotHistory())
            if h.last_copy is not None and not h.last_copy.before(w):
                hazards.append(
                    Hazard(
                        HazardKind.WRITE_AFTER_WRITE,
                        i,
                        f"{op.label} ({op.content!r}) is not ordered after op "
                        f"{h.last_copy.index} ({h.last_copy.label})",
                    )
                )
            for r in h.reads:
                if not r.before(w):
                    hazards.append(
                        Hazard(
                            HazardKind.WRITE_AFTER_READ,
                            i,
                            f"{op.label} ({op.content!r}) may overwrite {op.resource!r} while "
                            f"op {r.index} ({r.label}) still reads {h.content!r}",
                        )
                    )
            h.last_copy, h.content, h.reads = w, op.content, []
        elif isinstance(op, ReadOp):
            reads += 1
            r = tick(op.stream, i, op.label)
            h = slots.setdefault(op.resource, _SlotHistory())
            if h.last_copy is None:
                hazards.append(
                    Hazard(
                        HazardKind.WRONG_CONTENT,
                        i,
                        f"{op.label} expects {op.content!r} but {op.resource!r} was never filled",
                    )
                )
            elif h.content != op.content:
                hazards.append(
                    Hazard(
                        HazardKind.WRONG_CONTENT,
                        i,
                        f"{op.label} expects {op.content!r} but the latest copy into "
                        f"{op.resource!r} (op {h.last_copy.index}) wrote {h.content!r}",
                    )
                )
            elif not h.last_copy.before(r):
                hazards.append(
                    Hazard(
                        HazardKind.READ_AFTER_WRITE,
                        i,
                        f"{op.label} is not ordered after op {h.last_copy.index} "
                        f"({h.last_copy.label}) that filled {op.resource!r}",
                    )
                )
            h.reads.append(r)
        else:  # pragma: no cover - the trace holds only the types above
            raise TypeError(f"unknown trace operation {op!r}")
    return HbReport(tuple(hazards), reads, copies, syncs)
