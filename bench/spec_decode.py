"""Speculative decoding's pay (``engine.speculative``, n-gram drafts): time per output token at
concurrency 1 and output tokens/s at concurrency 32, with and without drafts, in one run.

The model is the trained demo model (``dwdp testing train-demo-model``, cached; it knows the
capitals of its corpus), on the CPU or one GPU (``--device cuda``: the worker's GPU kernels,
CUDA graphs captured in both modes; a verify step, which is no decode-only step, replays the
piecewise graphs or runs eagerly). The workload is copy-heavy (a summarize-and-quote shape):
each prompt quotes ``--facts`` capital sentences of the corpus and then starts quoting them
again, so the answer repeats text of its prompt, where n-gram drafts find their tokens. Greedy,
``--max-tokens`` tokens, EOS ignored.

- ``c1``: the requests one at a time through the running engine (``generate``); per request
  ``tpot_ms`` = (last token's arrival - first token's) / (tokens - 1); the median over requests.
- ``c32``: 32 requests at once; output tokens / wall time.
- ``acceptance``: accepted over proposed draft tokens (``EngineStats``), and accepted tokens per
  draft position over drafts.

Run: ``.venv/bin/python bench/spec_decode.py [--device cuda]``; writes
``bench/results/spec_decode-<device>.json`` (``device`` names the card or the CPU) and prints a
table. Ratios (speculative over plain) are the comparable figures; the absolute times depend
on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dwdp.worker.engine.base import EngineConfig
from dwdp.worker.engine.continuous import ContinuousEngine
from dwdp.worker.engine.protocol import SamplingParams
from dwdp.worker.engine.speculative import SpeculativeConfig
from dwdp.worker.loading.checkpoint import load_checkpoint
from dwdp_dev.devcluster.paths import cache_dir
from dwdp_dev.worker.demo_corpus import CAPITALS
from dwdp_dev.worker.demo_model import cached_demo_model

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(tokenizer, count: int, facts: int) -> list[list[int]]:
    """Copy-heavy prompts: ``facts`` capital sentences, then the first of them again and the
    start of the second."""
    out = []
    for i in range(count):
        chosen = [CAPITALS[(i * 7 + j * 3) % len(CAPITALS)] for j in range(facts)]
        quoted = " ".join(f"The capital of {c} is {k}." for c, k in chosen)
        again = f"The capital of {chosen[0][0]} is {chosen[0][1]}. The capital of"
        out.append(tokenizer(f"{quoted} {again}")["input_ids"])
    return out


def engine(model, tok, spec: SpeculativeConfig | None, device: str) -> ContinuousEngine:
    config = EngineConfig(max_batch_size=32, max_num_tokens=2048, max_model_len=512,
                          cuda_graphs=device == "cuda", speculative=spec)
    return ContinuousEngine(model, tok, model_name="demo", config=config)


async def one(eng: ContinuousEngine, rid: str, prompt: list[int], params) -> tuple[float, int]:
    """(seconds from the first token's arrival to the last's, tokens)."""
    first = last = None
    tokens = 0
    async for out in eng.generate(rid, prompt, params):
        if out.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(out.token_ids)
    return (last or 0.0) - (first or 0.0), tokens


async def measure(eng: ContinuousEngine, work: list[list[int]], params) -> dict:
    tpot = []
    for i, prompt in enumerate(work):
        seconds, tokens = await one(eng, f"c1-{i}", prompt, params)
        if tokens > 1:
            tpot.append(seconds / (tokens - 1) * 1e3)
    batch = (work * (32 // len(work) + 1))[:32]
    began = time.perf_counter()
    done = await asyncio.gather(*(one(eng, f"c32-{i}", p, params) for i, p in enumerate(batch)))
    wall = time.perf_counter() - began
    s = eng.stats
    return {
        "c1_tpot_ms_p50": statistics.median(tpot),
        "c32_output_tokens_per_s": sum(t for _, t in done) / wall,
        "acceptance": s.spec_acceptance_rate,
        "accepted_per_position": [a / s.spec_drafts for a in s.spec_accepted_per_pos]
        if s.spec_drafts else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--facts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="numSpeculativeTokens")
    args = ap.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    model, tok = load_checkpoint(cached_demo_model(cache_dir() / "models"))
    if args.device == "cuda":
        from dwdp.worker.gpu.cuda_path import use_cuda_kernels

        model.to("cuda")
        use_cuda_kernels(model)
    work = prompts(tok, args.requests, args.facts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"plain": None,
             "ngram": SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=2,
                                        prompt_lookup_max=4)}
    rows = {}
    for name, spec in modes.items():
        with engine(model, tok, spec, args.device) as eng:
            asyncio.run(measure(eng, work[:2], params))  # warm-up: kernels, graphs, caches
            eng.stats = type(eng.stats)()
            rows[name] = asyncio.run(measure(eng, work, params))
    card = (torch.cuda.get_device_name() if args.device == "cuda"
            else platform.processor() or "cpu")
    result = {
        "device": card,
        "settings": vars(args),
        "modes": rows,
        "c1_tpot_ngram_over_plain": rows["ngram"]["c1_tpot_ms_p50"]
        / rows["plain"]["c1_tpot_ms_p50"],
        "c32_throughput_ngram_over_plain": rows["ngram"]["c32_output_tokens_per_s"]
        / rows["plain"]["c32_output_tokens_per_s"],
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"spec_decode-{args.device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device: {card}")
    print(f"{'mode':8} {'c1 tpot p50 ms':>15} {'c32 tok/s':>10} {'acceptance':>11}")
    for name, r in rows.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tpot, rate = r["c1_tpot_ms_p50"], r["c32_output_tokens_per_s"]
        print(f"{name:8} {tpot:15.2f} {rate:10.1f} {acc:>11}")
    print(f"ngram / plain: c1 tpot {result['c1_tpot_ngram_over_plain']:.2f}x, "
          f"c32 throughput {result['c32_throughput_ngram_over_plain']:.2f}x -> {out}")


if __name__ == "__main__":
    main()
