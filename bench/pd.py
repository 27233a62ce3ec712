"""Prefill/decode disaggregation against a colocated server, through vllm-router, in one run.

It writes a seeded tiny Qwen3-MoE checkpoint (``dwdp_dev.worker.checkpoint``) and serves it
twice on this machine's CPU (loopback only):
- **colocated**: one worker (continuous engine) behind vllm-router's plain mode;
- **disaggregated**: a context worker and a generation worker behind vllm-router's PD mode
  (``--vllm-pd-disaggregation``): the router prefills on the context worker
  (``do_remote_decode``), the generation worker reads the prompt's KV blocks with NIXL (UCX
  over TCP) and decodes.
Streaming clients (httpx, ``--concurrency`` levels) send the same seeded requests to both:
prompts of 16 to ``--max-prompt`` token ids, ``--output`` tokens each (EOS ignored). Reported:
time to first token (p50/p99), inter-token latency (p50), and the disaggregated / colocated
ratios; every answer of the two is checked token for token (greedy).

Usage: python bench/pd.py [--requests 16] [--concurrency 1,4] [--max-prompt 96] [--output 24]
                          [--out bench/results]
Writes OUT/pd.json and OUT/pd.txt (the printed table).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_result

KEY = "bench-pd-key"


def workload(n: int, vocab: int, max_prompt: int, output: int) -> list[list[int]]:
    """``n`` seeded prompts of 16 to ``max_prompt`` token ids."""
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, max_prompt))]
            for _ in range(n)]


def _one(base: str, prompt: list[int], output: int) -> dict:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": output, "ignore_eos": True,
            "stream": True}
    start, stamps, tokens = time.perf_counter(), [], []
    headers = {"Authorization": f"Bearer {KEY}"}  # plain mode passes the client's key on
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if got:
                stamps.append(time.perf_counter())
                tokens += got
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft_s": stamps[0] - start, "itl_s": itl, "token_ids": tokens}


def drive(base: str, prompts: list[list[int]], output: int, concurrency: int) -> dict:
    """Every prompt streamed through ``base`` by ``concurrency`` clients."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda p: _one(base, p, output), prompts))
    ttft = sorted(r["ttft_s"] for r in rows)
    itl = [x for r in rows for x in r["itl_s"]]
    return {
        "concurrency": concurrency, "requests": len(rows),
        "wall_s": time.perf_counter() - start,
        "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1,
                                                                      int(0.99 * len(ttft)))],
        "itl_p50_s": statistics.median(itl) if itl else None,
        "token_ids": [r["token_ids"] for r in rows],
    }


def run(args: argparse.Namespace, ckpt: Path) -> dict:
    from dwdp_dev.worker.servers import EngineServer, VllmRouter

    limits = {"max_model_len": args.max_prompt + args.output, "block_size": 16}
    levels = [int(c) for c in args.concurrency.split(",")]
    result: dict = {}
    with EngineServer(ckpt, api_key=KEY, kv=False, **limits) as solo:
        prompts = workload(args.requests, solo.engine.model.config.vocab_size,
                           args.max_prompt, args.output)
        with VllmRouter([solo.base], api_key=KEY) as base:
            _one(base, prompts[0], 2)  # warm-up
            result["colocated"] = [drive(base, prompts, args.output, c) for c in levels]
    with EngineServer(ckpt, api_key=KEY, **limits) as ctx, \
            EngineServer(ckpt, api_key=KEY, **limits) as gen:
        with VllmRouter([ctx.base], [gen.base], api_key=KEY) as base:
            _one(base, prompts[0], 2)
            result["disaggregated"] = [drive(base, prompts, args.output, c) for c in levels]
        result["kv_blocks_received"] = gen.engine.kv.blocks_received
        result["remote_prefill_tokens"] = gen.engine.stats.remote_prefill_tokens
    return result


def _report(result: dict, args: argparse.Namespace) -> str:
    lines = [f"tiny Qwen3-MoE on CPU, {args.requests} streamed requests (prompts 16-"
             f"{args.max_prompt} tokens, {args.output} out) through vllm-router",
             f"{'mode':>14} {'conc':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8}"]
    for mode in ("colocated", "disaggregated"):
        for row in result[mode]:
            lines.append(f"{mode:>14} {row['concurrency']:>4} {row['ttft_p50_s'] * 1e3:>7.1f}ms "
                         f"{row['ttft_p99_s'] * 1e3:>7.1f}ms {row['itl_p50_s'] * 1e3:>6.1f}ms")
    for co, pd in zip(result["colocated"], result["disaggregated"], strict=True):
        same = co["token_ids"] == pd["token_ids"]
        lines.append(f"concurrency {co['concurrency']}: TTFT p50 disaggregated / colocated = "
                     f"{pd['ttft_p50_s'] / co['ttft_p50_s']:.2f}, ITL p50 = "
                     f"{pd['itl_p50_s'] / co['itl_p50_s']:.2f}; answers equal: {same}")
    lines.append(f"generation server: {result['kv_blocks_received']} KV blocks received over "
                 f"NIXL, {result['remote_prefill_tokens']} prompt tokens prefilled remotely")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from dwdp_dev.worker.checkpoint import make_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--output", type=int, default=24)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="dwdp-bench-pd-") as work:
        ckpt = make_checkpoint("qwen3_moe", Path(work) / "q", num_experts=8)
        result = run(args, ckpt)
    text = _report(result, args)
    for mode in ("colocated", "disaggregated"):
        for row in result[mode]:
            row.pop("token_ids")
    write_result(args, "pd", text, result)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NIXL 1.5's native teardown segfaults at exit once a UCX agent existed
