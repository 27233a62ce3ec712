"""The header check before the rendezvous (``validate_checkpoint``) refuses an expert count
other than config.json's, a tensor of the wrong shape and one of the wrong dtype, each in
one line naming the file and the tensor (every rank reads the same headers: all refuse
alike)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from dwdp.worker.loading.validate import (  # noqa: E402
    INDEX_FILE,
    CheckpointError,
    validate_checkpoint,
)
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

# the routed-expert field of config.json as make_checkpoint's save_pretrained writes it, and
# the on-disk names of an expert's gate and up matrices (stacked into gate_up_proj, up last)
ARCHS = {
    "qwen3_moe": ("num_local_experts", "model.layers.{l}.mlp.experts.{e}.{m}_proj.weight",
                  ("gate", "up")),
    "deepseek_v3": ("n_routed_experts", "model.layers.{l}.mlp.experts.{e}.{m}_proj.weight",
                    ("gate", "up")),
    "mixtral": ("num_local_experts", "model.layers.{l}.block_sparse_moe.experts.{e}.{m}.weight",
                ("w1", "w3")),
}


def _refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(path)
    line = str(info.value)
    assert "\n" not in line
    return line


def _with_config_of(weights: Path, config: Path, dst: Path) -> Path:
    """``weights``' checkpoint with ``config``'s config.json."""
    shutil.copytree(weights, dst)
    shutil.copy(config / "config.json", dst / "config.json")
    return dst


def _first_moe_layer(path: Path) -> int:
    names = load_file(str(path / "model.safetensors")).keys()
    return min(int(n.split(".")[2]) for n in names if ".experts." in n)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_more_experts_on_disk_than_config_says(tmp_path, arch):
    six = make_checkpoint(arch, tmp_path / "six", num_experts=6, seed=1)
    five = make_checkpoint(arch, tmp_path / "five", num_experts=5, seed=1)
    path = _with_config_of(six, five, tmp_path / "bad")
    field, pattern, (gate, _up) = ARCHS[arch]
    tensor = pattern.format(l=_first_moe_layer(six), e=5, m=gate)
    assert _refusal(path) == (
        f"checkpoint {path / 'model.safetensors'}: tensor {tensor} is expert 5 (counting from "
        f"0) where config.json gives 5 ({field})"
    )


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fewer_experts_on_disk_than_config_says(tmp_path, arch):
    five = make_checkpoint(arch, tmp_path / "five", num_experts=5, seed=1)
    six = make_checkpoint(arch, tmp_path / "six", num_experts=6, seed=1)
    path = _with_config_of(five, six, tmp_path / "bad")
    field, pattern, (gate, up) = ARCHS[arch]
    layer = _first_moe_layer(five)
    assert _refusal(path) == (
        f"checkpoint {path}: tensor {pattern.format(l=layer, e=5, m=gate)} is missing: the "
        f"checkpoint holds 5 experts (the last, {pattern.format(l=layer, e=4, m=up)}, in "
        f"model.safetensors) where config.json gives 6 ({field})"
    )


def test_fused_table_of_another_expert_count(tmp_path):
    six = make_checkpoint("qwen3_moe", tmp_path / "six", num_experts=6, seed=1)
    five = make_checkpoint("qwen3_moe", tmp_path / "five", num_experts=5, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(six))
    path = _with_config_of(six, five, tmp_path / "bad")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    table = f"model.layers.{_first_moe_layer(six)}.mlp.experts.gate_up_proj"
    got = list(state[table].shape)
    assert got[0] == 6
    assert _refusal(path) == (
        f"checkpoint {path / 'model.safetensors'}: tensor {table} has shape {got}: 6 experts "
        f"where config.json gives 5 (num_local_experts)"
    )


@pytest.fixture
def indexed(tmp_path):
    """A Qwen3-MoE checkpoint in several shard files with an index."""
    path = make_checkpoint("qwen3_moe", tmp_path / "ix", num_experts=4, hidden_size=64,
                           moe_width=64, max_shard_size="50KB")
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    return path, weight_map


def _rewrite(path: Path, weight_map: dict, tensor: str, change) -> str:
    file = weight_map[tensor]
    tensors = load_file(str(path / file))
    tensors[tensor] = change(tensors[tensor])
    save_file(tensors, str(path / file), metadata={"format": "pt"})
    return file


@pytest.mark.parametrize("tensor", [
    "model.layers.2.self_attn.o_proj.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight",
])
def test_wrong_shape_names_the_shard_file_and_tensor(indexed, tensor):
    path, weight_map = indexed
    want = list(load_file(str(path / weight_map[tensor]))[tensor].shape)
    file = _rewrite(path, weight_map, tensor, lambda t: t[:, :-1].contiguous())
    got = [want[0], want[1] - 1]
    assert _refusal(path) == (
        f"checkpoint {path / file}: tensor {tensor} has shape {got}, expected {want}"
    )


@pytest.mark.parametrize("tensor", [
    "model.norm.weight",
    "model.layers.1.mlp.experts.0.gate_proj.weight",
])
def test_wrong_dtype_names_the_shard_file_and_tensor(indexed, tensor):
    path, weight_map = indexed
    file = _rewrite(path, weight_map, tensor, lambda t: t.to(torch.bfloat16))
    assert _refusal(path) == (
        f"checkpoint {path / file}: tensor {tensor} has dtype bfloat16, expected float32"
    )


def test_the_field_is_named_as_config_json_spells_it(tmp_path):
    """Qwen3-MoE's own checkpoints spell the count ``num_experts`` (transformers aliases it)."""
    six = make_checkpoint("qwen3_moe", tmp_path / "six", num_experts=6, seed=1)
    five = make_checkpoint("qwen3_moe", tmp_path / "five", num_experts=5, seed=1)
    path = _with_config_of(six, five, tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(config))
    assert _refusal(path).endswith("where config.json gives 5 (num_experts)")
