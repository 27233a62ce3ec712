"""Serving through HTTP on one GPU: the continuous engine against the wave engine and
transformers' ``generate``, replicated and as a DWDP rank.

One run: it writes a seeded Qwen3-MoE checkpoint (``--layers`` layers of 128 experts, hidden
2048, bf16) and starts ``--world`` rank processes sharing the GPU. Rank 0 serves the OpenAI API
(uvicorn on 127.0.0.1) with, in turn: the continuous engine on replicated weights, the wave
engine on replicated weights, then (after every rank attached expert + dense DWDP, 2 slots,
gather copies) the continuous engine as a DWDP rank; the other ranks wait. Each is driven at
concurrency 1, 8 and 32 by streaming clients (aiohttp, in a process of their own) sending
mixed requests: prompts of 32 to
2048 token ids and 16 to 512 output tokens (EOS ignored), drawn from one seed, so every engine
serves the same work. Reported per engine and concurrency: requests/s, time to first token
(p50/p99), inter-token latency (p50) and output tokens/s. transformers' ``generate`` (batches of
``concurrency`` left-padded prompts, no HTTP) gives the in-library output tokens/s. Every engine
runs the same model with the worker's GPU kernels and attention (``bench/gpu_common.load``).
``serve_and_drive`` can also serve each level with every request constrained
(``structured_body``: ``bench/gpu_decode.py --structured json``); this script's own run does
not.

Usage: python bench/gpu_serve.py [--layers 4] [--world 4] [--requests-per-slot 2] [--max-output 512]
                                 [--fp8] [--out bench/results] [--workdir DIR]
Writes OUT/gpu_serve.json and OUT/gpu_serve.txt (the printed table).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import add_group_arguments, group_transport, load, run_group, write_result

LEVELS = (1, 8, 32)


MAX_OUTPUT = [512]  # --max-output sets it once, before any workload is drawn

STRUCTURED = ("json",)
"""The constraints a request of the workload may ask for (``structured_body``)."""


def structured_body(mode: str | None, max_output: int) -> dict:
    """The completion body's fields that constrain every answer in ``mode``: none for free
    text; ``json``: ``"structured_outputs": {"json": SCHEMA}``, SCHEMA an object whose
    ``items`` is an array of at least ``max_output`` integers. Each item takes a token and
    its comma one more, so the grammar cannot end a document before ``max_tokens`` (the
    workload's lengths hold, as unconstrained with EOS ignored)."""
    if mode is None:
        return {}
    if mode != "json":
        raise ValueError(f"structured mode {mode!r}, not one of {STRUCTURED}")
    items = {"type": "array", "items": {"type": "integer"}, "minItems": max_output}
    schema = {"type": "object", "properties": {"items": items}, "required": ["items"]}
    return {"structured_outputs": {"json": schema}}


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output tokens) pairs: prompts of 32-2048 tokens, outputs of 16 to
    ``--max-output`` (512)."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(32, 2048))],
             rng.randint(16, MAX_OUTPUT[0])) for _ in range(n)]


async def _one(session, base: str, prompt: list[int], n: int, extra: dict | None = None,
               ) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
            **(extra or {})}
    start = time.perf_counter()
    stamps = []
    reason = None
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                stamps.extend([time.perf_counter()] * len(chunk["choices"][0]["token_ids"]))
            if chunk["choices"]:
                reason = chunk["choices"][0].get("finish_reason") or reason
    ttft = stamps[0] - start
    itl = [(b - a) for a, b in itertools.pairwise(stamps) if b > a]
    return {"ttft": ttft, "itl": itl, "tokens": len(stamps), "asked": n, "reason": reason,
            "end": time.perf_counter()}


async def _requests(base: str, work: list[tuple[list[int], int]], concurrency: int,
                    extra: dict | None = None) -> tuple[list[dict], float, float]:
    """Send ``work`` keeping ``concurrency`` requests in flight, ``extra`` added to each body:
    (each request's figures, the wall clock's start and end)."""
    import aiohttp

    queue = list(work)
    results: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.time()

        async def worker():
            while queue:
                prompt, n = queue.pop(0)
                results.append(await _one(session, base, prompt, n, extra))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, start, time.time()


def _figures(results: list[dict], concurrency: int, wall: float) -> dict:
    """A level's figures from its requests' (``_one``)."""
    ttfts = sorted(r["ttft"] for r in results)
    itls = [x for r in results for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "itl_p50_s": statistics.median(itls) if itls else None,
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "output_tokens": sum(r["tokens"] for r in results),
        "asked_tokens": sum(r["asked"] for r in results),
        "finish_reasons": dict(collections.Counter(str(r["reason"]) for r in results)),
    }


async def drive(base: str, work: list[tuple[list[int], int]], concurrency: int,
                extra: dict | None = None) -> dict:
    """Send ``work`` keeping ``concurrency`` requests in flight (``extra`` added to each
    body); the level's figures."""
    results, start, end = await _requests(base, work, concurrency, extra)
    return _figures(results, concurrency, end - start)


def requests_blocking(base: str, work: list[tuple[list[int], int]], concurrency: int,
                      ) -> tuple[list[dict], float, float]:
    """``_requests`` run to its end (the entry point of one of several client processes)."""
    return asyncio.run(_requests(base, work, concurrency))


def drive_split(clients: Any, processes: int, base: str, work: list[tuple[list[int], int]],
                concurrency: int) -> dict:
    """``drive`` spread over the ``processes`` of ``clients`` (``client_process``): each sends
    its share of ``work`` with its share of ``concurrency`` (so no client process's parsing of
    the streams delays the first tokens it times); the figures of all of them together."""
    futures = [clients.submit(requests_blocking, base, work[i::processes],
                              concurrency // processes + (i < concurrency % processes))
               for i in range(processes)]
    parts = [f.result() for f in futures]
    results = [r for part, _, _ in parts for r in part]
    wall = max(end for _, _, end in parts) - min(start for _, start, _ in parts)
    return _figures(results, concurrency, wall)


@contextlib.contextmanager
def serving(engine, *, api_process: bool = True) -> Iterator[str]:
    """The (started) engine behind the OpenAI app on a free loopback port; yields its URL.

    As a rank serves it (``api_process``): the HTTP routes in an API server process
    (``dwdp.worker.server.api_process``, its tokenizer read from the engine tokenizer's
    directory), the engine in this one. Otherwise the app in a thread of this process."""
    from dwdp.worker.server.app import build_app

    if not api_process:
        with serving_app(build_app(engine, served_name="bench")) as base:
            yield base
        return
    from dwdp_dev.worker.servers import RankServer, free_port

    app = build_app(engine, served_name="bench", openai=False)
    with RankServer(engine, app, port=free_port(), tokenizer=engine.tokenizer.name_or_path,
                    served_name="bench") as base:
        yield base


@contextlib.contextmanager
def serving_app(app) -> Iterator[str]:
    """``app`` under uvicorn (a thread of this process) on a free loopback port; yields its
    URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)


def drive_blocking(base: str, work: list[tuple[list[int], int]], concurrency: int,
                   extra: dict | None = None) -> dict:
    """``drive`` run to its end (the entry point of a client process)."""
    return asyncio.run(drive(base, work, concurrency, extra))


def _drive_workload(base: str, n: int, vocab: int, seed: int, concurrency: int,
                    max_output: int, structured: str | None = None) -> dict:
    """``drive`` over ``workload(n, vocab, seed)``, each request constrained as
    ``structured_body(structured)`` says (in a client process: ``MAX_OUTPUT`` is set here,
    since a spawned process starts from the module's default)."""
    MAX_OUTPUT[0] = max_output
    return drive_blocking(base, workload(n, vocab, seed), concurrency,
                          structured_body(structured, max_output))


@contextlib.contextmanager
def client_process(processes: int = 1) -> Iterator[Any]:
    """``processes`` spawned processes (without torch) for the streaming clients, so that their
    parsing of the streams does not take the serving process's interpreter lock; yields their
    ``ProcessPoolExecutor``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes,
                             mp_context=multiprocessing.get_context("spawn")) as clients:
        yield clients


def serve_and_drive(engine, per_slot: int, vocab: int, levels: tuple[int, ...] = LEVELS,
                    modes: tuple[str | None, ...] = (None,), rounds: int = 1) -> list[dict]:
    """The engine behind the OpenAI app on a free loopback port, at every concurrency of
    ``levels``. The clients run in another process (spawned, without torch), so their
    parsing of the streams does not take the serving process's interpreter lock: the
    figures are the server's, as a remote client would see them.

    ``modes`` (``None``: free text, else a ``STRUCTURED`` constraint on every request): each
    level serves the same work once per mode, in turn, ``rounds`` times; each row names its
    ``structured`` mode and ``round``. A constrained mode is warmed up first at the largest
    level (one request per slot: every constrained batch size from 1 to that level, so the
    mask kernel's variants are compiled before any timing)."""
    with serving(engine) as base, client_process() as clients:
        def run(n: int, seed: int, c: int, mode: str | None = None) -> dict:
            return clients.submit(_drive_workload, base, n, vocab, seed, c,
                                  MAX_OUTPUT[0], mode).result()

        run(2, 99, 2)  # warm-up
        for mode in modes:
            if mode is not None:
                run(max(levels), 98, max(levels), mode)
        rows = []
        for r in range(rounds):
            for c in levels:
                for mode in modes:
                    rows.append({**run(max(4, c * per_slot), c, c, mode),
                                 "structured": mode, "round": r})
        return rows


def generate_baseline(model, per_slot: int, vocab: int,
                      levels: tuple[int, ...] = LEVELS) -> list[dict]:
    """transformers' ``generate`` over the same work: batches of ``c`` left-padded prompts
    (``c`` each concurrency of ``levels``), on the model's device."""
    import torch

    rows = []
    for c in levels:
        work = workload(max(4, c * per_slot), vocab, c)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(work), c):
            batch = work[i : i + c]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, _) in enumerate(batch):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            n = max(n for _, n in batch)
            with torch.inference_mode():
                model.generate(input_ids=ids.to(model.device),
                               attention_mask=mask.to(model.device), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)
            tokens += sum(n for _, n in batch)  # what the requests asked for
        wall = time.perf_counter() - start
        rows.append({"concurrency": c, "requests": len(work), "wall_s": wall,
                     "requests_per_s": len(work) / wall, "output_tokens_per_s": tokens / wall})
    return rows


def _serve_one(engine, args: argparse.Namespace, vocab: int) -> list[dict]:
    """``serve_and_drive`` over ``engine`` (started here, stopped after), printed."""
    rows = serve_and_drive(engine.start(), args.requests_per_slot, vocab)
    engine.stop()
    print(type(engine).__name__, rows, flush=True)
    return rows


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from dwdp.api.enums import HandleType
    from dwdp.worker.backend.cuda import CudaBackend
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp_dev.worker.wave_engine import BatchingEngine

    torch.cuda.set_device(0)
    config = EngineConfig(max_batch_size=32, max_num_tokens=8192, max_model_len=4096,
                          kv_capacity_tokens=32 * 4096)
    results: dict[str, list[dict]] = {}
    backend = CudaBackend(device=0, handle_type=HandleType.POSIX_FD)
    with group_transport(args.rank, args.world, args.group, args.port) as transport:
        if args.rank == 0:
            model, tok, _ = load(args.ckpt)
            vocab = model.config.vocab_size
            results["generate"] = generate_baseline(model, args.requests_per_slot, vocab)
            print("generate", results["generate"], flush=True)
            for name, engine_class in (("wave", BatchingEngine), ("continuous", ContinuousEngine)):
                results[name] = _serve_one(engine_class(model, tok, model_name="bench",
                                                        config=config), args, vocab)
            del model
            torch.cuda.empty_cache()
            if args.ckpt_fp8:  # the same model in block-scaled FP8, continuous batching
                model, tok, _ = load(args.ckpt_fp8)
                results["continuous-fp8"] = _serve_one(ContinuousEngine(
                    model, tok, model_name="bench", config=config), args, vocab)
                del model
                torch.cuda.empty_cache()
        transport.barrier(label="replicated.done")
        model, tok, att = load(args.ckpt, backend=backend, transport=transport,
                               world=args.world, dense=True, slots=2, mode="gather")
        if args.rank == 0:
            engine = ContinuousEngine(model, tok, model_name="bench", config=config).start()
            results["continuous+dwdp"] = serve_and_drive(
                engine, args.requests_per_slot, model.config.vocab_size)
            engine.stop()
            print("continuous+dwdp", results["continuous+dwdp"], flush=True)
            Path(args.result).write_text(json.dumps(results))
        torch.cuda.synchronize()
        transport.barrier(label="dwdp.done")
        att.close()
    backend.close()


def _ms(row: dict, key: str) -> str:
    return f"{row[key] * 1e3:.1f}ms" if row.get(key) is not None else "-"


def _report(results: dict[str, list[dict]], layers: int) -> str:
    lines = [f"Qwen3-MoE {layers} layers x 128 experts (hidden 2048, bf16), one H200; mixed "
             f"prompts 32-2048 tokens, outputs 16-{MAX_OUTPUT[0]}",
             f"{'engine':>16} {'conc':>4} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'ITL p50':>8} {'out tok/s':>10}"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"{name:>16} {r['concurrency']:>4} {r['requests_per_s']:>7.2f} "
                         f"{_ms(r, 'ttft_p50_s'):>9} {_ms(r, 'ttft_p99_s'):>9} "
                         f"{_ms(r, 'itl_p50_s'):>8} "
                         f"{r['output_tokens_per_s']:>10.1f}")
    wave = {r["concurrency"]: r for r in results.get("wave", [])}
    cont = {r["concurrency"]: r for r in results.get("continuous", [])}
    if 32 in wave and 32 in cont:
        lines.append(
            f"at concurrency 32: output tokens/s continuous / wave = "
            f"{cont[32]['output_tokens_per_s'] / wave[32]['output_tokens_per_s']:.2f}; "
            f"TTFT p99 continuous / wave = {cont[32]['ttft_p99_s'] / wave[32]['ttft_p99_s']:.2f}")
    fp8 = {r["concurrency"]: r for r in results.get("continuous-fp8", [])}
    if 32 in fp8 and 32 in cont:
        lines.append(
            f"at concurrency 32: output tokens/s FP8 / bf16 = "
            f"{fp8[32]['output_tokens_per_s'] / cont[32]['output_tokens_per_s']:.3f}")
    dw = {r["concurrency"]: r for r in results.get("continuous+dwdp", [])}
    if 32 in dw and 32 in cont:
        lines.append(
            f"at concurrency 32: output tokens/s DWDP / replicated = "
            f"{dw[32]['output_tokens_per_s'] / cont[32]['output_tokens_per_s']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_group_arguments(ap, layers=4)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--max-output", type=int, default=512, help="longest output, tokens")
    ap.add_argument("--fp8", action="store_true",
                    help="also serve the checkpoint's block-scaled FP8 twin (replicated)")
    args = ap.parse_args(argv)
    MAX_OUTPUT[0] = args.max_output
    if args.rank is not None:
        rank_main(args)
        return 0
    extra = ["--requests-per-slot", str(args.requests_per_slot),
             "--max-output", str(args.max_output)]
    try:
        results, _ = run_group(__file__, args, extra, fp8=args.fp8)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    write_result(args, "gpu_serve", _report(results, args.layers), {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
