"""The copy settings resolved once (``dwdp.worker.settings``) and carried down the real setup
path: contentionOpt with copyMode unset runs batched copies in both managers; gather on the
cpu backend is refused naming the field; a tma gather below SM90 runs the register kernel
with one WARNING; the SM reserve and the leak count reach ``/dwdp/status`` and the metrics;
the ring-too-big refusal expert setup really uses. Two ranks in threads over the cpu
backend."""

from __future__ import annotations

import logging
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from test_transport import run_threads  # noqa: E402

from dwdp.api.config import DwdpConfig  # noqa: E402
from dwdp.api.enums import CopyMode, GatherKernel  # noqa: E402
from dwdp.api.launch import LaunchConfig  # noqa: E402
from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments  # noqa: E402
from dwdp.worker.settings import (  # noqa: E402
    CopySettings,
    CopySettingsError,
    HostInfo,
    resolve_copy_settings,
)
from dwdp_dev.worker.checkpoint import fill_seeded, tiny_config  # noqa: E402

NUM_EXPERTS = 4
CPU = HostInfo(backend="cpu")
A100 = HostInfo(backend="cuda", capability=(8, 0), sm_count=108)
H200 = HostInfo(backend="cuda", capability=(9, 0), sm_count=132)


def _dwdp(**fields) -> DwdpConfig:
    return DwdpConfig(dwdp_size=2, **fields)


def test_contention_opt_with_copy_mode_unset_means_batched():
    assert resolve_copy_settings(_dwdp(contention_opt=True), CPU) == CopySettings(
        copy_mode=CopyMode.BATCHED, contention_opt=True
    )
    assert resolve_copy_settings(_dwdp(), CPU).copy_mode is CopyMode.PER_SLICE
    explicit = resolve_copy_settings(_dwdp(copy_mode="batched", contention_opt=True), H200)
    assert explicit.copy_mode is CopyMode.BATCHED and explicit.gather_kernel is None


def test_gather_on_the_cpu_backend_is_refused_naming_the_field():
    with pytest.raises(CopySettingsError, match=r"dwdp\.copyMode: gather .* cpu backend"):
        resolve_copy_settings(_dwdp(copy_mode="gather"), CPU)


def test_gather_kernel_default_and_the_tma_fallback_below_sm90(caplog):
    assert resolve_copy_settings(_dwdp(copy_mode="gather"), H200).gather_kernel is (
        GatherKernel.REGISTER
    )
    tma = _dwdp(copy_mode="gather", gather_kernel="tma")
    assert resolve_copy_settings(tma, H200).gather_kernel is GatherKernel.TMA
    with caplog.at_level(logging.WARNING, logger="dwdp.worker.settings"):
        settings = resolve_copy_settings(tma, A100)
    assert settings.gather_kernel is GatherKernel.REGISTER
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sm_80" in warnings[0] and "register" in warnings[0]
    assert settings.notes == (warnings[0],)


def _model():
    config = tiny_config("deepseek_v3", vocab_size=64, num_experts=NUM_EXPERTS)
    model = transformers.AutoModelForCausalLM.from_config(config)
    fill_seeded(model, 0)
    return model.eval()


class RecordingBackend(CpuBackend):
    """The cpu backend, recording the copy mode of every ``launch_copies``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.modes: list[CopyMode] = []

    def launch_copies(self, plan, stream, *, mode, gather=None):
        self.modes.append(mode)
        super().launch_copies(plan, stream, mode=mode, gather=gather)


def test_contention_opt_runs_batched_copies_through_setup_dwdp(monkeypatch):
    """The launch's settings go through ``setup_dwdp`` (the worker's path) to the backend
    and both managers: every copy of setup and of the forward is batched."""
    from dwdp.worker.bringup import setup_dwdp
    from dwdp.worker.models import adapter_for

    name = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]
    cfg = LaunchConfig.model_validate(
        {
            "model": {"path": "/unused"},
            "handleType": "shm",
            "dwdp": {"dwdpSize": 2, "enableDense": True, "contentionOpt": True},
        }
    )
    settings = resolve_copy_settings(cfg.dwdp, CPU)
    backends: dict[int, RecordingBackend] = {}

    def make(cfg, transport, settings, environ=None):
        backends[transport.rank] = RecordingBackend(
            group=name, incarnation="1", rank=transport.rank
        )
        return backends[transport.rank]

    monkeypatch.setattr("dwdp.worker.bringup.make_backend", make)
    ids = torch.arange(6).reshape(1, 6) % 64

    def body(transport):
        model = models[transport.rank]
        att = setup_dwdp(model, adapter_for(model), cfg, group=transport, settings=settings)
        with torch.no_grad():
            model(ids)
        transport.barrier(label="forward-done")
        status = att.status()
        att.close()
        return att, status

    for rank, result in enumerate(run_threads(2, body)):
        assert not isinstance(result, BaseException), repr(result)
        att, status = result
        assert att.dense.settings is settings and att.experts.settings is settings
        assert status["copy_mode"] == "batched" and status["sm_reserve"] == 0
        assert backends[rank].modes and set(backends[rank].modes) == {CopyMode.BATCHED}
    assert not leftover_segments(name)


def test_leaked_original_is_counted_in_status_and_metrics():
    """An original expert table still referenced after the commit is a leak: counted on
    the rank that holds it, in ``status()`` and in the ``dwdp_leaks`` metric."""
    from prometheus_client import generate_latest

    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for
    from dwdp.worker.server.metrics import ServerMetrics

    name = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]
    held = adapter_for(models[1]).moe_layers(models[1])[0].experts.gate_up_proj.data

    def body(transport):
        model = models[transport.rank]
        backend = CpuBackend(group=name, incarnation="1", rank=transport.rank)
        att = attach(
            model,
            adapter_for(model),
            backend=backend,
            transport=transport,
            partition=expert_partition(NUM_EXPERTS, 2),
            enable_dense=False,
        )
        status = att.status()
        metrics = generate_latest(ServerMetrics(None, att).registry).decode()
        transport.barrier(label="read")
        att.close()
        return status, metrics

    results = run_threads(2, body)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), repr(result)
        status, metrics = result
        assert status["leaks"] == rank  # rank 1 holds one original table
        assert f"dwdp_leaks {float(rank)}" in metrics
    assert held.numel() > 0
    assert not leftover_segments(name)


def test_a_prefetch_ring_too_big_for_free_memory_is_refused_before_allocating():
    """The refusal expert setup really uses: the store plus ``num_slots`` slots need more
    than ``free_bytes()``: every rank raises at the allocate step, nothing allocated."""
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for
    from dwdp.worker.setup.phases import SetupError

    name = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]
    slot_bytes = sum(
        t.untyped_storage().nbytes()
        for m in adapter_for(models[0]).moe_layers(models[0])[:1]
        for t in m.expert_tensors().values()
    )
    probe = CpuBackend(group=name, incarnation="0", rank=0)
    num_slots = 2 * probe.free_bytes() // slot_bytes  # twice the free memory

    def body(transport):
        model = models[transport.rank]
        backend = CpuBackend(group=name, incarnation="1", rank=transport.rank)
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        with pytest.raises(SetupError) as info:
            attach(
                model,
                adapter_for(model),
                backend=backend,
                transport=transport,
                partition=expert_partition(NUM_EXPERTS, 2),
                enable_dense=False,
                num_slots=num_slots,
            )
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
        return info.value

    for exc in run_threads(2, body):
        assert isinstance(exc, SetupError), repr(exc)
        assert exc.phase == "allocate" and exc.failed_ranks == (0, 1) and exc.restored
        assert "PrefetchRingMemoryError" in str(exc) and "are free" in str(exc)
        assert f"{num_slots} prefetch slots" in str(exc)
        assert "lower dwdp.numPrefetchSlots" in str(exc) and "raise dwdp.dwdpSize" in str(exc)
    assert not leftover_segments(name)


def test_sm_reserve_resolves_to_what_the_model_leaves_free():
    """dwdp.smReserve: unset is off; auto takes the gather's resident SMs (no number here:
    the loaded kernel's occupancy decides it); a number is kept; the cpu backend and a
    number as large as the device's SM count are refused naming the field."""
    off = resolve_copy_settings(_dwdp(copy_mode="gather"), H200)
    assert (off.reserve_model_sms, off.sm_reserve_sms) == (False, None)
    auto = resolve_copy_settings(_dwdp(copy_mode="gather", sm_reserve="auto"), H200)
    assert (auto.reserve_model_sms, auto.sm_reserve_sms) == (True, None)
    pinned = resolve_copy_settings(_dwdp(sm_reserve=16), H200)
    assert (pinned.copy_mode, pinned.reserve_model_sms, pinned.sm_reserve_sms) == (
        CopyMode.PER_SLICE, True, 16)
    with pytest.raises(CopySettingsError, match=r"^dwdp.smReserve: 8 needs a CUDA device"):
        resolve_copy_settings(_dwdp(sm_reserve=8), CPU)
    with pytest.raises(CopySettingsError, match=r"^dwdp.smReserve: 132 SMs .* at most 131"):
        resolve_copy_settings(_dwdp(sm_reserve=132), H200)
