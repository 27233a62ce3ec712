"""Where and why greedy tokens of an engine with CUDA graphs part from the eager engine's, on
the tiny models of ``tests/gpu/test_decode_graphs_gpu.py`` (same checkpoints, prompts and
settings).

Three runs per architecture: eager; graphs (the 69-token prefill replayed as the pieces of
bucket 128, decode steps replayed); graphs with the prefill eager (``MAX_CAPTURE_TOKENS`` 32,
decode steps replayed). For each request of a run that parts from the eager tokens: the first
differing position, the largest logit difference at each position up to it, and both runs'
top-2 margins there. For the eager run: at every decode step and request, the smallest routing
margin over the MoE layers (the k-th largest router logit minus the (k+1)-th, in the router's
dtype): a margin of zero is a tie that rounding elsewhere can break either way, and a
different expert set moves the logits by far more than rounding.

    python bench/gpu_graph_divergence.py [--archs qwen3_moe,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))


def run(model, tok, graphs: bool, prompts, params):
    from test_decode_graphs_gpu import _engine

    engine = _engine((model, tok), graphs=graphs)
    return engine.run_batch(prompts, params, keep_logits=True)


def first_difference(got, want):
    rows = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        n = next((p for p, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True))
                  if a != b), None)
        if n is None:
            continue
        diffs = [float((g.logits[p].float() - w.logits[p].float()).abs().max())
                 for p in range(n + 1)]
        margin = [float((x.float().topk(2).values.diff().abs())[0]) for x in
                  (w.logits[n], g.logits[n])]
        rows.append({"request": i, "position": n, "tokens": [g.token_ids[n], w.token_ids[n]],
                     "max_logit_diff_by_position": diffs, "eager_top2_margin": margin[0],
                     "graph_top2_margin": margin[1]})
    return rows


def main() -> None:
    from test_decode_graphs_gpu import NEW_TOKENS, PROMPTS, TINY, RouterMargins, _params

    import dwdp.worker.engine.piecewise as piecewise
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="qwen3_moe,mixtral,deepseek_v3")
    parser.add_argument("--out", default="bench/results/gpu_graph_divergence.json")
    parser.add_argument("--tmp", default="/tmp/gpu_graph_divergence")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "archs": {}}
    params = _params([NEW_TOKENS] * len(PROMPTS))
    for arch in args.archs.split(","):
        model, tok = load_checkpoint(make_checkpoint(arch, Path(args.tmp) / arch, **TINY))
        model.to("cuda:0")
        use_cuda_kernels(model)
        margins = RouterMargins(model)
        eager = run(model, tok, False, PROMPTS, params)
        margins.close()
        graphs = run(model, tok, True, PROMPTS, params)
        limit = piecewise.MAX_CAPTURE_TOKENS
        piecewise.MAX_CAPTURE_TOKENS = 32
        try:
            eager_prefill = run(model, tok, True, PROMPTS, params)
        finally:
            piecewise.MAX_CAPTURE_TOKENS = limit
        n = margins.layers
        steps = [torch.stack(margins.calls[i:i + n]).amin(0).tolist()
                 for i in range(0, len(margins.calls), n)] if n else []
        result["archs"][arch] = {
            "graphs": first_difference(graphs, eager),
            "graphs_prefill_eager": first_difference(eager_prefill, eager),
            "eager_first_routing_tie_by_request": margins.first_ties(PROMPTS),  # (pos, margin)
            "eager_decode_min_router_margin_by_step_and_request": steps[1:],
        }
        print(arch, json.dumps(result["archs"][arch], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
