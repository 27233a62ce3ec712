"""Both engines (continuous and wave): prefill/decode, greedy and sampled, stop conditions,
logprobs, the async API and a failing forward."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import (  # noqa: E402
    EngineClient,
    EngineDeadError,
    EngineError,
    RequestError,
    SamplingParams,
)
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.wave_engine import BatchingEngine  # noqa: E402

PROMPTS = ["Hello world, the", "What is the capital of France?", "a", "The quick brown"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)
    return load_checkpoint(path)


@pytest.fixture(params=[ContinuousEngine, BatchingEngine], ids=["continuous", "wave"])
def engine_cls(request):
    return request.param


@pytest.fixture
def engine(loaded, engine_cls):
    model, tok = loaded
    return engine_cls(model, tok, model_name="tiny", config=EngineConfig(max_model_len=64))


def _ids(engine, texts):
    return [engine.tokenizer(t)["input_ids"] for t in texts]


def test_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)
    assert engine.max_model_len == 64


def test_greedy_batch_equals_one_by_one(engine):
    prompts = _ids(engine, PROMPTS)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    batch = engine.run_batch(prompts, params, keep_logits=True)
    for prompt, res in zip(prompts, batch, strict=True):
        alone = engine.run_batch([prompt], params)[0]
        assert alone.token_ids == res.token_ids
        assert len(res.token_ids) == 6
        assert res.finish_reason == "length"
        assert len(res.logits) == 6
        assert res.logits[0].shape == (engine.model.config.vocab_size,)
        assert [int(x.argmax()) for x in res.logits] == res.token_ids
        assert res.text == engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)


def test_prefill_logits_match_plain_forward(engine):
    """The first step's logits are the model's last-position logits (other kernels: close)."""
    prompt = _ids(engine, ["Hello world, the"])[0]
    res = engine.run_batch([prompt], SamplingParams(max_tokens=1), keep_logits=True)[0]
    with torch.no_grad():
        plain = engine.model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(res.logits[0], plain, rtol=1e-5, atol=1e-5)


def test_tiny_temperature_decodes_greedily(engine):
    """A temperature too small to divide the logits by (they overflow to infinities and the
    softmax is no distribution: the engine used to die on it, taking its rank down) decodes
    greedily, as vLLM does below 1e-5; the engine keeps serving."""
    prompt = _ids(engine, ["Hello world, the"])[0]
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    tiny = SamplingParams(max_tokens=5, ignore_eos=True, temperature=1e-300, seed=1)
    assert engine.run_batch([prompt], tiny)[0].token_ids == (
        engine.run_batch([prompt], greedy)[0].token_ids
    )


def test_sampling_seeded(engine):
    prompt = _ids(engine, ["Hello"])[0]
    sampled = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True
    )
    a = engine.run_batch([prompt], sampled)[0].token_ids
    b = engine.run_batch([prompt], sampled)[0].token_ids
    assert a == b
    others = {
        tuple(
            engine.run_batch(
                [prompt], SamplingParams(max_tokens=8, temperature=1.5, seed=s, ignore_eos=True)
            )[0].token_ids
        )
        for s in range(4)
    }
    assert len(others) > 1
    top1 = engine.run_batch(
        [prompt], SamplingParams(max_tokens=5, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    )[0]
    greedy = engine.run_batch([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_conditions(engine):
    prompt = _ids(engine, ["The quick brown"])[0]
    full = engine.run_batch([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    # a stop token: the request ends before it, with reason stop
    stop_at = full.token_ids[3]
    first = full.token_ids.index(stop_at)
    res = engine.run_batch([prompt], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))[0]
    assert res.token_ids == full.token_ids[:first]
    assert res.finish_reason == "stop"
    # a stop string: the text is cut before it
    text = full.text
    needle = next(
        text[i : i + 2]
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].strip()
    )
    res = engine.run_batch([prompt], SamplingParams(max_tokens=8, stop=(needle,)))[0]
    assert res.finish_reason == "stop"
    assert res.text == text[: text.find(needle)]
    # ... and the tokens end with the one that completed it (the continuous engine decides
    # stop strings one step late: the token its next step made is dropped)
    tok = engine.tokenizer
    k = next(k for k in range(1, 9) if needle in tok.decode(full.token_ids[:k],
                                                             skip_special_tokens=True))
    assert res.token_ids == full.token_ids[:k]
    # EOS stops unless ignored
    eos = next(iter(engine.eos_token_ids))
    engine.eos_token_ids.add(full.token_ids[0])
    try:
        res = engine.run_batch([prompt], SamplingParams(max_tokens=8))[0]
        assert res.token_ids == [] and res.finish_reason == "stop"
        res = engine.run_batch([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert res.token_ids == full.token_ids
    finally:
        engine.eos_token_ids.discard(full.token_ids[0])
        engine.eos_token_ids.add(eos)


def test_context_length_bound(loaded, engine_cls):
    model, tok = loaded
    engine = engine_cls(model, tok, model_name="tiny", config=EngineConfig(max_model_len=12))
    prompt = tok("Hello world")["input_ids"]
    res = engine.run_batch([prompt], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(prompt) + len(res.token_ids) == 12
    assert res.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 64, SamplingParams(), "context"),
        ([10**6], SamplingParams(), "outside the vocabulary"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(temperature=-1), "temperature"),
        ([1], SamplingParams(top_p=0), "top_p"),
        ([1], SamplingParams(top_k=-1), "top_k"),
    ],
)
def test_refusals(engine, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        engine.run_batch([prompt], params)


def test_async_generate_stream_and_abort(engine):
    prompt = _ids(engine, ["Hello world, the"])[0]
    want = engine.run_batch([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]

    async def main():
        with engine:
            await engine.check_health()
            outs = [
                o
                async for o in engine.generate(
                    "r1", prompt, SamplingParams(max_tokens=6, ignore_eos=True)
                )
            ]
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert [t for o in outs for t in o.token_ids] == want.token_ids
            assert "".join(o.text for o in outs) == want.text
            assert outs[-1].completion_tokens == 6 and outs[-1].prompt_tokens == len(prompt)
            # abort: a long request stops with reason abort
            gen = engine.generate("r2", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
            first = await anext(gen)
            assert not first.finished
            await engine.abort("r2")
            rest = [o async for o in gen]
            assert rest[-1].finish_reason == "abort"

            # concurrent requests are served together and each gets its own tokens
            async def one(i, p):
                return [
                    t
                    async for o in engine.generate(
                        f"c{i}", p, SamplingParams(max_tokens=4, ignore_eos=True)
                    )
                    for t in o.token_ids
                ]

            prompts = _ids(engine, PROMPTS)
            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            for p, g in zip(prompts, got, strict=True):
                assert (
                    g
                    == engine.run_batch([p], SamplingParams(max_tokens=4, ignore_eos=True))[
                        0
                    ].token_ids
                )
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(main())
    assert engine.stats.requests_aborted >= 1
    assert engine.stats.generation_tokens > 0


def test_forward_failure_is_fatal(loaded, engine_cls):
    model, tok = loaded
    fatal = []
    engine = engine_cls(model, tok, model_name="tiny", on_fatal=fatal.append)

    def boom(*_a, **_k):
        raise RuntimeError("device lost")

    handle = model.model.layers[0].register_forward_pre_hook(boom)

    async def main():
        with engine:
            with pytest.raises(EngineError, match="device lost"):
                async for _ in engine.generate("x", [1, 2], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(EngineDeadError, match="device lost"):
                await engine.check_health()

    try:
        asyncio.run(main())
    finally:
        handle.remove()
    assert len(fatal) == 1 and "device lost" in str(fatal[0])
    assert engine.snapshot().failure == "RuntimeError: device lost"  # /dwdp/status's error


def test_greedy_matches_transformers_generate(engine):
    """Prefill + decode with the KV cache gives the tokens of ``model.generate``."""
    for text in ("Hello world, the", "What is"):
        ids = engine.tokenizer(text)["input_ids"]
        ours = engine.run_batch([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        with torch.no_grad():
            ref = engine.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
            )
        assert ours.token_ids == ref[0, len(ids) :].tolist()


def test_logprobs_are_the_log_softmax_of_the_logits(engine):
    """Each generated token's logprob is the raw logits' log-softmax at it, and the top
    alternatives are the most likely tokens in order (greedy: the token is the first)."""
    prompt = _ids(engine, ["Hello world, the"])[0]
    res = engine.run_batch(
        [prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3), keep_logits=True
    )[0]
    assert len(res.logprobs) == 4
    for token, entry, logits in zip(res.token_ids, res.logprobs, res.logits, strict=True):
        logp = torch.log_softmax(logits, -1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(logp[token]), abs=1e-5)
        assert [t for t, _ in entry.top] == torch.topk(logp, 3).indices.tolist()
        assert entry.top[0][0] == token
    plain = engine.run_batch([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert plain.logprobs == [] and plain.token_ids == res.token_ids
