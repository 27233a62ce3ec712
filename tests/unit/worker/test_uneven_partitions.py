"""Uneven expert partitions served end to end: redundant (overlapping ranges, each expert copied
from the lowest rank that stores it) and capped (the last rank holds what is left), the
specification's shapes scaled down, with expert + dense DWDP attached on every rank (threads
over the cpu backend). Every rank's logits are bitwise the replicated model's and its greedy
tokens equal the reference's, for the three architectures."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from test_transport import run_threads  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments  # noqa: E402
from dwdp_dev.worker.checkpoint import fill_seeded, tiny_config  # noqa: E402

PARTITIONS = {
    # kind: (experts, ranks, experts per rank, stride) -> ranges
    "redundant-2": (6, 2, 4, 2),  # (0, 4) (2, 6)
    "redundant-3": (8, 3, 4, 2),  # (0, 4) (2, 6) (4, 8)
    "capped-2": (7, 2, 4, 4),  # (0, 4) (4, 7)
    "capped-3": (10, 3, 4, 4),  # (0, 4) (4, 8) (8, 10)
}


def _model(arch: str, num_experts: int):
    config = tiny_config(arch, vocab_size=64, num_experts=num_experts)
    model = transformers.AutoModelForCausalLM.from_config(config)
    fill_seeded(model, 0)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("shape", sorted(PARTITIONS))
def test_an_uneven_partition_serves_the_replicated_models_tokens(arch, shape):
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for

    num_experts, ranks, size, stride = PARTITIONS[shape]
    partition = expert_partition(num_experts, ranks, experts_per_worker=size,
                                 prefetch_experts=stride)
    assert str(partition.kind) == shape.split("-")[0]
    group = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 29]])
    reference = _model(arch, num_experts)
    with torch.no_grad():
        want_logits = reference(ids).logits
        want_tokens = reference.generate(ids, max_new_tokens=5, do_sample=False)
    models = [_model(arch, num_experts) for _ in range(ranks)]

    def body(transport):
        model = models[transport.rank]
        backend = CpuBackend(group=group, incarnation="1", rank=transport.rank)
        att = attach(model, adapter_for(model), backend=backend, transport=transport,
                     partition=partition, enable_dense=True, dense_min_bytes=0)
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
        held = att.status()
        transport.barrier(label="served")
        att.close()
        return logits, tokens, held

    for rank, result in enumerate(run_threads(ranks, body)):
        assert not isinstance(result, BaseException), repr(result)
        logits, tokens, held = result
        assert torch.equal(logits, want_logits), rank
        assert torch.equal(tokens, want_tokens), rank
        assert held["phase"] == "committed" and held["leaks"] == 0, held
        assert [(r["start"], r["end"]) for r in held["partition"]["ranks"]] == list(
            partition.ranges), held
        assert held["bytes_moved_remote"] > 0, held  # experts came from the peers' stores
    assert not leftover_segments(group)


def test_a_shared_expert_held_with_other_bytes_is_refused_naming_it():
    """Redundant ranges (0, 4) and (2, 6): rank 1 holds expert 3 with other bytes than rank
    0 (the expert's owner): every rank refuses at the expert check, naming expert 3."""
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for
    from dwdp.worker.setup.phases import SetupError

    partition = expert_partition(6, 2, experts_per_worker=4, prefetch_experts=2)
    group = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model("qwen3_moe", 6) for _ in range(2)]
    with torch.no_grad():
        models[1].model.layers[-1].mlp.experts.down_proj[3].add_(1.0)

    def body(transport):
        model = models[transport.rank]
        backend = CpuBackend(group=group, incarnation="1", rank=transport.rank)
        with pytest.raises(SetupError) as info:
            attach(model, adapter_for(model), backend=backend, transport=transport,
                   partition=partition, enable_dense=False)
        return info.value

    for exc in run_threads(2, body):
        assert exc.failed_ranks == (1,), exc
        assert "down_proj: the gathered slot differs from the original in experts [3]" in str(
            exc), exc
    assert not leftover_segments(group)
