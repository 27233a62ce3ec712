"""Sharded loading on one H200: each of 4 DWDP ranks sharing the GPU holds its quarter of a
21 GB Qwen3-MoE checkpoint's experts, not the checkpoint, and answers as the replicated model.

The checkpoint (``write_qwen3_moe_checkpoint``, drawn on the GPU, written once for the module
and deleted after): hidden 2048, 17 MoE layers of 128 experts of width 768, top-8, bf16, 18
safetensors files with an index, in ``save_pretrained``'s layout (one tensor per expert
matrix). Every process is a fresh interpreter (``dwdp_dev.worker.memory_probe``): first
the replicated reference alone (``load_checkpoint`` + ``.to(cuda)``, the worker's path
without DWDP), which exits before the ranks start; then 4 rank processes on cuda:0 that share
their stores through POSIX fds and, in turn, load through ``load_sharded`` and attach expert
DWDP, then expert + dense DWDP, generating greedily each time. Every number is a per-process
counter, so the ranks sharing the device do not see each other's memory.

Per rank and scenario: device peak = torch's ``max_memory_allocated`` (reset when the
scenario starts: the model, the expert and dense slots, which are torch allocations,
activations) + the VMM stores (``cuMemCreate``, which torch does not count; granularity-
rounded). Bound = 1.1 x (replicated part + experts/4 + slots (+ the dense store with dense
DWDP) + the serving engine's KV pool, which the generation allocates), where the replicated
part is what the rank's model holds after the load (checked to be the checkpoint's
non-expert bytes) and experts/4 the checkpoint's expert bytes of the rank's range.
"""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dwdp_dev.worker.large_checkpoint import (  # noqa: E402
    Qwen3MoeShape,
    checkpoint_sizes,
    write_qwen3_moe_checkpoint,
)
from dwdp_dev.worker.memory_probe import SCENARIOS, run_probes  # noqa: E402

pytestmark = pytest.mark.timeout(900)

WORLD = 4
SHAPE = Qwen3MoeShape()  # 17 layers: 21.2 GB
SLACK = 1.1
GB = 1e9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    try:
        path = write_qwen3_moe_checkpoint(root / "ckpt", SHAPE, seed=3, device="cuda:0")
        torch.cuda.empty_cache()
        yield path
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 21 GB on a 64 GB disk


@pytest.fixture(scope="module")
def records(checkpoint, tmp_path_factory) -> dict:
    reference, ranks = run_probes(checkpoint, tmp_path_factory.mktemp("probe"), world=WORLD)
    return {"replicated": reference, "ranks": ranks}


def _bound(rec: dict, sizes: dict[str, int]) -> tuple[int, int]:
    """(experts/4 of the rank's range, the bound) of one rank's record."""
    start, end = rec["range"]
    share = sizes["experts"] * (end - start) // SHAPE.num_experts
    dense_store = rec["resident"].get("dense", {}).get("store_allocated_bytes", 0)
    held = rec["loaded_weights"] + share + rec["slots"] + dense_store + rec["kv_cache"]
    return share, int(SLACK * held)


def _table(scenario: str, rows: list[dict], sizes: dict[str, int], ref: dict) -> str:
    lines = [
        f"\n{scenario} DWDP, {WORLD} ranks on one GPU; checkpoint {sizes['full'] / GB:.2f} GB "
        f"(experts {sizes['experts'] / GB:.2f}, replicated {sizes['replicated'] / GB:.3f}); "
        f"replicated reference: peak {ref['peak'] / GB:.2f} GB",
        f"{'rank':>4} {'range':>9} {'load pk':>8} {'torch pk':>8} {'VMM':>7} {'slots':>7} "
        f"{'repl':>7} {'held':>7} {'exp/4':>7} {'dev pk':>7} {'bound':>7} {'pk/bd':>6}  (GB)",
    ]
    for rank, rec in enumerate(rows):
        share, bound = _bound(rec, sizes)
        peak = rec["peak"] + rec["vmm"]
        lines.append(
            f"{rank:>4} {tuple(rec['range'])!s:>9} {rec['load_peak'] / GB:>8.3f} "
            f"{rec['peak'] / GB:>8.3f} {rec['vmm'] / GB:>7.3f} {rec['slots'] / GB:>7.3f} "
            f"{rec['loaded_weights'] / GB:>7.3f} {rec['weights'] / GB:>7.3f} "
            f"{share / GB:>7.3f} {peak / GB:>7.3f} {bound / GB:>7.3f} {peak / bound:>6.3f}"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_rank_holds_its_share_and_answers_as_replicated(records, checkpoint, scenario):
    sizes = checkpoint_sizes(checkpoint)
    assert sizes["full"] >= 20 * GB
    ref = records["replicated"]
    assert ref["peak"] >= sizes["full"]  # the reference really holds the whole checkpoint
    index = SCENARIOS.index(scenario)
    rows = [per_rank[index] for per_rank in records["ranks"]]
    print(_table(scenario, rows, sizes, ref))
    print("KV pool tokens: replicated", ref["kv_pool"]["capacity_tokens"], "| ranks",
          [r["kv_pool"]["capacity_tokens"] for r in rows])
    for rank, rec in enumerate(rows):
        assert rec["scenario"] == scenario and rec["leaks"] == 0
        share, bound = _bound(rec, sizes)
        # the bound's replicated part is the checkpoint's non-expert bytes (+ rotary buffers)
        assert sizes["replicated"] <= rec["loaded_weights"] <= sizes["replicated"] + (1 << 20)
        assert rec["resident"]["expert"]["store_allocated_bytes"] >= share  # counted as VMM
        assert rec["peak"] + rec["vmm"] <= bound, (rank, rec["peak"], rec["vmm"], bound)
        assert rec["peak"] + rec["vmm"] < sizes["full"] / 2
        if scenario == "expert+dense":  # the dense weights were sharded after the load
            assert rec["weights"] < rec["loaded_weights"]
        assert rec["tokens"] == ref["tokens"], rank
        # what DWDP freed became KV cache: the worker's pool (sized after the commit, as
        # on a GPU of the rank's own) holds more tokens than the replicated rank's
        pool, base = rec["kv_pool"], ref["kv_pool"]
        assert pool["bytes_per_token"] == base["bytes_per_token"]
        freed = ref["weights"] - rec["weights"] - rec["vmm"] - rec["slots"]
        assert freed > sizes["experts"] / 2
        assert pool["capacity_tokens"] > base["capacity_tokens"], (rank, pool, base)
        ledger = rec["ledger"]
        assert ledger["expert_store"]["device"] == rec["resident"]["expert"][
            "store_allocated_bytes"]
        assert ledger["replicated_weights"]["device"] == rec["weights"]
        assert ledger["kv_pool"]["device"] == pool["bytes"]
