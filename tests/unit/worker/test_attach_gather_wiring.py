"""attach wires the gather kernel and the setup stream: each manager (dense, expert)
resolves the gather once and passes it to every ``launch_copies``; setup's gathers run on
created streams, never on ``backend.current_stream()`` (the legacy NULL stream on CUDA,
which batched copies refuse). Two ranks in threads over the cpu backend."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from test_transport import run_threads  # noqa: E402

from dwdp.api.enums import CopyMode, GatherKernel  # noqa: E402
from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments  # noqa: E402
from dwdp.worker.settings import CopySettings  # noqa: E402
from dwdp_dev.worker.checkpoint import fill_seeded, tiny_config  # noqa: E402

NUM_EXPERTS = 4


class RecordingBackend(CpuBackend):
    """The cpu backend, recording every ``resolve_gather`` (returning a fresh token) and
    the stream and ``gather`` of every ``launch_copies``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.resolved: list[tuple[object, object]] = []
        self.launches: list[tuple[object, object]] = []

    def resolve_gather(self, kernel=None, blocks=None):
        token = object()
        self.resolved.append((kernel, token))
        return token

    def launch_copies(self, plan, stream, *, mode, gather=None):
        self.launches.append((stream, gather))
        super().launch_copies(plan, stream, mode=mode, gather=gather)


def _model():
    config = tiny_config("deepseek_v3", vocab_size=64, num_experts=NUM_EXPERTS)
    model = transformers.AutoModelForCausalLM.from_config(config)
    fill_seeded(model, 0)
    return model.eval()


def test_attach_resolves_the_gather_once_per_manager_and_sets_up_on_created_streams():
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for

    group = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]
    ids = torch.arange(6).reshape(1, 6) % 64
    with torch.no_grad():
        reference = models[0](ids).logits

    def body(transport):
        rank = transport.rank
        backend = RecordingBackend(group=group, incarnation="1", rank=rank)
        model = models[rank]
        att = attach(
            model,
            adapter_for(model),
            backend=backend,
            transport=transport,
            partition=expert_partition(NUM_EXPERTS, 2),
            enable_dense=True,
            num_slots=2,
            settings=CopySettings(copy_mode=CopyMode.PER_SLICE, gather_kernel=GatherKernel.TMA),
        )
        setup_launches = list(backend.launches)
        with torch.no_grad():
            logits = model(ids).logits
        transport.barrier(label="forward-done")
        att.close()
        return backend, setup_launches, logits

    results = run_threads(2, body)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        backend, setup_launches, logits = result
        assert torch.equal(logits, reference)
        # one resolve per manager (dense at P1, expert at allocate), with the kernel asked
        assert [k for k, _ in backend.resolved] == [GatherKernel.TMA, GatherKernel.TMA]
        tokens = {id(t) for _, t in backend.resolved}
        assert backend.launches and all(id(g) in tokens for _, g in backend.launches)
        # the dense and the expert launches each carry their own manager's token
        assert {id(g) for _, g in backend.launches} == tokens
        # setup (P4, P5, the expert check) never copies on the compute stream
        compute = backend.current_stream()
        assert setup_launches and all(s is not compute for s, _ in setup_launches)
    assert not leftover_segments(group)


def test_expert_failure_after_the_dense_commit_says_not_restored():
    """Dense DWDP committed (originals dropped), then expert setup fails on rank 1: every
    rank raises the expert phase with ``restored=False`` and leaves no store behind."""
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for
    from dwdp.worker.setup.phases import FailAt, FailureInjector, SetupError

    group = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]

    def body(transport):
        model = models[transport.rank]
        backend = CpuBackend(group=group, incarnation="1", rank=transport.rank)
        with pytest.raises(SetupError) as info:
            attach(
                model,
                adapter_for(model),
                backend=backend,
                transport=transport,
                partition=expert_partition(NUM_EXPERTS, 2),
                enable_dense=True,
                injector=FailureInjector((FailAt("map", 1),)),
            )
        return info.value

    for exc in run_threads(2, body):
        assert isinstance(exc, SetupError), repr(exc)
        assert (exc.phase, exc.failed_ranks, exc.restored) == ("map", (1,), False)
        assert "restart the process" in str(exc)
    assert not leftover_segments(group)
