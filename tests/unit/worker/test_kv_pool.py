"""The KV cache pool: bytes per token as transformers' cache really stores them, the sizing
rules of ``kvCache``, the refusals, and the engine admitting waves against the pool."""

from __future__ import annotations

import asyncio

import pytest

from dwdp.api.launch import KvCacheConfig
from dwdp.worker.engine.kv_pool import (
    KvPoolError,
    check_max_tokens,
    kv_bytes_per_token,
    size_kv_pool,
)
from dwdp_dev.worker.checkpoint import ARCHS, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GIB = 2**30


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_is_what_the_dynamic_cache_holds(arch, dtype):
    """A forward of 7 tokens through a DynamicCache: the cache's keys and values are
    exactly 7 x kv_bytes_per_token (MLA's compressed latent for DeepSeek-V3)."""
    config = tiny_config(arch, vocab_size=64, dtype="float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.arange(7).unsqueeze(0), past_key_values=cache, use_cache=True)
    held = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
    )
    assert held == 7 * kv_bytes_per_token(config, dtype.itemsize)


def test_the_pool_takes_the_fraction_of_what_is_left():
    kv = KvCacheConfig(free_memory_fraction=0.5)
    pool = size_kv_pool(kv, free_bytes=10 * GIB, bytes_per_token=1024, max_model_len=4096,
                        where="device")
    assert pool.capacity_tokens == 5 * GIB // 1024
    assert pool.limited_by == "freeMemoryFraction" and pool.nbytes == 5 * GIB
    assert pool.as_dict()["bytes"] == 5 * GIB and pool.as_dict()["free_bytes"] == 10 * GIB


def test_max_tokens_bounds_the_pool_when_it_is_smaller():
    kv = KvCacheConfig(max_tokens=8192)
    small = size_kv_pool(kv, free_bytes=10 * GIB, bytes_per_token=1024, max_model_len=4096,
                         where="device")
    assert (small.capacity_tokens, small.limited_by) == (8192, "maxTokens")
    big = size_kv_pool(KvCacheConfig(max_tokens=10**9), free_bytes=GIB, bytes_per_token=1024,
                       max_model_len=4096, where="device")
    assert big.limited_by == "freeMemoryFraction" and big.capacity_tokens < 10**9


def test_a_pool_below_one_max_length_request_is_refused_naming_the_numbers():
    with pytest.raises(KvPoolError) as err:
        size_kv_pool(KvCacheConfig(free_memory_fraction=0.1), free_bytes=GIB,
                     bytes_per_token=2**20, max_model_len=4096, where="device")
    text = str(err.value)
    assert "holds 102 tokens" in text and "maxModelLen 4096" in text
    assert "freeMemoryFraction 0.1" in text and "1.00 GiB" in text


def test_max_tokens_below_max_model_len_is_refused_before_loading():
    check_max_tokens(KvCacheConfig(max_tokens=4096), 4096)
    with pytest.raises(KvPoolError, match=r"kvCache.maxTokens: 100 tokens .* maxModelLen 512"):
        check_max_tokens(KvCacheConfig(max_tokens=100), 512)


# -- the engine admits waves against the pool ---------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dwdp.worker.engine.loader import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "m", seed=3)
    return load_checkpoint(path)


def _waves(tiny, capacity: int | None) -> int:
    """Three requests of 4 + 6 tokens queued while the engine is busy with a first one;
    returns the waves the three took."""
    import time

    from dwdp.worker.engine.protocol import SamplingParams
    from dwdp_dev.worker.wave_engine import BatchingEngine, EngineConfig

    model, tok = tiny
    engine = BatchingEngine(model, tok, model_name="m",
                            config=EngineConfig(kv_capacity_tokens=capacity)).start()
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def drain(gen):
        return [out async for out in gen]

    async def main() -> int:
        with engine._forward_lock:  # the engine thread blocks in its first forward
            first = asyncio.create_task(drain(engine.generate("r0", [5, 6, 7, 8], params)))
            deadline = time.monotonic() + 30
            while engine.stats.waves < 1:
                assert time.monotonic() < deadline, "the first wave never started"
                await asyncio.sleep(0.01)
            tasks = [asyncio.create_task(drain(engine.generate(f"r{i}", [5, 6, 7, 8], params)))
                     for i in (1, 2, 3)]
            while engine._queue.qsize() < 3:  # all three wait behind the first wave
                assert time.monotonic() < deadline, "the requests were not queued"
                await asyncio.sleep(0.01)
        results = await asyncio.gather(first, *tasks)
        assert all(r[-1].finish_reason == "length" for r in results)
        return engine.stats.waves - 1

    try:
        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.stop()


def test_the_engine_admits_a_wave_only_as_far_as_the_pool_holds(tiny):
    assert _waves(tiny, None) == 1
    assert _waves(tiny, 30) == 1  # 3 x (4 + 6) reserved tokens fit
    assert _waves(tiny, 29) == 2  # two fit, the third waits for the next wave
    assert _waves(tiny, 10) == 3
