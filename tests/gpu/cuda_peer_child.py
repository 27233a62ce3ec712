"""One rank of the 4-process peer-mapping test (run by test_cuda_peers_mp.py, not pytest).

Usage: python cuda_peer_child.py RANK WORLD PORT SCENARIO, SCENARIO "ok" or "fail".
Prints one JSON line with what the rank saw. The group transport is a minimal one over
torch's TCPStore (allgather_object, barrier), the duck type the CUDA backend needs.
"""

from __future__ import annotations

import json
import pickle
import sys
import traceback
from datetime import timedelta

import torch

MIB = 1 << 20


class StoreTransport:
    """allgather of picklable objects over a TCPStore hosted by rank 0."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        from torch.distributed import TCPStore

        self.rank, self.world_size = rank, world
        self._store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=90))
        self._seq = 0

    def allgather_object(self, obj):
        self._seq += 1
        self._store.set(f"{self._seq}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self._store.get(f"{self._seq}/{r}")) for r in range(self.world_size)]

    def barrier(self) -> None:
        self.allgather_object(None)

    def close(self) -> None:
        """Rank 0 hosts the store: it leaves last, after every peer said it is done reading
        (otherwise a peer still inside the last barrier loses its connection)."""
        if self.rank == 0:
            self._store.wait([f"left/{r}" for r in range(1, self.world_size)])
        else:
            self._store.set(f"left/{self.rank}", b"1")


def store_bytes(rank: int) -> int:
    return 3 * MIB + 4096 * rank + 7


def pattern(rank: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    n = store_bytes(rank)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def main() -> None:
    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from dwdp.api.enums import CopyMode, GatherKernel
    from dwdp.worker.backend import cuda_vmm
    from dwdp.worker.backend.base import BackendError, CopyDescriptor, CopyPlan
    from dwdp.worker.backend.cuda import CudaBackend, live_handles

    torch.cuda.set_device(0)
    out: dict = {"rank": rank, "scenario": scenario}
    transport = StoreTransport(rank, world, port)
    out["handles_start"] = live_handles()
    backend = CudaBackend(device=0)
    store = backend.allocate_store(store_bytes(rank), tag=f"store{rank}")
    store.tensor()[: store_bytes(rank)].copy_(pattern(rank))
    torch.cuda.synchronize()
    out["handles_store"] = live_handles()

    if scenario == "fail" and rank == 2:
        real, calls = cuda_vmm.import_region, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise BackendError("injected failure on the second peer import")
            return real(*args, **kwargs)

        cuda_vmm.import_region = flaky

    try:
        views = backend.map_peers(store, transport)
    except BackendError as e:
        out["error"] = str(e)
        out["handles_after_error"] = live_handles()
        transport.barrier()
        store.close()
        backend.close()
        out["handles_end"] = live_handles()
        print(json.dumps(out), flush=True)
        return

    out["handles_mapped"] = live_handles()
    out["self_entry_none"] = views[rank] is None
    out["read_only"] = [bool(v.read_only) for v in views if v is not None]
    out["bytes_ok"] = {}
    for r, v in enumerate(views):
        if v is None:
            continue
        n = store_bytes(r)
        out["bytes_ok"][r] = bool(torch.equal(v.tensor()[:n], pattern(r))) and v.nbytes >= n
    # Every copy mode reading every peer's store into a slot, checked byte for byte.
    slot = backend.allocate(world * 2 * MIB, tag="slot")
    descs, ref, off = [], [], 0
    for r, v in enumerate(views):
        src = store if v is None else v
        n = MIB + 16 * r + 3
        descs.append((r == rank, CopyDescriptor(src, 16 * (r + 1), slot, off, n)))
        ref.append((off, n, pattern(r)[16 * (r + 1) : 16 * (r + 1) + n]))
        off += 2 * MIB
    plan = CopyPlan(
        remote=tuple(d for loc, d in descs if not loc), local=tuple(d for loc, d in descs if loc)
    )
    stream = backend.new_stream("expert-copy")
    out["modes_ok"] = {}
    for mode, kernel in [
        ("per_slice", None),
        ("batched", None),
        ("gather", "register"),
        ("gather", "tma"),
    ]:
        slot.tensor().fill_(0xA5)  # on torch's stream: landed before the copy stream writes
        torch.cuda.synchronize()
        g = backend.resolve_gather(GatherKernel(kernel), 16) if kernel else None
        backend.launch_copies(plan, stream, mode=CopyMode(mode), gather=g)
        stream.synchronize()
        ok = all(torch.equal(slot.tensor()[o : o + n], want) for o, n, want in ref)
        out["modes_ok"][f"{mode}{'-' + kernel if kernel else ''}"] = bool(ok)
    torch.cuda.synchronize()
    transport.barrier()  # no rank unmaps its store while a peer still reads it
    for v in views:
        if v is not None:
            v.close()
    out["handles_views_closed"] = live_handles()
    store.close()
    backend.close()
    out["handles_end"] = live_handles()
    transport.barrier()
    transport.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
