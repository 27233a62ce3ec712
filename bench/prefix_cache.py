"""Prefix caching through HTTP: the engine with ``prefix_caching`` on against the same engine
with it off, on one device, in one run.

Two workloads, each served by both engines (on 127.0.0.1 as a rank serves: the OpenAI app in an
API server process, the engine in the bench's; ``--http in-process`` serves the app from a thread
of the engine's process instead, ``both`` does both in turn; one engine per setting serves
everything, ``sequential`` first):

- ``sequential``: six requests sharing a ``--prefix``-token prefix (1536) plus 16 unique tokens
  each, answered one after another (greedy, 4 output tokens), after two warm-up requests of
  another prefix of the same length (the first calls' compilation is not measured). Reported:
  each request's latency and ``usage.prompt_tokens_details.cached_tokens``, the warm requests'
  median latency over the first one's, and whether every answer equals the engine without
  caching.
- ``shared`` (a shared system prompt): ``--shared-requests`` (256: over 64, the p50 of one run
  moved by a fifth from one run to the next) requests of a 2048-token
  shared prefix plus 128 unique tokens, 64 output tokens, EOS ignored, at concurrency 16
  (streaming clients of ``bench/gpu_serve.py``, in ``CLIENT_PROCESSES`` processes of their
  own, so their parsing of the streams neither takes the server's interpreter lock nor delays
  the first tokens they time). Reported: time to first token
  p50/p99 and output tokens/s with and without caching, and their TTFT ratio; and the mean TTFT
  as the clients see it beside the server's own (its ``dwdp_time_to_first_token_seconds``
  histogram: handler to first token), which tells the server's wait from the clients'.

Each engine is configured as a server on that device runs by default: on a GPU its decode
steps replay CUDA graphs (``cuda_graphs``, captured when it starts), on the CPU they run eagerly.

The model: on a GPU the Qwen3-MoE slice of the other GPU benches (``--layers`` layers of 128
experts, bf16, the worker's kernels); on the CPU a small float32 Qwen3-MoE (hidden 256, 16
experts of 128, 4 layers), big enough that a prefill costs more than an HTTP round trip.

Usage: python bench/prefix_cache.py [--device cuda|cpu] [--layers 4] [--out bench/results]
                                    [--http api-process|in-process|both]
                                    [--skip sequential,shared]
Writes OUT/prefix_cache.json and OUT/prefix_cache.txt (OUT/prefix_cache-cpu.* on the CPU).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import load, write_result
from gpu_serve import client_process, drive_blocking, drive_split, serving

UNIQUE, SEQUENTIAL_REQUESTS, SEQUENTIAL_OUTPUT = 16, 6, 4
SHARED_PREFIX, SHARED_UNIQUE, SHARED_OUTPUT, SHARED_CONCURRENCY = 2048, 128, 64, 16
CLIENT_PROCESSES = 4
"""The shared workload's clients: 4 processes of 4 streams each, so that no client's parsing
of 16 streams (about 9000 events a second) delays the first tokens it times."""


def model_and_tokenizer(args: argparse.Namespace, work: Path) -> tuple[Any, Any]:
    """The bench's model on ``args.device`` (module docstring)."""
    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape, write_qwen3_moe_checkpoint

    cuda = args.device.startswith("cuda")
    shape = Qwen3MoeShape(num_layers=args.layers) if cuda else Qwen3MoeShape(
        num_layers=4, hidden_size=256, num_experts=16, moe_intermediate_size=128,
        num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        dtype="float32")
    ckpt = write_qwen3_moe_checkpoint(work / "ck", shape, seed=3,
                                      device="cuda:0" if cuda else "cpu")
    if cuda:
        model, tok, _ = load(str(ckpt))
        return model, tok
    from dwdp.worker.loading.checkpoint import load_checkpoint

    return load_checkpoint(str(ckpt))


def engine(model: Any, tok: Any, *, caching: bool) -> Any:
    """A started continuous engine (blocks of 16, 4096 tokens a request, 64 requests; CUDA
    graphs on a GPU)."""
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine

    config = EngineConfig(max_batch_size=64, max_num_tokens=8192, max_model_len=4096,
                          kv_capacity_tokens=64 * 4096, prefix_caching=caching,
                          cuda_graphs=model.device.type == "cuda")
    return ContinuousEngine(model, tok, model_name="bench", config=config).start()


def sequential_prompts(vocab: int, args: argparse.Namespace) -> tuple[list, list]:
    """(warm-up prompts, measured prompts) of the ``sequential`` workload."""
    rng = random.Random(1)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(UNIQUE)]
               for _ in range(SEQUENTIAL_REQUESTS)]
    other = [rng.randrange(vocab) for _ in range(args.prefix)]
    return [other + [rng.randrange(vocab) for _ in range(UNIQUE)] for _ in range(2)], prompts


def sequential(base: str, warm_up: list, prompts: list) -> list[dict]:
    """The ``sequential`` workload against the server at ``base``: a row per measured
    request (module docstring)."""
    import httpx

    rows = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for warm in warm_up:  # first calls: a prompt of the same shapes, then one served
            client.post("/v1/completions", json={  # from its blocks
                "prompt": warm, "max_tokens": SEQUENTIAL_OUTPUT, "ignore_eos": True})
        for prompt in prompts:
            start = time.perf_counter()
            r = client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": SEQUENTIAL_OUTPUT, "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            rows.append({
                "latency_s": time.perf_counter() - start,
                "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                "token_ids": body["choices"][0]["token_ids"],
            })
    return rows


def shared_work(vocab: int, args: argparse.Namespace) -> tuple[list, list]:
    """(warm-up, measured) (prompt, output tokens) pairs of the ``shared`` workload."""
    rng = random.Random(2)
    prefix = [rng.randrange(vocab) for _ in range(SHARED_PREFIX)]
    work = [(prefix + [rng.randrange(vocab) for _ in range(SHARED_UNIQUE)], SHARED_OUTPUT)
            for _ in range(args.shared_requests)]
    return [([rng.randrange(vocab) for _ in range(64)], 4) for _ in range(2)], work


def server_ttft(base: str) -> tuple[float, float]:
    """(sum, count) of the server's ``dwdp_time_to_first_token_seconds`` histogram (its
    ``/metrics``): from a request's arrival at its handler to its first token there, so the
    clients' parsing and the stream's way back are not in it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=60).text
    got = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "dwdp_time_to_first_token_seconds":
            for sample in family.samples:
                kind = sample.name.rsplit("_", 1)[-1]
                if kind in got:
                    got[kind] += sample.value
    return got["sum"], got["count"]


def shared(eng: Any, base: str, warm: list, load: list) -> dict:
    """The ``shared`` workload against ``eng`` served at ``base``: the clients' figures, the
    engine's steps and graph replays, and the server's mean TTFT."""
    with client_process(CLIENT_PROCESSES) as clients:
        clients.submit(drive_blocking, base, warm, 2).result()
        steps, replays = eng.stats.waves, eng.stats.graph_replays
        ttft = server_ttft(base)
        row = drive_split(clients, CLIENT_PROCESSES, base, load, SHARED_CONCURRENCY)
    row["steps"] = eng.stats.waves - steps
    row["graph_replays"] = eng.stats.graph_replays - replays
    total, count = (a - b for a, b in zip(server_ttft(base), ttft, strict=True))
    row["server_ttft_mean_s"] = total / count if count else None
    return row


def measure(model: Any, tok: Any, args: argparse.Namespace) -> dict:
    """Both workloads (those ``--skip`` leaves) against the engine with caching off, then on:
    one engine per setting serves both, the ``sequential`` one first."""
    vocab = model.config.vocab_size
    seq_warm, seq_prompts = sequential_prompts(vocab, args)
    shared_warm, shared_load = shared_work(vocab, args)
    seq: dict[str, Any] = {}
    sh: dict[str, Any] = {}
    modes = {"api-process": [True], "in-process": [False], "both": [True, False]}[args.http]
    for name, caching in (("off", False), ("on", True)):
        eng = engine(model, tok, caching=caching)
        try:
            for apart in modes:
                key = name if apart else f"{name}/in-process"
                with serving(eng, api_process=apart) as base:
                    if "sequential" not in args.skip and apart == modes[0]:
                        seq[name] = sequential(base, seq_warm, seq_prompts)
                    if "shared" not in args.skip:
                        sh[key] = shared(eng, base, shared_warm, shared_load)
        finally:
            eng.stop()
    result: dict[str, Any] = {}
    if seq:
        on, off = seq["on"], seq["off"]
        seq["warm_over_first"] = (statistics.median(r["latency_s"] for r in on[1:])
                                  / on[0]["latency_s"])
        seq["answers_equal"] = [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
        result["sequential"] = seq
    if sh:
        for suffix in ("", "/in-process"):
            if f"off{suffix}" in sh:
                sh[f"ttft_p50_off_over_on{suffix}"] = (sh[f"off{suffix}"]["ttft_p50_s"]
                                                       / sh[f"on{suffix}"]["ttft_p50_s"])
        result["shared"] = sh
    return result


def report(result: dict, args: argparse.Namespace) -> str:
    lines = [f"prefix caching on {result.get('device_name', args.device)}: {result['model']}"]
    seq = result.get("sequential")
    if seq:
        lines.append(f"sequential: {SEQUENTIAL_REQUESTS} requests of a {args.prefix}-token "
                     f"prefix + {UNIQUE} unique tokens, {SEQUENTIAL_OUTPUT} output tokens")
        lines.append(f"{'request':>8} {'off ms':>9} {'on ms':>9} {'cached':>7}")
        for i, (a, b) in enumerate(zip(seq["off"], seq["on"], strict=True)):
            lines.append(f"{i:>8} {a['latency_s'] * 1e3:>9.1f} {b['latency_s'] * 1e3:>9.1f} "
                         f"{b['cached_tokens']:>7}")
        lines.append(f"warm median / first (on) = {seq['warm_over_first']:.3f}; answers equal "
                     f"to caching off: {seq['answers_equal']}")
    sh = result.get("shared")
    if sh:
        lines.append(f"shared system prompt: {args.shared_requests} requests of a "
                     f"{SHARED_PREFIX}-token prefix + {SHARED_UNIQUE} unique, {SHARED_OUTPUT} "
                     f"output tokens, concurrency {SHARED_CONCURRENCY}")
        lines.append(f"{'caching':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'out tok/s':>10} "
                     f"{'steps':>6} {'graphs':>6}")
        rows = [k for k in sh if isinstance(sh[k], dict)]
        for name in rows:
            r = sh[name]
            lines.append(f"{name:>8} {r['ttft_p50_s'] * 1e3:>8.1f}ms "
                         f"{r['ttft_p99_s'] * 1e3:>8.1f}ms {r['output_tokens_per_s']:>10.1f} "
                         f"{r.get('steps', 0):>6} {r.get('graph_replays', 0):>6}")
        for key in (k for k in sh if k.startswith("ttft_p50_off_over_on")):
            lines.append(f"TTFT p50 off / on{key[len('ttft_p50_off_over_on'):]} = {sh[key]:.2f}")
        for name in rows:
            r = sh[name]
            server = r.get("server_ttft_mean_s")
            lines.append(f"{name:>8} TTFT mean: clients {r['ttft_mean_s'] * 1e3:.1f} ms, server "
                         f"(handler to first token) "
                         f"{server * 1e3 if server is not None else float('nan'):.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=4, help="GPU model's layers")
    ap.add_argument("--prefix", type=int, default=1536, help="sequential: shared prefix tokens")
    ap.add_argument("--shared-requests", type=int, default=256)
    ap.add_argument("--skip", default="", help="workloads to leave out: sequential,shared")
    ap.add_argument("--http", default="api-process", choices=["api-process", "in-process", "both"],
                    help="where HTTP is served: an API server process as a rank does (the "
                    "default), a thread of the engine's process, or both in turn")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dwdp-prefix-") as work:
        model, tok = model_and_tokenizer(args, Path(work))
        text = model.config.get_text_config()
        result["model"] = (f"Qwen3-MoE {text.num_hidden_layers} layers x {text.num_experts} "
                           f"experts (hidden {text.hidden_size}, {model.dtype})")
        if args.device == "cuda":
            result["device_name"] = torch.cuda.get_device_name(0)
        else:
            result["threads"] = torch.get_num_threads()
        result.update(measure(model, tok, args))
    name = "prefix_cache" if args.device == "cuda" else "prefix_cache-cpu"
    write_result(args, name, report(result, args), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
