"""Prefix caching through the OpenAI server (uvicorn on 127.0.0.1, real HTTP): six requests that
share a 1536-token prefix report the cached tokens in ``usage.prompt_tokens_details`` and answer
what a server without caching answers; ``cache_salt``, vLLM's metric names, ``/dwdp/status``."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer  # noqa: E402

KEY = "prefix-cache-test-key"
PREFIX, UNIQUE, BLOCK = 1536, 16, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # room for the 1536-token prefix
    (path / "config.json").write_text(json.dumps(config))
    return path


def _server(path, *, caching: bool) -> EngineServer:
    return EngineServer(path, api_key=KEY, kv=False, max_model_len=2048, block_size=BLOCK,
                        prefix_caching=caching)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, 200) for _ in range(UNIQUE)] for _ in range(6)]


def _complete(server, prompt, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, **extra}
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def test_requests_sharing_a_prefix_are_served_from_the_cache(checkpoint):
    """One after another: the first computes everything (0 cached); each later one finds the
    prefix's 96 blocks (1536 tokens) and answers what a server without caching answers."""
    prompts = _prompts()
    with _server(checkpoint, caching=False) as cold:
        want = [_answer(_complete(cold, p)) for p in prompts]
        assert _complete(cold, prompts[0])["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0}
    with _server(checkpoint, caching=True) as warm:
        outs = [_complete(warm, p) for p in prompts]
        assert [_answer(o) for o in outs] == want
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        assert cached == [0] + [PREFIX] * 5
        assert all(o["usage"]["prompt_tokens"] == PREFIX + UNIQUE for o in outs)

        status = warm.client.get("/dwdp/status").json()["prefix_cache"]
        assert status["enabled"] and status["cached_blocks"] >= PREFIX // BLOCK
        assert (status["queries"], status["hits"]) == (6 * (PREFIX + UNIQUE), 5 * PREFIX)
        metrics = warm.client.get("/metrics").text
        assert f'vllm:prefix_cache_hits_total{{model_name="m"}} {5 * PREFIX}.0' in metrics
        assert f"dwdp_prefix_cache_queries_total {6 * (PREFIX + UNIQUE)}.0" in metrics

        # cache_salt: the same prompt under a tenant's salt misses, then hits its own
        salted = [_complete(warm, prompts[0], cache_salt="tenant-a") for _ in range(2)]
        assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in salted] == [
            0, PREFIX + UNIQUE - BLOCK]  # every full block but the one holding the last token
        assert [_answer(o) for o in salted] == [want[0]] * 2


def test_a_cache_salt_that_is_not_a_nonempty_string_is_a_400_naming_it(checkpoint):
    with _server(checkpoint, caching=True) as server:
        for salt in (7, "", ["a"]):
            r = server.client.post("/v1/completions",
                                   json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
            assert r.status_code == 400, r.text
            assert "cache_salt" in r.json()["error"]["message"], r.text
