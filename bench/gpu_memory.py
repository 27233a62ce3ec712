"""Device memory per rank on one GPU: replicated, expert DWDP and expert + dense DWDP.

One run: it writes a seeded Qwen3-MoE checkpoint (``write_qwen3_moe_checkpoint``, drawn on the
GPU; by default 17 layers of 128 experts of width 768, hidden 2048, bf16: 21 GB), runs the
replicated model alone, then ``--world`` DWDP rank processes sharing the GPU through POSIX
fds, each attaching expert DWDP and then expert + dense DWDP
(``dwdp_dev.worker.memory_probe``), and deletes the checkpoint. Reported per rank and
configuration, in GB: the weights the rank holds outside DWDP's buffers (the replicated
part), the stores (VMM, ``cuMemCreate``; expert and dense), the slots, torch's peak and
reserved bytes, and the KV pool in tokens the worker sizes after the commit
(``dwdp.worker.memory.size_rank_memory``, default ``kvCache``), with its gain over the
replicated rank's. Every rank is sized as if it
had the device to itself (in a deployment each rank has its own GPU); the numbers are
per-process counters, so the ranks sharing the GPU here do not see each other's memory.

Usage: python bench/gpu_memory.py [--layers 17] [--world 4] [--slots 2] [--max-tokens 8]
                                  [--seed 3] [--out bench/results] [--workdir DIR] [--keep]
Writes OUT/gpu_memory.json and OUT/gpu_memory.txt (the printed table); exits 1 when a DWDP
rank's tokens differ from the replicated model's. ``--layers 4`` gives a 5 GB checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

GB = 1e9


def _row(config_name: str, rank: object, rec: dict, base: int | None) -> dict:
    resident = rec["resident"]
    tokens = rec["kv_pool"]["capacity_tokens"]
    return {
        "config": config_name,
        "rank": rank,
        "range": rec["range"],
        "weights": rec["weights"],
        "loaded_weights": rec["loaded_weights"],
        "expert_store": resident.get("expert", {}).get("store_allocated_bytes", 0),
        "dense_store": resident.get("dense", {}).get("store_allocated_bytes", 0),
        "slots": rec["slots"],
        "torch_peak": rec["peak"],
        "torch_reserved": rec["reserved"],
        "headroom": rec["ledger"]["activations_headroom"]["device"],
        "kv_pool_bytes": rec["kv_pool"]["bytes"],
        "kv_tokens": tokens,
        "kv_gain_tokens": None if base is None else tokens - base,
        "tokens_equal_replicated": None,
    }


def _table(rows: list[dict], head: str) -> str:
    lines = [
        head,
        f"{'config':>12} {'rank':>4} {'range':>9} {'weights':>8} {'exp st':>7} {'dns st':>7} "
        f"{'slots':>7} {'peak':>7} {'resvd':>7} {'KV tokens':>10} {'gain':>9} {'same':>5}",
    ]
    for r in rows:
        rng = "-" if r["range"] is None else f"{tuple(r['range'])}"
        gain = "" if r["kv_gain_tokens"] is None else f"{r['kv_gain_tokens']:+d}"
        same = "" if r["tokens_equal_replicated"] is None else str(r["tokens_equal_replicated"])
        lines.append(
            f"{r['config']:>12} {r['rank']!s:>4} {rng:>9} {r['weights'] / GB:>8.3f} "
            f"{r['expert_store'] / GB:>7.3f} {r['dense_store'] / GB:>7.3f} "
            f"{r['slots'] / GB:>7.3f} {r['torch_peak'] / GB:>7.3f} "
            f"{r['torch_reserved'] / GB:>7.3f} {r['kv_tokens']:>10} {gain:>9} {same:>5}"
        )
    lines.append("(GB; weights: the rank's tensors outside DWDP's buffers; st: VMM stores; KV "
                 "tokens: the worker's pool (dwdp.worker.memory.size_rank_memory, kvCache "
                 "defaults): 0.9 x (device total - torch allocated - stores - activation "
                 "headroom of an 8192-token forward) / bytes per token)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=17, help="MoE layers (17: 21 GB)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default="bench/results", help="folder for gpu_memory.{json,txt}")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    args = ap.parse_args(argv)

    import torch

    from dwdp_dev.worker.large_checkpoint import (
        Qwen3MoeShape,
        checkpoint_sizes,
        write_qwen3_moe_checkpoint,
    )
    from dwdp_dev.worker.memory_probe import SCENARIOS, run_probes

    work = Path(tempfile.mkdtemp(prefix="dwdp-gpu-memory-", dir=args.workdir))
    try:
        ckpt = write_qwen3_moe_checkpoint(work / "ck", Qwen3MoeShape(num_layers=args.layers),
                                          seed=args.seed, device="cuda:0")
        torch.cuda.empty_cache()
        sizes = checkpoint_sizes(ckpt)
        (work / "probe").mkdir()
        reference, ranks = run_probes(ckpt, work / "probe", world=args.world,
                                      slots=args.slots, max_tokens=args.max_tokens)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    per_token = reference["kv_pool"]["bytes_per_token"]
    base = _row("replicated", "each", reference, None)
    rows = [base]
    for index, scenario in enumerate(SCENARIOS):
        for rank, records in enumerate(ranks):
            row = _row(scenario, rank, records[index], base["kv_tokens"])
            row["tokens_equal_replicated"] = records[index]["tokens"] == reference["tokens"]
            rows.append(row)
    head = (
        f"Qwen3-MoE {args.layers} layers x 128 experts (hidden 2048, width 768, bf16): "
        f"{sizes['full'] / GB:.2f} GB (experts {sizes['experts'] / GB:.2f}); {args.world} ranks "
        f"on one {torch.cuda.get_device_name(0)} "
        f"({reference['device_total'] / GB:.1f} GB), {args.slots} slots; KV "
        f"{per_token} B/token"
    )
    text = _table(rows, head)
    result = {
        "bench": "gpu_memory",
        "host": platform.node(),
        "device": torch.cuda.get_device_name(0),
        "args": vars(args),
        "checkpoint_bytes": sizes,
        "kv_bytes_per_token": per_token,
        "rows": rows,
        "replicated_tokens": reference["tokens"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_memory.txt").write_text(text + "\n")
    print(text)
    print(f"(JSON: {out / 'gpu_memory.json'})")
    return 0 if all(r["tokens_equal_replicated"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
