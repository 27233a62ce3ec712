"""The OpenAI front end's own cost per streamed token: the worker's app (``build_app``: the
guard, the request counter, FastAPI's routing, the completions serving, the server-sent
events) in front of an engine that answers at once, so what is measured is the host work a
GPU engine's decode step waits behind (the serving process's event loop shares the
interpreter with the engine's thread).

The engine here takes no step: each request yields ``max_tokens`` one-token updates, one per
turn of the event loop, as a real engine's step sends one update per running request. The
clients (``bench/gpu_serve.py``'s, streaming, in a process of their own) send that bench's
mixed prompts. Reported per concurrency: output tokens/s through HTTP and the serving
process's CPU time per streamed token (microseconds; ``time.process_time`` over the run, the
client excluded). Runs on the CPU; no model.

Usage: python bench/http_stream.py [--levels 1,32] [--requests-per-slot 4] [--max-output 96]
                                   [--out bench/results]
Writes OUT/http_stream.json and OUT/http_stream.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serve

from dwdp.worker.engine.protocol import RequestOutput, SamplingParams

VOCAB = 32000


class InstantEngine:
    """An ``EngineClient`` whose every token is ready at once (one update per loop turn)."""

    model_name = "bench"
    max_model_len = 8192
    kv = None
    tokenizer = None

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, kv_transfer: Any = None, *,
                       shared: Any = None) -> AsyncGenerator[RequestOutput, None]:
        n = params.max_tokens
        for i in range(n):
            await asyncio.sleep(0)
            last = i == n - 1
            yield RequestOutput(request_id, [i % VOCAB], "x", len(prompt_token_ids), i + 1,
                                finished=last, finish_reason="length" if last else None)

    async def score_prompt(self, prompt_token_ids: Sequence[int], top: int) -> list:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def snapshot(self) -> None:
        return None


def measure(levels: Sequence[int], per_slot: int) -> list[dict]:
    """Each level's output tokens/s and the serving process's CPU microseconds per token."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from dwdp.worker.server.app import build_app

    rows = []
    spawn = multiprocessing.get_context("spawn")
    with gpu_serve.serving_app(build_app(InstantEngine(), served_name="bench")) as base, \
            ProcessPoolExecutor(1, mp_context=spawn) as clients:
        def run(n: int, seed: int, c: int) -> dict:
            return clients.submit(gpu_serve._drive_workload, base, n, VOCAB, seed, c,
                                  gpu_serve.MAX_OUTPUT[0]).result()

        run(4, 99, 2)  # warm-up
        for c in levels:
            cpu = time.process_time()
            row = run(max(4, c * per_slot), c, c)
            cpu = time.process_time() - cpu
            tokens = row["output_tokens_per_s"] * row["wall_s"]
            rows.append({**row, "server_cpu_s": cpu, "cpu_us_per_token": cpu / tokens * 1e6})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["OpenAI front end with an instant engine (bench/http_stream.py): streamed "
             f"completions, outputs 16-{gpu_serve.MAX_OUTPUT[0]} tokens",
             f"{'conc':>4} {'out tok/s':>10} {'server CPU us/token':>20}"]
    lines += [f"{r['concurrency']:>4} {r['output_tokens_per_s']:>10.0f} "
              f"{r['cpu_us_per_token']:>20.1f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--levels", default="1,32")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--max-output", type=int, default=96)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    gpu_serve.MAX_OUTPUT[0] = args.max_output
    rows = measure([int(x) for x in args.levels.split(",")], args.requests_per_slot)
    text = report(rows)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_stream.txt").write_text(text + "\n")
    (out / "http_stream.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
