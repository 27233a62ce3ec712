"""CUDA graphs of decode-only steps (``ContinuousEngine.capture_cuda_graphs``) on tiny models of
the three architectures with the worker's GPU kernels (``use_cuda_kernels``), bf16 on cuda:0 (the
experts' grouped GEMMs take bf16 only):

- replayed steps give the greedy tokens (and, within bf16 rounding, the logits) of the same
  engine without graphs, and every decode-only step replays a graph;
- a decode batch between buckets (3 of 1, 2, 4) is padded into the next bucket without
  touching the requests' cache; steps holding prefill chunks replay the piecewise graphs
  (attention eager between the pieces), with the same tokens; a step above their largest
  bucket runs eagerly, with the same tokens;
- a forward that cannot be captured (a host read inside it) makes the capture raise
  ``CudaGraphError`` with one line naming the reason, not a silent fallback;
- a started engine has compiled every variant of the paged attention kernels: serving steps of
  any shape (chunked prefill, cached prefixes, decode of several lengths) compile none."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.graphs import bucket_sizes  # noqa: E402
from dwdp.worker.engine.piecewise import token_buckets  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
MAX_BATCH = 4  # buckets 1, 2, 4
TINY = {"num_experts": 8, "seed": 9, "dtype": "bfloat16", "hidden_size": 128, "moe_width": 64}
# four prompts of different lengths; one prefill step (69 tokens) then decode-only steps
PROMPTS = [list(range(5, 8)), list(range(20, 37)), list(range(40, 80)), list(range(100, 109))]
NEW_TOKENS = 8
# three prompts through a 16-token step budget: chunked prefill beside decode tokens. The
# schedule (scheduler.py's policy; chunk sizes per step): [3, 13] [1, 15] [1, 12, 3]
# [1, 1, 14] [1, 1, 3], then 5 decode-only steps of 3 requests (padded into bucket 4),
# 2 of 2 and 2 of 1: 14 steps, 9 of them decode-only.
MIXED_PROMPTS = [list(range(5, 8)), list(range(20, 60)), list(range(100, 120))]
MIXED_NEW_TOKENS = [14, 10, 6]
MIXED_STEPS, MIXED_DECODE_ONLY = 14, 9


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tmp_path_factory):
    """A tiny bf16 checkpoint of the architecture on cuda:0 with the worker's kernels."""
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ck") / request.param,
                           **TINY)
    model, tok = load_checkpoint(path)
    model.to("cuda:0")
    use_cuda_kernels(model)
    return model, tok


def _engine(loaded, graphs: bool, **limits) -> ContinuousEngine:
    model, tok = loaded
    # no prefix caching: the served run repeats the prompts, and a prefill from cached
    # blocks may round differently (the comparison here is graphs against eager steps)
    config = EngineConfig(max_batch_size=MAX_BATCH, max_model_len=128, cuda_graphs=graphs,
                          prefix_caching=False, **limits)
    engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
    if graphs:
        captured = engine.capture_cuda_graphs()
        assert captured.buckets == bucket_sizes(MAX_BATCH) == (1, 2, 4)
        assert captured.token_buckets == token_buckets(min(engine.config.max_num_tokens, 128))
        assert captured.pool_bytes > 0
    return engine


def _params(counts: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in counts]


ROUTING_TIE = 3 / 128
"""A router margin (the top-k-th router logit minus the next one, in the router's bf16) at or
under which the rounding of another kernel may route the token to the other expert: 3 bf16
steps of a logit in [1, 2), about what a bf16 rounding of the hidden state moves a router
logit of this size by. A different expert set moves the logits by far more than rounding, so
a comparison of two kernels' greedy runs cannot extend past such a tie (on the CPU, the tiny
Qwen3-MoE's eager run routes request 3's fifth token with a margin of 0.0117: its
router logits are near 1 and spread over [0, 1.3])."""


class RouterMargins:
    """Forward hooks on the softmax top-k routers of ``model`` (the ``gate`` of Qwen3-MoE's and
    Mixtral's MoE blocks, whose first output is the router's logits; DeepSeek-V3's grouped
    sigmoid routing is not read, so its runs are compared without exception): for each step of
    an eager engine, the smallest margin over the layers of each of the step's token rows."""

    def __init__(self, model) -> None:
        self.calls: list[Any] = []
        routers = [m for n, m in model.named_modules() if n.endswith(".gate")
                   and type(m).__name__ in ("Qwen3MoeTopKRouter", "MixtralTopKRouter")]
        self.layers = len(routers)
        self._handles = [m.register_forward_hook(self._record) for m in routers]

    def _record(self, module, _args, out) -> None:
        top = out[0].float().topk(module.top_k + 1, dim=-1).values
        self.calls.append((top[:, -2] - top[:, -1]).cpu())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def first_ties(self, prompts) -> list[tuple[int, float] | None]:
        """Per request of an eager run of ``prompts`` in one prefill step and then decode-only
        steps of every request in order (``test_replayed_decode_steps_give_the_eager_tokens``):
        the first generated position whose step routed one of the request's tokens with a
        margin at or under ``ROUTING_TIE`` (0: a prompt token in the prefill) and that margin,
        or None."""
        if not self.layers:
            return [None] * len(prompts)
        steps = [torch.stack(self.calls[i:i + self.layers]).amin(0)
                 for i in range(0, len(self.calls), self.layers)]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()
        rows = [steps[0][end - len(p):end] for p, end in zip(prompts, ends, strict=True)]
        firsts = []
        for r, prefill in enumerate(rows):
            margins = [float(prefill.min()), *(float(step[r]) for step in steps[1:])]
            firsts.append(next(((n, m) for n, m in enumerate(margins) if m <= ROUTING_TIE),
                               None))
        return firsts


def _assert_same(got, want, ties: list[tuple[int, float] | None] | None = None) -> int:
    """Greedy tokens equal; logits equal within bf16 rounding (a graph runs the eager step's
    kernels, a padded one at the bucket's size, where a GEMM may tile and round differently:
    a 69-token prefill padded to 128 tokens moved logits by up to 0.05 on an H100, against
    0.02 for decode steps padded to their bucket).

    ``ties`` (``RouterMargins.first_ties`` of the eager run): a request may part from the eager
    one only at or after the first position whose step had a routing tie; what is compared
    before it must hold, and what follows is not compared (the runs then hold different
    experts' outputs). The parting is printed with the tie that allowed it. Returns the
    number of requests excused so."""
    excused = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g.token_ids) == len(w.token_ids), f"request {i}"
        part = next((p for p in range(len(w.token_ids)) if g.token_ids[p] != w.token_ids[p]
                     or not torch.allclose(g.logits[p], w.logits[p], rtol=2e-2, atol=1e-1)),
                    None)
        tie = ties[i] if ties else None
        if part is not None and tie is not None and tie[0] <= part:
            mine, theirs = g.logits[part].float(), w.logits[part].float()
            diff = float((mine - theirs).abs().max())
            top = theirs.topk(2).values
            print(f"request {i} parts at position {part} (tokens {g.token_ids[part]} and "
                  f"{w.token_ids[part]}; eager top-2 logit margin {float(top[0] - top[1]):.4f}, "
                  f"largest logit difference {diff:.3f}) after a routing tie at position "
                  f"{tie[0]} (router margin {tie[1]:.4f}); positions {part}+ are not compared")
            excused += 1
            continue
        stop = len(w.token_ids) if part is None else part + 1
        assert g.token_ids[:stop] == w.token_ids[:stop], f"request {i} (routing ties: {ties})"
        torch.testing.assert_close(torch.stack(g.logits[:stop]), torch.stack(w.logits[:stop]),
                                   rtol=2e-2, atol=1e-1,
                                   msg=lambda m, i=i: f"request {i} (routing ties: {ties}): {m}")
    return excused


def test_replayed_decode_steps_give_the_eager_tokens(loaded):
    params = _params([NEW_TOKENS] * len(PROMPTS))
    eager = _engine(loaded, graphs=False)
    margins = RouterMargins(loaded[0])
    try:
        want = eager.run_batch(PROMPTS, params, keep_logits=True)
    finally:
        margins.close()
    ties = margins.first_ties(PROMPTS)
    assert eager.stats.graph_replays == 0
    graphs = _engine(loaded, graphs=True)
    got = graphs.run_batch(PROMPTS, params, keep_logits=True)
    # a tie excuses at most one request here: the others are compared token by token
    assert _assert_same(got, want, ties) <= 1, ties
    # one prefill step (69 tokens, the pieces of bucket 128), then every one of the
    # NEW_TOKENS - 1 decode-only steps replays
    assert graphs.stats.waves == eager.stats.waves == NEW_TOKENS
    assert graphs.stats.graph_replays == NEW_TOKENS - 1
    assert graphs.stats.piecewise_replays == 1
    # served: the engine's own thread replays what this thread captured
    with graphs:
        served = graphs.run_batch(PROMPTS, params, keep_logits=True)
    assert _assert_same(served, want, ties) <= 1, ties
    assert graphs.stats.graph_replays > NEW_TOKENS - 1


def test_a_batch_between_buckets_is_padded_and_prefill_steps_replay_the_pieces(loaded):
    params = _params(MIXED_NEW_TOKENS)
    eager = _engine(loaded, graphs=False, max_num_tokens=16)
    want = eager.run_batch(MIXED_PROMPTS, params, keep_logits=True)
    graphs = _engine(loaded, graphs=True, max_num_tokens=16)
    got = graphs.run_batch(MIXED_PROMPTS, params, keep_logits=True)
    _assert_same(got, want)
    assert graphs.stats.waves == eager.stats.waves == MIXED_STEPS
    # the 5 steps with a prefill chunk (16 tokens, then 14 and 5: buckets 16 and 8) replayed
    # the pieces; the decode-only ones (3 requests in bucket 4, then 2, then 1) their graphs
    assert graphs.stats.graph_replays == MIXED_DECODE_ONLY
    assert graphs.stats.piecewise_replays == MIXED_STEPS - MIXED_DECODE_ONLY
    assert graphs.allocator.num_in_use == 0


def test_a_step_above_the_largest_token_bucket_runs_eagerly(loaded, monkeypatch):
    import dwdp.worker.engine.piecewise as piecewise

    monkeypatch.setattr(piecewise, "MAX_CAPTURE_TOKENS", 32)  # the 69-token prefill is above
    params = _params([NEW_TOKENS] * len(PROMPTS))
    want = _engine(loaded, graphs=False).run_batch(PROMPTS, params, keep_logits=True)
    graphs = _engine(loaded, graphs=True)
    assert graphs.runner.pieces is not None and graphs.runner.pieces.buckets[-1] == 32
    got = graphs.run_batch(PROMPTS, params, keep_logits=True)
    _assert_same(got, want)
    assert graphs.stats.piecewise_replays == 0
    assert graphs.stats.graph_replays == NEW_TOKENS - 1


UNCAPTURABLE = textwrap.dedent(
    """
    import json, sys, torch
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.graphs import CudaGraphError
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint

    model, tok = load_checkpoint(sys.argv[1])
    model.to("cuda:0")
    use_cuda_kernels(model)
    norm = model.model.norm
    plain = norm.forward

    def forward(hidden):  # a host read of a device value: no graph can hold it
        if hidden.float().abs().sum().item() < 0:
            raise AssertionError("unreachable")
        return plain(hidden)

    norm.forward = forward
    config = EngineConfig(max_batch_size=4, max_model_len=128, cuda_graphs=True)
    engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
    try:
        engine.capture_cuda_graphs()
    except CudaGraphError as exc:
        print("RESULT " + json.dumps({"error": str(exc)}), flush=True)
    else:
        print("RESULT " + json.dumps({"error": None}), flush=True)
    """
)


def test_a_forward_that_cannot_be_captured_raises_cuda_graph_error(tmp_path):
    """In a child process: a failed capture may leave the CUDA context unusable, and the
    worker stops the rank on it anyway."""
    from dwdp_dev.worker.checkpoint import make_checkpoint

    path = make_checkpoint("qwen3_moe", tmp_path / "q", **TINY)
    child = subprocess.run([sys.executable, "-c", UNCAPTURABLE, str(path)],
                           capture_output=True, text=True, timeout=300)
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    assert child.returncode == 0 and lines, child.stderr[-4000:]
    error = json.loads(lines[-1][len("RESULT "):])["error"]
    assert error is not None, "the capture succeeded with a host read inside the forward"
    assert error.strip() and "\n" not in error, repr(error)
    assert "not built yet" not in error
    assert "captur" in error.lower(), error  # it names the capture as what failed


SERVE_WITHOUT_COMPILES = textwrap.dedent(
    """
    import json, sys, triton
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint

    model, tok = load_checkpoint(sys.argv[1])
    model.to("cuda:0")
    use_cuda_kernels(model)
    compiled = []

    def note(**info):
        compiled.append(info["fn"].name)

    triton.knobs.runtime.jit_post_compile_hook = note
    config = EngineConfig(max_batch_size=4, max_model_len=512, max_num_tokens=48,
                          prefix_caching=True)
    engine = ContinuousEngine(model, tok, model_name="tiny", config=config).start()
    at_start = list(compiled)
    # token ids below the tiny vocabulary's 384
    prompts = [list(range(5, 8)), list(range(20, 130)), list(range(80, 380)), [7] * 33]
    again = [list(range(20, 130)) + [3, 4], list(range(80, 380))[:200] + [9] * 40]
    engine.run_batch(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.run_batch(again, SamplingParams(max_tokens=60, ignore_eos=True))
    hits = engine.stats.prefix_cache_hits
    engine.stop()
    print("RESULT " + json.dumps({"start": at_start, "serving": compiled[len(at_start):],
                                  "hits": hits}), flush=True)
    """
)


def test_a_started_engine_compiles_no_attention_kernel_while_it_serves(tmp_path):
    """In a child process, so that no earlier test has compiled a variant in this one."""
    from dwdp_dev.worker.checkpoint import make_checkpoint

    path = make_checkpoint("qwen3_moe", tmp_path / "q", **TINY)
    child = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_COMPILES, str(path)],
                           capture_output=True, text=True, timeout=600)
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    assert child.returncode == 0 and lines, child.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert "_paged_attention_kernel" in result["start"], result  # the warm-up compiled them
    assert result["hits"] > 0, result  # a step read a cached prefix through the kernel
    attention = {"_paged_attention_kernel", "_combine_splits_kernel"}
    assert not attention & set(result["serving"]), result
