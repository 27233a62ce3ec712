"""FP8 against bf16 on one GPU: do the block-scaled FP8 model's greedy tokens agree with the
same checkpoint dequantized to bf16?

It writes the seeded Qwen3-MoE slice of the other GPU benches (``--layers`` layers, 128 experts
of 768, hidden 2048), its block-scaled FP8 twin (``quantize_checkpoint``) and that twin
dequantized to bf16 (``dequantize_checkpoint``: the reference), loads both on cuda:0 with the
worker's GPU path (``use_cuda_kernels``: the FP8 one through ``fp8_gemm``), lets the reference
continue ``--prompts`` random prompts of 128 tokens by 16 greedy tokens, and reports at how many
of those positions the FP8 model's top-1 token (teacher-forced on the same sequence) is the
reference's, and the weights' bytes on the GPU. Beside it, the same count for the bf16
reference against the checkpoint computed in float32 (transformers' eager path): how often a
seeded random slice's top-1 token moves under bf16's own rounding, the floor any lower
precision is measured against; and each model's logits' relative error (L2) against
float32's. First it times the experts' two grouped GEMMs of
one MoE layer at 8192 tokens, FP8 against bf16, at the slice's shapes and at DeepSeek-V3's
(256 experts of width 2048, hidden 7168: GEMMs four to ten times larger) (``--gemm-only``:
only that).

Usage: python bench/gpu_fp8.py [--layers 8] [--prompts 64] [--gemm-only] [--out bench/results]
Writes OUT/gpu_fp8.json and OUT/gpu_fp8.txt.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_result

PROMPT, NEW = 128, 16


GEMM_SHAPES = {
    # name: (experts, hidden, expert width); top-8 routing in both
    "qwen3": (128, 2048, 768),  # the slice the other benches run (Qwen3-30B-A3B's layers)
    "deepseek-v3": (256, 7168, 2048),  # DeepSeek-V3's and Kimi-K2's routed experts
}


def gemm_times(model: str = "qwen3", tokens: int = 8192, top_k: int = 8) -> dict:
    """Milliseconds of the experts' two grouped GEMMs of one MoE layer of ``model``
    (``GEMM_SHAPES``) at ``tokens`` tokens (rows spread evenly over the experts): FP8
    (``fp8_gemm.grouped_mm``, its activation quantization included) against bf16 (torch's
    ``grouped_mm``). Keys are prefixed with ``model``."""
    import torch

    from dwdp.worker.gpu import fp8_gemm
    from dwdp.worker.gpu.cuda_path import _grouped_mm

    experts, hidden, width = GEMM_SHAPES[model]
    rows = tokens * top_k
    offsets = torch.linspace(rows / experts, rows, experts, device="cuda").to(torch.int32)
    out = {}
    for name, n, k in ((f"{model}/gate_up", 2 * width, hidden), (f"{model}/down", hidden, width)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = w.to(torch.float8_e4m3fn)
        scale = torch.ones(experts, n // 128, k // 128, device="cuda")
        calls = {"fp8": partial(fp8_gemm.grouped_mm, x, q, scale, offsets),
                 "bf16": partial(_grouped_mm, x, w.transpose(-2, -1), offsets),
                 "fp8_quantize_only": partial(fp8_gemm.quantize_rows, x)}
        for kind, call in calls.items():
            for _ in range(3):
                call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                call()
            end.record()
            torch.cuda.synchronize()
            out[f"{name}/{kind}_ms"] = start.elapsed_time(end) / 10
        out[f"{name}/tflops_fp8"] = 2 * rows * n * k / out[f"{name}/fp8_ms"] / 1e9
        out[f"{name}/fp8_speedup"] = out[f"{name}/bf16_ms"] / out[f"{name}/fp8_ms"]
        del x, w, q
        torch.cuda.empty_cache()
    return out


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--gemm-only", action="store_true", help="only the GEMM timings")
    args = ap.parse_args(argv)

    import torch

    gemms = {**gemm_times("qwen3"), **gemm_times("deepseek-v3")}
    gemm_text = "grouped GEMMs of one MoE layer at 8192 tokens: " + ", ".join(
        f"{k} {v:.3f}" for k, v in gemms.items())
    if args.gemm_only:
        write_result(args, "gpu_fp8_gemm", gemm_text, {"gemm": gemms})
        return 0

    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint
    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape, write_qwen3_moe_checkpoint

    work = Path(tempfile.mkdtemp(prefix="dwdp-fp8-"))
    src = write_qwen3_moe_checkpoint(work / "bf16-src", Qwen3MoeShape(num_layers=args.layers),
                                     seed=3, device="cuda:0")
    fp8 = quantize_checkpoint(src, work / "fp8", device="cuda:0")
    ref_path = dequantize_checkpoint(fp8, work / "ref")
    models = {}
    for name, path in (("fp8", fp8), ("bf16", ref_path), ("fp32", ref_path)):
        model, _ = load_checkpoint(path)
        model.to("cuda:0")
        if name == "fp32":
            model.to(torch.float32)  # eager: torch's grouped_mm takes bf16 only
        else:
            use_cuda_kernels(model)
        models[name] = model
    gen = torch.Generator(device="cuda").manual_seed(7)
    vocab = models["bf16"].config.vocab_size
    agree = floor = total = 0
    squared = {"fp8": 0.0, "bf16": 0.0, "norm": 0.0}  # logits' errors against float32's
    with torch.no_grad():
        for _ in range(args.prompts // 8):
            ids = torch.randint(0, vocab, (8, PROMPT), device="cuda", generator=gen)
            for _step in range(NEW):  # the reference's greedy continuation
                nxt = models["bf16"](ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            want = ids[:, PROMPT:]
            logits = {name: models[name](ids[:, :-1]).logits[:, PROMPT - 1:].float()
                      for name in ("fp8", "bf16", "fp32")}
            agree += int((logits["fp8"].argmax(-1) == want).sum())
            floor += int((logits["fp32"].argmax(-1) == want).sum())
            total += want.numel()
            for name in ("fp8", "bf16"):
                squared[name] += float((logits[name] - logits["fp32"]).square().sum())
            squared["norm"] += float(logits["fp32"].square().sum())
    errors = {name: (squared[name] / squared["norm"]) ** 0.5 for name in ("fp8", "bf16")}
    result = {
        "gemm": gemms,
        "layers": args.layers,
        "positions": total,
        "top1_agreement": agree / total,
        "top1_agreement_bf16_vs_fp32": floor / total,
        "logits_relative_error_vs_fp32": errors,
        "weight_bytes": {k: weight_bytes(models[k]) for k in ("fp8", "bf16")},
    }
    ratio = result["weight_bytes"]["fp8"] / result["weight_bytes"]["bf16"]
    text = (f"FP8 vs bf16 (dequantized twin), Qwen3-MoE {args.layers} layers x 128 experts on "
            f"{torch.cuda.get_device_name(0)}: top-1 agreement {agree}/{total} = "
            f"{agree / total:.1%} over {args.prompts} prompts x {NEW} greedy tokens (bf16 vs "
            f"float32 of the same weights: {floor}/{total} = {floor / total:.1%}); logits' "
            f"relative error against float32's: FP8 {errors['fp8']:.2%}, bf16 "
            f"{errors['bf16']:.2%}; weights "
            f"on the GPU {result['weight_bytes']['fp8'] / 2**30:.2f} GiB FP8 vs "
            f"{result['weight_bytes']['bf16'] / 2**30:.2f} GiB bf16 ({ratio:.3f}x)\n{gemm_text}")
    write_result(args, "gpu_fp8", text, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
