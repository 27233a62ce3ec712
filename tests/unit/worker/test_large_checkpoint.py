"""``write_qwen3_moe_checkpoint`` at a tiny size on CPU: the layout ``save_pretrained`` writes
for the same config (names, shapes, dtypes, an index over several files), accepted by the
checks, loaded whole by ``from_pretrained`` and sharded by ``load_sharded`` alike, seeded,
and with the values it promises (std-scaled matrices, unit norms, a finite forward)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.sharded import load_sharded  # noqa: E402
from dwdp.worker.loading.validate import (  # noqa: E402
    INDEX_FILE,
    expert_count,
    read_headers,
    validate_checkpoint,
)
from dwdp.worker.models import require_adapter  # noqa: E402
from dwdp_dev.worker.large_checkpoint import (  # noqa: E402
    Qwen3MoeShape,
    checkpoint_sizes,
    write_qwen3_moe_checkpoint,
)

SHAPE = Qwen3MoeShape(
    num_layers=3,
    hidden_size=64,
    num_experts=8,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("large") / "ck", SHAPE, seed=4)


def test_layout_is_save_pretrained_s(written, tmp_path):
    from transformers import AutoModelForCausalLM

    config = validate_checkpoint(written)
    assert expert_count(config) == SHAPE.num_experts and config.num_experts_per_tok == 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path / "sp"))
    headers = read_headers(written)
    assert headers == read_headers(tmp_path / "sp")
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in headers  # one tensor per matrix
    index = json.loads((written / INDEX_FILE).read_text())
    files = {p.name for p in written.glob("*.safetensors")}
    assert set(index["weight_map"]) == set(headers)
    assert set(index["weight_map"].values()) == files and len(files) == SHAPE.num_layers + 1
    sizes = checkpoint_sizes(written)
    assert index["metadata"]["total_size"] == sizes["full"]
    assert sizes["experts"] == SHAPE.num_layers * SHAPE.num_experts * SHAPE.expert_bytes()


def test_whole_and_sharded_loads_agree_and_values_are_as_promised(written):
    whole, tok = load_checkpoint(written)
    ids = torch.tensor([tok("Hello world, the")["input_ids"]])
    with torch.no_grad():
        logits = whole(ids).logits
    assert torch.isfinite(logits).all()
    state = whole.state_dict()
    ones = torch.ones(SHAPE.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(state["model.norm.weight"], ones)
    table = state["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H], fused on load
    assert table.shape == (SHAPE.num_experts, 2 * SHAPE.moe_intermediate_size, SHAPE.hidden_size)
    assert 0.015 < table.float().std().item() < 0.025
    partition = expert_partition(SHAPE.num_experts, 4)
    adapter = require_adapter(whole, dense=False)
    model, _tok, rows = load_sharded(written, adapter=adapter, partition=partition, rank=2)
    start, end = partition.ranges[2]
    for m in adapter.moe_layers(whole):
        for name, full in m.expert_tensors().items():
            assert torch.equal(rows.tables[m.prefix][name], full[start:end]), (m.prefix, name)
    assert torch.equal(model.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_seeded(written, tmp_path):
    again = write_qwen3_moe_checkpoint(tmp_path / "again", SHAPE, seed=4, workers=1)
    other = write_qwen3_moe_checkpoint(tmp_path / "other", SHAPE, seed=5)
    name = "model-00002-of-00004.safetensors"
    assert (again / name).read_bytes() == (written / name).read_bytes()
    assert (other / name).read_bytes() != (written / name).read_bytes()
