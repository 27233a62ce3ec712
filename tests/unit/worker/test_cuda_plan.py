"""Pure rules of the CUDA backend (no GPU): contention_opt interleaving, gather entries,
SM reserve and FABRIC messages."""

from __future__ import annotations

import pytest

from dwdp.worker.backend.base import BackendError, Buffer, CopyDescriptor, CopyPlan
from dwdp.worker.backend.cuda_plan import (
    SmReserveError,
    check_sm_reserve,
    fabric_refused_message,
    gather_entries,
    interleave_peers,
    split_descriptor,
)


class Buf(Buffer):
    def __init__(self, nbytes: int, rank: int | None = None, ptr: int = 0) -> None:
        self.nbytes = nbytes
        if rank is not None:
            self.rank = rank
        self.ptr = ptr

    def tensor(self):
        raise BackendError("no tensors")

    def close(self) -> None:
        pass


def _bytes_map(descs):
    """(src id, src byte) -> (dst id, dst byte) for every byte the descriptors move."""
    out = {}
    for d in descs:
        for i in range(d.nbytes):
            key = (id(d.src), d.src_offset + i)
            assert key not in out
            out[key] = (id(d.dst), d.dst_offset + i)
    return out


def test_split_covers_descriptor_in_order():
    src, dst = Buf(100), Buf(200)
    d = CopyDescriptor(src, 10, dst, 50, 37)
    parts = split_descriptor(d, 16)
    assert [p.nbytes for p in parts] == [16, 16, 5]
    assert [p.src_offset for p in parts] == [10, 26, 42]
    assert [p.dst_offset for p in parts] == [50, 66, 82]
    with pytest.raises(ValueError):
        split_descriptor(d, 0)


def test_interleave_round_robin_over_peers_and_same_bytes():
    p1, p2, p3 = Buf(1000, rank=1), Buf(1000, rank=2), Buf(1000, rank=3)
    own, slot = Buf(1000, rank=0), Buf(4000)
    remote = (
        CopyDescriptor(p1, 0, slot, 0, 40),
        CopyDescriptor(p1, 100, slot, 40, 20),
        CopyDescriptor(p2, 0, slot, 60, 25),
        CopyDescriptor(p3, 0, slot, 85, 10),
    )
    local = (CopyDescriptor(own, 0, slot, 95, 5),)
    plan = CopyPlan(remote=remote, local=local)
    out = interleave_peers(plan, sub_slice_bytes=10)
    assert out.local == local
    assert out.nbytes == plan.nbytes
    assert _bytes_map(out.remote) == _bytes_map(remote)
    ranks = [d.src.rank for d in out.remote]
    # Round 1..: every peer that still has slices appears once per round, in peer order.
    assert ranks[:3] == [1, 2, 3]
    assert ranks[3:5] == [1, 2]
    assert ranks[5:7] == [1, 2]
    assert all(r == 1 for r in ranks[7:])
    assert max(d.nbytes for d in out.remote) == 10
    # Within a peer, original order is kept.
    p1_src = [d.src_offset for d in out.remote if d.src.rank == 1]
    assert p1_src == [0, 10, 20, 30, 100, 110]


def test_interleave_empty_plan():
    assert interleave_peers(CopyPlan(remote=())).remote == ()


def test_gather_entries_shared_destination_uses_offsets():
    src = Buf(64, ptr=0x1000)
    dst = Buf(128, ptr=0x9000)
    spec = gather_entries(
        [CopyDescriptor(src, 16, dst, 32, 16), CopyDescriptor(src, 0, dst, 0, 8)],
        lambda b: b.ptr,
    )
    assert spec.dst_base == 0x9000
    assert [(e.src, e.dst_offset, e.nbytes) for e in spec.entries] == [
        (0x1010, 32, 16),
        (0x1000, 0, 8),
    ]


def test_gather_entries_several_destinations_are_absolute():
    src = Buf(64, ptr=0x1000)
    a, b = Buf(64, ptr=0x9000), Buf(64, ptr=0xA000)
    spec = gather_entries(
        [CopyDescriptor(src, 0, a, 16, 8), CopyDescriptor(src, 8, b, 0, 8)], lambda x: x.ptr
    )
    assert spec.dst_base == 0
    assert [e.dst_offset for e in spec.entries] == [0x9010, 0xA000]


@pytest.mark.parametrize(
    ("src_off", "dst_off", "n"), [(60, 0, 8), (0, 120, 16), (-1, 0, 1), (0, 0, -4)]
)
def test_gather_entries_refuses_out_of_bounds(src_off, dst_off, n):
    src, dst = Buf(64), Buf(128)
    with pytest.raises(BackendError, match="descriptor 0"):
        gather_entries([CopyDescriptor(src, src_off, dst, dst_off, n)], lambda b: b.ptr)


def test_sm_reserve_must_leave_an_sm():
    assert check_sm_reserve(131, 132) == 131
    assert check_sm_reserve(1, 132) == 1
    with pytest.raises(SmReserveError, match="leaves no SM"):
        check_sm_reserve(132, 132)
    with pytest.raises(SmReserveError, match="at least 1"):
        check_sm_reserve(0, 132)


def test_fabric_message_names_setting_and_remedy():
    msg = fabric_refused_message(0, "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED")
    assert "handleType: fabric" in msg
    assert "ComputeDomain" in msg
    assert "IMEX" in msg
    assert "CUDA_ERROR_NOT_PERMITTED" in msg
    assert "handleType: posixFd" in msg
