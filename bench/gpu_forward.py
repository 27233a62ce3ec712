"""Prefill forward time and model FLOP utilisation on one GPU: replicated weights against DWDP.

One run: it writes a seeded Qwen3-MoE checkpoint (``write_qwen3_moe_checkpoint``: hidden 2048,
128 experts of width 768, top-8, bf16, ``--layers`` layers), measures the GPU's bf16 matmul
peak (8192^3 GEMMs), then starts ``--world`` rank processes sharing the GPU through POSIX fds.
For every configuration (replicated; expert DWDP; expert + dense DWDP with 2 and 3 slots, each
copy mode and gather kernel) every rank loads the model and attaches DWDP; rank 0 alone times
prefill forwards of 2K, 8K and 16K tokens (one sequence, CUDA events, median of ``--repeats``
after warm-ups) while the others wait at a barrier. FLOPs are counted from the shapes
(projections, causal attention, router, top-k experts; no output head: one logit row), so
``mfu = flops / time / peak``. One forward at 8K tokens of each ``--profile`` configuration
is profiled (``torch.profiler``): busy time per CUDA stream (compute, DWDP's copies), their
overlap, the GEMMs' share of the compute stream (with the bound it puts on what faster GEMMs,
FP8's, can give) and the kernels that take the most time.

Usage: python bench/gpu_forward.py [--layers 8] [--world 4] [--tokens 2048,8192,16384]
                                   [--repeats 5] [--configs NAMES] [--out bench/results]
                                   [--workdir DIR]
Writes OUT/gpu_forward.json and OUT/gpu_forward.txt (the printed table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import add_group_arguments, group_transport, load, run_group, write_result


class Config(NamedTuple):
    """One measured configuration: DWDP (expert, dense), slots, copy mode, gather kernel,
    other ``CopySettings`` fields (``copy``) and the GPU path's kernels (``kernels``, as
    ``gpu_common.load`` takes them)."""

    name: str
    expert: bool = False
    dense: bool = False
    slots: int = 0
    mode: str | None = None
    kernel: str | None = None
    copy: dict | None = None
    kernels: str = "fused"
    fp8: bool = False


CONFIGS = [
    Config("replicated"),
    Config("replicated/compiled-combine", kernels="compiled-combine"),
    Config("expert/2/gather-register", True, False, 2, "gather", "register"),
    Config("dense/2/per_slice", True, True, 2, "per_slice"),
    Config("dense/2/batched", True, True, 2, "batched"),
    Config("dense/2/gather-register", True, True, 2, "gather", "register"),
    Config("dense/2/gather-register/sm-reserve", True, True, 2, "gather", "register",
           {"reserve_model_sms": True}),
    Config("dense/2/gather-register/sm-reserve/16-blocks", True, True, 2, "gather",
           "register", {"reserve_model_sms": True, "gather_blocks": 16}),
    Config("dense/2/gather-register/sm-reserve/8-blocks", True, True, 2, "gather",
           "register", {"reserve_model_sms": True, "gather_blocks": 8}),
    Config("dense/2/gather-register/64-blocks", True, True, 2, "gather", "register",
           {"gather_blocks": 64}),
    Config("dense/3/gather-register/64-blocks", True, True, 3, "gather", "register",
           {"gather_blocks": 64}),
    Config("dense/2/gather-tma", True, True, 2, "gather", "tma"),
    Config("dense/3/gather-register", True, True, 3, "gather", "register"),
    Config("dense/3/batched", True, True, 3, "batched"),
    Config("fp8/replicated", fp8=True),
    Config("fp8/expert/2/gather-register", True, False, 2, "gather", "register", fp8=True),
    Config("fp8/dense/2/gather-register", True, True, 2, "gather", "register", fp8=True),
]
"""``sm-reserve``: the model's persistent GEMMs leave the gather's SMs free while DWDP is
attached (``CopySettings.reserve_model_sms``); ``N-blocks``: the gather's grid
(``gather_blocks``; default ``DEFAULT_GATHER_BLOCKS``); ``compiled-combine``: the experts'
combine through ``torch.compile`` instead of ``moe_combine``'s Triton kernel; ``fp8/``: the
same checkpoint in block-scaled FP8 (``quantize_checkpoint``: experts and attention in FP8 with
128x128 block scales, served through ``fp8_gemm``)."""
PROFILED = "dense/2/gather-register"


def forward_flops(shape, tokens: int) -> float:
    """FLOPs of one prefill forward of ``tokens`` tokens (one sequence), 2 per multiply-add."""
    h, layers = shape.hidden_size, shape.num_layers
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    proj = 2 * tokens * h * (2 * q + 2 * kv)  # q, k, v, o
    attn = 2 * 2 * shape.num_attention_heads * shape.head_dim * tokens * tokens / 2  # causal
    router = 2 * tokens * h * shape.num_experts
    experts = 2 * tokens * shape.num_experts_per_tok * 3 * h * shape.moe_intermediate_size
    return layers * (proj + attn + router + experts)


def matmul_peak() -> float:
    """Measured bf16 GEMM throughput (FLOP/s) of this GPU: best of 20 8192^3 products."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / best


def _time(model, ids, repeats: int) -> float:
    import torch

    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _stream_profile(model, ids) -> dict:
    """Busy seconds per CUDA stream of one forward, and the copy streams' overlap with the
    compute stream (the stream with the most busy time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    spans: dict[int, list[tuple[float, float]]] = {}
    by_kernel: dict[str, float] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e:
            stream = int(e.get("args", {}).get("stream", -1))
            spans.setdefault(stream, []).append((e["ts"], e["ts"] + e["dur"]))
            name = str(e.get("name", "?"))[:200]
            by_kernel[name] = by_kernel.get(name, 0.0) + e["dur"] / 1e6
    busy = {s: sum(b - a for a, b in v) / 1e6 for s, v in spans.items()}
    compute = max(busy, key=busy.get) if busy else -1
    first = min((a for v in spans.values() for a, _ in v), default=0.0)
    last = max((b for v in spans.values() for _, b in v), default=0.0)
    overlap = 0.0
    for s, v in spans.items():
        if s == compute:
            continue
        for a, b in v:
            overlap += sum(max(0.0, min(b, d) - max(a, c)) for c, d in spans[compute]) / 1e6
    copy = sum(t for s, t in busy.items() if s != compute)
    gemm = sum(e["dur"] for e in events if e.get("cat") == "kernel" and "dur" in e
               and int(e.get("args", {}).get("stream", -1)) == compute
               and _is_gemm(str(e.get("name", "")))) / 1e6
    return {
        "wall_s": (last - first) / 1e6,
        "compute_stream": compute,
        "compute_busy_s": busy.get(compute, 0.0),
        "compute_gemm_s": gemm,
        "copy_busy_s": copy,
        "copy_overlapped_s": overlap,
        "copy_overlap_fraction": overlap / copy if copy else None,
        "busy_per_stream_s": {str(s): t for s, t in busy.items()},
        "top_kernels_s": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]),
    }


GEMM_KERNELS = ("gemm", "nvjet", "_grouped_kernel")
"""Name fragments of matrix-multiply kernels (lower case): CUTLASS's and cuBLAS's GEMMs
(``...GemmUniversal...``, ``nvjet_...``, ``sm90_xmma_gemm_...``) and ``fp8_gemm``'s Triton
kernel. cuDNN's attention (``..._wgmma_...``) is not one."""


def _is_gemm(kernel: str) -> bool:
    name = kernel.lower()
    return any(part in name for part in GEMM_KERNELS)


def _copy_bytes_per_layer(model, att) -> float:
    """Bytes DWDP's prefetches move for one forward (2048 tokens), per decoder layer."""
    import torch

    before = att.status()["bytes_moved"]
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize()
    return (att.status()["bytes_moved"] - before) / model.config.num_hidden_layers


def rank_main(args: argparse.Namespace) -> None:
    """One rank process: every configuration in turn (see the module docstring)."""
    import torch

    from dwdp.api.enums import HandleType
    from dwdp.worker.backend.cuda import CudaBackend

    torch.cuda.set_device(0)
    rank, world = args.rank, args.world
    tokens = [int(t) for t in args.tokens.split(",")]
    backend = CudaBackend(device=0, handle_type=HandleType.POSIX_FD)
    results = []
    with group_transport(rank, world, args.group, args.port) as transport:
        chosen = args.configs.split(",")
        for name, expert, dense, slots, mode, kernel, copy, kernels, fp8 in (
                c for c in CONFIGS if c.name in chosen):
            if not expert and rank != 0:
                transport.barrier(label=f"{name}.done")
                continue
            model, _tok, att = load(args.ckpt_fp8 if fp8 else args.ckpt,
                                    backend=backend if expert else None,
                                    transport=transport, world=world, dense=dense, slots=slots,
                                    mode=mode, kernel=kernel, kernels=kernels,
                                    copy_settings=copy or {})
            if rank == 0:
                row = {"config": name, "experts_implementation":
                       model.config._experts_implementation, "times_s": {}}
                for t in tokens:
                    ids = torch.randint(0, model.config.vocab_size, (1, t), device="cuda")
                    row["times_s"][str(t)] = _time(model, ids, args.repeats)
                    if name in args.profile.split(",") and t == 8192:
                        row["profile_8192"] = _stream_profile(model, ids)
                if att is not None:
                    row["copy_bytes_per_layer"] = _copy_bytes_per_layer(model, att)
                    status = att.status()
                    for key in ("slot_waits", "bytes_moved", "sm_reserve"):
                        row[key] = status.get(key)
                results.append(row)
                print(f"rank 0: {name} {row['times_s']}", flush=True)
            torch.cuda.synchronize()
            transport.barrier(label=f"{name}.done")
            if att is not None:
                att.close()
            del model
            torch.cuda.empty_cache()
    backend.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))


def _report(rows: list[dict], shape, peak: float, tokens: list[int]) -> str:
    base = next(r for r in rows if r["config"] == "replicated")["times_s"]
    head = (f"Qwen3-MoE {shape.num_layers} layers x {shape.num_experts} experts (hidden "
            f"{shape.hidden_size}, width {shape.moe_intermediate_size}, top-"
            f"{shape.num_experts_per_tok}, bf16); measured bf16 matmul peak {peak / 1e12:.0f} "
            f"TFLOP/s")
    lines = [head, f"{'config':>44} " + " ".join(
        f"{f'{t} ms':>9} {'ratio':>6} {'mfu':>5}" for t in tokens)]
    for r in rows:
        cells = []
        for t in tokens:
            s = r["times_s"][str(t)]
            r.setdefault("ratio", {})[str(t)] = s / base[str(t)]
            r.setdefault("mfu", {})[str(t)] = forward_flops(shape, t) / s / peak
            cells.append(f"{s * 1e3:>9.2f} {s / base[str(t)]:>6.3f} {r['mfu'][str(t)]:>5.1%}")
        lines.append(f"{r['config']:>44} " + " ".join(cells))
    lines += _fp8_lines(rows, tokens)
    for r in rows:
        if r.get("profile_8192"):
            lines += _profile_lines(r["config"], r["profile_8192"])
    return "\n".join(lines)


def _profile_lines(name: str, prof: dict) -> list[str]:
    """A profiled forward: streams' busy time, the copies' overlap, the GEMMs' share of the
    compute stream and the largest speed-up faster GEMMs alone could give (Amdahl: at twice
    their speed, FP8's peak over bf16's), and the kernels that take the most time."""
    busy, gemm = prof["compute_busy_s"], prof.get("compute_gemm_s", 0.0)
    lines = [
        f"profile {name} at 8192 tokens: wall {prof['wall_s'] * 1e3:.2f} ms, compute "
        f"stream busy {busy * 1e3:.2f} ms, copy streams busy "
        f"{prof['copy_busy_s'] * 1e3:.2f} ms, of which overlapped with compute "
        f"{(prof['copy_overlap_fraction'] or 0):.1%}",
    ]
    if busy and gemm:
        lines.append(
            f"  GEMMs {gemm * 1e3:.2f} ms ({gemm / busy:.1%} of the compute stream); at twice "
            f"their speed the compute stream would take {(busy - gemm / 2) * 1e3:.2f} ms: at "
            f"most {busy / (busy - gemm / 2):.2f}x from GEMM speed alone")
    lines.append("  kernels by time: " + "; ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in list(prof.get("top_kernels_s", {}).items())[:8]))
    return lines


def _fp8_lines(rows: list[dict], tokens: list[int]) -> list[str]:
    """FP8 against bf16, per configuration measured both ways: prefill speed-up per token
    count and DWDP's copy bytes per layer."""
    by_name = {r["config"]: r for r in rows}
    lines = []
    for name, r in by_name.items():
        base = by_name.get(name.removeprefix("fp8/"))
        if not name.startswith("fp8/") or base is None:
            continue
        speed = " ".join(f"{t}: {base['times_s'][str(t)] / r['times_s'][str(t)]:.2f}x"
                         for t in tokens)
        line = f"{name}: prefill speed-up over bf16 {speed}"
        if r.get("copy_bytes_per_layer") and base.get("copy_bytes_per_layer"):
            ratio = r["copy_bytes_per_layer"] / base["copy_bytes_per_layer"]
            line += (f"; copy bytes per layer {r['copy_bytes_per_layer'] / 2**20:.1f} MiB, "
                     f"{ratio:.3f}x bf16's")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_group_arguments(ap, layers=8)
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", default=PROFILED,
                    help="comma-separated configurations profiled at 8192 tokens")
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                    help="comma-separated configuration names (default: all)")
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0

    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape

    extra = ["--tokens", args.tokens, "--repeats", str(args.repeats), "--configs", args.configs,
             "--profile", args.profile]
    try:
        rows, peak = run_group(__file__, args, extra, before=matmul_peak,
                               fp8=any(c.fp8 for c in CONFIGS if c.name in args.configs.split(",")))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    shape = Qwen3MoeShape(num_layers=args.layers)
    tokens = [int(t) for t in args.tokens.split(",")]
    text = _report(rows, shape, peak, tokens)
    write_result(args, "gpu_forward", text,
                 {"peak_flops": peak, "shape": vars(shape), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
