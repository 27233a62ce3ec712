"""Speculative decoding's pay (``engine.speculative``): time per output token at concurrency 1
and output tokens/s at concurrency 32, plain, with n-gram drafts and with MTP drafts, in one run.

The model is the trained demo model with its trained MTP layer (``dwdp_dev.worker.demo_mtp``,
cached; it knows the capitals of its corpus), on the CPU or one GPU (``--device cuda``: the
worker's GPU kernels, for the MTP layer too, and CUDA graphs in every mode: decode steps replay
the decode graphs, verify steps the verify graphs, the MTP layer's pass after either its own
graphs; steps with a prompt chunk the piecewise graphs). Two workloads, greedy, up to
``--max-tokens`` tokens:

- ``quote`` (copy-heavy, a summarize-and-quote shape): each prompt quotes ``--facts`` capital
  sentences of the corpus and then starts quoting them again; the answers run to
  ``--max-tokens`` (``ignore_eos``: past its first sentence the model goes on quoting capital
  sentences), repeating text of the prompt, where n-gram drafts find their tokens;
- ``ask``: the corpus's capital questions as plain completions ("What is the capital of X?"),
  whose answers the prompt does not hold; the model's EOS ends an answer (a few tokens), as it
  was trained to, so the MTP layer drafts in the text it was trained on.

- ``c1``: the requests one at a time through the running engine (``generate``); per request
  ``tpot_ms`` = (last token's arrival - first token's) / (tokens - 1); the median over requests.
- ``c32``: 32 requests at once, ``--rounds`` times; output tokens / wall time, the median over
  the rounds (one round of the ``ask`` answers lasts milliseconds: a single one is noise).
- ``acceptance``: accepted over proposed draft tokens (``EngineStats``), and accepted tokens per
  draft position over drafts.

Run: ``.venv/bin/python bench/spec_decode.py [--device cuda]`` (about a minute on 2 CPU
cores); writes ``bench/results/spec_decode-<device>.json`` (``device`` names the card or
the CPU) and prints a table. Ratios (speculative over plain) are the comparable figures; the
absolute times depend on the machine and its load.
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
from dwdp.worker.loading.mtp import load_mtp
from dwdp.worker.loading.validate import validate_checkpoint
from dwdp_dev.devcluster.paths import cache_dir
from dwdp_dev.worker.demo_corpus import CAPITALS
from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model

RESULTS = Path(__file__).resolve().parent / "results"


def quote_prompts(tokenizer, count: int, facts: int) -> list[list[int]]:
    """Copy-heavy prompts: ``facts`` capital sentences, then the first of them again and the
    start of the second."""
    out = []
    for i in range(count):
        chosen = [CAPITALS[(i * 7 + j * 3) % len(CAPITALS)] for j in range(facts)]
        quoted = " ".join(f"The capital of {c} is {k}." for c, k in chosen)
        again = f"The capital of {chosen[0][0]} is {chosen[0][1]}. The capital of"
        out.append(tokenizer(f"{quoted} {again}")["input_ids"])
    return out


def ask_prompts(tokenizer, count: int) -> list[list[int]]:
    """The corpus's capital questions."""
    return [tokenizer(f"What is the capital of {CAPITALS[(i * 5) % len(CAPITALS)][0]}?")
            ["input_ids"] for i in range(count)]


def engine(model, tok, layer, spec: SpeculativeConfig | None, device: str) -> ContinuousEngine:
    mtp = spec is not None and spec.method == "mtp"
    config = EngineConfig(max_batch_size=32, max_num_tokens=2048, max_model_len=512,
                          cuda_graphs=device == "cuda", speculative=spec)
    eng = ContinuousEngine(model, tok, model_name="demo", config=config)
    if mtp:
        eng.attach_draft_layer(layer)
    return eng


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


async def measure(eng: ContinuousEngine, work: list[list[int]], params, rounds: int) -> dict:
    tpot = []
    for i, prompt in enumerate(work):
        seconds, tokens = await one(eng, f"c1-{i}", prompt, params)
        if tokens > 1:
            tpot.append(seconds / (tokens - 1) * 1e3)
    batch = (work * (32 // len(work) + 1))[:32]
    throughput = []
    for r in range(rounds):
        began = time.perf_counter()
        done = await asyncio.gather(*(one(eng, f"c32-{r}-{i}", p, params)
                                      for i, p in enumerate(batch)))
        throughput.append(sum(t for _, t in done) / (time.perf_counter() - began))
    s = eng.stats
    return {
        "c1_tpot_ms_p50": statistics.median(tpot),
        "c32_output_tokens_per_s": statistics.median(throughput),
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
    ap.add_argument("--k", type=int, default=4, help="numSpeculativeTokens of ngram")
    ap.add_argument("--mtp-k", type=int, default=1, help="numSpeculativeTokens of mtp")
    ap.add_argument("--rounds", type=int, default=5, help="c32 rounds (the median is kept)")
    args = ap.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    path = cached_demo_mtp_model(cache_dir() / "models")
    # bf16 on the GPU: the worker's Triton kernels at the demo's shapes need more shared
    # memory than an H100 has in float32 (OutOfResources, seen on one)
    model, tok = load_checkpoint(path, dtype="bfloat16" if args.device == "cuda" else "auto")
    if args.device == "cuda":
        from dwdp.worker.gpu.cuda_path import use_cuda_kernels

        model.to("cuda")
        use_cuda_kernels(model)
    layer = load_mtp(path, validate_checkpoint(path), dtype=model.dtype, device=str(model.device))
    if args.device == "cuda":
        use_cuda_kernels(layer.block)  # as the worker's load_draft_layer
    workloads = {"quote": quote_prompts(tok, args.requests, args.facts),
                 "ask": ask_prompts(tok, args.requests)}
    params = {"quote": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
              "ask": SamplingParams(max_tokens=args.max_tokens)}
    modes = {"plain": None,
             "ngram": SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=2,
                                        prompt_lookup_max=4),
             "mtp": SpeculativeConfig(method="mtp", num_speculative_tokens=args.mtp_k)}
    rows: dict[str, dict] = {}
    for load, work in workloads.items():
        for name, spec in modes.items():
            with engine(model, tok, layer, spec, args.device) as eng:
                asyncio.run(measure(eng, work[:2], params[load], 1))  # warm-up: kernels, graphs
                eng.stats = type(eng.stats)()
                rows[f"{load}/{name}"] = asyncio.run(measure(eng, work, params[load], args.rounds))
    card = (torch.cuda.get_device_name() if args.device == "cuda"
            else platform.processor() or "cpu")
    ratios = {f"{load}/{name}": {
        "c1_tpot_over_plain": rows[f"{load}/{name}"]["c1_tpot_ms_p50"]
        / rows[f"{load}/plain"]["c1_tpot_ms_p50"],
        "c32_throughput_over_plain": rows[f"{load}/{name}"]["c32_output_tokens_per_s"]
        / rows[f"{load}/plain"]["c32_output_tokens_per_s"]}
        for load in workloads for name in ("ngram", "mtp")}
    result = {"device": card, "settings": vars(args), "modes": rows, "ratios": ratios}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"spec_decode-{args.device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device: {card}")
    print(f"{'workload/mode':14} {'c1 tpot p50 ms':>15} {'c32 tok/s':>10} {'accept':>7} "
          f"{'c1 x plain':>10} {'c32 x plain':>11}")
    for key, r in rows.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        ratio = ratios.get(key, {"c1_tpot_over_plain": 1.0, "c32_throughput_over_plain": 1.0})
        print(f"{key:14} {r['c1_tpot_ms_p50']:15.2f} {r['c32_output_tokens_per_s']:10.1f} "
              f"{acc:>7} {ratio['c1_tpot_over_plain']:10.2f} "
              f"{ratio['c32_throughput_over_plain']:11.2f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
