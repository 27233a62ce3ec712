"""Protocol tests of the expert prefetch schedule over the recording fake backend.

A rig drives the schedule like the executor and the MoE layers do (``start_forward``,
``bind``, a read of the bound prefetch slot on the compute stream, ``finish``) and every
read and copy is judged by the happens-before checker: a read must follow the copy that
filled its slot and see the content (layer and weight version) it expects; a copy must
follow every read of the slot's previous occupant; no host synchronization while serving.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest

from dwdp.api.enums import CopyMode
from dwdp.worker.backend.base import BackendError, CopyDescriptor, CopyPlan, Stream
from dwdp.worker.schedule import ExpertPrefetchSchedule, PassPhase, ScheduleStateError, SlotState
from dwdp_dev.worker.fake_backend import FakeBackend, HazardKind, HbReport

CHUNK = 64
LAYER_COUNTS = [*range(1, 13), 92]
SLOT_COUNTS = [2, 3, 4]
FAIL_POINTS = ["before_bind", "after_bind", "after_finish"]


class Abort(Exception):
    """The simulated exception that abandons a pass."""


class ExpertRig:
    """One rank: a fake backend, a copy stream, prefetch slots, a peer store whose bytes
    for (weight version, layer) live at their own offset, and the schedule under test."""

    def __init__(
        self,
        n: int,
        slots: int,
        *,
        repeated: Iterable[int] = (),
        cls: type[ExpertPrefetchSchedule] = ExpertPrefetchSchedule,
    ) -> None:
        self.fake = FakeBackend()
        self.copy = self.fake.new_stream("expert-copy")
        self.layers = [3 + 2 * k for k in range(n)]  # layer ids differ from MoE orders
        self.buffers = [self.fake.allocate(CHUNK, tag=f"expert-slot{s}") for s in range(slots)]
        self.peer = self.fake.peer_view(1, CHUNK * 100_000, tag="peer1")
        self.version = 0
        self.strict = True
        self.fail_after: int | None = None
        """Launches that succeed before one fails (None: none fails)."""
        self.log: list[tuple[str, int]] = []
        self.copies_done = self.fake.new_event()
        self.sched = cls(
            backend=self.fake,
            copy_stream=self.copy,
            moe_layers=self.layers,
            num_slots=slots,
            launch=self._launch,
            repeated_layers=frozenset(repeated),
        )
        # Setup: the store is written, the host waits for it, then serving starts.
        self.fake.record_copy("store", 0, self.fake.compute, label="setup write")
        self.fake.compute.synchronize()
        self.fake.begin_serving()

    # -- the caller's side of the seam ------------------------------------------------
    def plan(self, layer: int, slot: int) -> CopyPlan:
        src = (self.version * 1000 + layer) * CHUNK
        return CopyPlan(remote=(CopyDescriptor(self.peer, src, self.buffers[slot], 0, CHUNK),))

    def _launch(self, layer: int, slot: int, stream: Stream) -> None:
        if self.fail_after is not None:
            self.fail_after -= 1
            if self.fail_after < 0:
                self.fail_after = None
                raise BackendError(f"injected launch failure for layer {layer}")
        # The copy reads the store (checked against the last weight update) and fills the slot.
        self.fake.read("store", expect=self.version, stream=stream, label=f"E({layer}) source")
        self.fake.launch_copies(self.plan(layer, slot), stream, mode=CopyMode.BATCHED)
        self.log.append(("E", layer))

    # -- the model's side -------------------------------------------------------------
    def layer(self, layer: int, fail: str | None = None) -> None:
        if fail == "before_bind":
            raise Abort
        bound = self.sched.bind(layer)
        slot = self.layers.index(layer) % len(self.buffers)  # where the module tensors point
        if self.strict:
            assert bound == slot == self.sched.slot_of(layer)
        self.log.append(("bind", layer))
        self.fake.read(self.buffers[slot], expect=self.plan(layer, slot), label=f"MoE {layer}")
        if fail == "after_bind":
            raise Abort
        self.log.append(("finish", layer))  # the copies finish issues follow it in the log
        self.sched.finish(layer)
        if fail == "after_finish":
            raise Abort

    def forward(
        self,
        *,
        start: bool = True,
        layers: Sequence[int] | None = None,
        fail_at: int | None = None,
        fail: str | None = None,
        abort: bool = False,
    ) -> bool:
        """One pass; returns False if it was abandoned (``abort``: the caller reports it)."""
        try:
            if start:
                self.sched.start_forward()
            for layer in self.layers if layers is None else layers:
                self.layer(layer, fail if layer == fail_at else None)
        except (Abort, BackendError):
            if abort:
                self.sched.abort()
            return False
        return True

    def update_weights(self) -> None:
        """A control action: wait for copies in flight, rewrite the store, invalidate."""
        self.copies_done.record(self.copy)
        self.fake.compute.wait_event(self.copies_done)  # the action's duty: no copy reads mid-write
        self.version += 1
        self.fake.record_copy("store", self.version, self.fake.compute, label="weight update")
        self.sched.invalidate_prefetch()

    def check(self) -> HbReport:
        report = self.fake.check()
        assert report.ok, str(report)  # includes: no host synchronization while serving
        return report

    def events(self) -> list[tuple[str, int]]:
        out, self.log = self.log, []
        return out


rig = ExpertRig


def _positions(n: int) -> dict[str, int]:
    return {"first": 0, "second": min(1, n - 1), "middle": n // 2, "last": n - 1}


# ---------------------------------------------------------------------------------------
# construction and queries
# ---------------------------------------------------------------------------------------


def test_slot_of_is_moe_order_modulo_slots() -> None:
    r = rig(7, 3)
    assert [r.sched.slot_of(layer) for layer in r.layers] == [o % 3 for o in range(7)]
    with pytest.raises(KeyError, match="not a MoE layer"):
        r.sched.slot_of(4)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"moe_layers": [], "num_slots": 2}, "at least one"),
        ({"moe_layers": [1, 1], "num_slots": 2}, "duplicates"),
        ({"moe_layers": [1, 2], "num_slots": 1}, "at least 2"),
        ({"moe_layers": [1, 2], "num_slots": 2, "repeated_layers": {5}}, "not MoE layers"),
    ],
)
def test_bad_configuration_is_refused(kw: dict, match: str) -> None:
    fake = FakeBackend()
    with pytest.raises(ValueError, match=match):
        ExpertPrefetchSchedule(
            backend=fake, copy_stream=fake.new_stream("c"), launch=lambda *a: None, **kw
        )


def test_finish_of_an_unbound_layer_is_a_caller_error() -> None:
    r = rig(3, 2)
    r.sched.start_forward()
    with pytest.raises(ScheduleStateError, match="not bound"):
        r.sched.finish(r.layers[0])
    r.sched.bind(r.layers[0])
    with pytest.raises(ScheduleStateError, match="not bound"):
        r.sched.finish(r.layers[1])


# ---------------------------------------------------------------------------------------
# steady state and copy order
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", SLOT_COUNTS)
@pytest.mark.parametrize("n", LAYER_COUNTS)
def test_steady_state_is_race_free_and_primed(n: int, slots: int) -> None:
    r = rig(n, slots)
    for k in range(4):
        before = r.sched.stats.copies
        assert r.forward(start=k != 2)  # one pass without the executor's start
        assert r.sched.phase is PassPhase.IDLE
        # primed after every pass: the next pass's first layers are already issued
        assert r.sched.pending() == tuple(r.layers[: min(n, slots)])
        if k:
            assert r.sched.stats.copies - before == n  # each layer gathered once per pass
    stats = r.sched.stats
    assert (stats.restarts, stats.abandoned, stats.demand_copies) == (0, 0, 0)
    report = r.check()
    assert report.reads == 4 * n + stats.copies  # MoE reads plus one store read per copy


def test_start_forward_enqueues_nothing_in_steady_state() -> None:
    r = rig(5, 2)
    r.forward()
    r.events()
    r.sched.start_forward()
    assert r.events() == []


def test_copy_order_four_layers_two_slots() -> None:
    r = rig(4, 2)
    a, b, c, d = r.layers
    r.forward()
    assert r.events() == [
        ("E", a), ("E", b),
        ("bind", a), ("finish", a), ("E", c),
        ("bind", b), ("finish", b), ("E", d),
        ("bind", c), ("finish", c), ("E", a),  # the next pass's first layers,
        ("bind", d), ("finish", d), ("E", b),  # gathered across the step boundary
    ]  # fmt: skip
    r.check()


def test_copy_order_wraps_with_a_shared_slot_at_the_pass_boundary() -> None:
    r = rig(3, 2)  # MoE orders 2 and 0 both use slot 0
    a, b, c = r.layers
    r.forward()
    assert r.events() == [
        ("E", a), ("E", b),
        ("bind", a), ("finish", a), ("E", c),
        ("bind", b), ("finish", b),  # slot 0 still holds c: nothing to issue
        ("bind", c), ("finish", c), ("E", a), ("E", b),
    ]  # fmt: skip
    r.check()


def test_three_slots_run_two_layers_ahead() -> None:
    r = rig(6, 3)
    r.forward()
    events = r.events()
    assert events[:3] == [("E", layer) for layer in r.layers[:3]]
    first_finish = events.index(("finish", r.layers[0]))
    assert events[first_finish + 1] == ("E", r.layers[3])
    r.check()


# ---------------------------------------------------------------------------------------
# passes that do not follow the sequence
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_cold_pass_without_start_issues_at_the_first_bind(slots: int) -> None:
    r = rig(5, slots)
    assert r.forward(start=False)
    assert r.sched.stats.demand_copies == 1 and r.sched.stats.restarts == 0
    assert r.forward(start=False)
    r.check()


@pytest.mark.parametrize("start", [True, False])
@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_truncated_pass_restarts_the_sequence(slots: int, start: bool) -> None:
    r = rig(8, slots)
    r.forward()
    r.forward(layers=r.layers[:3])  # a pass that stops early
    r.forward(start=start)
    assert r.sched.stats.restarts == 1
    r.forward(start=start)
    assert r.sched.stats.restarts == 1
    r.check()


@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_out_of_order_binds_restart_the_sequence(slots: int) -> None:
    r = rig(7, slots)
    r.forward()
    layers = r.layers
    r.forward(layers=[layers[0], layers[3], layers[1], *layers[4:]])
    r.forward(layers=layers[2:])  # a pass that starts in the middle
    assert r.sched.stats.restarts >= 3
    r.forward()
    r.forward(start=False)
    r.check()


def test_restarts_are_logged_at_powers_of_two(caplog: pytest.LogCaptureFixture) -> None:
    r = rig(4, 2)
    with caplog.at_level("WARNING", logger="dwdp.worker.schedule.expert"):
        for _ in range(5):
            r.forward(layers=r.layers[:2])
    assert r.sched.stats.restarts == 4
    assert len(caplog.records) == 3  # restarts 1, 2, 4
    r.check()


# ---------------------------------------------------------------------------------------
# abandoned passes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fail", FAIL_POINTS)
@pytest.mark.parametrize("slots", SLOT_COUNTS)
@pytest.mark.parametrize("n", [4, 5, 12])
def test_abandoned_pass_recovers(n: int, slots: int, fail: str) -> None:
    for k, (where, at) in enumerate(_positions(n).items()):
        # with and without start_forward; the explicit abort() alternates
        for start, explicit in ((True, k % 2 == 0), (False, k % 2 == 1)):
            r = rig(n, slots)
            r.forward()
            assert not r.forward(fail_at=r.layers[at], fail=fail, abort=explicit)
            if fail == "after_bind":
                assert r.sched.stats.abandoned == int(explicit)
            assert r.forward(start=start), (where, start, explicit)
            assert r.forward(start=start)
            assert r.sched.pending() == tuple(r.layers[: min(n, slots)])
            if fail == "after_bind":
                assert r.sched.stats.abandoned == 1
            r.check()


def test_abandoned_layer_slot_is_reused_only_after_its_reads() -> None:
    r = rig(4, 2)
    r.forward()
    r.forward(fail_at=r.layers[1], fail="after_bind")
    # The abandoned layer's MoE read is the last read on the compute stream; the copy that
    # next fills its slot must be ordered after it without any host synchronization.
    r.forward(start=True)
    report = r.check()
    assert report.host_syncs == 1  # the setup's only


@pytest.mark.parametrize("start", [True, False])
@pytest.mark.parametrize("slots", SLOT_COUNTS)
def test_failed_launch_is_retried(slots: int, start: bool) -> None:
    r = rig(5, slots)
    r.fail_after = 0
    assert not r.forward()  # the cold start's first launch fails: a failed start
    assert r.forward(start=start)
    r.forward()
    r.fail_after = 1
    assert not r.forward(start=start)  # fails in a finish, inside the pass
    assert r.forward(start=start)
    assert r.forward(start=start)
    assert r.sched.pending() == tuple(r.layers[: min(5, slots)])
    r.check()


def test_failed_start_then_pass() -> None:
    r = rig(5, 3)
    r.forward()
    r.sched.start_forward()  # the executor started, the forward failed before any bind
    r.forward(start=True)
    r.forward(start=False)
    assert r.sched.stats.restarts == 0
    r.check()


# ---------------------------------------------------------------------------------------
# invalidation and repeated layers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [True, False])
@pytest.mark.parametrize("slots", SLOT_COUNTS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 92])
def test_invalidation_gathers_the_new_weights(n: int, slots: int, start: bool) -> None:
    r = rig(n, slots)
    r.forward()
    r.update_weights()
    assert r.sched.pending() == ()
    assert r.forward(start=start)  # reads expect version 1: stale copies would be caught
    r.forward(layers=r.layers[: max(1, n // 2)])
    r.update_weights()  # in the middle of the sequence
    assert r.forward(start=start)
    assert r.forward(start=start)
    assert r.sched.stats.invalidations == 2
    r.check()


@pytest.mark.parametrize("slots", SLOT_COUNTS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_repeated_layer_keeps_its_slot(n: int, slots: int, which: str) -> None:
    at = _positions(n)[which]
    base = rig(n, slots)
    repeated = base.layers[at]
    r = rig(n, slots, repeated={repeated})
    order = [*r.layers[: at + 1], repeated, repeated, repeated, *r.layers[at + 1 :]]
    r.forward()
    for _ in range(3):
        before = r.sched.stats.copies
        assert r.forward(layers=order)
        assert r.sched.stats.copies - before == n  # no layer gathered twice per pass
    assert r.sched.stats.repeats == 9 and r.sched.stats.restarts == 0
    r.check()


def test_repeated_last_layer_defers_its_slot_to_the_next_start() -> None:
    r = rig(3, 3, repeated={7})  # layers 3, 5, 7; 7 is MoE order 2 -> slot 2
    r.forward()
    r.events()
    r.forward(layers=[3, 5, 7, 7])
    assert r.sched.slot_state(2) is SlotState.HELD
    r.sched.start_forward()
    assert r.events()[-1] == ("E", 7)  # the cross-step copy into the held slot
    r.check()


def test_undeclared_repeat_regathers() -> None:
    r = rig(3, 2)
    r.forward()
    before = r.sched.stats.copies
    r.forward(layers=[3, 5, 7, 7, 7])
    assert r.sched.stats.restarts == 2
    assert r.sched.stats.copies - before > 3
    r.check()


# ---------------------------------------------------------------------------------------
# random sequences
# ---------------------------------------------------------------------------------------


def _random_sequence(seed: int) -> None:
    rng = random.Random(seed)
    n, slots = rng.randint(1, 7), rng.randint(2, 4)
    probe = rig(n, slots)
    repeated = {rng.choice(probe.layers)} if rng.random() < 0.4 else set()
    r = rig(n, slots, repeated=repeated)
    for _ in range(rng.randint(4, 12)):
        op = rng.choice(
            ["pass", "pass", "abort", "failed_start", "invalidate", "truncated", "launch_fails"]
        )
        start = rng.random() < 0.6
        layers = [x for layer in r.layers for x in [layer] * (3 if layer in repeated else 1)]
        if op == "pass":
            assert r.forward(start=start, layers=layers)
        elif op == "abort":
            at = rng.choice(r.layers)
            r.forward(
                start=start, fail_at=at, fail=rng.choice(FAIL_POINTS), abort=rng.random() < 0.5
            )
        elif op == "failed_start":
            r.sched.start_forward()
        elif op == "launch_fails":
            r.fail_after = rng.randint(0, 4)
            r.forward(start=start, layers=layers, abort=rng.random() < 0.5)
            r.fail_after = None
        elif op == "invalidate":
            r.update_weights()
        else:
            r.forward(start=start, layers=layers[: rng.randint(1, len(layers))])
    assert r.forward(start=rng.random() < 0.5)
    assert r.forward()
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


class NoConsumeWait(ExpertPrefetchSchedule):
    def _wait_for_readers(self, slot):  # type: ignore[no-untyped-def]
        pass


class NoFillWait(ExpertPrefetchSchedule):
    def _wait_for_copy(self, slot):  # type: ignore[no-untyped-def]
        pass


class AbandonWithoutConsume(ExpertPrefetchSchedule):
    def _abandon(self, slot):  # type: ignore[no-untyped-def]
        slot.release()
        self._bound = None


class NoUpdateWait(ExpertPrefetchSchedule):
    def invalidate_prefetch(self) -> None:
        super().invalidate_prefetch()
        self._update_pending = False


class NoInvalidation(ExpertPrefetchSchedule):
    def invalidate_prefetch(self) -> None:
        pass


class HostSyncing(ExpertPrefetchSchedule):
    def _issue(self, slot, position, layer):  # type: ignore[no-untyped-def]
        self._copy_stream.synchronize()
        super()._issue(slot, position, layer)


class ShiftedSlots(ExpertPrefetchSchedule):
    def _slot_at(self, position):  # type: ignore[no-untyped-def]
        return self._slots[(position + 1) % len(self._slots)]


def _hazards(r: ExpertRig) -> set[HazardKind]:
    return r.fake.check().kinds()


def test_checker_catches_a_missing_consume_wait() -> None:
    r = rig(4, 2, cls=NoConsumeWait)
    r.forward()
    assert HazardKind.WRITE_AFTER_READ in _hazards(r)


def test_checker_catches_a_missing_fill_wait() -> None:
    r = rig(4, 2, cls=NoFillWait)
    r.forward()
    assert HazardKind.READ_AFTER_WRITE in _hazards(r)


def test_checker_catches_an_abandoned_slot_reused_too_early() -> None:
    r = rig(4, 2, cls=AbandonWithoutConsume)
    r.forward()
    r.forward(fail_at=r.layers[1], fail="after_bind")
    r.forward()
    assert _hazards(r) == {HazardKind.WRITE_AFTER_READ}


def test_checker_catches_copies_racing_the_weight_update() -> None:
    r = rig(4, 2, cls=NoUpdateWait)
    r.forward()
    r.update_weights()
    r.forward()
    assert _hazards(r) == {HazardKind.READ_AFTER_WRITE}


def test_checker_catches_stale_weights_without_invalidation() -> None:
    r = rig(4, 2, cls=NoInvalidation)
    r.forward()
    r.update_weights()
    r.forward()
    assert HazardKind.WRONG_CONTENT in _hazards(r)


def test_checker_catches_a_host_sync_while_serving() -> None:
    r = rig(4, 2, cls=HostSyncing)
    r.forward()
    assert _hazards(r) == {HazardKind.HOST_SYNC}


def test_checker_catches_a_wrong_slot_table() -> None:
    r = rig(3, 2, cls=ShiftedSlots)  # copies go where the module tensors do not point
    r.strict = False
    r.forward(start=True)
    assert HazardKind.WRONG_CONTENT in _hazards(r)
