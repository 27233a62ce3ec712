"""Sharded loading on 4 real rank processes: each rank's peak resident memory holds its
quarter of the experts, not the whole checkpoint, and the ranks answer as the replicated model.

A Qwen3-MoE checkpoint of 16 experts of 1.5 MiB (bf16, hidden 256, expert width 1024) in 8 MoE
layers (192 MiB of experts, split over several safetensors files with an index), and the same
weights in block-scaled FP8 (96 MiB of experts and their scales, the same files and index).
Every process is a fresh interpreter (``_memory_rank.py``); a baseline process that imports
what a rank imports, checks the headers, builds the meta-device model and the tokenizer, and
reads no weight, gives the interpreter's own peak. The ranks load through
``load_sharded`` and set expert DWDP up through ``attach`` (as the worker does), the reference
process through ``load_checkpoint`` (the whole model, as before).

The bound, per rank (``B`` = 24 MiB: allocator slack, library pages touched for the first
time, the tokenizer, one expert in flight):
- after the load: replicated + its expert range + B;
- after setup: replicated + its expert rows (freed at the repoint, but part of the peak) +
  the 2 slots + every rank's store (on the cpu backend the stores are shared-memory files
  that the gather maps and reads, so their pages count in every rank's resident set; on a
  GPU a peer's store is not the rank's memory) + B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from conftest import read_records  # noqa: E402
from ports import free_port  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.backend.cpu import leftover_segments  # noqa: E402
from dwdp.worker.loading.validate import INDEX_FILE, read_headers  # noqa: E402
from dwdp.worker.transport.base import make_secret_file  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.fp8_checkpoint import quantize_checkpoint  # noqa: E402

WORLD = 4
NUM_EXPERTS = 16
MOE_LAYERS = 8
BOUND = 24 << 20
MIB = 1 << 20
SCRIPT = Path(__file__).parent / "_memory_rank.py"


def _run(out: Path, *args: object) -> list[subprocess.Popen]:
    env = {**os.environ, "DWDP_RENDEZVOUS_SECRET_FILE": str(make_secret_file(out))}
    return [subprocess.Popen([sys.executable, str(SCRIPT), str(a), str(out), *map(str, rest)],
                             env=env)
            for a, *rest in args]


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * len(procs)


@pytest.fixture(scope="module", params=["bfloat16", "fp8"])
def checkpoint(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    path = make_checkpoint("qwen3_moe", root / "ckpt", num_experts=NUM_EXPERTS,
                           num_layers=MOE_LAYERS + 1, hidden_size=256, moe_width=1024,
                           dtype="bfloat16", seed=5, max_shard_size="60MB")
    if request.param == "fp8":  # the same weights block-scaled FP8, same files and index
        path = quantize_checkpoint(path, root / "fp8")
    assert (path / INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


def _sizes(path: Path) -> dict[str, int]:
    elem = {"bfloat16": 2, "float32": 4, "float16": 2, "float8_e4m3fn": 1}
    sizes = {"full": 0, "experts": 0}
    for name, (shape, dtype) in read_headers(path).items():
        nbytes = int(torch.Size(shape).numel()) * elem[dtype]
        sizes["full"] += nbytes
        if ".experts." in name:
            sizes["experts"] += nbytes
    sizes["replicated"] = sizes["full"] - sizes["experts"]
    return sizes


def test_each_rank_peaks_at_its_share_not_the_whole_checkpoint(tmp_path, checkpoint):
    sizes = _sizes(checkpoint)
    matrices = MOE_LAYERS * NUM_EXPERTS * 3 * 256 * 1024
    fp8 = "quantization_config" in (checkpoint / "config.json").read_text()
    # bf16: 192 MiB; FP8: 96 MiB plus one float32 scale per 128x128 block
    assert sizes["experts"] == (matrices + matrices // (128 * 128) * 4 if fp8 else 2 * matrices)
    group = f"m{uuid.uuid4().hex[:10]}"
    port = free_port()
    _wait(_run(tmp_path, ("baseline", checkpoint)))
    _wait(_run(tmp_path, *[("rank", checkpoint, group, port, r) for r in range(WORLD)]))
    assert not leftover_segments(group)
    _wait(_run(tmp_path, ("whole", checkpoint)))
    baseline = json.loads((tmp_path / "baseline.0.json").read_text())["load"]["VmHWM"]
    whole = json.loads((tmp_path / "whole.0.json").read_text())
    records = read_records(tmp_path, "rank", WORLD)
    partition = expert_partition(NUM_EXPERTS, WORLD)
    lines = [f"baseline VmHWM {baseline / MIB:.1f} MiB; checkpoint {sizes['full'] / MIB:.1f} "
             f"MiB (experts {sizes['experts'] / MIB:.1f}, replicated "
             f"{sizes['replicated'] / MIB:.1f}); whole load: VmHWM - baseline "
             f"{(whole['load']['VmHWM'] - baseline) / MIB:.1f} MiB"]
    for rank, rec in enumerate(records):
        start, end = partition.ranges[rank]
        mine = sizes["experts"] * (end - start) // NUM_EXPERTS
        load_peak = rec["load"]["VmHWM"] - baseline
        setup_peak = rec["setup"]["VmHWM"] - baseline
        lines.append(f"rank {rank} [{start}, {end}): load peak {load_peak / MIB:.1f} MiB "
                     f"(bound {(sizes['replicated'] + mine + BOUND) / MIB:.1f}), setup peak "
                     f"{setup_peak / MIB:.1f} MiB (after load RssAnon "
                     f"{rec['load']['RssAnon'] / MIB:.1f}, RssFile "
                     f"{rec['load']['RssFile'] / MIB:.1f}; RssShmem "
                     f"{rec['setup']['RssShmem'] / MIB:.1f}, slots "
                     f"{rec['slot_bytes'] / MIB:.1f})")
        assert rec["store_bytes"] >= mine
        assert load_peak <= sizes["replicated"] + mine + BOUND, lines
        assert load_peak < sizes["full"] / 2, lines
        setup_bound = sizes["replicated"] + mine + rec["slot_bytes"] + sizes["experts"] + BOUND
        assert setup_peak <= setup_bound, lines
        assert rec["tokens"] == whole["tokens"], rank
    # the whole load really holds the whole checkpoint: the difference is unmistakable
    assert whole["load"]["VmHWM"] - baseline >= sizes["full"], lines
    print("\n".join(lines))
