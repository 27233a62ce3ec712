"""Architecture adapters: MoE layers, blobs A(l)/D(l), never-move names, refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dwdp.worker.models import (  # noqa: E402
    EXPERT_PARAMS,
    GenericFusedExpertsAdapter,
    UnsupportedArchitectureError,
    adapter_for,
    require_adapter,
)
from dwdp.worker.models.deepseek_v3 import DeepseekV3Adapter  # noqa: E402
from dwdp.worker.models.mixtral import MixtralAdapter  # noqa: E402
from dwdp.worker.models.qwen3_moe import Qwen3MoeAdapter  # noqa: E402
from dwdp_dev.worker.checkpoint import fill_seeded, tiny_config  # noqa: E402

EXPECTED = {
    "deepseek_v3": (DeepseekV3Adapter, [1, 2]),
    "qwen3_moe": (Qwen3MoeAdapter, [1, 2]),
    "mixtral": (MixtralAdapter, [0, 1, 2]),
}


def _model(arch: str, num_experts: int = 5):
    config = tiny_config(arch, vocab_size=300, num_experts=num_experts)
    config.architectures = [
        transformers.AutoModelForCausalLM.from_config(config).__class__.__name__
    ]
    model = transformers.AutoModelForCausalLM.from_config(config)
    fill_seeded(model, 0)
    return model


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def arch_model(request):
    return request.param, _model(request.param)


def test_adapter_and_moe_layers(arch_model):
    arch, model = arch_model
    cls, moe_indices = EXPECTED[arch]
    adapter = adapter_for(model)
    assert isinstance(adapter, cls)
    assert adapter.has_dense_roots
    layers = adapter.moe_layers(model)
    assert [m.layer_index for m in layers] == moe_indices
    assert [m.moe_index for m in layers] == list(range(len(moe_indices)))
    for m in layers:
        assert m.prefix == f"model.layers.{m.layer_index}"
        assert m.num_experts == 5
        tables = m.expert_tensors()
        assert set(tables) == set(EXPERT_PARAMS)
        e, two_i, h = tables["gate_up_proj"].shape
        assert (e, h) == (5, model.config.hidden_size)
        assert tables["down_proj"].shape == (e, h, two_i // 2)
        assert m.attention is m.decoder_layer.self_attn


def test_blobs_partition_every_moe_layer_tensor(arch_model):
    """Each tensor of a MoE decoder layer is in exactly one of: blob A, blob D, the expert
    tables, the never-move names."""
    arch, model = arch_model
    adapter = adapter_for(model)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for m in adapter.moe_layers(model):
        a = [t.name for t in m.blob_tensors("A")]
        d = [t.name for t in m.blob_tensors("D")]
        experts = [f"{m.prefix}.mlp.experts.{p}" for p in EXPERT_PARAMS]
        never = [f"{m.prefix}.{n}" for n in m.never_move]
        layer_names = [n for n in state if n.startswith(m.prefix + ".")]
        groups = a + d + experts + never
        assert sorted(groups) == sorted(layer_names), arch
        assert all(".self_attn." in n for n in a)
        assert not any(".self_attn." in n for n in d)
        assert any(n.endswith("mlp.gate.weight") for n in d)
        assert any(n.endswith("input_layernorm.weight") for n in d)
        for t in m.blob_tensors("A") + m.blob_tensors("D"):
            assert t.get() is state[t.name]
    if arch == "deepseek_v3":
        (first,) = [m for m in adapter.moe_layers(model) if m.layer_index == 1]
        d = [t.name for t in first.blob_tensors("D")]
        assert any(".mlp.shared_experts." in n for n in d)
        assert "model.layers.1.mlp.gate.e_score_correction_bias" not in d
        assert adapter.never_move_names(model) == [
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.gate.e_score_correction_bias",
        ]


def test_blob_name_refused(arch_model):
    _arch, model = arch_model
    layer = adapter_for(model).moe_layers(model)[0]
    with pytest.raises(ValueError, match="unknown dense blob"):
        layer.blob_tensors("B")


def test_dense_layer_like_protocol(arch_model):
    """The dense layout collector reads MoeLayer through its DenseLayerLike protocol."""
    _arch, model = arch_model
    layer = adapter_for(model).moe_layers(model)[0]
    for attr in ("prefix", "decoder_layer", "attention_roots", "moe_dense_roots", "never_move"):
        assert hasattr(layer, attr)


def test_model_without_adapter_refuses_dense_keeps_experts():
    config = transformers.OlmoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    adapter = adapter_for(model)
    assert isinstance(adapter, GenericFusedExpertsAdapter)
    assert not adapter.has_dense_roots
    assert [m.layer_index for m in adapter.moe_layers(model)] == [0, 1]
    assert adapter.moe_layers(model)[0].blob_tensors("A") == []
    with pytest.raises(
        UnsupportedArchitectureError, match=r"enable_dense: architecture .* no dense roots"
    ):
        require_adapter(model, dense=True)
    assert require_adapter(model, dense=False) is adapter
    assert adapter_for(model, allow_generic=False) is None


def test_dense_model_has_no_moe_layers():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert adapter_for(model).moe_layers(model) == []


def test_checkpoint_forms_mixtral_renames():
    adapter = MixtralAdapter()
    forms = adapter.checkpoint_forms("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 4))
    assert forms[0] == {"model.layers.0.mlp.experts.gate_up_proj": (2, 8, 4)}
    legacy = forms[-1]
    assert legacy["model.layers.0.block_sparse_moe.experts.1.w1.weight"] == (4, 4)
    assert legacy["model.layers.0.block_sparse_moe.experts.1.w3.weight"] == (4, 4)
    down = adapter.checkpoint_forms("model.layers.0.mlp.experts.down_proj", (2, 4, 4))[-1]
    assert set(down) == {f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in (0, 1)}
    gate = adapter.checkpoint_forms("model.layers.0.mlp.gate.weight", (2, 4))
    assert {"model.layers.0.block_sparse_moe.gate.weight": (2, 4)} in gate
