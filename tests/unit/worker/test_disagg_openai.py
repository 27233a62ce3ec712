"""OpenAI requests that a rank accepts work through the real vllm-router too (issue 34): ``n``
choices (plain and streamed) decoded by the generation server from one prefill whose blocks
they share, refusals naming what the client sent (not the router's rewritten ``max_tokens``),
and prompt scoring (``echo`` with ``logprobs``, ``max_tokens: 0``, ``prompt_logprobs``).

Two real servers (uvicorn on 127.0.0.1, KV over real NIXL READs) behind the vllm-router binary.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmRouter, wait_for  # noqa: E402

KEY = "disagg-openai-key"
CONTEXT = 128
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)


@pytest.fixture(scope="module")
def routed(checkpoint):
    """(context server, generation server, router URL)."""
    def server():
        return EngineServer(checkpoint, api_key=KEY, max_model_len=CONTEXT, block_size=BLOCK)

    with server() as ctx, server() as gen, VllmRouter([ctx.base], [gen.base], api_key=KEY) as url:
        yield ctx, gen, url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _at_rest(ctx: EngineServer, gen: EngineServer) -> None:
    wait_for(lambda: ctx.engine.kv.leases == 0, "context leases not released")
    wait_for(lambda: ctx.engine.allocator.num_in_use == 0, "context blocks still held")
    wait_for(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_n_choices_decode_from_one_prefill_whose_blocks_they_share(routed):
    """``n: 3`` sampled choices through the router equal the generation server's own ``n: 3``
    answer (choice i seeded seed + i); the prompt's KV crossed once (its blocks, once), and the
    two other choices computed one prompt token each: they shared the read blocks."""
    ctx, gen, url = routed
    prompt = list(range(5, 19))  # 14 tokens: 3 full blocks shared, the 4th copied (1 slot)
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 1.0,
            "seed": 7, "ignore_eos": True}
    local = gen.client.post("/v1/completions", json=body).json()["choices"]
    kv, stats = gen.engine.kv, gen.engine.stats
    blocks, tokens, computed = kv.blocks_received, stats.remote_prefill_tokens, stats.prompt_tokens
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in got] == [0, 1, 2]
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in local]
    assert len({tuple(c["token_ids"]) for c in got}) > 1  # sampled apart: not one copied 3x
    assert kv.blocks_received - blocks == -(-len(prompt) // BLOCK)  # read once, not 3 times
    assert stats.remote_prefill_tokens - tokens == len(prompt)
    assert stats.prompt_tokens - computed == 3  # each choice ran only the prompt's last token
    _at_rest(ctx, gen)


def test_a_streamed_n_2_through_the_router_equals_the_whole_answer(routed):
    ctx, gen, url = routed
    chat = {"model": "m", "messages": [{"role": "user", "content": "tell me"}], "n": 2,
            "max_tokens": 5, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    whole = _post(url, "/v1/chat/completions", chat)
    assert whole.status_code == 200, whole.text
    want = {c["index"]: c["token_ids"] for c in whole.json()["choices"]}
    streamed: dict[int, list[int]] = {0: [], 1: []}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c.get("token_ids") or []
    assert streamed == want and all(len(t) == 5 for t in want.values())
    _at_rest(ctx, gen)


def test_scoring_requests_through_the_router(routed):
    """``echo`` + ``logprobs`` + ``max_tokens: 0`` and ``prompt_logprobs`` through the router
    answer the generation server's own scores of the prompt (first entry null)."""
    ctx, gen, url = routed
    prompt = list(range(20, 31))
    body = {"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 2}
    local = gen.client.post("/v1/completions", json=body)
    assert local.status_code == 200, local.text
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (want,) = local.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)
    assert choice["token_ids"] == [] and r.json()["usage"]["completion_tokens"] == 0
    _at_rest(ctx, gen)  # the leased prompt KV was read and released all the same


def test_refusals_name_what_the_client_sent(routed):
    """A prompt over the context: the context rank's 400 names the prompt, never the ``1``
    the router put in ``max_tokens``; a prompt that fits with a ``max_tokens`` that does not:
    the generation server's 400 names the client's value."""
    _ctx, _gen, url = routed
    long = {"model": "m", "prompt": [7] * (CONTEXT + 5), "max_tokens": 8}
    r = _post(url, "/v1/completions", long)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"prompt: {CONTEXT + 5} tokens") and "max_tokens (1)" not in message
    over = {"model": "m", "prompt": [7] * 100, "max_tokens": 40}
    r = _post(url, "/v1/completions", over)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"max_tokens: prompt (100 tokens) + max_tokens (40) exceeds the model's context "
        f"({CONTEXT})"
    )
