"""The cpu backend: shared-memory stores, read-only peer views, real copies, unlink once."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_transport import run_threads

from dwdp.api.enums import CopyMode, HandleType
from dwdp.worker.backend.base import BackendError, CopyDescriptor, CopyPlan
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments


@pytest.fixture
def group():
    name = f"u{uuid.uuid4().hex[:8]}"
    yield name
    left = leftover_segments(name)
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert not left


def test_store_is_a_named_shared_memory_file_unlinked_once(group):
    backend = CpuBackend(group=group, incarnation="1", rank=0)
    store = backend.allocate_store(10, tag="dense")
    assert backend.handle_type is HandleType.SHM
    assert store.path == f"/dev/shm/dwdp-{group}-1-0-dense" and os.path.exists(store.path)
    assert store.nbytes % backend.granularity == 0 and store.nbytes >= 10
    store.tensor()[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    with open(store.path, "rb") as f:
        assert f.read(3) == b"\x01\x02\x03"  # the file is the memory
    store.close()
    store.close()
    assert leftover_segments(group) == []


def test_a_second_store_with_the_same_name_is_refused_and_leaves_none(group):
    backend = CpuBackend(group=group, incarnation="1", rank=0)
    store = backend.allocate_store(10, tag="x")
    with pytest.raises(BackendError, match="exists"):
        backend.allocate_store(10, tag="x")
    store.close()
    assert leftover_segments(group) == []


def test_a_store_that_cannot_be_sized_is_unlinked(group, monkeypatch):
    def fail(fd, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "ftruncate", fail)
    with pytest.raises(BackendError, match="No space left"):
        CpuBackend(group=group, incarnation="1", rank=0).allocate_store(4096, tag="dense")
    assert leftover_segments(group) == []


def test_peers_map_each_others_store_and_copies_move_real_bytes(group):
    def body(t):
        backend = CpuBackend(group=group, incarnation="1", rank=t.rank)
        store = backend.allocate_store(4096, tag="rows")
        store.tensor()[:8].fill_(t.rank + 1)
        views = backend.map_peers(store, t)
        assert store.unlinked  # every peer mapped it: the name is gone
        slot = backend.allocate(16, tag="slot")
        peer = 1 - t.rank
        plan = CopyPlan(
            remote=(CopyDescriptor(views[peer], 0, slot, 8, 8),),
            local=(CopyDescriptor(store, 0, slot, 0, 8),),
        )
        stream = backend.new_stream("copy")
        event = backend.new_event()
        backend.launch_copies(plan, stream, mode=CopyMode.BATCHED)
        event.record(stream)
        assert event.query()
        got = slot.tensor().tolist()
        with pytest.raises(BackendError, match="not available"):
            backend.launch_copies(plan, stream, mode=CopyMode.GATHER)
        t.barrier()
        for v in views:
            if v is not None:
                v.close()
        store.close()
        return views[t.rank], views[peer].rank, got

    results = run_threads(2, body)
    assert results[0] == (None, 1, [1] * 8 + [2] * 8)
    assert results[1] == (None, 0, [2] * 8 + [1] * 8)
    assert leftover_segments(group) == []


def test_a_rank_that_cannot_map_fails_map_peers_on_every_rank(group):
    def body(t):
        backend = CpuBackend(group=group, incarnation="1", rank=t.rank)
        store = backend.allocate_store(4096, tag="rows")
        t.barrier()
        os.unlink(f"/dev/shm/dwdp-{group}-1-0-rows")  # rank 0's file vanishes before mapping
        t.barrier()
        try:
            backend.map_peers(store, t)
        except BackendError as exc:
            return str(exc)
        finally:
            store.close()
        return "mapped"

    results = run_threads(2, lambda t: body(t) if t.rank == 1 else _rank0(t, group))
    assert all("failed on rank(s) [1]" in r for r in results), results
    assert leftover_segments(group) == []


def _rank0(t, group):
    backend = CpuBackend(group=group, incarnation="1", rank=0)
    store = backend.allocate_store(4096, tag="rows")
    t.barrier()
    t.barrier()
    try:
        backend.map_peers(store, t)
    except BackendError as exc:
        return str(exc)
    finally:
        store.close()
    return "mapped"


def test_free_bytes_is_positive():
    assert CpuBackend(group="g", incarnation="1", rank=0).free_bytes() > 0


def test_the_launcher_of_a_whole_group_removes_the_stores_its_ranks_left():
    """Ranks killed in setup leave their store files (SIGKILL: no unlink); once every local
    rank exited, the launcher of the whole group removes that incarnation's files, and only
    them (not another incarnation's, and nothing when the group spans other pods)."""
    from dwdp.worker.backend.cpu import CpuBackend, leftover_segments
    from dwdp.worker.launcher import _sweep_stores

    group = f"sw{uuid.uuid4().hex[:8]}"
    left = [CpuBackend(group=group, incarnation=inc, rank=r).allocate_store(4096, tag="experts")
            for inc in ("3", "4") for r in (0, 1)]
    env = {"DWDP_GROUP": group, "DWDP_INCARNATION": "3", "DWDP_WORLD_SIZE": "2"}
    try:
        _sweep_stores({**env, "DWDP_WORLD_SIZE": "4"}, nproc=2)  # other pods hold ranks
        assert len(leftover_segments(group)) == 4
        _sweep_stores(env, nproc=2)
        assert leftover_segments(group) == [f"dwdp-{group}-4-{r}-experts" for r in (0, 1)]
    finally:
        for store in left:
            store.close()
        for name in leftover_segments(group):
            os.unlink(os.path.join("/dev/shm", name))
