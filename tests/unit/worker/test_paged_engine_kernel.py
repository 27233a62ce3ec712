"""The continuous engine on the paged kernel's path (what runs on CUDA: the cache read in place,
MLA through the absorbed latent form, fresh chunks through SDPA over their new entries) gives
the tokens of the packed SDPA path (what runs on the CPU), for the three architectures, with
chunked prefill (chunks after earlier chunks go through the kernel), prompts whose prefix is
cached, and decode steps of several requests. Triton's interpreter runs the kernel on the CPU
(``TRITON_INTERPRET=1``, set before triton is imported, hence a child process); fp32 models."""

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
    import random
    import sys
    import tempfile

    import torch

    import dwdp.worker.engine.paged as paged
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    torch.set_num_threads(1)
    arch = sys.argv[1]
    model, tok = load_checkpoint(make_checkpoint(arch, tempfile.mkdtemp() + "/m", num_experts=5))
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 19, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_model_len=96, max_num_tokens=16, block_size=4)

    def tokens(kernel):
        paged.kernel_for = lambda device: kernel
        engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
        assert engine.runner.cache.kernel is kernel
        out = [r.token_ids for r in engine.run_batch(prompts, params)]
        # then prompts whose prefixes the first batch left cached: their first chunk starts
        # after shared blocks (the kernel reads them in place)
        again = [prompts[3][:33] + [5, 6], prompts[2]]
        out += [r.token_ids for r in engine.run_batch(again, params)]
        assert engine.stats.prefix_cache_hits >= 32 + 16, engine.stats
        assert engine.allocator.num_in_use == 0
        return out

    packed, kernel = tokens(False), tokens(True)
    assert kernel == packed, (kernel, packed)
    print("ok")
    """
)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_the_kernel_path_gives_the_packed_paths_tokens(arch):
    run_interpreted(CHILD, arch)


REPLAY_CHILD = textwrap.dedent(
    """
    import random
    import sys
    import tempfile

    import torch

    import dwdp.worker.engine.paged as paged
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.graphs import DecodeGraphs
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    torch.set_num_threads(1)
    paged.kernel_for = lambda device: True
    model, tok = load_checkpoint(make_checkpoint("qwen3_moe", tempfile.mkdtemp() + "/m",
                                                 num_experts=5))
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(2)
    lengths, max_tokens, max_num_tokens, replays = {
        # three rows padded to four, then two, then one as requests end
        "decode": ((3, 18, 9), (21, 6, 13), 512, 20),
        # a budget of 4 tokens: three requests decode while the fourth's prompt comes one
        # token at a time (start > 0, not sampling): those steps are not decode steps
        "budget": ((3, 2, 2, 18), (30, 30, 30, 4), 4, 10),
        # four requests, each ended by a stop string: the graph steps find a stop while the
        # next step runs, and a request whose stop is found in the step whose token fills a
        # block (prefix caching would register it) has freed its blocks by then
        "stop": ((3, 4, 5, 6), (20, 20, 20, 20), 512, 4),
    }[sys.argv[1]]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    config = EngineConfig(max_model_len=64, max_batch_size=4, block_size=4,
                          max_num_tokens=max_num_tokens)
    eager = ContinuousEngine(model, tok, model_name="tiny", config=config)
    if sys.argv[1] == "stop":
        # a stop at the text of the first k new tokens is found when the token after them is
        # settled, while the step that brings the request to P + k computed tokens runs (P:
        # the prompt's length); choose k so that this step fills a block, where the text of
        # k tokens is whole
        # (not held back on a partial character) and longer than that of k - 1
        def stop_at(prompt, free):
            texts = [tok.decode(free[:k]) for k in range(len(free) + 1)]
            ends = [k for k in range(2, len(free) - 1) if (len(prompt) + k) % 4 == 0
                    and not texts[k].endswith("\ufffd") and len(texts[k]) > len(texts[k - 1])]
            return SamplingParams(max_tokens=20, ignore_eos=True, stop=(texts[ends[0]],))

        free = [r.token_ids for r in eager.run_batch(prompts, params)]
        params = [stop_at(p, f) for p, f in zip(prompts, free)]
    want = [(r.token_ids, r.finish_reason) for r in eager.run_batch(prompts, params)]

    engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
    graphs = DecodeGraphs(engine.runner.cache, max_batch_size=4, max_model_len=64)

    class Eager:
        # the capture needs CUDA: here a replay runs the forward over the bucket's static
        # layout, which reads exactly what replay() copied into the static tensors
        def __init__(self, batch):
            self.batch = batch

        def replay(self):
            layout = graphs.layout(self.batch)
            graphs.outputs[self.batch].copy_(engine.runner.forward(layout))

    for b in graphs.buckets:
        graphs.graphs[b] = Eager(b)
        graphs.outputs[b] = torch.empty(b, vocab)
    engine.runner.graphs = graphs
    got = [(r.token_ids, r.finish_reason) for r in engine.run_batch(prompts, params)]
    assert got == want, (got, want)
    if sys.argv[1] == "stop":
        assert {reason for _, reason in got} == {"stop"}, got
    assert engine.stats.graph_replays >= replays, engine.stats.graph_replays
    assert engine.allocator.num_in_use == 0
    print("ok")
    """
)


@pytest.mark.parametrize("case", ["decode", "budget", "stop"])
def test_decode_steps_through_the_static_graph_inputs_give_the_eager_tokens(case):
    """Requests of different lengths decode through the graphs' static inputs (buckets 1, 2,
    4) and get the tokens of the eager kernel path: as requests end (``decode``), and beside a
    prompt fed one token per step by a 4-token budget (``budget``: those steps run eagerly,
    a replay would return a row the step has no sampler for), and as stop strings end them
    (``stop``: found while the next step runs, its token dropped and its blocks, freed, not
    cached by that step). The capture itself needs CUDA
    (tests/gpu); here each bucket's "graph" runs the forward over the bucket's static layout."""
    run_interpreted(REPLAY_CHILD, case)


PIECEWISE_CHILD = textwrap.dedent(
    """
    import random
    import sys
    import tempfile
    from dataclasses import replace

    import torch

    import dwdp.worker.engine.paged as paged
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.piecewise import PiecewiseGraphs, _Site
    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    torch.set_num_threads(1)
    paged.kernel_for = lambda device: True
    model, tok = load_checkpoint(make_checkpoint(sys.argv[1], tempfile.mkdtemp() + "/m",
                                                 num_experts=5))
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 18, 9, 30)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 7)]
    # then prompts whose first chunk starts after cached blocks (paged rows beside fresh ones)
    again = [prompts[3][:20] + [5, 6], prompts[1] + [7], [4, 4, 4]]
    config = EngineConfig(max_model_len=64, max_batch_size=4, block_size=4, max_num_tokens=16)

    def run(engine):
        out = [(r.token_ids, r.finish_reason) for r in engine.run_batch(prompts, params)]
        out += [(r.token_ids, r.finish_reason) for r in engine.run_batch(again, params[:3])]
        assert engine.allocator.num_in_use == 0
        return out

    want = run(ContinuousEngine(model, tok, model_name="tiny", config=config))
    engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
    pieces = PiecewiseGraphs(engine.runner.cache, max_num_tokens=16, max_rows=4)

    class Eager:
        # the capture needs CUDA: here a bucket's "pieces" are the forward over its static
        # layout, each attention call run over the step's layout into the static output, as
        # a replay runs it between two pieces
        def __init__(self, tokens):
            self.tokens = tokens
            self.out = None

        def split(self, step, module, query, key, value, scaling, window):
            if self.out is None:
                self.out = torch.full((self.tokens, query.shape[1], value.shape[3]), 7.0)
            _Site(module, query, key, value, scaling, window, self.out).attend(step)
            return self.out[None]

        def run(self, step):
            static = replace(pieces.layout(self.tokens), split=lambda *a: self.split(step, *a))
            return engine.runner.forward(static)

    for tokens in pieces.buckets:
        pieces.steps[tokens] = Eager(tokens)
    engine.runner.pieces = pieces
    got = run(engine)
    assert got == want, (got, want)
    # every step replayed the pieces (no decode graphs here): padded ones too
    assert engine.stats.piecewise_replays == engine.stats.waves, engine.stats
    print("ok")
    """
)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_steps_through_the_piecewise_static_inputs_give_the_eager_tokens(arch):
    """Steps of chunked prompts, cached prefixes and decode tokens (1 to 16 tokens, padded into
    buckets 1, 2, 4, 8, 16) run through the piecewise graphs' static inputs, each attention
    over the step's own layout into the static output rows, and get the eager kernel path's
    tokens. The capture itself needs CUDA (tests/gpu); here a bucket's pieces are the forward
    over its static layout."""
    run_interpreted(PIECEWISE_CHILD, arch)
