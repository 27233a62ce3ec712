"""Protocol tests of the dense slot schedule (hooks H0-H3), standalone and in attached
mode beside the expert prefetch schedule, over the recording fake backend.

A rig drives the hooks like the model does: H0 at forward entry, then per layer H1, reads
of blob A(l) in its attention slot, H2, reads of blob D(l) in its MoE-dense slot around the
expert bind/finish (attached: with a read of the expert prefetch slot), H3. Every read and
copy is judged by the happens-before checker, which also reports any host synchronization
while serving.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from dwdp.api.enums import CopyMode
from dwdp.worker.backend.base import BackendError, CopyDescriptor, CopyPlan, Stream
from dwdp.worker.dense.layout import Segment
from dwdp.worker.schedule import (
    DensePassPhase,
    DenseSlotSchedule,
    ExpertPrefetchSchedule,
    ScheduleStateError,
)
from dwdp_dev.worker.fake_backend import FakeBackend, HazardKind, HbReport

ROW = 16
RANKS = 4
A, D = Segment.ATTENTION, Segment.MOE_DENSE
SEGMENT_SETS = {"both": (A, D), "moe_dense": (D,), "attention": (A,)}
H0_POINTS = ["before_h0", "after_h0"]
LAYER_POINTS = [
    "before_h1",
    "after_h1",
    "before_h2",
    "after_h2",
    "after_bind",
    "before_h3",
    "after_h3",
]
MODES = {"standalone": None, "attached2": 2, "attached3": 3, "attached4": 4}


class Abort(Exception):
    """The simulated exception that abandons a forward."""


class DenseRig:
    """One rank: a fake backend, one copy stream, the two slot rings, every rank's row
    store, and the dense slot schedule (attached: with an expert prefetch schedule on the
    same copy stream)."""

    def __init__(
        self,
        n: int,
        *,
        expert_slots: int | None = None,
        segments: Sequence[Segment] = (A, D),
        cls: type[DenseSlotSchedule] = DenseSlotSchedule,
    ) -> None:
        self.fake = FakeBackend(world=RANKS)
        self.copy = self.fake.new_stream("dwdp-copy")
        self.layers = list(range(1, n + 1))
        self.segments = tuple(segments)
        self.rings = {
            A: [self.fake.allocate(ROW * RANKS, tag=f"A-slot{k}") for k in range(2)],
            D: [self.fake.allocate(ROW * RANKS, tag=f"D-slot{k}") for k in range(3)],
        }
        self.store = self.fake.allocate_store(ROW * 10_000, tag="row-store")
        self.rows = self.fake.map_peers(self.store, transport=None)
        self.log: list[tuple[str, int]] = []
        self.version = 0
        self._plans: dict[tuple[int, Segment, int], CopyPlan] = {}
        self.fail_after: int | None = None
        """Launches that succeed before one fails (None: none fails)."""
        self.expert: ExpertPrefetchSchedule | None = None
        if expert_slots is not None:
            self.expert_buffers = [
                self.fake.allocate(ROW, tag=f"expert-slot{s}") for s in range(expert_slots)
            ]
            self.expert = ExpertPrefetchSchedule(
                backend=self.fake,
                copy_stream=self.copy,
                moe_layers=self.layers,
                num_slots=expert_slots,
                launch=self._launch_expert,
            )
        self.dense = cls(
            backend=self.fake,
            copy_stream=self.copy,
            layers=self.layers,
            launch=self._launch_dense,
            attached=expert_slots is not None,
            segments=self.segments,
            expert_schedule=self.expert,
        )
        self.fake.begin_serving()

    # -- the caller's side of the seam ------------------------------------------------
    def dense_plan(self, layer: int, segment: Segment, slot: int) -> CopyPlan:
        """Blob ``segment`` of ``layer``: one row from every rank's row store."""
        key = (layer, segment, slot)
        if key not in self._plans:
            self._plans[key] = self._dense_plan(layer, segment, slot)
        return self._plans[key]

    def _dense_plan(self, layer: int, segment: Segment, slot: int) -> CopyPlan:
        dst = self.rings[segment][slot]
        src = (layer * 2 + (segment is D)) * ROW
        remote, local = [], []
        for rank, view in enumerate(self.rows):
            if view is None:
                local.append(CopyDescriptor(self.store, src, dst, rank * ROW, ROW))
            else:
                remote.append(CopyDescriptor(view, src, dst, rank * ROW, ROW))
        return CopyPlan(remote=tuple(remote), local=tuple(local))

    def expert_plan(self, layer: int, slot: int) -> CopyPlan:
        peer = self.rows[1]
        assert peer is not None
        src = (5000 + self.version * 1000 + layer) * ROW
        return CopyPlan(remote=(CopyDescriptor(peer, src, self.expert_buffers[slot], 0, ROW),))

    def _maybe_fail(self, what: str) -> None:
        if self.fail_after is not None:
            self.fail_after -= 1
            if self.fail_after < 0:
                self.fail_after = None
                raise BackendError(f"injected launch failure: {what}")

    def _launch_dense(self, layer: int, segment: Segment, slot: int, stream: Stream) -> None:
        self._maybe_fail(f"{segment.value} of layer {layer}")
        self.fake.launch_copies(self.dense_plan(layer, segment, slot), stream, mode=CopyMode.GATHER)
        if segment is self.segments[0]:
            self.log.append(("L", layer))

    def _launch_expert(self, layer: int, slot: int, stream: Stream) -> None:
        self._maybe_fail(f"experts of layer {layer}")
        self.fake.launch_copies(self.expert_plan(layer, slot), stream, mode=CopyMode.GATHER)
        self.log.append(("E", layer))

    # -- the model's side -------------------------------------------------------------
    def _read(self, layer: int, segment: Segment) -> None:
        if segment in self.segments:
            slot = self.layers.index(layer) % len(self.rings[segment])
            plan = self.dense_plan(layer, segment, slot)
            self.fake.read(self.rings[segment][slot], expect=plan, label=f"{segment.value} {layer}")

    def forward(
        self,
        *,
        start: bool = False,
        layers: Sequence[int] | None = None,
        fail: str | None = None,
        fail_layer: int | None = None,
        abort: bool = False,
        h0: bool = True,
    ) -> bool:
        """One forward; returns False if it was abandoned (``abort``: reported)."""

        def point(name: str, layer: int) -> None:
            if name == fail and layer == fail_layer:
                raise Abort

        first = self.layers[0]
        try:
            if start:
                self.dense.start_forward()
            point("before_h0", first)
            if h0:
                self.log.append(("H0", 0))
                self.dense.h0_forward_entry()
            point("after_h0", first)
            for layer in self.layers if layers is None else layers:
                point("before_h1", layer)
                self.dense.h1_layer_entry(layer)
                self._read(layer, A)
                self._read(layer, D)  # e.g. an input norm
                point("after_h1", layer)
                self._read(layer, A)
                point("before_h2", layer)
                self.log.append(("H2", layer))
                self.dense.h2_after_attention(layer)
                point("after_h2", layer)
                self._read(layer, D)  # the router
                if self.expert is not None:
                    slot = self.expert.bind(layer)
                    self.fake.read(
                        self.expert_buffers[slot],
                        expect=self.expert_plan(layer, slot),
                        label=f"experts {layer}",
                    )
                    point("after_bind", layer)
                    self.log.append(("finish", layer))
                    self.expert.finish(layer)
                self._read(layer, D)  # the shared expert
                point("before_h3", layer)
                self.log.append(("H3", layer))
                self.dense.h3_after_moe(layer)
                point("after_h3", layer)
        except (Abort, BackendError):
            if abort:
                self.dense.abort()
            return False
        return True

    def update_expert_weights(self) -> None:
        """A control action on the expert weights (the dense weights never change)."""
        assert self.expert is not None
        self.version += 1
        self.expert.invalidate_prefetch()

    def check(self) -> HbReport:
        report = self.fake.check()
        assert report.ok, str(report)  # includes: no host synchronization while serving
        assert report.host_syncs == 0
        return report

    def assert_primed(self) -> None:
        """After a completed forward: the next forward's first layers are enqueued
        (attached) or nothing is (standalone: H0 enqueues them)."""
        n = len(self.layers)
        if self.expert is None:
            assert self.dense.pending() == ()
            return
        assert self.dense.pending()[: min(2, n)] == tuple(self.layers[: min(2, n)])
        assert self.expert.pending() == tuple(self.layers[: min(n, self.expert.num_slots)])

    def copies(self) -> list[tuple[str, int]]:
        out = [e for e in self.log if e[0] in ("E", "L")]
        self.log = []
        return out


def _positions(n: int) -> dict[str, int]:
    return {"first": 1, "second": 2, "middle": (n + 1) // 2, "last": n}


# ---------------------------------------------------------------------------------------
# construction and caller errors
# ---------------------------------------------------------------------------------------


def test_slots_of_a_layer() -> None:
    r = DenseRig(7)
    assert [r.dense.slot_of(x, A) for x in r.layers] == [i % 2 for i in range(7)]
    assert [r.dense.slot_of(x, D) for x in r.layers] == [i % 3 for i in range(7)]
    with pytest.raises(KeyError, match="not a MoE decoder layer"):
        r.dense.slot_of(99, A)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layers": []}, "at least one"),
        ({"layers": [1, 1]}, "duplicates"),
        ({"layers": [1], "moe_slots": 0}, "needs a slot"),
        ({"layers": [1], "segments": ()}, "segment"),
    ],
)
def test_bad_configuration_is_refused(kw: dict, match: str) -> None:
    fake = FakeBackend()
    with pytest.raises(ValueError, match=match):
        DenseSlotSchedule(
            backend=fake,
            copy_stream=fake.new_stream("c"),
            launch=lambda *a: None,
            attached=False,
            **kw,
        )


def test_expert_schedule_needs_attached_mode() -> None:
    fake = FakeBackend()
    expert = ExpertPrefetchSchedule(
        backend=fake, copy_stream=fake.new_stream("c"), moe_layers=[1], num_slots=2, launch=print
    )
    with pytest.raises(ValueError, match="attached"):
        DenseSlotSchedule(
            backend=fake,
            copy_stream=fake.new_stream("c"),
            layers=[1],
            launch=print,
            attached=False,
            expert_schedule=expert,
        )


def test_hooks_out_of_order_are_caller_errors() -> None:
    r = DenseRig(3)
    r.dense.h0_forward_entry()
    with pytest.raises(ScheduleStateError, match="H1, H2, H3"):
        r.dense.h2_after_attention(1)
    r.dense.h1_layer_entry(1)
    with pytest.raises(ScheduleStateError, match="H1, H2, H3"):
        r.dense.h3_after_moe(1)
    with pytest.raises(ScheduleStateError):
        r.dense.h2_after_attention(2)
    with pytest.raises(KeyError):
        r.dense.h1_layer_entry(42)


# ---------------------------------------------------------------------------------------
# steady state and copy order
# ---------------------------------------------------------------------------------------


STEADY = [(mode, "both") for mode in MODES] + [
    (mode, segments)
    for mode in ("standalone", "attached2")
    for segments in ("moe_dense", "attention")
]


@pytest.mark.parametrize(("mode", "segments"), STEADY)
@pytest.mark.parametrize("n", [*range(1, 13), 92])
def test_steady_state_is_race_free_and_primed(n: int, mode: str, segments: str) -> None:
    r = DenseRig(n, expert_slots=MODES[mode], segments=SEGMENT_SETS[segments])
    for k in range(3):
        before = r.dense.stats.layer_copies
        assert r.forward(start=k == 1)
        assert r.dense.phase is DensePassPhase.IDLE
        r.assert_primed()
        assert r.dense.stats.layer_copies - before == (n if k else n + len(r.dense.pending()))
    stats = r.dense.stats
    assert (stats.barriers, stats.restarts, stats.demand_fills, stats.aborts) == (0, 0, 0, 0)
    if r.expert is not None:
        e = r.expert.stats
        assert (e.restarts, e.demand_copies, e.abandoned) == (0, 0, 0)
    r.check()


def test_standalone_copy_order() -> None:
    r = DenseRig(5)
    for _ in range(2):
        r.forward()
        assert r.log == [
            ("H0", 0), ("L", 1), ("L", 2),
            ("H2", 1), ("L", 3), ("H3", 1),
            ("H2", 2), ("L", 4), ("H3", 2),
            ("H2", 3), ("L", 5), ("H3", 3),
            ("H2", 4), ("H3", 4),
            ("H2", 5), ("H3", 5),
        ]  # fmt: skip
        r.log = []
    r.check()


def test_attached_copy_order_within_a_forward_and_at_the_boundary() -> None:
    r = DenseRig(92, expert_slots=2)
    r.forward()
    copies = r.copies()
    assert copies[:4] == [("L", 1), ("L", 2), ("E", 1), ("E", 2)]  # the cold start at H0
    at = copies.index(("L", 42))
    assert copies[at - 1 : at + 4] == [("E", 41), ("L", 42), ("E", 42), ("L", 43), ("E", 43)]
    assert copies[-4:] == [("E", 1), ("L", 1), ("E", 2), ("L", 2)]  # the next forward's
    r.forward()
    assert r.copies()[-4:] == [("E", 1), ("L", 1), ("E", 2), ("L", 2)]
    r.check()


def test_attached_h0_finds_the_forward_primed() -> None:
    r = DenseRig(6, expert_slots=3)
    r.forward()
    r.log = []
    r.dense.start_forward()
    r.dense.h0_forward_entry()
    assert r.copies() == []
    r.check()


# ---------------------------------------------------------------------------------------
# aborted forwards
# ---------------------------------------------------------------------------------------


def _abort_cases(n: int) -> list[tuple[str, int, str]]:
    cases = [(p, 1, "first") for p in H0_POINTS]
    for where, layer in _positions(n).items():
        cases += [(p, layer, where) for p in LAYER_POINTS]
    return cases


@pytest.mark.parametrize(
    ("mode", "segments"),
    [(mode, "both") for mode in MODES] + [("standalone", "moe_dense"), ("attached3", "moe_dense")],
)
def test_aborted_forward_recovers(mode: str, segments: str) -> None:
    n = 5
    for k, (point, layer, where) in enumerate(_abort_cases(n)):
        if point == "after_bind" and MODES[mode] is None:
            continue
        # with and without the executor's start; the explicit abort() alternates
        for start, explicit in ((True, k % 2 == 0), (False, k % 2 == 1)):
            case = (point, where, start, explicit)
            r = DenseRig(n, expert_slots=MODES[mode], segments=SEGMENT_SETS[segments])
            r.forward()
            assert not r.forward(fail=point, fail_layer=layer, abort=explicit), case
            assert r.forward(start=start), case
            r.assert_primed()
            assert r.forward(start=start), case
            r.assert_primed()
            # A barrier where the abandoned forward entered a layer, or was declared
            # aborted after H0; none before H0 or after the last H3.
            if point == "before_h0" or (point == "after_h3" and layer == n):
                expected = 0
            elif point == "after_h0" or (point == "before_h1" and layer == 1):
                expected = int(explicit)
            else:
                expected = 1
            assert r.dense.stats.barriers == expected, case
            try:
                r.check()
            except AssertionError as exc:
                raise AssertionError(f"{case}: {exc}") from exc


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_failed_start_then_forward(mode: str, explicit: bool) -> None:
    r = DenseRig(4, expert_slots=MODES[mode])
    r.forward()
    r.dense.start_forward()  # the executor started, the forward failed before H0
    if explicit:
        r.dense.abort()
    assert r.forward(start=True)
    assert r.forward()
    r.assert_primed()
    assert r.dense.stats.barriers == int(explicit)
    r.check()


@pytest.mark.parametrize("cold", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_failed_launch_is_retried(mode: str, cold: bool) -> None:
    for after in range(8):  # every launch of a start and of the first layers in turn
        r = DenseRig(5, expert_slots=MODES[mode])
        if not cold:
            r.forward()
        r.fail_after = after
        while r.fail_after is not None:
            r.forward(start=after % 2 == 0, abort=after % 3 == 0)
        assert r.forward(), after
        assert r.forward(start=True), after
        r.assert_primed()
        r.check()


@pytest.mark.parametrize("mode", MODES)
def test_forward_without_h0_primes_at_the_first_layer(mode: str) -> None:
    r = DenseRig(5, expert_slots=MODES[mode])
    assert r.forward(h0=False)
    assert r.forward(h0=False)
    assert r.forward()
    r.check()


@pytest.mark.parametrize("mode", MODES)
def test_out_of_order_layer_restarts(mode: str) -> None:
    r = DenseRig(6, expert_slots=MODES[mode])
    r.forward()
    assert r.forward(layers=[1, 2, 4, 3, 5, 6])
    assert r.dense.stats.restarts >= 2
    assert r.forward()
    assert r.forward()
    r.assert_primed()
    r.check()


@pytest.mark.parametrize("mode", ["attached2", "attached3", "attached4"])
def test_expert_invalidation_in_attached_mode(mode: str) -> None:
    r = DenseRig(5, expert_slots=MODES[mode])
    r.forward()
    r.update_expert_weights()
    assert r.forward()  # expert reads expect the new version
    assert r.forward()
    r.assert_primed()
    r.check()


# ---------------------------------------------------------------------------------------
# random sequences
# ---------------------------------------------------------------------------------------


def _random_sequence(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    mode = rng.choice(list(MODES))
    segments = rng.choice(list(SEGMENT_SETS))
    r = DenseRig(n, expert_slots=MODES[mode], segments=SEGMENT_SETS[segments])
    points = H0_POINTS + LAYER_POINTS
    for _ in range(rng.randint(4, 12)):
        op = rng.choice(
            ["forward", "forward", "abort", "abort", "failed_start", "invalidate", "launch_fails"]
        )
        start = rng.random() < 0.5
        explicit = rng.random() < 0.5
        if op == "forward":
            assert r.forward(start=start)
        elif op == "abort":
            r.forward(
                start=start,
                fail=rng.choice(points),
                fail_layer=rng.choice(r.layers),
                abort=explicit,
            )
        elif op == "failed_start":
            r.dense.start_forward()
            if explicit:
                r.dense.abort()
        elif op == "launch_fails":
            r.fail_after = rng.randint(0, 6)
            r.forward(start=start, abort=explicit)
            r.fail_after = None
        elif r.expert is not None:
            r.update_expert_weights()
    assert r.forward(start=rng.random() < 0.5)
    assert r.forward()
    r.assert_primed()
    r.check()


@pytest.mark.parametrize("block", range(4))
def test_random_sequences(block: int) -> None:
    for seed in range(block * 50, block * 50 + 50):
        try:
            _random_sequence(seed)
        except AssertionError as exc:
            raise AssertionError(f"random sequence seed {seed}: {exc}") from exc


# ---------------------------------------------------------------------------------------
# the checker catches broken schedules
# ---------------------------------------------------------------------------------------


class NoBarrier(DenseSlotSchedule):
    def _drop_in_flight(self) -> None:
        for ring in self._rings.values():
            for slot in ring:
                if slot.state.value != "free":
                    slot.drop()


class NoCloseWait(DenseSlotSchedule):
    def _wait_for_readers(self, slot):  # type: ignore[no-untyped-def]
        pass


class NoFillWait(DenseSlotSchedule):
    def _wait_for_copy(self, slot):  # type: ignore[no-untyped-def]
        pass


class NoCloseRecordAtH2(DenseSlotSchedule):
    def _close(self, slot):  # type: ignore[no-untyped-def]
        if slot.segment is not Segment.ATTENTION:
            slot.close_event.record(self._backend.current_stream())
        slot.close()


class HostSyncingH0(DenseSlotSchedule):
    def h0_forward_entry(self) -> None:
        self._copy_stream.synchronize()
        super().h0_forward_entry()


def test_checker_catches_a_recovery_without_barrier() -> None:
    r = DenseRig(5, cls=NoBarrier)
    r.forward()
    r.forward(fail="after_h1", fail_layer=1)
    r.forward()
    assert r.fake.check().kinds() == {HazardKind.WRITE_AFTER_READ}


def test_checker_catches_a_missing_close_wait() -> None:
    r = DenseRig(5, expert_slots=2, cls=NoCloseWait)
    r.forward()
    assert HazardKind.WRITE_AFTER_READ in r.fake.check().kinds()


def test_checker_catches_a_missing_fill_wait() -> None:
    r = DenseRig(5, cls=NoFillWait)
    r.forward()
    assert HazardKind.READ_AFTER_WRITE in r.fake.check().kinds()


def test_checker_catches_a_missing_close_record_at_h2() -> None:
    r = DenseRig(5, expert_slots=2, cls=NoCloseRecordAtH2)
    r.forward()
    assert r.fake.check().kinds() == {HazardKind.WRITE_AFTER_READ}


def test_checker_catches_a_host_sync_in_h0() -> None:
    r = DenseRig(3, cls=HostSyncingH0)
    r.forward()
    assert r.fake.check().kinds() == {HazardKind.HOST_SYNC}
