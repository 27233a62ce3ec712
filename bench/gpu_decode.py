"""Decode on one GPU: the engine's decode step with CUDA graphs, eager, transformers' compiled
static cache and the bytes-read floor; then serving through HTTP against ``generate``.

One process, one GPU. It writes the seeded Qwen3-MoE checkpoint of the other GPU benches
(``--layers`` layers of 128 experts of 768, top-8, hidden 2048, bf16; ``bench/gpu_common``),
loads it with the worker's GPU kernels and attention (``gpu_common.load``) and measures, each
section on its own (a failing section prints its traceback, is named under ``errors`` and the
rest still runs; the JSON is written either way):

- ``copy``: the copy bandwidth, bytes read per second of a 2 GiB device-to-device copy (best
  of 5);
- ``engine`` / ``eager``: the wall time of one decode-only step of ``ContinuousEngine``
  (``EngineConfig(max_batch_size=64, max_num_tokens=8192, max_model_len=4096,
  kv_capacity_tokens=64 * 4096)``), with ``cuda_graphs=True`` and ``capture_cuda_graphs()``
  called, then with ``cuda_graphs=False``, at each batch of ``--batches`` and context of
  ``--contexts``. Method: ``batch`` requests of ``context`` random prompt tokens (greedy,
  EOS ignored) join the engine (its thread not started) and the bench drives its steps
  itself (``engine._step()`` under ``engine._step_lock``, as ``run_batch`` does) until every
  request has its first token (prefill done, chunked at 8192 tokens a step), runs
  ``--warmup`` decode steps, then times ``--steps`` decode steps between two device syncs:
  ``step_ms`` = that wall time / ``--steps``. A step is everything the engine does for it on
  the host and the GPU: scheduling, input building, the forward (or graph replay), sampling
  with its copy to the host, and delivering tokens. Each row also records the tokens
  delivered per step in the window (``batch`` when every step was decode-only for every
  request), the graph replays in the window (``EngineStats.graph_replays`` where the engine
  has it) and the preemptions (0 expected);
- ``reference``: the same checkpoint in transformers (its own kernels and SDPA, no worker
  kernels) with ``generate(cache_implementation="static")``, which compiles the decode
  forward (``torch.compile``, mode ``reduce-overhead``): step = (t(64) - t(8)) / 56 from
  ``generate`` of 64 and 8 new tokens on the same ``batch`` x ``context`` prompt (medians of
  3 runs each, after two warm-up runs that compile); at ``--reference-batches`` x
  ``--reference-contexts`` only (each pair compiles once);
- ``floor``: the bytes a decode step must read over the copy bandwidth: every weight but the
  routed experts and the input embedding (attention, norms, routers, ``lm_head``), the input
  embedding's ``batch`` rows, the routed experts a batch touches in expectation (per layer
  ``E * (1 - (1 - k / E) ** batch)`` of ``E`` experts, top-``k``) and the KV cache of
  ``batch`` x ``context`` tokens. ``floor_ms`` divides by the copy's bytes read per second;
  a copy also writes as many bytes, so ``floor_traffic_ms`` (over twice that rate, the
  copy's read + write traffic) is the tighter floor of a step that only reads;
- ``serve``: ``bench/gpu_serve.py``'s streaming clients at ``--levels`` concurrencies
  (its workload: prompts of 32-2048 token ids, outputs of 16 to ``--max-output`` tokens, EOS
  ignored, ``--requests-per-slot`` requests per concurrency slot) against the engine with CUDA
  graphs behind the OpenAI app, and transformers' batched ``generate`` over the same work
  (``gpu_serve.generate_baseline``, the worker-kernel model, no HTTP). With ``--structured
  json`` the engine serves each level twice on one engine and server, free text and then
  every request constrained (``gpu_serve.structured_body``: ``"structured_outputs": {"json":
  SCHEMA}``, SCHEMA an object holding an array of at least ``--max-output`` integers, so
  the grammar cannot end an answer before its ``max_tokens`` and both modes serve the same
  work), ``--structured-rounds`` times in turn (free, json at c1, then at c8, ...), after
  warming the constrained mode up at the largest level. Output tokens/s and ITL come from
  the tokens the streams delivered (each row also has ``output_tokens``, ``asked_tokens`` and
  ``finish_reasons``); the figures of a mode pool its rounds (tokens over summed wall time;
  the median of every inter-token gap). ``structured_host``: the host time of the engine's
  calls of ``grammar.masked`` (timed by wrapping the sampler's reference to it; the mask
  fill and the launches, not the device's work) and of ``Constraint.accept``, per step.

Usage: python bench/gpu_decode.py [--layers 4] [--quick] [--out bench/results]
                                  [--batches 1,8,32,64] [--contexts 256,2048] [--steps 32]
                                  [--reference-batches 1,8,32] [--reference-contexts 256]
                                  [--levels 1,8,32,64] [--max-output 96]
                                  [--requests-per-slot 2] [--skip SECTIONS] [--workdir DIR]
                                  [--structured json] [--structured-rounds 2]
                                  [--spec-ngram K]
``--quick``: batches 1,8 at context 256, reference at batch 1, serving at 1 and 8 (a smoke run);
``--skip engine,eager,serve,generate,reference``: leave those sections out (``generate``: the
serving section's transformers baseline).
``--spec-ngram K``: also the engine with n-gram drafts of K tokens (speculative decoding, CUDA
graphs: verify steps replay the verify graphs), the same rows as ``engine``; its lines give the
step, the tokens a request gets per step, the acceptance and the time per output token of a
request over the engine's without drafts (``details.spec`` of each row).
``--device cpu --tiny``: a tiny float32 model on the CPU (checks the bench itself; capture
fails there by design and is reported under ``errors``).
Writes OUT/gpu_decode.json (``rows``: ``batch``, ``context``, ``engine_step_ms``,
``eager_step_ms``, ``reference_step_ms``, ``floor_ms`` and the rows' details; ``serve``:
``engine`` and ``generate`` per concurrency, ``c32_ratio_vs_generate`` (the engine's output
tokens/s over generate's at concurrency 32), ``itl_p50_c1_ms``; with ``--structured``:
``structured`` (the rows of both modes), ``pooled`` (per mode and level),
``structured_c32_tokens_ratio`` (constrained output tokens/s over free at concurrency 32),
``structured_itl_c1_ratio`` (constrained ITL p50 over free at concurrency 1) and
``structured_host``; ``copy_bytes_per_s``,
``graphs``, ``errors``) and OUT/gpu_decode.txt (the printed table), rewritten after each
section (a run cut short keeps what it measured); exit status 1 when a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import load, write_result

MAX_BATCH = 64
MAX_NUM_TOKENS = 8192
MAX_MODEL_LEN = 4096
REFERENCE_TOKENS = (64, 8)
SECTIONS = ("engine", "eager", "serve", "generate", "reference")
QUICK = {"batches": "1,8", "contexts": "256", "reference_batches": "1",
         "reference_contexts": "256", "levels": "1,8", "steps": 16, "requests_per_slot": 1}


# -- sections ---------------------------------------------------------------------------------
def guarded(errors: dict[str, str], name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``None`` when it raised: the traceback goes to stderr and its last line to
    ``errors[name]``."""
    try:
        return fn()
    except Exception as exc:  # a section's failure must not stop the others
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"[{name}] failed: {errors[name]}", file=sys.stderr, flush=True)
        return None


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read per second of a large copy on ``device`` (2 GiB on a GPU, 64 MiB on the
    CPU), the best of 5 after one warm-up copy."""
    import torch

    nbytes = 2 << 30 if device.startswith("cuda") else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return nbytes / best


def step_bytes(model: Any, batch: int, context: int) -> int:
    """Bytes one decode step of ``batch`` requests at ``context`` tokens must read (see the
    module docstring, ``floor``)."""
    cfg = model.config.get_text_config()
    embed = model.get_input_embeddings().weight
    experts = other = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if p is embed:
            continue
        if ".experts." in name:
            experts += size
        else:
            other += size  # lm_head among them (untied in this checkpoint)
    e, k = int(cfg.num_experts), int(cfg.num_experts_per_tok)
    touched = e * (1 - (1 - k / e) ** batch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
                    * embed.element_size())
    rows = batch * embed.shape[1] * embed.element_size()
    return int(other + rows + experts / e * touched + kv_per_token * batch * context)


def engine_config(graphs: bool, spec: Any = None) -> Any:
    from dwdp.worker.engine.base import EngineConfig

    return EngineConfig(max_batch_size=MAX_BATCH, max_num_tokens=MAX_NUM_TOKENS,
                        max_model_len=MAX_MODEL_LEN, kv_capacity_tokens=MAX_BATCH * MAX_MODEL_LEN,
                        cuda_graphs=graphs, speculative=spec)


def spec_config(k: int) -> Any:
    """``--spec-ngram K``: n-gram drafts of ``K`` tokens, vLLM's lookup defaults (1 to K)."""
    from dwdp.worker.engine.speculative import SpeculativeConfig

    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=k)


def make_engine(model: Any, tok: Any, graphs: bool, spec: Any = None) -> tuple[Any, dict | None]:
    """A ``ContinuousEngine`` (not started), its graphs captured when ``graphs`` (with
    ``spec``, a ``SpeculativeConfig``, its verify graphs too); returns it and the capture's
    ``GraphStats`` as a dict (``None`` without graphs)."""
    from dwdp.worker.engine.continuous import ContinuousEngine

    engine = ContinuousEngine(model, tok, model_name="bench",
                              config=engine_config(graphs, spec))
    if not graphs:
        return engine, None
    start = time.perf_counter()
    stats = engine.capture_cuda_graphs()
    return engine, {"buckets": list(stats.buckets), "token_buckets": list(stats.token_buckets),
                    "pool_bytes": stats.pool_bytes, "capture_s": time.perf_counter() - start}


def decode_step(engine: Any, batch: int, context: int, *, steps: int, warmup: int,
                device: str) -> dict:
    """One row of ``engine`` (see the module docstring, ``engine``): ``step_ms`` and what the
    timed window delivered. Raises ``RuntimeError`` when prefill does not end or a request
    ends inside the window."""
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.engine.requests import RequestState

    rng = random.Random(batch * 100003 + context)
    prefill_steps = batch * context // MAX_NUM_TOKENS + batch + 8
    # the first requests decode while the last ones still prefill: room for those steps too
    spec = engine.config.speculative  # with drafts a step may give 1 + k tokens a request
    per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    params = SamplingParams(max_tokens=prefill_steps + (warmup + steps) * per_step + 16,
                            ignore_eos=True)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(context)] for _ in range(batch)]
    states = [RequestState(f"d{batch}x{context}-{i}", p, params) for i, p in enumerate(prompts)]
    with engine._step_lock:
        for state in states:
            engine.validate(state.prompt, params)
            engine._add(state)
        try:
            for _ in range(prefill_steps):
                if all(s.tokens for s in states):
                    break
                engine._step()
            else:
                raise RuntimeError(f"prefill of {batch} x {context} tokens did not end")
            for _ in range(warmup):
                engine._step()
            stats = engine.stats
            replays = getattr(stats, "graph_replays", None)
            tokens, preempted = stats.generation_tokens, stats.preemptions
            drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                engine._step()
            _sync(device)
            wall = time.perf_counter() - start
            if any(s.finished for s in states):
                raise RuntimeError("a request ended inside the timed window")
            after = getattr(stats, "graph_replays", None)
            drafted = stats.spec_draft_tokens - drafted
            return {"step_ms": wall / steps * 1e3,
                    "tokens_per_step": (stats.generation_tokens - tokens) / steps,
                    "graph_replays": None if replays is None else after - replays,
                    "preemptions": stats.preemptions - preempted,
                    "acceptance": (stats.spec_accepted_tokens - accepted) / drafted
                    if drafted else None}
        finally:
            _end_all(engine, states)


def _end_all(engine: Any, states: list) -> None:
    """Abort ``states`` and step until the scheduler holds no request (their blocks go back;
    at most 4 steps)."""
    for state in states:
        state.aborted = True
    try:
        for _ in range(4):
            engine._step()
            if not engine.scheduler.has_work:
                break
    except Exception as exc:  # the row already failed; its error is the one reported
        print(f"cleanup step failed: {exc!r}", file=sys.stderr)


def engine_rows(model: Any, tok: Any, args: argparse.Namespace, graphs: bool,
                errors: dict[str, str], spec: Any = None) -> tuple[dict, dict | None]:
    """``{(batch, context): row}`` of one engine (see ``decode_step``; rows that failed are
    absent and named in ``errors``) and its capture's stats; ``spec``: with drafts."""
    name = "spec" if spec is not None else "engine" if graphs else "eager"
    made = guarded(errors, f"{name}.build", lambda: make_engine(model, tok, graphs, spec))
    if made is None:
        return {}, None
    engine, captured = made
    rows = {}
    for batch in args.batches:
        for context in args.contexts:
            row = guarded(errors, f"{name}.b{batch}.c{context}", lambda b=batch, c=context:
                          decode_step(engine, b, c, steps=args.steps, warmup=args.warmup,
                                      device=args.device))
            if row is not None:
                rows[(batch, context)] = row
                print(f"{name} b{batch} c{context}: {row['step_ms']:.3f} ms/step "
                      f"({row['tokens_per_step']:.1f} tokens/step, replays "
                      f"{row['graph_replays']})", flush=True)
    return rows, captured


def _release() -> None:
    """Free what dropped engines held (an engine and its runner refer to each other)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reference_step(model: Any, batch: int, context: int, device: str) -> dict:
    """The decode step of transformers' compiled static cache (see the module docstring,
    ``reference``), ms."""
    import torch

    long, short = REFERENCE_TOKENS
    for attr in ("_cache", "_previous_max_cache_length"):  # a new static cache per shape
        if hasattr(model, attr):
            delattr(model, attr)
    g = torch.Generator().manual_seed(batch * 7 + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, cache_implementation="static")
        _sync(device)
        return time.perf_counter() - start

    compile_s = run(long)
    run(long)
    times: dict[int, list[float]] = {long: [], short: []}
    for _ in range(3):
        for n in (long, short):
            times[n].append(run(n))
    t_long, t_short = statistics.median(times[long]), statistics.median(times[short])
    return {"step_ms": (t_long - t_short) / (long - short) * 1e3, "first_run_s": compile_s,
            "t_long_s": t_long, "t_short_s": t_short}


def reference_rows(ckpt: str, args: argparse.Namespace, errors: dict[str, str]) -> dict:
    """``{(batch, context): row}`` of ``reference_step`` over the reference pairs."""
    import torch

    model, _tok = load_model(ckpt, args, kernels="transformers")
    for knob in ("cache_size_limit", "recompile_limit"):  # one compile per (batch, context)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    rows = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
    for batch in args.reference_batches:
        for context in args.reference_contexts:
            row = guarded(errors, f"reference.b{batch}.c{context}", lambda b=batch, c=context:
                          reference_step(model, b, c, args.device))
            if row is not None:
                rows[(batch, context)] = row
                print(f"reference b{batch} c{context}: {row['step_ms']:.3f} ms/step "
                      f"(first run {row['first_run_s']:.1f} s)", flush=True)
    return rows


def serve(model: Any, tok: Any, args: argparse.Namespace, errors: dict[str, str]) -> dict:
    """The serving section: the engine (CUDA graphs on a GPU) through HTTP and ``generate``
    at ``args.levels``, and the summary figures (with ``--structured``, both modes')."""
    import gpu_serve

    gpu_serve.MAX_OUTPUT[0] = args.max_output
    vocab = model.config.vocab_size
    levels = tuple(args.levels)
    graphs = args.device.startswith("cuda")
    out: dict[str, Any] = {"cuda_graphs": graphs}
    modes = (None, args.structured) if args.structured else (None,)
    rounds = args.structured_rounds if args.structured else 1

    def engine_side() -> list[dict]:
        engine, out["graphs"] = make_engine(model, tok, graphs)
        engine.start()
        try:
            with grammar_host_time() as host:
                rows = gpu_serve.serve_and_drive(engine, args.requests_per_slot, vocab, levels,
                                                 modes=modes, rounds=rounds)
            if args.structured:
                out["structured_host"] = host_summary(host)
            return rows
        finally:
            engine.stop()
            del engine
            _release()

    rows = guarded(errors, "serve.engine", engine_side) or []
    out["pooled"] = {str(m): pooled([r for r in rows if r["structured"] == m], levels)
                     for m in modes}
    out["engine"] = out["pooled"]["None"]
    if args.structured:
        out["structured"] = rows
    print("serve engine", out["engine"], flush=True)
    if "generate" not in args.skip:
        out["generate"] = guarded(errors, "serve.generate", lambda: gpu_serve.generate_baseline(
            model, args.requests_per_slot, vocab, levels)) or []
        print("serve generate", out["generate"], flush=True)
    eng = {r["concurrency"]: r for r in out["engine"]}
    gen = {r["concurrency"]: r for r in out.get("generate", [])}
    out["c32_ratio_vs_generate"] = (
        eng[32]["output_tokens_per_s"] / gen[32]["output_tokens_per_s"]
        if 32 in eng and 32 in gen else None)
    itl = eng.get(1, {}).get("itl_p50_s")
    out["itl_p50_c1_ms"] = itl * 1e3 if itl is not None else None
    if args.structured:
        con = {r["concurrency"]: r for r in out["pooled"][args.structured]}
        out["structured_c32_tokens_ratio"] = _ratio(
            con.get(32, {}).get("output_tokens_per_s"), eng.get(32, {}).get("output_tokens_per_s"))
        out["structured_itl_c1_ratio"] = _ratio(con.get(1, {}).get("itl_p50_s"), itl)
    return out


def pooled(rows: list[dict], levels: tuple[int, ...]) -> list[dict]:
    """One row per level from its rounds' rows (``gpu_serve._figures``): output tokens/s =
    the rounds' tokens over their summed wall time, ITL and TTFT p50 = the median of the
    rounds' medians, each round's tokens/s and ITL p50 kept."""
    out = []
    for c in levels:
        got = [r for r in rows if r["concurrency"] == c]
        if not got:
            continue
        wall, tokens = sum(r["wall_s"] for r in got), sum(r["output_tokens"] for r in got)
        itls = [r["itl_p50_s"] for r in got if r["itl_p50_s"] is not None]
        reasons: dict[str, int] = {}
        for r in got:
            for k, v in r["finish_reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        out.append({
            "concurrency": c, "rounds": len(got), "requests": sum(r["requests"] for r in got),
            "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "itl_p50_s": statistics.median(itls) if itls else None,
            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in got),
            "output_tokens": tokens, "asked_tokens": sum(r["asked_tokens"] for r in got),
            "finish_reasons": reasons,
            "per_round_tokens_per_s": [r["output_tokens_per_s"] for r in got],
            "per_round_itl_p50_s": [r["itl_p50_s"] for r in got]})
    return out


@contextlib.contextmanager
def grammar_host_time() -> Any:
    """Time, on the host, the engine's calls of ``grammar.masked`` (through the sampler's
    reference) and of ``Constraint.accept``; yields ``{"masked": {rows: [calls, seconds]},
    "accept": [calls, seconds]}``, filled while the block runs."""
    import dwdp.worker.engine.sampler as sampler
    from dwdp.worker.engine.grammar import Constraint

    host: dict[str, Any] = {"masked": {}, "accept": [0, 0.0]}
    masked, accept = sampler.masked, Constraint.accept

    def timed_masked(logits: Any, constraints: list) -> Any:
        start = time.perf_counter()
        try:
            return masked(logits, constraints)
        finally:
            entry = host["masked"].setdefault(sum(c is not None for c in constraints), [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def timed_accept(self: Any, token: int) -> bool:
        start = time.perf_counter()
        try:
            return accept(self, token)
        finally:
            host["accept"][0] += 1
            host["accept"][1] += time.perf_counter() - start

    sampler.masked, Constraint.accept = timed_masked, timed_accept  # type: ignore[method-assign]
    try:
        yield host
    finally:
        sampler.masked, Constraint.accept = masked, accept  # type: ignore[method-assign]


def host_summary(host: dict[str, Any]) -> dict[str, Any]:
    """``grammar_host_time``'s counts as microseconds per call: ``masked_us`` by constrained
    rows in the step (warm-up included), ``accept_us``."""
    calls, secs = host["accept"]
    return {"masked_us": {rows: {"calls": n, "us_per_call": s / n * 1e6}
                          for rows, (n, s) in sorted(host["masked"].items())},
            "accept_calls": calls, "accept_us": secs / calls * 1e6 if calls else None}


# -- the run ----------------------------------------------------------------------------------
def load_model(ckpt: str, args: argparse.Namespace, kernels: str = "fused") -> tuple[Any, Any]:
    """The checkpoint with ``gpu_common.load`` (``kernels``) on a GPU; on the CPU (smoke runs)
    as ``load_checkpoint`` gives it."""
    if args.device.startswith("cuda"):
        model, tok, _ = load(ckpt, kernels=kernels)
        return model, tok
    from dwdp.worker.loading.checkpoint import load_checkpoint

    return load_checkpoint(ckpt)


def write_checkpoint(args: argparse.Namespace, work: Path) -> str:
    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape, write_qwen3_moe_checkpoint

    shape = Qwen3MoeShape(num_layers=args.layers)
    if args.tiny:
        shape = Qwen3MoeShape(num_layers=args.layers, hidden_size=64, num_experts=16,
                              moe_intermediate_size=32, num_experts_per_tok=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              dtype="float32")
    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    return str(write_qwen3_moe_checkpoint(work / "ck", shape, seed=3, device=device))


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every section not in ``--skip``, in order; what each gives goes into ``result``
    (``measured``: the step rows by engine and (batch, context); ``serve``, ``graphs``,
    ``copy_bytes_per_s``, ``bytes``) and a failure into ``result["errors"]``. The files are
    rewritten after each section, so a run cut short leaves what it measured."""
    import torch

    errors, measured = result["errors"], result["measured"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dwdp-gpu-decode-"))
    try:
        if args.device.startswith("cuda"):
            torch.cuda.set_device(0)
            result["device_name"] = torch.cuda.get_device_name(0)
        ckpt = guarded(errors, "checkpoint", lambda: write_checkpoint(args, work))
        if ckpt is None:
            return
        result["copy_bytes_per_s"] = guarded(errors, "copy", lambda: copy_bandwidth(args.device))
        loaded = guarded(errors, "load", lambda: load_model(ckpt, args))
        if loaded is not None:
            model, tok = loaded
            result["bytes"] = guarded(errors, "floor", lambda: {
                f"{b}x{c}": step_bytes(model, b, c) for b in args.batches for c in args.contexts})
            for name, graphs in (("engine", True), ("eager", False)):
                if name not in args.skip:
                    measured[name], captured = engine_rows(model, tok, args, graphs, errors)
                    result.setdefault("graphs", captured)
                    _release()
                    save(args, result)
            if args.spec_ngram:
                measured["spec"], _ = engine_rows(model, tok, args, True, errors,
                                                  spec_config(args.spec_ngram))
                _release()
                save(args, result)
            if "serve" not in args.skip:
                result["serve"] = serve(model, tok, args, errors)
                save(args, result)
            del model, tok, loaded
            _release()
        if "reference" not in args.skip:
            got = guarded(errors, "reference", lambda: reference_rows(ckpt, args, errors)) or {}
            result["reference_experts_implementation"] = got.pop("experts_implementation", None)
            measured["reference"] = got
    finally:
        shutil.rmtree(work, ignore_errors=True)


def save(args: argparse.Namespace, result: dict[str, Any], *, final: bool = False) -> None:
    """Write OUT/gpu_decode.json and .txt from ``result`` (printed when ``final``)."""
    import contextlib
    import io

    result["elapsed_s"] = time.perf_counter() - result["started"]
    payload = {k: v for k, v in result.items() if k not in ("measured", "started")}
    payload["rows"] = table_rows(args, result["measured"], result.get("bytes") or {},
                                 result.get("copy_bytes_per_s"))
    text = report(payload, args)
    with contextlib.redirect_stdout(sys.stdout if final else io.StringIO()):
        write_result(args, "gpu_decode", text, payload)


def table_rows(args: argparse.Namespace, measured: dict[str, dict], nbytes: dict[str, int],
               bw: float | None) -> list[dict]:
    """One row per (batch, context): the step times (ms, ``None`` where not measured), the
    floor and each measurement's details."""
    rows = []
    for b in args.batches:
        for c in args.contexts:
            got = {name: measured.get(name, {}).get((b, c))
                   for name in ("engine", "eager", "reference", "spec")}
            step = {name: (r["step_ms"] if r else None) for name, r in got.items()}
            size = nbytes.get(f"{b}x{c}")
            rows.append({"batch": b, "context": c, "engine_step_ms": step["engine"],
                         "eager_step_ms": step["eager"], "reference_step_ms": step["reference"],
                         "floor_ms": size / bw * 1e3 if size and bw else None,
                         "floor_traffic_ms": size / (2 * bw) * 1e3 if size and bw else None,
                         "step_bytes": size, "details": got})
    return rows


# -- the report -------------------------------------------------------------------------------
def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(result: dict, args: argparse.Namespace) -> str:
    bw = result.get("copy_bytes_per_s")
    lines = [f"Qwen3-MoE {args.layers} layers{' (tiny)' if args.tiny else ''}, "
             f"{result.get('device_name', args.device)}; copy {_f(bw and bw / 1e9, '.0f')} GB/s "
             f"read; graphs {result.get('graphs')}",
             "decode step, ms (engine: CUDA graphs; reference: transformers static cache, "
             "compiled; floor: bytes read / copy bandwidth)",
             f"{'batch':>5} {'ctx':>5} {'engine':>8} {'eager':>8} {'reference':>9} "
             f"{'floor':>7} {'eng/ref':>7} {'eng/floor':>9} {'tok/step':>8}"]
    by = {}
    for r in result.get("rows", []):
        by[(r["batch"], r["context"])] = r
        eng = r["details"]["engine"]
        lines.append(
            f"{r['batch']:>5} {r['context']:>5} {_f(r['engine_step_ms']):>8} "
            f"{_f(r['eager_step_ms']):>8} {_f(r['reference_step_ms']):>9} {_f(r['floor_ms']):>7} "
            f"{_f(_ratio(r['engine_step_ms'], r['reference_step_ms']), '.2f'):>7} "
            f"{_f(_ratio(r['engine_step_ms'], r['floor_ms']), '.1f'):>9} "
            f"{_f(eng and eng['tokens_per_step'], '.1f'):>8}")
    if args.spec_ngram:
        lines += spec_report(result.get("rows", []), args)
    long, short = by.get((32, 2048)), by.get((32, 256))
    if long and short:
        lines.append("batch 32: engine step at context 2048 / at 256 = "
                     f"{_f(_ratio(long['engine_step_ms'], short['engine_step_ms']), '.2f')}")
    s = result.get("serve") or {}
    lines.append(f"serving through HTTP (prompts 32-2048, outputs 16-{args.max_output}; engine "
                 f"cuda_graphs={s.get('cuda_graphs')}) vs transformers' batched generate")
    lines.append(f"{'conc':>4} {'out tok/s':>10} {'ITL p50':>8} {'TTFT p50':>9} "
                 f"{'generate':>10} {'ratio':>6}")
    gen = {r["concurrency"]: r for r in s.get("generate", [])}
    for r in s.get("engine", []):
        g = gen.get(r["concurrency"], {}).get("output_tokens_per_s")
        lines.append(f"{r['concurrency']:>4} {r['output_tokens_per_s']:>10.1f} "
                     f"{_f(r['itl_p50_s'] and r['itl_p50_s'] * 1e3, '.2f'):>8} "
                     f"{_f(r['ttft_p50_s'] * 1e3, '.1f'):>9} {_f(g, '.1f'):>10} "
                     f"{_f(_ratio(r['output_tokens_per_s'], g), '.2f'):>6}")
    lines.append(f"c32 output tok/s engine / generate = {_f(s.get('c32_ratio_vs_generate'), '.2f')}"
                 f"; ITL p50 at c1 = {_f(s.get('itl_p50_c1_ms'), '.2f')} ms")
    if args.structured:
        lines += structured_report(s, args)
    for name, err in result.get("errors", {}).items():
        lines.append(f"ERROR {name}: {err}")
    lines.append(f"elapsed {result.get('elapsed_s', 0):.0f} s")
    return "\n".join(lines)


def spec_report(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """The ``--spec-ngram`` lines: per row the step with drafts, its tokens a request and
    step, and the time per output token of a request over the engine's without drafts."""
    lines = [f"n-gram drafts ({args.spec_ngram} a step, CUDA graphs; verify steps replay the "
             "verify graphs): step ms, tokens per request and step, acceptance, ITL vs engine",
             f"{'batch':>5} {'ctx':>5} {'step':>8} {'tok/req':>7} {'accept':>6} {'ITL':>8} "
             f"{'ITL/eng':>7}"]
    for r in rows:
        spec, eng = r["details"].get("spec"), r["engine_step_ms"]
        if not spec:
            continue
        per = spec["tokens_per_step"] / r["batch"]
        itl = spec["step_ms"] / per if per else None
        lines.append(f"{r['batch']:>5} {r['context']:>5} {spec['step_ms']:>8.3f} {per:>7.2f} "
                     f"{_f(spec['acceptance'], '.2f'):>6} {_f(itl):>8} "
                     f"{_f(_ratio(itl, eng), '.2f'):>7}")
    return lines


def structured_report(s: dict, args: argparse.Namespace) -> list[str]:
    """The ``--structured`` lines of the report: both modes per level, the two ratios and the
    host time of the grammar's calls."""
    lines = [f"structured outputs: every request {args.structured} (an array of at least "
             f"{args.max_output} integers) vs free text, one engine, "
             f"{args.structured_rounds} rounds pooled",
             f"{'conc':>4} {'mode':>5} {'out tok/s':>10} {'ITL p50':>8} {'TTFT p50':>9} "
             f"{'tokens/asked':>13}  finish; per round: tok/s, ITL p50 ms"]
    for c in args.levels:
        for mode, rows in (s.get("pooled") or {}).items():
            for r in (r for r in rows if r["concurrency"] == c):
                per = ", ".join(f"{t:.0f}/{_f(i and i * 1e3, '.2f')}" for t, i in
                                zip(r["per_round_tokens_per_s"], r["per_round_itl_p50_s"],
                                    strict=True))
                lines.append(
                    f"{c:>4} {mode if mode != 'None' else 'free':>5} "
                    f"{r['output_tokens_per_s']:>10.1f} "
                    f"{_f(r['itl_p50_s'] and r['itl_p50_s'] * 1e3, '.3f'):>8} "
                    f"{_f(r['ttft_p50_s'] * 1e3, '.1f'):>9} "
                    f"{r['output_tokens']:>6}/{r['asked_tokens']:<6}  {r['finish_reasons']}; {per}")
    lines.append(f"c32 output tok/s {args.structured} / free = "
                 f"{_f(s.get('structured_c32_tokens_ratio'), '.3f')} (target >= 0.90); "
                 f"c1 ITL p50 {args.structured} / free = "
                 f"{_f(s.get('structured_itl_c1_ratio'), '.3f')} (target <= 1.15)")
    host = s.get("structured_host") or {}
    per = ", ".join(f"{rows} rows {v['us_per_call']:.0f} us ({v['calls']})"
                    for rows, v in (host.get("masked_us") or {}).items())
    lines.append(f"host time per call: grammar.masked by constrained rows: {per or '-'}; "
                 f"Constraint.accept {_f(host.get('accept_us'), '.1f')} us")
    return lines


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (module docstring); lists come back as lists of ints."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rows (a smoke run)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per row")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before timing")
    ap.add_argument("--reference-batches", default="1,8,32")
    ap.add_argument("--reference-contexts", default="256")
    ap.add_argument("--levels", default="1,8,32,64", help="serving concurrencies")
    ap.add_argument("--max-output", type=int, default=96, help="longest served output, tokens")
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--skip", default="", help="sections to leave out: engine,eager,serve,"
                    "generate,reference")
    ap.add_argument("--structured", choices=("json",), default=None,
                    help="serve each level free and with every request constrained")
    ap.add_argument("--structured-rounds", type=int, default=2,
                    help="with --structured: rounds of (free, constrained) per level")
    ap.add_argument("--spec-ngram", type=int, default=0, metavar="K",
                    help="also the engine with n-gram drafts of K tokens (spec rows)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (smoke runs)")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if ap.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    args.skip = [x for x in args.skip.split(",") if x]
    unknown = set(args.skip) - set(SECTIONS)
    if unknown:
        ap.error(f"--skip: {','.join(sorted(unknown))}, not among {','.join(SECTIONS)}")
    for key in ("batches", "contexts", "reference_batches", "reference_contexts", "levels"):
        setattr(args, key, _ints(str(getattr(args, key))))
    if max(args.batches) > MAX_BATCH or max(args.levels) > MAX_BATCH:
        ap.error(f"--batches/--levels: at most {MAX_BATCH} (the engine's max_batch_size)")
    if args.max_output < 16:
        ap.error(f"--max-output: {args.max_output}, at least 16 (the shortest served output)")
    if max(args.contexts) + (args.warmup + args.steps) * (1 + args.spec_ngram) + 16 \
            > MAX_MODEL_LEN:
        ap.error(f"--contexts: context + (warmup + steps) x (1 + --spec-ngram) + 16 must fit "
                 f"{MAX_MODEL_LEN} tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"errors": {}, "measured": {}, "started": time.perf_counter()}
    try:
        run(args, result)
    except Exception as exc:  # outside every section: still write what is known
        traceback.print_exc()
        result["errors"]["run"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    finally:
        save(args, result, final=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
