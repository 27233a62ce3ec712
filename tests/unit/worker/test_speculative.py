"""Speculative decoding (``engine.speculative``, n-gram drafts): the same answers as without
drafts, greedy token for token and sampled by the target's law, with the cache's books kept
(rejected tails' blocks given back, only accepted tokens in the prefix cache)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.blocks import BlockAllocator  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.kv_pool import kv_bytes_per_token  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams, StructuredOutput  # noqa: E402
from dwdp.worker.engine.requests import RequestState  # noqa: E402
from dwdp.worker.engine.scheduler import Scheduler, Sequence  # noqa: E402
from dwdp.worker.engine.speculative import Drafter, SpeculativeConfig, ngram_drafts  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.mtp import load_mtp  # noqa: E402
from dwdp.worker.loading.validate import validate_checkpoint  # noqa: E402
from dwdp_dev.devcluster.paths import cache_dir  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.demo_corpus import CAPITALS  # noqa: E402
from dwdp_dev.worker.demo_model import cached_demo_model  # noqa: E402
from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model  # noqa: E402

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3"])
def loaded(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ck") / "m", num_experts=5)
    return load_checkpoint(path)


def _engine(loaded, spec: SpeculativeConfig | None = SPEC, **limits) -> ContinuousEngine:
    model, tok = loaded
    config = EngineConfig(max_model_len=160, speculative=spec, **limits)
    return ContinuousEngine(model, tok, model_name="tiny", config=config)


def _prompts(loaded, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram drafts find something to propose)."""
    vocab = loaded[0].config.get_text_config().vocab_size
    return [[(i * 7 + j * 3) % vocab for j in range(10)] * 2 + [i % vocab] for i in range(count)]


def test_ngram_drafts_follow_the_earliest_occurrence_of_the_longest_recurring_suffix():
    assert ngram_drafts([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 2]  # 3 tokens, earliest
    assert ngram_drafts([4, 3, 8, 5, 3], 3, 1, 3) == [8, 5, 3]  # only the last token recurs
    assert ngram_drafts([4, 3, 8, 5, 3], 3, 2, 3) == []  # no suffix of 2 recurs
    assert ngram_drafts([1, 2, 1, 2], 5, 1, 2) == [1, 2]  # fewer than k left after the match
    assert Drafter(SPEC).propose([1, 2, 3, 1, 2], 1) == [3]  # the caller's limit
    assert Drafter(SPEC).propose([1, 2, 3, 1, 2], 0) == []


def test_greedy_answers_are_token_for_token_those_without_drafts(loaded):
    """Eight greedy requests at once through a small pool and token budget (chunked prefill,
    preemptions, drafts cut to the budget): each request's tokens and logprobs are those
    without speculation; drafts were both accepted and rejected; no block is held after."""
    prompts = _prompts(loaded, 8)
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)
    limits = {"kv_capacity_tokens": 320, "block_size": 8, "max_num_tokens": 40}
    plain = _engine(loaded, None, **limits).run_batch(prompts, params)
    engine = _engine(loaded, **limits)
    spec = engine.run_batch(prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert [e.token_id for e in b.logprobs] == [e.token_id for e in a.logprobs]
        assert [e.logprob for e in b.logprobs] == pytest.approx(
            [e.logprob for e in a.logprobs], abs=1e-4)
    stats = engine.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.preemptions > 0
    assert engine.allocator.num_in_use == 0
    # a step of an accepted draft gives several tokens: fewer steps than tokens
    assert stats.generation_tokens == sum(len(a.token_ids) for a in plain)


def test_stop_tokens_max_tokens_and_parallel_samples_end_as_without_drafts(loaded):
    """A stop token inside an accepted run of drafts ends the request there (not part of the
    output), so does a stop string (the text cut before it), ``max_tokens`` is never overrun
    by a run of accepted drafts, and requests of one prompt side by side (``n`` > 1's sibling
    sequences) each decode as they would alone."""
    prompts = _prompts(loaded, 3)
    plain = _engine(loaded, None).run_batch(prompts, SamplingParams(max_tokens=30,
                                                                     ignore_eos=True))
    stop = plain[0].token_ids[17]
    text = plain[1].text
    for params in (SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
                   SamplingParams(max_tokens=30, ignore_eos=True,
                                  stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
                   SamplingParams(max_tokens=13, ignore_eos=True),
                   SamplingParams(max_tokens=20, ignore_eos=True)):
        want = _engine(loaded, None).run_batch(prompts * 2, params)
        got = _engine(loaded).run_batch(prompts * 2, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert [o.text for o in got] == [o.text for o in want]


def test_seeded_sampled_answers_are_those_without_drafts(loaded):
    """A seeded request draws once per output token with or without drafts: the same tokens,
    also where drafts were accepted."""
    prompts = _prompts(loaded, 6)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.3, seed=11)
    plain = _engine(loaded, None).run_batch(prompts, params)
    engine = _engine(loaded)
    spec = engine.run_batch(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.spec_accepted_tokens > 0


@pytest.fixture(scope="module")
def demo():
    """The trained demo model (``dwdp testing train-demo-model``, cached): its answers are
    peaked and quote their prompts, so drafts are accepted."""
    torch.set_num_threads(1)
    return load_checkpoint(cached_demo_model(cache_dir() / "models"))


def test_a_token_sampled_after_an_accepted_draft_follows_the_target_distribution(demo):
    """Unseeded sampling (temperature 1), 3 tokens per request, on a prompt the demo model
    goes on quoting: where the second token was the draft the engine proposed after the first
    (so the third was chosen at a draft's position of the verify step), the third token's
    counts match the model's own softmax at that context (chi-square, p > 0.001)."""
    model, tok = demo
    prompt = tok("Paris is the capital of France. Paris is the")["input_ids"]
    engine = _engine(demo, max_batch_size=64)
    outs = engine.run_batch([prompt] * 1200, SamplingParams(max_tokens=3, ignore_eos=True,
                                                            temperature=1.0))
    drafter = Drafter(SPEC)
    verified = collections.Counter(
        tuple(o.token_ids[:2]) for o in outs
        if drafter.propose(prompt + o.token_ids[:1], 3)[:1] == o.token_ids[1:2])
    (first, second), n = verified.most_common(1)[0]
    assert n >= 500, f"only {n} samples of the most common verified context"
    assert engine.stats.spec_accepted_tokens >= n
    thirds = collections.Counter(o.token_ids[2] for o in outs if o.token_ids[:2] == [first, second])
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, first, second]])).logits[0, -1]
    expected = torch.softmax(logits.double(), dim=-1) * n
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [thirds.get(t, 0) for t in big] + [n - sum(thirds.get(t, 0) for t in big)]
    want = [float(expected[t]) for t in big] + [n - float(expected[big].sum())]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, want, strict=True) if e > 0)
    df = len(big)  # the cells above, the rest lumped into one, less one
    assert df >= 4, f"{df + 1} cells: the test would be weak"
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(chi2 / 2.0)))
    assert p > 1e-3, f"chi-square {chi2:.1f} over {df} degrees of freedom: p = {p:.2g}"


def test_accepting_part_of_a_draft_frees_the_rejected_tail_and_caches_only_kept_tokens():
    """The scheduler's books around a verify step: a draft of 6 tokens after the pending one
    grows the table across two more blocks; accepting 1 of them keeps the blocks the pending
    token needs, frees the rest and registers in the prefix cache only the blocks filled by
    kept tokens."""
    alloc = BlockAllocator(16, 4, prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=64)
    state = RequestState("r", list(range(100, 106)), SamplingParams(max_tokens=20))
    seq = Sequence(state)
    sched.add(seq)
    (first,) = sched.schedule()
    sched.commit(seq, len(first.chunk.token_ids))  # the prompt: 6 tokens, 1 full block
    state.tokens.append(7)  # the prefill's token: pending 1
    seq.draft = [8, 9, 10, 11, 12, 13]
    (step,) = sched.schedule()
    assert step.chunk.draft == 6 and list(step.chunk.token_ids) == [7, 8, 9, 10, 11, 12, 13]
    assert len(seq.blocks) == 4  # 13 tokens of 4
    sched.commit(seq, 1)
    state.tokens += [8, 5]  # the first draft token accepted, then the target's own
    sched.accept(seq, 1)
    assert seq.computed == 8 and seq.pending == 1
    assert len(seq.blocks) == 3  # 9 tokens: the pending one's block kept, one freed
    assert alloc.num_in_use == 3
    assert seq.registered == 2  # blocks of tokens 0-7: prompt, its token, the accepted draft


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_constrained_answer_is_the_same_with_drafts(demo, temperature):
    """A request under a grammar (a regex here) takes each draft position's token under the
    grammar as advanced by the tokens before it: the same answer as without drafts, greedy or
    seeded, with drafts accepted."""
    _, tok = demo
    text = "Paris is the capital of France. Paris is the capital of France. Paris"
    prompt = tok(text)["input_ids"]
    rule = StructuredOutput("regex", r"( is the capital of (France|Peru)\.( Paris)?){1,4}")
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=5, structured=rule)
    plain = _engine(demo, None).run_batch([prompt] * 3, params)
    engine = _engine(demo)
    spec = engine.run_batch([prompt] * 3, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert re.fullmatch(rule.source, spec[0].text), spec[0].text
    assert engine.stats.spec_accepted_tokens > 0


@pytest.fixture(scope="module")
def demo_mtp():
    """The demo model with its trained MTP layer (``dwdp_dev.worker.demo_mtp``, cached):
    ``(model, tokenizer, layer)``."""
    torch.set_num_threads(1)
    path = cached_demo_mtp_model(cache_dir() / "models")
    model, tok = load_checkpoint(path)
    return model, tok, load_mtp(path, validate_checkpoint(path), dtype=torch.float32,
                                device="cpu")


def _mtp_engine(demo_mtp, k: int) -> ContinuousEngine:
    model, tok, layer = demo_mtp
    engine = _engine((model, tok), SpeculativeConfig(method="mtp", num_speculative_tokens=k),
                     block_size=8)
    engine.attach_draft_layer(layer)
    return engine


def _capital_prompts(tok) -> list[list[int]]:
    return [tok(f"What is the capital of {country}?")["input_ids"]
            for country, _ in CAPITALS[:12]]


def test_mtp_drafts_are_mostly_accepted_and_change_no_answer(demo_mtp):
    """The trained MTP layer's drafts (3 per step) on the corpus's questions: the greedy
    answers are token for token those without drafts, and the first draft token is accepted
    at least 60% of the time (the issue's bar for DeepSeek's MTP)."""
    model, tok, _ = demo_mtp
    prompts = _capital_prompts(tok)
    params = SamplingParams(max_tokens=24)
    plain = _engine((model, tok), None).run_batch(prompts, params)
    engine = _mtp_engine(demo_mtp, 3)
    spec = engine.run_batch(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.stats
    assert stats.spec_accepted_per_pos[0] >= 0.6 * stats.spec_drafts, stats
    assert len(stats.spec_accepted_per_pos) == 3 and stats.spec_accepted_per_pos[2] > 0
    assert engine.allocator.num_in_use == 0
    # the layer's KV is one more layer of the engine's cache, after the model's: one more
    # layer's bytes per pooled token, what the ledger adds
    extra = kv_bytes_per_token(model.config, 4, 1) - kv_bytes_per_token(model.config, 4)
    mtp_kv = engine.runner.cache.layers[model.config.num_hidden_layers]
    assert sum(t.numel() * t.element_size() for t in mtp_kv) == \
        extra * engine.allocator.capacity_tokens


def test_mtp_seeded_sampled_answers_are_those_without_drafts(demo_mtp):
    model, tok, _ = demo_mtp
    prompts = _capital_prompts(tok)[:6]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
    plain = _engine((model, tok), None).run_batch(prompts, params)
    engine = _mtp_engine(demo_mtp, 2)
    assert [o.token_ids for o in engine.run_batch(prompts, params)] == \
        [o.token_ids for o in plain]
    assert engine.stats.spec_accepted_tokens > 0


def test_mtp_on_a_checkpoint_without_the_layer_is_refused_naming_the_field(loaded):
    """``engine.speculative.method: mtp`` on a checkpoint whose config declares no MTP layer
    stops the rank at its checkpoint check, one line naming the field; the layer's loader
    refuses it too."""
    from dwdp.api.launch import LaunchConfig, LaunchError
    from dwdp.worker.loading.validate import CheckpointError
    from dwdp.worker.main import check_draft_layer

    model, _ = loaded
    path = Path(model.name_or_path)
    cfg = LaunchConfig.model_validate({
        "model": {"path": str(path)},
        "engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 2}}})
    with pytest.raises(LaunchError) as refused:
        check_draft_layer(cfg, model.config)
    assert str(refused.value).startswith("launch refused: engine.speculative.method: needs "
                                         "the checkpoint's multi-token prediction layer")
    with pytest.raises(CheckpointError, match="holds no MTP layer"):
        load_mtp(path, model.config, dtype=torch.float32, device="cpu")


def test_the_batch_size_schedule_caps_the_drafts_of_a_step(loaded):
    """vLLM's ``num_speculative_tokens_per_batch_size``: a step with that many running
    requests drafts at most the range's tokens (0: none); gaps and the tail keep the range
    before's; the answers stay the same."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             per_batch_size=((1, 2, 3), (3, 4, 1), (8, 16, 0)))
    assert [spec.drafts_at(b) for b in (1, 2, 3, 4, 5, 7, 8, 40)] == [3, 3, 1, 1, 1, 1, 0, 0]
    prompts = _prompts(loaded, 8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = _engine(loaded, None).run_batch(prompts, params)
    crowded = _engine(loaded, spec)
    assert [o.token_ids for o in crowded.run_batch(prompts, params)] == \
        [o.token_ids for o in plain]
    assert crowded.stats.spec_drafts == 0  # eight requests ran every step together
    fewer = _engine(loaded, spec)
    assert [o.token_ids for o in fewer.run_batch(prompts[:2], params)] == \
        [o.token_ids for o in plain[:2]]
    assert fewer.stats.spec_draft_tokens > 0


@given(prompt=st.lists(st.integers(0, 9), min_size=1, max_size=12),
       output=st.lists(st.integers(0, 9), max_size=12), start=st.integers(0, 30),
       count=st.integers(1, 8), held=st.none() | st.integers(10, 12))
def test_the_mtp_pass_reads_the_tokens_after_a_chunk_as_the_whole_sequence_holds_them(
        prompt, output, start, count, held):
    """``mtp_drafts._following`` (the tokens after a chunk's positions, read in place) is the
    slice of the whole sequence, a held prefill's token after it."""
    from types import SimpleNamespace

    from dwdp.worker.engine.mtp_drafts import _following

    seq = SimpleNamespace(state=SimpleNamespace(prompt=prompt, tokens=output))
    whole = prompt + output + ([] if held is None else [held])
    assert _following(seq, start, count, held) == whole[start + 1 : start + count + 1]
