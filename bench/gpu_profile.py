"""Where one GPU's time goes in a prefill forward and in a decode step (replicated weights).

One process, one GPU: it writes the seeded Qwen3-MoE checkpoint of ``bench/gpu_forward.py``
(``--layers`` layers of 128 experts, hidden 2048, bf16), then with ``torch.profiler``:
- one prefill forward of ``--tokens`` tokens (one sequence);
- decode steps at each batch size of ``--batches`` (one new token per sequence, a
  ``DynamicCache`` of a 128-token prompt per sequence), timed wall-clock with a device sync
  and profiled once.
For each it reports wall time, GPU busy time, the operators that spend the most GPU time (self
time, by ATen operator and input shapes) and the host time per step, so that a slow step says
whether it waits on the host (launch overhead, syncs) or on kernels. ``--experts`` picks what
to compare: ``dwdp`` (the worker's GPU path, ``dwdp.worker.gpu.cuda_path``; ``dwdp-eager``
the same without its ``torch.compile``-d kernels) and
transformers' own experts implementations (``grouped_mm``, ``batched_mm``, ``eager``) with its
SDPA attention.

Usage: python bench/gpu_profile.py [--layers 4] [--tokens 8192] [--batches 1,32]
                                   [--experts dwdp,grouped_mm] [--out bench/results]
Writes OUT/gpu_profile.json and OUT/gpu_profile.txt.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import load, write_result


def _profile(fn) -> dict:
    """Wall, GPU busy and the top operators (self device time) of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        dev = getattr(e, "self_device_time_total", 0) or 0
        if dev > 0:
            rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count,
                         "self_device_ms": dev / 1e3, "self_cpu_ms": e.self_cpu_time_total / 1e3})
    rows.sort(key=lambda r: -r["self_device_ms"])
    busy = sum(r["self_device_ms"] for r in rows)
    return {"wall_ms": wall * 1e3, "device_busy_ms": busy, "top_ops": rows[:15]}


def _decode(model, batch: int, steps: int) -> tuple[float, dict]:
    """Median wall seconds of one decode step at ``batch`` sequences, and its profile."""
    import statistics

    import torch
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ids = torch.randint(0, vocab, (batch, 128), device="cuda")
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []

        def step():
            nonlocal nxt
            o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = o.logits[:, -1:].argmax(-1)

        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        prof = _profile(step)
        prof["host_profile"] = _host_profile(step)
    return statistics.median(times[2:]), prof


def _host_profile(fn, top: int = 25) -> str:
    """cProfile of three calls of ``fn`` (a device sync after each): the host functions that
    take the most cumulative time, as pstats prints them."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def run(args: argparse.Namespace, ckpt: Path) -> dict:
    import torch

    result: dict = {}
    for impl in args.experts.split(","):
        if impl.startswith("dwdp"):  # the worker's GPU path (dwdp.worker.gpu.cuda_path)
            model, _tok, _ = load(str(ckpt), kernels="fused" if impl == "dwdp" else "eager")
        else:  # transformers' own
            model, _tok, _ = load(str(ckpt), kernels="transformers")
            model.set_experts_implementation(impl)
        row: dict = {"experts_implementation": model.config._experts_implementation,
                     "decode": {}}
        if args.tokens:
            ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
            with torch.inference_mode():
                for _ in range(2):
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                row["prefill"] = _profile(partial(model, input_ids=ids, use_cache=False,
                                                  logits_to_keep=1))
        for b in (int(x) for x in args.batches.split(",")):
            step_s, prof = _decode(model, b, steps=8)
            row["decode"][str(b)] = {"step_ms": step_s * 1e3, **prof}
        result[impl] = row
        print(f"{impl}: decode "
              + ", ".join(f"b{b} {d['step_ms']:.1f} ms" for b, d in row["decode"].items()),
              flush=True)
        del model
        torch.cuda.empty_cache()
    return result


def _report(result: dict, args: argparse.Namespace) -> str:
    lines = [f"Qwen3-MoE {args.layers} layers, prefill {args.tokens} tokens, one H200, replicated"]
    for impl, row in result.items():
        parts = [("prefill", row["prefill"])] if "prefill" in row else []
        parts += [(f"decode b{b}", d) for b, d in row["decode"].items()]
        for label, p in parts:
            step = f" step {p['step_ms']:.2f} ms" if "step_ms" in p else ""
            lines.append(f"[{impl}] {label}: wall {p['wall_ms']:.2f} ms (profiled),{step} "
                         f"device busy {p['device_busy_ms']:.2f} ms")
            for op in p["top_ops"][:8]:
                lines.append(f"    {op['self_device_ms']:8.3f} ms  x{op['calls']:<4} "
                             f"{op['op']} {op['shapes']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape, write_qwen3_moe_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="prefill tokens; 0: no prefill")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--experts", default="dwdp,dwdp-eager,grouped_mm")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dwdp-gpu-profile-"))
    try:
        ckpt = write_qwen3_moe_checkpoint(work / "ck", Qwen3MoeShape(num_layers=args.layers),
                                          seed=3, device="cuda:0")
        result = run(args, ckpt)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args, "gpu_profile", _report(result, args), {"rows": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
