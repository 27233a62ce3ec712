"""The CUDA backend in one process: stores and handles, every copy mode against a
reference copy, no host synchronization in a multi-layer loop, host check, fit and
SM-reserve errors."""

from __future__ import annotations

import pytest

from dwdp.api.enums import GatherKernel

torch = pytest.importorskip("torch")

MODES = [
    ("per_slice", None, False),
    ("batched", None, False),
    ("batched", None, True),  # contention_opt
    ("gather", "register", False),
    ("gather", "tma", False),
]
IDS = ["per_slice", "batched", "batched-contention_opt", "gather-register", "gather-tma"]
POISON = 0x5A


def _fill(buf, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = buf.tensor()
    t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, device="cuda", generator=g))


def _layer_plans(backend, n_layers=3, peers=3):
    """Stores standing in for peers (remote) and this rank (local), one slot per layer,
    descriptors with odd sizes and 16-byte offsets; returns (plans, slots, stores)."""
    from dwdp.worker.backend.base import CopyDescriptor, CopyPlan

    mib = 1 << 20
    stores = [backend.allocate_store(6 * mib + 1000, tag=f"store{r}") for r in range(peers + 1)]
    for r, s in enumerate(stores):
        _fill(s, 100 + r)
    plans, slots = [], []
    for layer in range(n_layers):
        slot = backend.allocate(4 * (peers + 1) * mib, tag=f"slot{layer}")
        slot.tensor().fill_(POISON)
        remote, local, off = [], [], 0
        for r, s in enumerate(stores):
            for piece in range(2):
                n = mib + 16 * (7 * layer + 3 * piece + r) + (r + piece + layer) % 5
                src_off = 16 * (1000 * layer + 97 * piece + 3)
                d = CopyDescriptor(s, src_off, slot, off, n)
                (local if r == 0 else remote).append(d)
                off += ((n + 15) // 16) * 16 + 32
        plans.append(CopyPlan(remote=tuple(remote), local=tuple(local)))
        slots.append(slot)
    return plans, slots, stores


def _reference(plan, slot_nbytes):
    ref = torch.full((slot_nbytes,), POISON, dtype=torch.uint8, device="cuda")
    for d in plan.remote + plan.local:
        ref[d.dst_offset : d.dst_offset + d.nbytes] = d.src.tensor()[
            d.src_offset : d.src_offset + d.nbytes
        ]
    return ref


@pytest.mark.parametrize(("mode", "kernel", "contention"), MODES, ids=IDS)
def test_copy_mode_equals_reference(mode, kernel, contention):
    from dwdp.api.enums import CopyMode
    from dwdp.worker.backend.cuda import CudaBackend
    from dwdp.worker.settings import CopySettings

    backend = CudaBackend(
        device=0,
        settings=CopySettings(copy_mode=CopyMode(mode), contention_opt=contention),
        sub_slice_bytes=256 << 10,
    )
    try:
        plans, slots, _ = _layer_plans(backend)
        gather = backend.resolve_gather(GatherKernel(kernel), 24) if kernel else None
        stream = backend.new_stream("expert-copy")
        for plan in plans:
            backend.launch_copies(plan, stream, mode=CopyMode(mode), gather=gather)
        stream.synchronize()
        for plan, slot in zip(plans, slots, strict=True):
            ref = _reference(plan, slot.nbytes)
            assert torch.equal(slot.tensor(), ref), f"{mode}/{kernel}: slot bytes differ"
    finally:
        backend.close()


def test_store_granularity_tensor_and_handles_released():
    from dwdp.worker.backend.cuda import CudaBackend, live_handles

    before = live_handles()
    backend = CudaBackend(device=0)
    gran = backend.granularity()
    assert gran == 2 << 20  # measured on H200 (gpu-facts)
    store = backend.allocate_store(gran + 1, tag="experts")
    assert store.nbytes == 2 * gran
    assert live_handles() == before + 3  # allocation, reservation, mapping
    t = store.tensor()
    assert t.dtype == torch.uint8 and t.numel() == store.nbytes and t.is_cuda
    t.fill_(7)
    assert int(t.sum()) == 7 * store.nbytes
    store.close()
    store.close()  # idempotent
    assert live_handles() == before
    backend.allocate_store(1, tag="left open")
    backend.close()  # closes what is left
    assert live_handles() == before


def test_region_creation_failure_releases_what_it_made(monkeypatch):
    from dwdp.worker.backend import cuda_vmm
    from dwdp.worker.backend.base import BackendError
    from dwdp.worker.backend.cuda import CudaBackend, live_handles

    backend = CudaBackend(device=0)
    before = live_handles()

    def refuse(*a, **k):
        raise cuda_vmm.CudaCallError("cuMemMap", "CUDA_ERROR_INJECTED")

    monkeypatch.setattr(cuda_vmm.driver, "cuMemMap", refuse)
    with pytest.raises(BackendError, match="INJECTED"):
        backend.allocate_store(1 << 20, tag="x")
    assert live_handles() == before
    backend.close()


def test_no_host_sync_in_multilayer_loop(backend):
    """Setup (plans prepared, kernels resolved) then a simulated forward loop of copies on
    a copy stream and reads on the compute stream, ordered only by events: torch's sync
    debug mode set to error proves no host synchronization between setup and teardown."""
    from dwdp.api.enums import CopyMode

    plans, slots, _ = _layer_plans(backend, n_layers=4)
    copy = backend.new_stream("expert-copy")
    compute = backend.current_stream()
    modes = [
        (CopyMode.GATHER, backend.resolve_gather(GatherKernel.REGISTER, 16)),
        (CopyMode.GATHER, backend.resolve_gather(GatherKernel.TMA, 16)),
        (CopyMode.BATCHED, None),
        (CopyMode.PER_SLICE, None),
    ]
    for mode, g in modes:
        for p in plans:
            backend.prepare(p, mode=mode, stream=copy, gather=g)
    ready = [backend.new_event() for _ in plans]
    consumed = [backend.new_event() for _ in plans]
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    copy.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mode, g in modes:
            for _ in range(2):  # two forward passes per mode
                for i, plan in enumerate(plans):
                    copy.wait_event(consumed[i])  # write-after-read on the slot
                    backend.launch_copies(plan, copy, mode=mode, gather=g)
                    ready[i].record(copy)
                    compute.wait_event(ready[i])  # read-after-write
                    acc += slots[i].tensor()[:4096].to(torch.int64).sum()
                    consumed[i].record(compute)
                    assert isinstance(ready[i].query(), bool)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for plan, slot in zip(plans, slots, strict=True):
        assert torch.equal(slot.tensor(), _reference(plan, slot.nbytes))
    expected = sum(int(s.tensor()[:4096].to(torch.int64).sum()) for s in slots) * 8
    assert int(acc) == expected


def test_lazy_prepare_does_not_sync(backend):
    """A plan launched without prepare() builds and uploads its table asynchronously."""
    from dwdp.api.enums import CopyMode

    plans, slots, _ = _layer_plans(backend, n_layers=1)
    g = backend.resolve_gather(GatherKernel.REGISTER, 8)
    copy = backend.new_stream("expert-copy")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.launch_copies(plans[0], copy, mode=CopyMode.GATHER, gather=g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    copy.synchronize()
    assert torch.equal(slots[0].tensor(), _reference(plans[0], slots[0].nbytes))


def test_gather_resolved_once_and_reserve_checked(backend):
    from dwdp.worker.backend.cuda_plan import SmReserveError

    a = backend.resolve_gather(GatherKernel.TMA, 16)
    b = backend.resolve_gather(GatherKernel.TMA, 32)
    per_sm = a.module.max_blocks_per_sm()
    assert a.module is b.module and (a.blocks, b.blocks) == (16, 32)
    # the reserve: the SMs the resident blocks hold at the kernel's occupancy
    assert (a.sm_reserve, b.sm_reserve) == (-(-16 // per_sm), -(-32 // per_sm))
    reg = backend.resolve_gather(GatherKernel.REGISTER, 1)
    with pytest.raises(SmReserveError, match="leaves no SM"):
        backend.resolve_gather(
            GatherKernel.REGISTER, backend.sm_count * reg.module.max_blocks_per_sm()
        )
    with pytest.raises(SmReserveError):
        backend.resolve_gather(GatherKernel.REGISTER, 0)


def test_host_check_posix_fd():
    from dwdp.api.enums import HandleType
    from dwdp.worker.backend.cuda import host_check, live_handles

    before = live_handles()
    facts = host_check(HandleType.POSIX_FD, device=0)
    assert facts["granularity"] == 2 << 20 and facts["sms"] >= 2
    assert live_handles() == before


def test_host_check_reports_fabric_refusal():
    """Without an IMEX channel (our H200 host), FABRIC is refused by name and remedy."""
    from dwdp.api.enums import HandleType
    from dwdp.worker.backend.cuda import CudaBackend, host_check, live_handles
    from dwdp.worker.backend.cuda_plan import FabricNotPermittedError

    before = live_handles()
    try:
        host_check(HandleType.FABRIC, device=0)
    except FabricNotPermittedError as e:
        msg = str(e)
    else:
        pytest.skip("this host grants an IMEX channel: FABRIC allocations work")
    assert "handleType: fabric" in msg and "ComputeDomain" in msg and "IMEX" in msg
    assert "CUDA_ERROR_NOT_PERMITTED" in msg
    assert live_handles() == before
    backend = CudaBackend(device=0, handle_type=HandleType.FABRIC)
    with pytest.raises(FabricNotPermittedError, match="ComputeDomain"):
        backend.allocate_store(1 << 20, tag="experts")
    backend.close()
    assert live_handles() == before


def test_batched_refuses_legacy_stream_by_name(backend):
    from dwdp.api.enums import CopyMode
    from dwdp.worker.backend.base import BackendError

    plans, _, _ = _layer_plans(backend, n_layers=1)
    with pytest.raises(BackendError, match="legacy NULL stream"):
        backend.launch_copies(plans[0], backend.current_stream(), mode=CopyMode.BATCHED)


def test_host_gate_passes_and_resolves_the_kernel_on_this_gpu():
    """The host gate of ``dwdp worker`` on a real GPU: posixFd passes ``host_check``, the
    settings resolve tma on SM90+ (register below, with the warning), and the resolved
    gather kernel loads."""
    from dwdp.api.launch import LaunchConfig
    from dwdp.worker.host import check_copy_ops, probe_host
    from dwdp.worker.settings import resolve_copy_settings

    cfg = LaunchConfig.model_validate(
        {
            "model": {"path": "/unused"},
            "handleType": "posixFd",
            "dwdp": {"dwdpSize": 2, "copyMode": "gather", "gatherKernel": "tma"},
        }
    )
    host = probe_host(cfg, device=0)
    props = torch.cuda.get_device_properties(0)
    assert host.backend == "cuda" and host.sm_count == props.multi_processor_count
    assert host.capability == (props.major, props.minor)
    settings = resolve_copy_settings(cfg.dwdp, host)
    sm90 = (props.major, props.minor) >= (9, 0)
    assert settings.gather_kernel is (GatherKernel.TMA if sm90 else GatherKernel.REGISTER)
    assert bool(settings.notes) is not sm90
    check_copy_ops(settings, host, device=0)
