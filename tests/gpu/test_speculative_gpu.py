"""Speculative decoding on a GPU (``engine.speculative``): the trained demo model with its trained
MTP layer (``dwdp_dev.worker.demo_mtp``) in bf16 on cuda:0 with the worker's GPU kernels.

- n-gram drafts with CUDA graphs (decode steps replay the decode graphs, verify steps the
  verify graphs: slabs of 1 + numSpeculativeTokens tokens a request) answer the greedy tokens
  of plain decoding with graphs;
- MTP drafts, eager and with graphs, answer the greedy tokens of plain decoding (eager, or
  with graphs), and the first draft is accepted at least 60% of the time on the corpus's
  questions.

The verify step computes a draft position's logits in a multi-token chunk of the paged kernel,
plain decoding in a one-token one: in bf16 the two may round apart, so two answers may part
only where plain decoding's top two logits were within ``TIE`` (a near-tie), never elsewhere.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.engine.speculative import SpeculativeConfig  # noqa: E402

TIE = 0.125
"""Top-2 logit gap (in the model's logits) under which bf16 rounding may pick either token."""


@pytest.fixture(scope="module")
def demo():
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.loading.mtp import load_mtp
    from dwdp.worker.loading.validate import validate_checkpoint
    from dwdp_dev.devcluster.paths import cache_dir
    from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model

    path = cached_demo_mtp_model(cache_dir() / "models")
    model, tok = load_checkpoint(path, dtype="bfloat16")
    model.to("cuda:0")
    use_cuda_kernels(model)
    layer = load_mtp(path, validate_checkpoint(path), dtype=torch.bfloat16, device="cuda:0")
    use_cuda_kernels(layer.block)  # as the worker's load_draft_layer
    return model, tok, layer


def _prompts(tok) -> list[list[int]]:
    from dwdp_dev.worker.demo_corpus import CAPITALS

    asks = [f"What is the capital of {c}?" for c, _ in CAPITALS[:6]]
    quotes = [f"The capital of {a} is {b}. The capital of {c} is {d}. The capital of {a}"
              for (a, b), (c, d) in zip(CAPITALS[6:10], CAPITALS[10:14], strict=True)]
    return [tok(t)["input_ids"] for t in asks + quotes]


def _engine(demo, spec: SpeculativeConfig | None, graphs: bool) -> ContinuousEngine:
    model, tok, layer = demo
    config = EngineConfig(max_batch_size=16, max_model_len=256, cuda_graphs=graphs,
                          prefix_caching=False, speculative=spec)
    engine = ContinuousEngine(model, tok, model_name="demo", config=config)
    if spec is not None and spec.method == "mtp":
        engine.attach_draft_layer(layer)
    if graphs:
        engine.capture_cuda_graphs()
    return engine


def _same_but_near_ties(plain, spec) -> int:
    """Assert each speculative answer equals the plain one up to the first position where
    plain decoding's top-2 gap is under ``TIE``; returns how many answers are equal whole."""
    whole = 0
    for a, b in zip(plain, spec, strict=True):
        if a.token_ids == b.token_ids:
            whole += 1
            continue
        at = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False))
                  if x != y)
        top = torch.topk(a.logits[at].float(), 2).values
        assert float(top[0] - top[1]) < TIE, (
            f"answers part at token {at} without a near-tie: {a.token_ids} vs {b.token_ids}")
    return whole


def test_ngram_drafts_with_cuda_graphs_answer_as_plain_decoding(demo):
    prompts = _prompts(demo[1])
    # past the EOS the model goes on quoting capital sentences: text its prompt and output hold
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = _engine(demo, None, True).run_batch(prompts, params, keep_logits=True)
    engine = _engine(demo, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                             prompt_lookup_max=3), True)
    spec = engine.run_batch(prompts, params)
    assert _same_but_near_ties(plain, spec) >= len(prompts) - 2
    assert engine.stats.spec_accepted_tokens > 0
    assert engine.runner.verify.replays > 0  # verify steps replayed the verify graphs


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_mtp_drafts_on_the_gpu_answer_as_plain_decoding_and_are_mostly_accepted(demo, graphs):
    """MTP drafts, eager and with graphs (decode, verify and piecewise graphs, and the MTP
    layer's pass after a replayed decode or verify step): the hook's copy of the final norm's
    output is one of the captured kernels, so a replayed step hands the MTP layer its own
    hidden states (drafts read from a stale buffer would be rejected nearly always). The
    answers are plain decoding's (eager or with graphs, as the drafts), the first drafts
    mostly accepted."""
    prompts = _prompts(demo[1])[:6]
    params = SamplingParams(max_tokens=24)
    plain = _engine(demo, None, graphs).run_batch(prompts, params, keep_logits=True)
    engine = _engine(demo, SpeculativeConfig(method="mtp", num_speculative_tokens=2), graphs)
    spec = engine.run_batch(prompts, params)
    assert _same_but_near_ties(plain, spec) >= len(prompts) - 1
    stats = engine.stats
    assert stats.spec_accepted_per_pos[0] >= 0.6 * stats.spec_drafts, stats
    # with graphs the verify steps, and the MTP pass after them, replayed their graphs
    verify = engine.runner.verify
    assert (verify is not None and verify.replays > 0) == graphs
    assert (sum(g.replays for g in engine.mtp.graphs.values()) > 0) == graphs
