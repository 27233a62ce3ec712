"""Block-scaled FP8 checkpoints (``dwdp.worker.quant.fp8``): loaded whole they answer as the
checkpoint dequantized to bfloat16 (bitwise, on the CPU, three architectures); a sharded load
reads the rank's FP8 rows and scale rows, bitwise as stored; what the worker does not run is
refused by the header check before the rendezvous, in one line naming the file, tensor or
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.sharded import load_sharded  # noqa: E402
from dwdp.worker.loading.validate import CheckpointError, load_config, validate_checkpoint  # noqa: E402
from dwdp.worker.models import adapter_for  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint  # noqa: E402

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 3, 11]])


def _fp8(tmp_path: Path, arch: str, *, moe_width: int = 128, num_experts: int = 4) -> Path:
    src = make_checkpoint(arch, tmp_path / f"{arch}-src", num_experts=num_experts, seed=3,
                          hidden_size=256, moe_width=moe_width, dtype="bfloat16")
    return quantize_checkpoint(src, tmp_path / f"{arch}-fp8")


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {arch: _fp8(root, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_answers_as_the_dequantized_checkpoint(fp8_checkpoints, tmp_path, arch):
    fp8 = fp8_checkpoints[arch]
    model, _ = load_checkpoint(fp8)
    reference, _ = load_checkpoint(dequantize_checkpoint(fp8, tmp_path / "bf16"))
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj_scale_inv"))
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.bfloat16  # the output head is not converted
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_sharded_fp8_load_reads_the_ranks_rows_as_stored(fp8_checkpoints, arch):
    path = fp8_checkpoints[arch]
    adapter = adapter_for(load_config(path))
    partition = expert_partition(4, 2)
    model, _, rows = load_sharded(path, adapter=adapter, partition=partition, rank=1)
    stored = load_file(str(path / "model.safetensors"))
    layer = adapter.moe_layers(model)[0]
    tables = rows.tables[layer.prefix]
    assert set(tables) == {"gate_up_proj", "down_proj", "gate_up_proj_scale_inv",
                           "down_proj_scale_inv"}
    names = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    for table, parts in names.items():
        for suffix, got in (("weight", tables[table]),
                            ("weight_scale_inv", tables[table + "_scale_inv"])):
            want = torch.stack([
                torch.cat([stored[f"{layer.prefix}.mlp.experts.{e}.{p}.{suffix}"] for p in parts])
                for e in range(2, 4)])
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8))
    attention = model.get_submodule(f"{layer.prefix}.self_attn")
    weight = next(m for m in attention.modules() if hasattr(m, "weight_scale_inv"))
    assert weight.weight.dtype == torch.float8_e4m3fn


def _edit(path: Path, *, config=None, tensors=None) -> Path:
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        config(raw)
        (path / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        stored = load_file(str(path / "model.safetensors"))
        tensors(stored)
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "mxfp4", "bitsandbytes"])
def test_a_quantization_the_worker_does_not_run_is_refused(tmp_path, method):
    path = _edit(_fp8(tmp_path, "qwen3_moe"),
                 config=lambda c: c["quantization_config"].update(quant_method=method))
    line = _refusal(path)
    assert "config.json" in line and f"quant_method: {method!r}" in line
    assert "'fp8'" in line and "[128, 128]" in line and "bfloat16" in line


@pytest.mark.parametrize(("edit", "said"), [
    (lambda c: c.update(quantization_config="fp8"),
     "quantization_config: 'fp8' is not a mapping"),
    (lambda c: c["quantization_config"].pop("quant_method"),
     "quantization_config.quant_method: missing"),
])
def test_a_quantization_config_of_the_wrong_form_is_refused(tmp_path, edit, said):
    line = _refusal(_edit(_fp8(tmp_path, "qwen3_moe"), config=edit))
    assert "config.json" in line and said in line


@pytest.mark.parametrize(("field", "value", "said"), [
    ("weight_block_size", [64, 64], "weight_block_size: [64, 64]"),
    ("activation_scheme", "static", "activation_scheme: 'static'"),
    ("fmt", "e5m2", "fmt: 'e5m2'"),
])
def test_an_fp8_setting_the_kernels_do_not_run_is_refused(tmp_path, field, value, said):
    path = _edit(_fp8(tmp_path, "deepseek_v3"),
                 config=lambda c: c["quantization_config"].update({field: value}))
    assert said in _refusal(path)


def test_a_weight_without_its_scale_is_refused(tmp_path):
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    path = _edit(_fp8(tmp_path, "qwen3_moe"), tensors=lambda t: t.pop(key))
    line = _refusal(path)
    assert f"tensor {key} is missing" in line


def test_an_expert_scale_of_the_wrong_shape_is_refused(tmp_path):
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"

    def widen(t):
        t[key] = torch.ones(t[key].shape[0], t[key].shape[1] + 1)

    line = _refusal(_edit(_fp8(tmp_path, "qwen3_moe"), tensors=widen))
    assert f"tensor {key} has shape [2, 2], expected [2, 1]" in line


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize(("key", "sharded"), [
    ("model.layers.1.self_attn.o_proj.weight_scale_inv", False),  # a dense linear's, whole
    ("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv", True),  # rank 1's expert rows
])
def test_a_scale_that_is_not_finite_and_positive_is_refused_at_load(tmp_path, bad, key,
                                                                     sharded):
    """A damaged scale (NaN, infinity, zero, negative) would make its block's products
    garbage: the load refuses it in one line naming the tensor, the first bad index (in the
    checkpoint's expert rows) and the value, whole or as the rank holding that expert."""
    def damage(t):
        t[key][1, 0] = bad

    path = _edit(_fp8(tmp_path, "qwen3_moe"), tensors=damage)
    with pytest.raises(CheckpointError) as info:
        if sharded:  # experts 2-3 are rank 1's of 2; the fused table names the expert row
            load_sharded(path, adapter=adapter_for(load_config(path)),
                         partition=expert_partition(4, 2), rank=1)
        else:
            load_checkpoint(path)
    line = str(info.value)
    assert "\n" not in line and "finite and positive" in line and f"scale {bad}" in line
    if sharded:
        assert "experts.down_proj_scale_inv" in line and "index (3, 1, 0)" in line, line
    else:
        assert key in line and "index (1, 0)" in line, line


def test_experts_narrower_than_a_block_are_refused(tmp_path):
    line = _refusal(_fp8(tmp_path, "deepseek_v3", moe_width=64))
    assert "moe_intermediate_size" in line and "64" in line and "128" in line


def test_modules_not_converted_keep_their_dtype(tmp_path):
    src = make_checkpoint("qwen3_moe", tmp_path / "src", num_experts=4, seed=3, hidden_size=256,
                          moe_width=128, dtype="bfloat16")
    kept = "model.layers.1.self_attn.o_proj.weight"
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", not_convert=[kept])
    model, _ = load_checkpoint(fp8)
    o_proj = model.get_submodule("model.layers.1.self_attn.o_proj")
    assert o_proj.weight.dtype == torch.bfloat16 and not hasattr(o_proj, "weight_scale_inv")
    reference, _ = load_checkpoint(dequantize_checkpoint(fp8, tmp_path / "bf16"))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
