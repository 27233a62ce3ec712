"""Prefix caching in the continuous engine: full blocks cached by chain hash, shared by later
requests, evicted least recently freed first; answers equal a cold engine's; the books balance."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.blocks import BlockAllocator, block_hashes, root_hash  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.engine.requests import RequestState  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def loaded(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ck") / "m", num_experts=5)
    return load_checkpoint(path)


def _engine(loaded, *, caching=True, **limits):
    model, tok = loaded
    config = EngineConfig(max_model_len=128, block_size=BLOCK, prefix_caching=caching, **limits)
    return ContinuousEngine(model, tok, model_name="tiny", config=config)


def _prompts(loaded, seed, *lengths):
    vocab = loaded[0].config.get_text_config().vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _run(engine, prompts, params=GREEDY):
    """Each prompt alone, one after the other: (token ids, cached tokens) per prompt."""
    out = []
    for prompt in prompts:
        state = RequestState(f"r{len(out)}", list(prompt), params)
        engine._run_states([state])
        out.append((state.tokens, state.cached_tokens))
    return out


def test_chain_hashes_depend_on_every_earlier_token_and_the_salt():
    """Block k's hash changes with any token before it, not with tokens after it; a salt
    changes every block's hash."""
    ids = list(range(12))
    base = block_hashes(ids, BLOCK, root_hash(None))
    assert len(base) == 3 and len(set(base)) == 3
    changed = block_hashes([99, *ids[1:]], BLOCK, root_hash(None))
    assert all(a != b for a, b in zip(base, changed, strict=True))
    tail = block_hashes([*ids[:8], 7, 7, 7, 7], BLOCK, root_hash(None))
    assert tail[:2] == base[:2] and tail[2] != base[2]
    salted = block_hashes(ids, BLOCK, root_hash("tenant-a"))
    assert not set(salted) & set(base)
    assert block_hashes(ids, BLOCK, base[0], start=1) == base[1:]


def test_the_allocator_shares_counts_and_evicts_least_recently_freed_first():
    alloc = BlockAllocator(4, BLOCK, prefix_caching=True)
    a = alloc.allocate(2)
    hashes = block_hashes(list(range(8)), BLOCK, root_hash(None))
    for block, h in zip(a, hashes, strict=True):
        alloc.register(block, h)
    assert alloc.cached_prefix(hashes) == a and alloc.num_cached == 2
    alloc.acquire(a[:1])  # a second holder of the first block
    alloc.free(a)
    assert alloc.num_in_use == 1 and alloc.num_free == 3  # the shared one is still held
    alloc.free(a[:1])
    assert alloc.num_in_use == 0 and alloc.num_free == 4  # cached blocks count as free
    assert alloc.cached_prefix(hashes) == a  # and stay cached while free
    assert sorted(alloc.allocate(2)) != sorted(a)  # never-cached blocks go first
    got = alloc.allocate(1)  # then the least recently freed cached block: the tail
    assert got == [a[1]] and alloc.cached_prefix(hashes) == [a[0]]
    assert alloc.num_cached == 1


def test_a_repeated_prompt_is_served_from_the_cache_with_the_cold_answer(loaded):
    """The second request of a 30-token prompt finds its 7 full blocks (28 tokens: never the
    last token, whose logits it needs) and answers what an engine without caching answers;
    the engine computes only the 2 tokens left; queries and hits count prompt tokens."""
    prompt, other = _prompts(loaded, 1, 30, 30)
    cold = _run(_engine(loaded, caching=False), [prompt])
    engine = _engine(loaded)
    got = _run(engine, [prompt, prompt, other])
    assert [t for t, _ in got[:2]] == [cold[0][0]] * 2
    assert [c for _, c in got] == [0, 28, 0]
    stats = engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (90, 28)
    assert stats.prompt_tokens == 30 + 2 + 30
    assert engine.allocator.num_in_use == 0 and engine.allocator.num_cached > 0


def test_a_shared_prefix_is_reused_and_each_suffix_computed(loaded):
    """Prompts of one 24-token prefix and different suffixes: each later one reuses the
    prefix's 6 blocks; answers equal the cold engine's."""
    (prefix,) = _prompts(loaded, 2, 24)
    prompts = [prefix + s for s in _prompts(loaded, 3, 5, 9, 3)]
    cold = _run(_engine(loaded, caching=False), prompts)
    got = _run(_engine(loaded), prompts)
    assert [t for t, _ in got] == [t for t, _ in cold]
    assert [c for _, c in got] == [0, 24, 24]


def test_cache_salt_keeps_identical_prompts_apart(loaded):
    (prompt,) = _prompts(loaded, 4, 20)
    engine = _engine(loaded)
    a = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    b = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="tenant-b")
    assert [c for _, c in _run(engine, [prompt], a)] == [0]
    assert [c for _, c in _run(engine, [prompt], b)] == [0]  # another tenant: a miss
    assert [c for _, c in _run(engine, [prompt])] == [0]  # no salt: a miss too
    assert [c for _, c in _run(engine, [prompt], a)] == [16]  # its own tenant: a hit


def test_eviction_under_pressure_keeps_the_cold_answers_and_the_books(loaded):
    """A pool of 12 blocks, prompts that need 5-8 each, repeated in another order while
    others run beside them: cached blocks are evicted as the pool needs them, every answer
    equals the cold engine's, and at rest nothing is held."""
    prompts = _prompts(loaded, 5, 17, 22, 13, 26, 9)
    order = [0, 1, 2, 3, 4, 2, 0, 4, 1, 3]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    limits = {"kv_capacity_tokens": 12 * BLOCK, "max_batch_size": 3}
    cold = _engine(loaded, caching=False, **limits).run_batch([prompts[i] for i in order], params)
    engine = _engine(loaded, **limits)
    got = engine.run_batch([prompts[i] for i in order], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in cold]
    assert engine.stats.prefix_cache_hits > 0
    assert engine.allocator.num_in_use == 0
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_cached_block_is_never_written_while_others_read_it(loaded):
    """A first request leaves its prefix cached; then three requests sharing that prefix, with
    different suffixes and outputs, run together: the cached blocks' bytes in every layer are
    those the first request wrote. The pool is tight (15 blocks): the requests' own blocks
    include evicted cached ones."""
    (prefix,) = _prompts(loaded, 6, 16)
    engine = _engine(loaded, kv_capacity_tokens=15 * BLOCK)
    _run(engine, [[*prefix, 1, 2, 3]])
    blocks = engine.allocator.cached_prefix(
        block_hashes(prefix, BLOCK, root_hash(None)))
    assert len(blocks) == 4
    slots = torch.tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])
    before = [t.index_select(0, slots).clone()
              for pair in engine.runner.cache.layers.values() for t in pair]
    suffixes = _prompts(loaded, 7, 3, 6, 1)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 4, 12)]
    got = engine.run_batch([prefix + s for s in suffixes], params)
    assert all(len(r.token_ids) == p.max_tokens for r, p in zip(got, params, strict=True))
    after = [t.index_select(0, slots)
             for pair in engine.runner.cache.layers.values() for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert engine.allocator.num_in_use == 0
