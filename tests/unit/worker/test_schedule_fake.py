"""The recording fake backend and its happens-before checker: each rule holds on a
correct trace and each hazard kind is reported on a trace that breaks it."""

from __future__ import annotations

import pytest

from dwdp.api.enums import CopyMode
from dwdp.worker.backend.base import Backend, BackendError, CopyDescriptor, CopyPlan
from dwdp_dev.worker.fake_backend import (
    FakeBackend,
    HazardKind,
    check_happens_before,
    content_of,
)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


def _kinds(fake: FakeBackend) -> set[HazardKind]:
    return fake.check().kinds()


def test_is_a_backend(fake: FakeBackend) -> None:
    assert isinstance(fake, Backend)
    store = fake.allocate_store(64, tag="store")
    views = fake.map_peers(store, transport=None)
    assert views[0] is None and views[1] is not None and views[1].rank == 1
    with pytest.raises(BackendError, match="no tensors"):
        store.tensor()
    assert fake.new_event().query()


def test_copy_mode_not_available_is_refused() -> None:
    fake = FakeBackend(modes=[CopyMode.PER_SLICE])
    src, dst = fake.peer_view(1, 64), fake.allocate(64, tag="slot")
    plan = CopyPlan(remote=(CopyDescriptor(src, 0, dst, 0, 64),))
    with pytest.raises(BackendError, match="gather"):
        fake.launch_copies(plan, fake.new_stream("copy"), mode=CopyMode.GATHER)


def test_ordered_copy_then_read_is_clean(fake: FakeBackend) -> None:
    copy, filled = fake.new_stream("copy"), fake.new_event()
    src, dst = fake.peer_view(1, 128), fake.allocate(64, tag="slot")
    plan = CopyPlan(remote=(CopyDescriptor(src, 64, dst, 0, 64),))
    fake.launch_copies(plan, copy, mode=CopyMode.BATCHED)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.read(dst, expect=plan)
    report = fake.check()
    assert report.ok, report
    assert (report.copies, report.reads) == (1, 1)
    assert content_of(plan, dst) == (("peer1", 64, 0, 64),)


def test_read_without_wait_is_read_after_write(fake: FakeBackend) -> None:
    copy = fake.new_stream("copy")
    fake.record_copy("slot", "L1", copy)
    fake.read("slot", expect="L1")
    assert _kinds(fake) == {HazardKind.READ_AFTER_WRITE}


def test_wait_before_the_record_orders_nothing(fake: FakeBackend) -> None:
    copy, filled = fake.new_stream("copy"), fake.new_event()
    fake.compute.wait_event(filled)  # never recorded yet: a no-op, as on a device
    fake.record_copy("slot", "L1", copy)
    filled.record(copy)
    fake.read("slot", expect="L1")
    assert _kinds(fake) == {HazardKind.READ_AFTER_WRITE}


def test_rerecorded_event_orders_only_up_to_the_record_waited_on(fake: FakeBackend) -> None:
    copy, filled = fake.new_stream("copy"), fake.new_event()
    fake.record_copy("slot", "L1", copy)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.record_copy("slot2", "L2", copy)
    filled.record(copy)  # moved after the wait: the compute stream does not see it
    fake.read("slot", expect="L1")
    fake.read("slot2", expect="L2")
    report = fake.check()
    assert [h.kind for h in report.hazards] == [HazardKind.READ_AFTER_WRITE]
    assert "slot2" in report.hazards[0].message


def test_wrong_or_missing_content(fake: FakeBackend) -> None:
    copy, filled = fake.new_stream("copy"), fake.new_event()
    fake.read("empty", expect="L1")
    fake.record_copy("slot", "L2", copy)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.read("slot", expect="L1")
    report = fake.check()
    assert [h.kind for h in report.hazards] == [HazardKind.WRONG_CONTENT] * 2
    assert "never filled" in report.hazards[0].message


def test_copy_over_an_unfinished_read_is_write_after_read(fake: FakeBackend) -> None:
    copy, filled, consumed = fake.new_stream("copy"), fake.new_event(), fake.new_event()
    fake.record_copy("slot", "L1", copy)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.read("slot", expect="L1")
    consumed.record(fake.compute)
    fake.record_copy("slot", "L3", copy)  # forgot copy.wait_event(consumed)
    assert _kinds(fake) == {HazardKind.WRITE_AFTER_READ}


def test_waited_copy_over_a_finished_read_is_clean(fake: FakeBackend) -> None:
    copy, filled, consumed = fake.new_stream("copy"), fake.new_event(), fake.new_event()
    fake.record_copy("slot", "L1", copy)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.read("slot", expect="L1")
    consumed.record(fake.compute)
    copy.wait_event(consumed)
    fake.record_copy("slot", "L3", copy)
    filled.record(copy)
    fake.compute.wait_event(filled)
    fake.read("slot", expect="L3")
    assert fake.check().ok


def test_unordered_copies_into_one_slot(fake: FakeBackend) -> None:
    fake.record_copy("slot", "L1", fake.new_stream("copy-a"))
    fake.record_copy("slot", "L2", fake.new_stream("copy-b"))
    assert _kinds(fake) == {HazardKind.WRITE_AFTER_WRITE}


def test_order_is_transitive_through_streams(fake: FakeBackend) -> None:
    a, b = fake.new_stream("a"), fake.new_stream("b")
    e1, e2 = fake.new_event(), fake.new_event()
    fake.record_copy("slot", "L1", a)
    e1.record(a)
    b.wait_event(e1)
    e2.record(b)
    fake.compute.wait_event(e2)
    fake.read("slot", expect="L1")
    assert fake.check().ok


def test_host_sync_orders_later_work_and_is_reported_while_serving(fake: FakeBackend) -> None:
    copy, filled = fake.new_stream("copy"), fake.new_event()
    fake.record_copy("slot", "L1", copy)
    filled.record(copy)
    filled.synchronize()  # setup: allowed, and orders every later operation
    fake.read("slot", expect="L1")
    assert fake.check().ok
    fake.begin_serving()
    copy.synchronize()
    fake.end_serving()
    fake.compute.synchronize()  # teardown: allowed
    report = fake.check()
    assert report.kinds() == {HazardKind.HOST_SYNC}
    assert report.host_syncs == 3 and len(report.hazards) == 1


def test_event_query_follows_host_syncs(fake: FakeBackend) -> None:
    copy, e = fake.new_stream("copy"), fake.new_event()
    e.record(copy)
    assert not e.query()
    copy.synchronize()
    assert e.query()
    e.record(copy)
    fake.drain()
    assert e.query()


def test_checker_accepts_a_plain_trace() -> None:
    assert check_happens_before([]).ok
