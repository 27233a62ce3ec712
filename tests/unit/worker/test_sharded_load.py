"""Sharded loading (``dwdp.worker.loading.sharded``): a rank's tensors equal the whole load's,
it reads only its expert rows, and a broken checkpoint is refused with one line naming the
file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from dwdp.api.partition import ExpertPartition, expert_partition  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.sharded import load_sharded  # noqa: E402
from dwdp.worker.loading.validate import (  # noqa: E402
    INDEX_FILE,
    CheckpointError,
    load_config,
    validate_checkpoint,
)
from dwdp.worker.models import require_adapter  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
NUM_EXPERTS = 6


def _load(path, rank: int, partition: ExpertPartition, dtype: str = "auto"):
    adapter = require_adapter(load_config(path), dense=False)
    return load_sharded(path, adapter=adapter, partition=partition, rank=rank, dtype=dtype)


def _assert_matches_whole(path, partition: ExpertPartition, rank: int, dtype: str = "auto"):
    whole, _ = load_checkpoint(path, dtype=dtype)
    model, _tok, loaded = _load(path, rank, partition, dtype)
    start, end = partition.ranges[rank]
    assert (loaded.start, loaded.end) == (start, end)
    adapter = require_adapter(whole, dense=False)
    managed = {m.prefix: m for m in adapter.moe_layers(whole)}
    assert set(loaded.tables) == set(managed)
    for prefix, m in managed.items():
        for name, table in m.expert_tensors().items():
            rows = loaded.tables[prefix][name]
            assert rows.dtype == table.dtype and torch.equal(rows, table[start:end]), name
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    want = dict(whole.named_parameters()) | dict(whole.named_buffers())
    assert set(got) == set(want)
    for name, tensor in want.items():
        if got[name].is_meta:  # a managed expert table: only its rows were read
            assert name.endswith(("experts.gate_up_proj", "experts.down_proj")), name
            assert got[name].shape == tensor.shape
            continue
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_rank_reads_its_rows_and_every_other_tensor(tmp_path, arch, dtype):
    path = make_checkpoint(arch, tmp_path / arch, num_experts=NUM_EXPERTS, seed=2, dtype=dtype)
    partition = expert_partition(NUM_EXPERTS, 4)  # 2, 2, 1, 1
    for rank in (0, 3):
        _assert_matches_whole(path, partition, rank)


def test_a_cast_dtype_is_the_whole_loads(tmp_path):
    path = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=NUM_EXPERTS, dtype="bfloat16")
    _assert_matches_whole(path, expert_partition(NUM_EXPERTS, 2), 1, dtype="float32")


def test_redundant_ranges_overlap(tmp_path):
    path = make_checkpoint("mixtral", tmp_path / "m", num_experts=NUM_EXPERTS)
    partition = expert_partition(NUM_EXPERTS, 2, experts_per_worker=4, prefetch_experts=2)
    assert str(partition.kind) == "redundant" and partition.ranges == ((0, 4), (2, 6))
    _assert_matches_whole(path, partition, 1)


def test_fused_tensors_on_disk_and_an_index(tmp_path):
    """A checkpoint that stores the fused [E, 2I, H] / [E, H, I] tables, split over two
    files with an index, loads the same rows."""
    src = make_checkpoint("deepseek_v3", tmp_path / "src", num_experts=NUM_EXPERTS, seed=4)
    whole, _ = load_checkpoint(src)
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    (fused / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in whole.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for file, part in (("a.safetensors", names[:half]), ("b.safetensors", names[half:])):
        save_file({k: state[k] for k in part}, str(fused / file))
        weight_map |= dict.fromkeys(part, file)
    (fused / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert any(k.endswith("experts.gate_up_proj") for k in weight_map)
    _assert_matches_whole(fused, expert_partition(NUM_EXPERTS, 4), 1)


@pytest.fixture
def indexed(tmp_path):
    """A Qwen3-MoE checkpoint in several files with an index."""
    path = make_checkpoint("qwen3_moe", tmp_path / "ix", num_experts=NUM_EXPERTS, hidden_size=64,
                           moe_width=64, max_shard_size="50KB")
    assert (path / INDEX_FILE).is_file()
    return path


def _one_line(exc_info) -> str:
    line = str(exc_info.value)
    assert "\n" not in line
    return line


def test_a_shard_file_the_index_names_is_missing(indexed):
    weight_map = json.loads((indexed / INDEX_FILE).read_text())["weight_map"]
    file = sorted(set(weight_map.values()))[-1]
    (indexed / file).unlink()
    with pytest.raises(CheckpointError) as exc_info:
        validate_checkpoint(indexed)
    line = _one_line(exc_info)
    assert f"shard file {file} named by {INDEX_FILE}" in line and "is missing" in line
    named = line.split("(tensor ")[1].split(")")[0]
    assert weight_map[named] == file
    with pytest.raises(CheckpointError):
        _load(indexed, 0, expert_partition(NUM_EXPERTS, 2))


def test_a_missing_expert_tensor_is_named(indexed):
    weight_map = json.loads((indexed / INDEX_FILE).read_text())["weight_map"]
    gone = "model.layers.1.mlp.experts.4.up_proj.weight"
    file = indexed / weight_map[gone]
    tensors = load_file(str(file))
    del tensors[gone]
    save_file(tensors, str(file), metadata={"format": "pt"})
    del weight_map[gone]
    (indexed / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as exc_info:
        _load(indexed, 1, expert_partition(NUM_EXPERTS, 2))  # rank 1 keeps experts 3..5
    line = _one_line(exc_info)
    assert f"tensor {gone} is missing" in line and str(indexed) in line


def test_a_file_without_the_tensor_the_index_gives_it(indexed):
    index = json.loads((indexed / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    tensor = next(k for k, v in sorted(weight_map.items()) if v == files[0])
    weight_map[tensor] = files[1]
    (indexed / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc_info:
        validate_checkpoint(indexed)
    line = _one_line(exc_info)
    assert f"shard file {files[1]} does not hold tensor {tensor}" in line
