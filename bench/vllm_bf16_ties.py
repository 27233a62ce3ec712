"""vLLM decoding a dwdp context rank's KV against vLLM alone, in bfloat16 and float32: how many
greedy answers differ, and whether each difference is a near-tie (issue 58, item 4).

For each dtype it writes a seeded tiny Qwen3-MoE checkpoint (``dwdp_dev.worker.checkpoint``:
hidden 256, 4 layers, head size 64, 8 experts of 128; the float32 and bfloat16 checkpoints hold
the same draws) and serves it on this machine's CPU, loopback only, as
``tests/unit/worker/test_vllm_interop.py`` does: an unmodified vLLM 0.32.0 server
(``kv_consumer``, the environment of ``scripts/vllm-cpu-venv.sh``; one OpenMP thread) and a
dwdp context rank (``EngineServer`` with ``VllmInterop``). Every prompt (``--prompts`` seeded
prompts of 16 to 300 token ids: one to three vLLM blocks) is answered greedily (``--output``
tokens, EOS ignored, ``logprobs: 5``) three ways:

- **alone**: vLLM prefills and decodes (no ``kv_transfer_params``);
- **split**: the rank prefills (``do_remote_decode``, as vllm-router asks it), vLLM reads the
  staged KV over NIXL and decodes (the rank's ``kv_transfer_params`` on the request; token ids
  in the logprobs, ``return_tokens_as_token_ids``, which the rank does not take);
- **routed**: the same through vllm-router's PD mode (text only: the check that ``split`` is
  the router's path);
and alone once more (the check that vLLM alone repeats its tokens and logprobs exactly).
The **exact** logprobs: the same checkpoint's weights upcast to float32 in transformers,
teacher-forced on alone's answer (for bfloat16: the arithmetic without bf16 rounding).

Reported per dtype: how many answers of ``split`` differ from ``alone``; for each, the first
differing token's position, the top-1 minus top-2 logprob there in alone's logprobs and in
split's, the exact logprob of alone's token minus split's there and whose token the exact
argmax is (a near-tie: small gaps, the two runs pick each other's runner-up, exact arithmetic
does not side with one run); and before the first difference, how far the chosen tokens'
logprobs of the two runs lie apart, and each run's from the exact ones.

Usage: .venv/bin/python bench/vllm_bf16_ties.py [--prompts 40] [--output 16]
           [--dtypes bfloat16,float32] [--vllm-python .venv-vllm/bin/python] [--out bench/results]
Writes OUT/vllm-bf16-ties.txt (the printed table). About 10 minutes on 2 cores, half of it
vLLM's start (once per dtype).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KEY = "bench-vllm-ties-key"
MODEL = {"num_experts": 8, "num_layers": 4, "hidden_size": 256, "head_dim": 64,
         "moe_width": 128}
TOP = 5
"""Logprobs asked per position (vLLM's ``logprobs``)."""


def workload(n: int, vocab: int) -> list[list[int]]:
    """``n`` seeded prompts of 16 to 300 token ids."""
    rng = random.Random(58)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 300))] for _ in range(n)]


def _post(base: str, body: dict) -> dict:
    import httpx

    answer = httpx.post(base + "/v1/completions", json=body, timeout=300,
                        headers={"Authorization": f"Bearer {KEY}"})
    if answer.status_code != 200:
        raise RuntimeError(f"{base}: {answer.status_code}: {answer.text[:300]}")
    return answer.json()


def _steps(choice: dict) -> list[tuple[int, dict[int, float]]]:
    """Each generated token's id and its top logprobs by token id (``token_id:N`` keys)."""
    lp = choice["logprobs"]
    return [(int(tok.removeprefix("token_id:")),
             {int(k.removeprefix("token_id:")): v for k, v in top.items()})
            for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]


def _gap(top: dict[int, float]) -> float:
    """Top-1 minus top-2 logprob."""
    first, second = sorted(top.values(), reverse=True)[:2]
    return first - second


def compare(alone: list, split: list, exact: Any) -> dict:
    """Where two answers' tokens first differ and the logprob gaps there (``each_others``: each
    run's token is the other's runner-up; ``exact_margin``: the exact logprob of alone's token
    minus split's, ``exact_pick`` whose token the exact argmax is); alone's gap at every
    position up to there; before it, the chosen tokens' logprob differences between the runs
    (``deltas``) and against the exact ones (``alone_err``, ``split_err``). ``exact``: float32
    logprobs of each position of alone's answer (``exact_logprobs``)."""
    deltas, gaps, alone_err, split_err = [], [], [], []
    for pos, ((a, a_top), (s, s_top)) in enumerate(zip(alone, split, strict=True)):
        gaps.append(_gap(a_top))
        if a != s:
            pick = int(exact[pos].argmax())
            return {"position": pos, "alone_token": a, "split_token": s,
                    "alone_gap": gaps[-1], "split_gap": _gap(s_top),
                    "each_others": _second(a_top) == s and _second(s_top) == a,
                    "exact_margin": float(exact[pos, a] - exact[pos, s]),
                    "exact_pick": {a: "alone", s: "split"}.get(pick, "other"),
                    "deltas": deltas, "gaps": gaps, "alone_err": alone_err,
                    "split_err": split_err}
        deltas.append(abs(a_top[a] - s_top[s]))
        alone_err.append(abs(a_top[a] - float(exact[pos, a])))
        split_err.append(abs(s_top[s] - float(exact[pos, s])))
    return {"position": None, "deltas": deltas, "gaps": gaps, "alone_err": alone_err,
            "split_err": split_err}


def exact_logprobs(model: Any, prompt: list[int], answer: list[int]) -> Any:
    """The float32 log-softmax of each position of ``answer`` after ``prompt`` (teacher-forced,
    one forward pass of ``model``, a transformers model in float32)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1)


def _second(top: dict[int, float]) -> int:
    return sorted(top, key=top.__getitem__, reverse=True)[1]


def run(dtype: str, args: argparse.Namespace, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dwdp.worker.disagg.vllm_nixl import VllmInterop
    from dwdp_dev.worker.checkpoint import make_checkpoint
    from dwdp_dev.worker.servers import EngineServer, VllmRouter, VllmServer, free_port, wait_for

    ckpt = make_checkpoint("qwen3_moe", work / dtype, dtype=dtype, **MODEL)
    model = str(ckpt)
    vllm_args = ["--dtype", dtype, "--max-model-len", "512", "--no-enable-prefix-caching",
                 "--api-key", KEY]
    rows, runs = [], []
    start = time.perf_counter()
    with VllmServer(args.vllm_python, ckpt, kv_role="kv_consumer", args=vllm_args) as decode, \
            EngineServer(ckpt, api_key=KEY, max_model_len=512, model_name=model,
                         vllm=VllmInterop(model=model, port=free_port())) as ctx, \
            VllmRouter([ctx.base], [decode], api_key=KEY) as router:
        for prompt in workload(args.prompts, ctx.engine.model.config.vocab_size):
            body = {"model": model, "prompt": prompt, "max_tokens": args.output,
                    "temperature": 0, "ignore_eos": True, "logprobs": TOP}
            ids = {**body, "return_tokens_as_token_ids": True}
            alone = _post(decode, ids)["choices"][0]
            pre = _post(ctx.base, {**body, "max_tokens": 1,
                                   "kv_transfer_params": {"do_remote_decode": True}})
            split = _post(decode, {**ids, "kv_transfer_params": pre["kv_transfer_params"]})
            split = split["choices"][0]
            wait_for(lambda: ctx.engine.kv.leases == 0, "vLLM did not release the lease")
            routed = _post(router, body)["choices"][0]
            wait_for(lambda: ctx.engine.kv.leases == 0, "vLLM did not release the lease")
            again = _post(decode, ids)["choices"][0]
            runs.append((prompt, _steps(alone), _steps(split)))
            rows.append({"prompt_tokens": len(prompt),
                         "routed_equal": routed["text"] == split["text"],
                         "repeat_equal": again["logprobs"] == alone["logprobs"]})
        handshakes = ctx.engine.kv.vllm.handshakes
    seconds = time.perf_counter() - start
    # the exact reference, once the servers are gone: the same weights upcast to float32
    exact = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for row, (prompt, alone, split) in zip(rows, runs, strict=True):
        reference = exact_logprobs(exact, prompt, [t for t, _ in alone])
        row.update(compare(alone, split, reference))
    return {"dtype": dtype, "rows": rows, "handshakes": handshakes, "seconds": seconds}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2e} / {max(values):.2e}"


def _report(results: list[dict], args: argparse.Namespace) -> str:
    m = MODEL
    lines = [f"tiny Qwen3-MoE (hidden {m['hidden_size']}, {m['num_layers']} layers, head size "
             f"{m['head_dim']}, {m['num_experts']} experts of {m['moe_width']}, vocabulary 384) "
             f"on CPU; vLLM 0.32.0 alone vs vLLM decoding a dwdp context rank's KV (NIXL); "
             f"{args.prompts} prompts of 16-300 token ids, {args.output} greedy tokens each"]
    for res in results:
        rows = res["rows"]
        diff = [(i, r) for i, r in enumerate(rows) if r["position"] is not None]
        deltas, alone_err, split_err = ([x for r in rows for x in r[k]]
                                        for k in ("deltas", "alone_err", "split_err"))
        routed, repeat = (sum(r[k] for r in rows) for k in ("routed_equal", "repeat_equal"))
        lines += ["", f"{res['dtype']}: {len(diff)} of {len(rows)} answers differ",
                  f"  controls: routed answers equal to split {routed} of {len(rows)}; alone "
                  f"asked again, same tokens and logprobs {repeat} of {len(rows)}; "
                  f"{res['handshakes']} handshake(s); {res['seconds']:.0f} s",
                  f"  the chosen tokens' logprobs before any difference ({len(deltas)} tokens), "
                  f"median / max: |alone - split| {_spread(deltas)}; against exact: "
                  f"|alone - exact| {_spread(alone_err)}, |split - exact| {_spread(split_err)}"]
        if diff:
            lines.append(f"  {'prompt':>6} {'tokens':>6} {'first diff':>10} {'alone gap':>9} "
                         f"{'split gap':>9} {'exact a-s':>9} {'exact picks':>11}  token alone "
                         f"-> split (each the other's #2)")
        for i, r in diff:
            lines.append(f"  {i:>6} {r['prompt_tokens']:>6} {r['position']:>10} "
                         f"{r['alone_gap']:>9.4f} {r['split_gap']:>9.4f} "
                         f"{r['exact_margin']:>9.4f} {r['exact_pick']:>11}  {r['alone_token']} "
                         f"-> {r['split_token']} ({'yes' if r['each_others'] else 'no'})")
        if diff:
            widest = max(r["alone_gap"] for _, r in diff)
            gaps = [g for r in rows for g in r["gaps"]]
            picks = [r["exact_pick"] for _, r in diff]
            lines += [f"  largest top-1 minus top-2 gap at a first difference: alone "
                      f"{widest:.4f}, split {max(r['split_gap'] for _, r in diff):.4f}; largest "
                      f"|exact a-s| {max(abs(r['exact_margin']) for _, r in diff):.4f}; exact "
                      f"picks alone's token {picks.count('alone')}, split's "
                      f"{picks.count('split')}, another {picks.count('other')}",
                      f"  alone's gap <= {widest:.4f} at {sum(g <= widest for g in gaps)} of "
                      f"{len(gaps)} positions compared (up to each answer's first difference); "
                      f"median gap {statistics.median(gaps):.4f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    repo = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--vllm-python", default=str(repo / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # vLLM's CPU worker binds one spinning OpenMP thread per core by default, which crawls on
    # a machine shared with other work: one unbound thread (the answers compared are all
    # vLLM's, so its thread count does not enter the comparison)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="dwdp-bench-ties-") as work:
        results = [run(dtype, args, Path(work)) for dtype in args.dtypes.split(",")]
    text = _report(results, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm-bf16-ties.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NIXL 1.5's native teardown segfaults at exit once a UCX agent existed
