"""FP8 against bf16 on one GPU: do the block-scaled FP8 model's greedy tokens agree with the
same checkpoint dequantized to bf16?

It writes the seeded Qwen3-MoE slice of the other GPU benches (``--layers`` layers, 128 experts
of 768, hidden 2048), its block-scaled FP8 twin (``quantize_checkpoint``) and that twin
dequantized to bf16 (``dequantize_checkpoint``: the reference), loads both on cuda:0 with the
worker's GPU path (``use_cuda_kernels``: the FP8 one through ``fp8_gemm``), lets the reference
continue ``--prompts`` random prompts of 128 tokens by 16 greedy tokens, and reports at how many
of those positions the FP8 model's top-1 token (teacher-forced on the same sequence) is the
reference's, and the weights' bytes on the GPU.

Usage: python bench/gpu_fp8.py [--layers 8] [--prompts 64] [--out bench/results]
Writes OUT/gpu_fp8.json and OUT/gpu_fp8.txt.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_result

PROMPT, NEW = 128, 16


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)

    import torch

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
    for name, path in (("fp8", fp8), ("bf16", ref_path)):
        model, _ = load_checkpoint(path)
        model.to("cuda:0")
        use_cuda_kernels(model)
        models[name] = model
    gen = torch.Generator(device="cuda").manual_seed(7)
    vocab = models["bf16"].config.vocab_size
    agree = total = 0
    with torch.no_grad():
        for _ in range(args.prompts // 8):
            ids = torch.randint(0, vocab, (8, PROMPT), device="cuda", generator=gen)
            for _step in range(NEW):  # the reference's greedy continuation
                nxt = models["bf16"](ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            want = ids[:, PROMPT:]
            got = models["fp8"](ids[:, :-1]).logits[:, PROMPT - 1:].argmax(-1)
            agree += int((got == want).sum())
            total += want.numel()
    result = {
        "layers": args.layers,
        "positions": total,
        "top1_agreement": agree / total,
        "weight_bytes": {k: weight_bytes(m) for k, m in models.items()},
    }
    ratio = result["weight_bytes"]["fp8"] / result["weight_bytes"]["bf16"]
    text = (f"FP8 vs bf16 (dequantized twin), Qwen3-MoE {args.layers} layers x 128 experts on "
            f"{torch.cuda.get_device_name(0)}: top-1 agreement {agree}/{total} = "
            f"{agree / total:.1%} over {args.prompts} prompts x {NEW} greedy tokens; weights "
            f"on the GPU {result['weight_bytes']['fp8'] / 2**30:.2f} GiB FP8 vs "
            f"{result['weight_bytes']['bf16'] / 2**30:.2f} GiB bf16 ({ratio:.3f}x)")
    write_result(args, "gpu_fp8", text, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
