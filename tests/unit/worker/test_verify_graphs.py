"""Verify steps and the MTP layer's pass through the decode graphs' slabs
(``dwdp.worker.engine.graphs.DecodeGraphs`` with ``q = 1 + numSpeculativeTokens``, and
``MtpDrafts.capture``): the trained demo model with its MTP layer, on the paged kernel's path
under Triton's interpreter (a child process, fp32).

With every decode and verify step, and the MTP pass after each, run through the graphs'
static inputs, the engine answers the tokens of its eager steps and its drafts are the eager
steps' drafts: as many accepted, position by position. A slab read at the wrong rows (the
target's hidden states of another request or position) would change the drafts, not the
answers (the target verifies them), hence the acceptance check. The capture itself needs CUDA
(tests/gpu/test_speculative_gpu.py); here each bucket's "graph" runs the forward over the
bucket's static layout, which reads exactly what a replay would."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
from _triton import run_interpreted

CHILD = textwrap.dedent(
    """
    import sys

    import torch

    import dwdp.worker.engine.paged as paged
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.graphs import DecodeGraphs
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.engine.speculative import SpeculativeConfig
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.loading.mtp import load_mtp
    from dwdp.worker.loading.validate import validate_checkpoint
    from dwdp_dev.devcluster.paths import cache_dir
    from dwdp_dev.worker.demo_corpus import CAPITALS
    from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model

    torch.set_num_threads(1)
    paged.kernel_for = lambda device: True
    path = cached_demo_mtp_model(cache_dir() / "models")
    model, tok = load_checkpoint(path)
    layer = load_mtp(path, validate_checkpoint(path), dtype=torch.float32, device="cpu")
    method, k, sampled = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "sampled"
    spec = (SpeculativeConfig(method="mtp", num_speculative_tokens=k) if method == "mtp" else
            SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                              prompt_lookup_max=3))
    asks = [f"What is the capital of {c}?" for c, _ in CAPITALS[:3]]
    quotes = [f"The capital of {a} is {b}. The capital of {c} is {d}. The capital of {a}"
              for (a, b), (c, d) in zip(CAPITALS[3:5], CAPITALS[5:7])]
    prompts = [tok(t)["input_ids"] for t in asks + quotes]
    # uneven lengths: requests end at different steps, the batch shrinks across buckets
    params = [SamplingParams(max_tokens=n, ignore_eos=True,
                             **({"temperature": 0.8, "seed": n} if sampled else {}))
              for n in (14, 9, 12, 6, 11)]
    config = EngineConfig(max_model_len=96, max_batch_size=4, block_size=4,
                          max_num_tokens=64, prefix_caching=False, speculative=spec)

    def engine():
        e = ContinuousEngine(model, tok, model_name="demo", config=config)
        if method == "mtp":
            e.attach_draft_layer(layer)
        propose, e.drafts = e._propose, []

        def recorded():  # every step's drafts, request by request
            propose()
            e.drafts.append([list(seq.draft) for seq in e.scheduler.running])

        e._propose = recorded
        return e

    def run(e):
        out = [(r.token_ids, r.finish_reason) for r in e.run_batch(prompts, params)]
        assert e.allocator.num_in_use == 0
        return out, e.drafts, list(e.stats.spec_accepted_per_pos), e.stats.spec_drafts

    def stand_in(graphs, forward, widths):
        # the capture needs CUDA: here a bucket's "graph" is the forward over its static
        # layout, written into the bucket's static outputs (a tuple for the MTP layer's)
        class Eager:
            def __init__(self, batch):
                self.batch = batch
                self.replays = 0

            def replay(self):
                self.replays += 1
                with torch.inference_mode():
                    out = forward(graphs.layout(self.batch))
                mine = graphs.outputs[self.batch]
                for o, m in zip(out if isinstance(out, tuple) else (out,),
                                mine if isinstance(mine, tuple) else (mine,)):
                    m.copy_(o)

        for b in graphs.buckets:
            graphs.graphs[b] = Eager(b)
            rows = b * graphs.q
            first = torch.empty(rows, widths[0])
            graphs.outputs[b] = (first if len(widths) == 1 else
                                 (first, torch.empty(rows, dtype=torch.long)))
        return graphs

    want = run(engine())
    e = engine()
    runner, vocab = e.runner, model.config.vocab_size
    made = {q: stand_in(DecodeGraphs(runner.cache, max_batch_size=4, max_model_len=96, q=q),
                        runner.forward, (vocab,)) for q in (1, 1 + k)}
    runner.graphs, runner.verify = made[1], made[1 + k]
    if e.mtp is not None:
        hidden = model.config.hidden_size
        e.mtp.graphs = {q: stand_in(DecodeGraphs(runner.cache, max_batch_size=4,
                                                 max_model_len=96, q=q), e.mtp._slabs,
                                         (hidden, "tokens"))
                        for q in (1, 1 + k)}
    got = run(e)
    assert got == want, (got, want)
    verified = sum(g.replays for g in runner.verify.graphs.values())
    assert verified > 0 and got[3] > 0, (verified, got)
    assert e.stats.graph_replays >= verified
    if e.mtp is not None:
        assert sum(g.replays for m in e.mtp.graphs.values() for g in m.graphs.values()) \\
            >= verified
    print("ok")
    """
)


@pytest.mark.parametrize(("method", "k", "sampling"), [
    ("mtp", 1, "greedy"), ("mtp", 2, "greedy"), ("mtp", 2, "sampled"), ("ngram", 3, "greedy")])
def test_verify_and_mtp_steps_through_the_graphs_slabs_answer_and_draft_as_eager_steps(
        method, k, sampling):
    """MTP with one and two drafts a step (the second from the layer's own output, eagerly)
    and n-gram drafts of 3: uneven drafts a request (none, some, all accepted), requests ending
    at different steps (slabs of padding in a bucket), answers, drafts and acceptance per
    position those of eager steps. Greedy requests get the MTP pass queued right behind the
    step (``MtpDrafts.launch``: its tokens and lengths found on the device), seeded sampled
    ones the pass after the host took the step's tokens (``MtpDrafts.after``); a rejected
    tail's blocks go back and other blocks take their places in the graphs' tables."""
    run_interpreted(CHILD, method, str(k), sampling)
