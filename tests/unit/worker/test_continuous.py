"""The continuous engine: requests join mid-flight, chunked prefill, preemption, the pool's
limits and its books (no block leaks), against each request run alone."""

from __future__ import annotations

import asyncio
import random

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.blocks import BlockAllocator  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.kv_connector import KvTransferParams  # noqa: E402
from dwdp.worker.engine.protocol import RequestError, SamplingParams  # noqa: E402
from dwdp.worker.engine.requests import RequestState  # noqa: E402
from dwdp.worker.engine.scheduler import Scheduler, Sequence  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def loaded(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ck") / "m", num_experts=5)
    return load_checkpoint(path)


def _engine(loaded, **limits):
    model, tok = loaded
    return ContinuousEngine(model, tok, model_name="tiny", config=EngineConfig(**limits))


async def _collect(engine, rid, prompt, params, log):
    tokens = []
    async for out in engine.generate(rid, prompt, params):
        tokens.extend(out.token_ids)
        if out.finished:
            log.append((rid, out.finish_reason))
    return tokens


def test_a_request_arriving_mid_flight_does_not_wait_for_the_others(loaded):
    """A short request sent while a long one decodes finishes while the long one still runs
    (a wave engine would hold it until the long one ended)."""
    engine = _engine(loaded, max_model_len=128)
    long_params = SamplingParams(max_tokens=60, ignore_eos=True)

    async def main():
        log = []
        with engine:
            gen = engine.generate("long", [5, 6, 7, 8], long_params)
            first = await anext(gen)
            assert not first.finished
            short = await _collect(
                engine, "short", [9, 10, 11], SamplingParams(max_tokens=2, ignore_eos=True), log
            )
            assert log == [("short", "length")]
            assert "long" in engine._active  # the long one still runs
            rest = [out async for out in gen]
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 60
        return short

    short = asyncio.run(asyncio.wait_for(main(), 120))
    alone = engine.run_batch([[9, 10, 11]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert short == alone.token_ids


def test_a_mixed_stream_is_token_for_token_each_request_alone(loaded):
    """Twelve greedy requests of mixed lengths, the first six together (they fill the batch
    and outgrow the pool whatever the machine's speed: preemptions) and the rest at random
    moments, through a small pool and a small token budget (chunked prefill): each one's
    tokens are those it gets alone; afterwards no block is held."""
    rng = random.Random(3)
    model, _ = loaded
    vocab = model.config.get_text_config().vocab_size
    work = [
        ([rng.randrange(vocab) for _ in range(rng.randint(1, 30))], rng.randint(1, 24))
        for _ in range(12)
    ]
    engine = _engine(
        loaded,
        max_model_len=64,
        max_batch_size=6,
        max_num_tokens=16,
        kv_capacity_tokens=96,
        block_size=4,
    )

    async def main():
        log = []
        with engine:
            tasks = []
            for i, (prompt, n) in enumerate(work):
                params = SamplingParams(max_tokens=n, ignore_eos=True)
                tasks.append(asyncio.create_task(_collect(engine, f"r{i}", prompt, params, log)))
                if i >= 5:
                    await asyncio.sleep(rng.random() * 0.02)
            return await asyncio.gather(*tasks)

    got = asyncio.run(asyncio.wait_for(main(), 300))
    assert engine.stats.preemptions > 0, "the pool was meant to force preemptions"
    assert engine.allocator.num_in_use == 0 and engine.stats.kv_tokens_in_use == 0
    roomy = _engine(loaded, max_model_len=64)
    for (prompt, n), tokens in zip(work, got, strict=True):
        alone = roomy.run_batch([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert tokens == alone.token_ids


def test_aborted_and_stopped_requests_give_their_blocks_back(loaded):
    engine = _engine(loaded, max_model_len=64, block_size=4)

    async def main():
        with engine:
            gens = [
                engine.generate(f"a{i}", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
                for i in range(3)
            ]
            for gen in gens:
                await anext(gen)
            assert engine.allocator.num_in_use > 0
            await engine.abort("a0")
            assert [o async for o in gens[0]][-1].finish_reason == "abort"
            await gens[1].aclose()  # a client that goes away aborts too
            assert [o async for o in gens[2]][-1].finish_reason == "length"
            for _ in range(200):
                if engine.allocator.num_in_use == 0:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 120))
    assert engine.allocator.num_in_use == 0
    assert engine.stats.requests_aborted == 2


def test_a_step_without_a_graph_streams_the_last_steps_tokens_before_its_forward(loaded):
    """Eager steps (every step on the CPU; on CUDA those with a prompt chunk) deliver the tokens
    the previous step took before launching their own forward, whose launch takes the host
    milliseconds: here a request decodes while another's prompt comes in chunks."""
    engine = _engine(loaded, max_model_len=128, max_num_tokens=6)
    late: list[tuple[str, int, int]] = []
    execute = engine.runner.execute

    def checked(chunks):
        for seq in engine.scheduler.running:
            state = seq.state
            if state.settled < len(state.tokens):
                late.append((state.request_id, state.settled, len(state.tokens)))
        return execute(chunks)

    engine.runner.execute = checked
    out = engine.run_batch([[5, 6, 7], list(range(20, 50))],
                           SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(r.token_ids) for r in out] == [8, 8]
    assert engine.stats.waves > 8  # the prompt of 30 came in chunks beside the decode
    assert not late, f"(request, tokens streamed, tokens taken) at a forward's launch: {late}"


def test_a_request_longer_than_the_pool_is_refused_naming_the_limit(loaded):
    engine = _engine(loaded, max_model_len=64, kv_capacity_tokens=32, block_size=8)
    with pytest.raises(RequestError, match=r"prompt \+ max_tokens: 40 tokens.*pool's 32 tokens"):
        engine.run_batch([[1] * 20], SamplingParams(max_tokens=20))
    # a prompt that alone overflows the pool is named alone (a router's prefill sends
    # max_tokens 1 in place of the client's value)
    with pytest.raises(RequestError, match=r"^prompt: 40 tokens, more than the KV cache pool's "
                                           r"32 tokens \(4 blocks of 8\); shorten the prompt$"):
        engine.run_batch([[1] * 40], SamplingParams(max_tokens=1))
    # one that fits alone runs (the pool is smaller than max_model_len: only here, in a test)
    assert (
        len(
            engine.run_batch([[1] * 20], SamplingParams(max_tokens=12, ignore_eos=True))[
                0
            ].token_ids
        )
        == 12
    )


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks(loaded):
    engine = _engine(loaded, max_model_len=64, max_num_tokens=7)
    prompt = list(range(3, 33))
    res = engine.run_batch([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert engine.stats.forward_passes == 5 + 2  # 30 prompt tokens in 7-token chunks, 2 decodes
    roomy = _engine(loaded, max_model_len=64)
    assert (
        res.token_ids
        == roomy.run_batch([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    )


# -- the scheduler alone --------------------------------------------------------------------


def _seq(n_prompt: int) -> Sequence:
    return Sequence(RequestState("r", list(range(n_prompt)), SamplingParams()))


def test_the_scheduler_splits_its_token_budget_oldest_first():
    sched = Scheduler(BlockAllocator(100, 4), max_num_seqs=8, max_num_tokens=10)
    a, b, c = _seq(6), _seq(6), _seq(6)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [(p.seq, len(p.chunk.token_ids), p.chunk.sample) for p in plan] == [
        (a, 6, True),
        (b, 4, False),
    ]
    assert c in sched.waiting
    a.computed, b.computed = 6, 4
    a.state.tokens.append(1)
    plan = sched.schedule()  # a decodes one token, b finishes its prompt, c starts
    assert [(p.seq, p.chunk.start, len(p.chunk.token_ids)) for p in plan] == [
        (a, 6, 1),
        (b, 4, 2),
        (c, 0, 6),
    ]


def test_the_scheduler_preempts_the_newest_request_when_blocks_run_out():
    alloc = BlockAllocator(4, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_tokens=64)
    old, new = _seq(8), _seq(8)
    sched.add(old)
    sched.add(new)
    sched.schedule()  # both prefill: 2 blocks each, the pool is full
    assert alloc.num_free == 0
    for s in (old, new):
        s.computed = 8
        s.state.tokens.append(1)  # token 9 needs a third block
    plan = sched.schedule()
    assert [p.seq for p in plan] == [old]
    assert list(sched.waiting) == [new] and new.computed == 0 and new.blocks == []
    assert sched.preemptions == 1
    sched.remove(old)
    assert alloc.num_in_use == 0


def _remote(n_prompt: int) -> tuple[Sequence, Sequence]:
    """A sequence that reads its prompt's KV remotely and a sibling that shares it."""
    first, sibling = _seq(n_prompt), _seq(n_prompt)
    first.pull = KvTransferParams()  # any value: the scheduler only tests its presence
    sibling.fork = first
    return first, sibling


def test_a_sibling_shares_the_pulled_prompts_full_blocks_and_copies_the_partial_one():
    """Prompt of 14 tokens in blocks of 4: the last token (13) sits in block 3; blocks 0-2 are
    shared (never written again), block 3 is the sibling's own with slots 12 copied in."""
    alloc = BlockAllocator(20, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_tokens=64)
    first, sibling = _remote(14)
    sched.add(first)
    sched.add(sibling)
    plan = sched.schedule()
    assert [(p.seq, p.chunk.start, len(p.chunk.token_ids)) for p in plan] == [
        (first, 13, 1),
        (sibling, 13, 1),
    ]
    assert sibling.blocks[:3] == first.blocks[:3] and sibling.blocks[3] not in first.blocks
    assert sibling.copy == (first, first.blocks[3], 1) and sibling.fork is None
    assert alloc.num_in_use == 5  # 4 + the sibling's own block
    sched.remove(first)
    assert alloc.num_in_use == 4  # the shared blocks stay with the sibling
    sched.remove(sibling)
    assert alloc.num_in_use == 0


def test_a_sibling_joining_after_the_pulled_prompt_is_gone_computes_its_own():
    alloc = BlockAllocator(20, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_tokens=64)
    first, sibling = _remote(12)
    sched.add(first)
    sched.schedule()
    sched.remove(first)  # finished (or failed) before the sibling arrived
    sched.add(sibling)
    (p,) = sched.schedule()
    assert (p.seq, p.chunk.start, len(p.chunk.token_ids)) == (sibling, 0, 12)
    assert sibling.copy is None and alloc.num_in_use == 3


def test_a_sibling_that_cannot_join_yet_is_left_untouched():
    alloc = BlockAllocator(4, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_tokens=64)
    first, sibling = _remote(14)  # the first takes all 4 blocks; the sibling needs 1 more
    sched.add(first)
    sched.add(sibling)
    assert [p.seq for p in sched.schedule()] == [first]
    assert list(sched.waiting) == [sibling]
    assert sibling.blocks == [] and sibling.computed == 0 and sibling.fork is first
