"""Prefill/decode disaggregation between two real servers (uvicorn on 127.0.0.1) whose KV
caches move with real NIXL READs (UCX over TCP), speaking vLLM's ``kv_transfer_params``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from dwdp.worker.engine.kv_connector import KvConnector  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmRouter, wait_for  # noqa: E402

KEY = "disagg-test-key"
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


CTX = {"role": "context", "group": "t-g0", "rank": 2, "incarnation": 1, "pod": "t-g0-0"}
GEN = {"role": "generation", "group": "t-gen-0", "rank": 0}


def _server(path: Path, lease_s: float = 30.0, server: dict | None = None) -> EngineServer:
    """A context or generation server of the tests (blocks of 4, 128 tokens, the test key)."""
    return EngineServer(
        path, api_key=KEY, lease_s=lease_s, max_model_len=128, block_size=4, server=server
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)


@pytest.fixture(scope="module")
def pair(checkpoint):
    with _server(checkpoint, server=CTX) as ctx, _server(checkpoint, server=GEN) as gen:
        yield ctx, gen


def _wait(predicate, what: str, timeout: float = 20.0) -> None:
    wait_for(predicate, what, timeout)


def _routed(ctx, gen, path: str, body: dict) -> tuple[dict, httpx.Response]:
    """What a PD router does: prefill on ctx (max_tokens 1, no stream), decode on gen."""
    pre = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    pre.pop("stream_options", None)
    r = ctx.client.post(path, json={**pre, "no_stop_trim": True, "min_tokens": 1})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    return params, gen.client.post(path, json={**body, "kv_transfer_params": params})


def test_routed_requests_decode_from_the_context_servers_kv(pair):
    """Completions and chat through prefill-on-ctx, decode-on-gen return the tokens the
    generation server produces alone; gen prefilled nothing but each prompt's last token; the
    context side's leases are all released."""
    ctx, gen = pair
    assert isinstance(ctx.engine.kv, KvConnector) and isinstance(gen.engine.kv, KvConnector)
    prompt = list(range(3, 40))
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    params, r = _routed(ctx, gen, "/v1/completions", body)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_engine_id"] == ctx.engine.kv.agent.engine_id
    assert len(params["remote_block_ids"]) == 10  # 37 tokens in blocks of 4
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == (
        "127.0.0.1",
        int(ctx.base.rsplit(":", 1)[1]),
        1,
    )
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    alone = gen.engine.run_batch([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert got == alone.token_ids
    before, hits = gen.engine.stats.prompt_tokens, gen.engine.stats.prefix_cache_hits
    chat = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        "ignore_eos": True,
    }
    _, rc = _routed(ctx, gen, "/v1/chat/completions", chat)
    assert rc.status_code == 200, rc.text
    local = gen.client.post("/v1/chat/completions", json=chat).json()
    assert rc.json()["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    # the routed request computed its last prompt token only; the local one its whole prompt
    # but what the prefix cache held (the pulled blocks, cached once the routed request ran)
    cached = gen.engine.stats.prefix_cache_hits - hits
    assert cached > 0
    assert gen.engine.stats.prompt_tokens - before == 1 + local["usage"]["prompt_tokens"] - cached
    assert gen.engine.stats.remote_prefill_tokens > 0 and gen.engine.kv.blocks_received > 0
    _wait(lambda: ctx.engine.kv.leases == 0, "the context side's leases were not released")
    _wait(lambda: ctx.engine.allocator.num_in_use == 0, "context blocks still held")
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")
    metrics = gen.client.get("/metrics").text
    assert "dwdp_remote_prefill_tokens_total 0.0" not in metrics
    assert "dwdp_remote_prefill_tokens_total" in metrics
    _wait(lambda: "dwdp_kv_leases 0.0" in ctx.client.get("/metrics").text, "lease gauge")


def test_a_prefix_cached_on_the_context_server_is_leased_and_decoded_alike(pair):
    """The same prompt routed twice: the second prefill finds its blocks in the context
    server's prefix cache (all but the one holding its last token), leases the shared blocks,
    and the generation server decodes the same tokens from them; every block comes back."""
    ctx, gen = pair
    body = {"prompt": list(range(3, 40)), "max_tokens": 6, "ignore_eos": True}
    _, first = _routed(ctx, gen, "/v1/completions", body)
    hits = ctx.engine.stats.prefix_cache_hits
    _, second = _routed(ctx, gen, "/v1/completions", body)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert ctx.engine.stats.prefix_cache_hits - hits == 36  # 9 blocks of 4 of 37 tokens
    tokens = [r.json()["choices"][0]["token_ids"] for r in (first, second)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    _wait(lambda: ctx.engine.kv.leases == 0, "the context side's leases were not released")
    _wait(lambda: ctx.engine.allocator.num_in_use == 0, "context blocks still held")
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_a_routed_stream_decodes_and_streams(pair):
    ctx, gen = pair
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "ignore_eos": True}
    pre = {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    params = ctx.client.post("/v1/completions", json=pre).json()["kv_transfer_params"]
    events = []
    with gen.client.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "kv_transfer_params": params}
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert tokens == gen.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_remote_prefill": True}, "kv_transfer_params.remote_engine_id: required"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "cannot be true"),
        (
            {
                "do_remote_prefill": True,
                "remote_engine_id": "e",
                "remote_request_id": "r",
                "remote_block_ids": [0],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "remote_lease_token": "t",
            },
            "remote_block_ids: 1 blocks, the prompt of",
        ),
        ({"remote_port": 0}, "kv_transfer_params.remote_port"),
        ({"remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids"),
        ({"tp_size": 2}, "kv_transfer_params.tp_size"),
        ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),  # strict
        ({"remote_port": "8001"}, "kv_transfer_params.remote_port"),
        ({"remote_block_ids": [True]}, "kv_transfer_params.remote_block_ids"),
    ],
)
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(pair, params, needle):
    _ctx, gen = pair
    r = gen.client.post(
        "/v1/completions",
        json={"prompt": list(range(3, 20)), "max_tokens": 2, "kv_transfer_params": params},
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_remote_decode_needs_no_stream(pair):
    ctx, _gen = pair
    r = ctx.client.post(
        "/v1/completions",
        json={"prompt": "hi", "stream": True, "kv_transfer_params": REMOTE_DECODE},
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("stream: true")
    assert "do_remote_decode" in message


@pytest.fixture(scope="module")
def other_ctx(checkpoint):
    """A second context server (another engine), which the generation server reads from once
    first, so it knows that engine when params name it."""
    with _server(checkpoint) as other:
        yield other


def _lease(ctx: EngineServer, prompt: list[int]) -> dict:
    """A prefill on ``ctx`` for a remote decode: its answer's ``kv_transfer_params``."""
    pre = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    r = ctx.client.post("/v1/completions", json=pre)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _read_counters(gen: EngineServer) -> tuple[int, int]:
    kv = gen.client.get("/dwdp/status").json()["kv_transfer"]
    return kv["blocks_received"], kv["remote_prefill_tokens"]


def test_crafted_params_read_nothing_and_name_the_field(pair, other_ctx):
    """Each crafted ``kv_transfer_params`` (another engine's id with a real lease, block ids
    outside the lease, another request's lease token, a misspelled flag beside the lease's
    fields) is a 4xx naming the field, and the generation server reads no block. A lease whose
    token was not shown stays for its real reader, who then decodes."""
    ctx, gen = pair
    body = {"prompt": list(range(3, 30)), "max_tokens": 3, "ignore_eos": True}
    _, r = _routed(other_ctx, gen, "/v1/completions", body)  # gen knows the other engine now
    assert r.status_code == 200, r.text
    other_engine = other_ctx.engine.kv.agent.engine_id
    before = _read_counters(gen)
    victim = _lease(ctx, list(range(40, 67)))  # another request's KV, on the same server
    cases = [
        (lambda p: {**p, "remote_engine_id": other_engine}, 400,
         f"kv_transfer_params.remote_engine_id: {other_engine!r}, but the side channel"),
        (lambda p: {**p, "remote_block_ids": victim["remote_block_ids"]}, 400,
         "kv_transfer_params.remote_block_ids: not the blocks of request"),
        (lambda p: {**p, "remote_block_ids": [2**31 - 1] * len(p["remote_block_ids"])}, 400,
         "kv_transfer_params.remote_block_ids: not the blocks of request"),
        (lambda p: {**p, "remote_lease_token": victim["remote_lease_token"]}, 403,
         "kv_transfer_params.remote_lease_token: not the token of"),
        (lambda p: {**{k: v for k, v in p.items() if k != "do_remote_prefill"},
                    "do_remote_prefil": True}, 400,
         "kv_transfer_params: unknown key 'do_remote_prefil' (did you mean "
         "'do_remote_prefill'?)"),
        (lambda p: {**p, "do_remote_prefill": "true"}, 400,
         "kv_transfer_params.do_remote_prefill: Input should be a valid boolean"),
    ]
    for craft, status, needle in cases:
        real = _lease(ctx, body["prompt"])
        r = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": craft(real)})
        assert r.status_code == status, (needle, r.text)
        assert r.json()["error"]["message"].startswith(needle), r.text
        assert _read_counters(gen) == before  # not one block read
        if status == 403 or craft(real).get("do_remote_prefill") is not True:  # token unshown
            ok = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": real})
            assert ok.status_code == 200, ok.text  # the lease waited for its reader
            before = _read_counters(gen)
    ok = gen.client.post("/v1/completions", json={**body, "prompt": list(range(40, 67)),
                                                  "kv_transfer_params": victim})
    assert ok.status_code == 200, ok.text
    _wait(lambda: ctx.engine.kv.leases == 0, "leases not released")
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_a_refused_decode_releases_the_lease_at_once(pair, router):
    """A generation server that refuses a routed request after its prefill (max_tokens over
    the context; max_tokens over the schema's bound, a validation error) releases the lease:
    the context server's leased blocks are back within 1 s, counted as refused, not expired.
    The same through the real vllm-router."""
    ctx, gen = pair
    prompt = list(range(3, 103))
    refusals = [{"max_tokens": 1000}, {"max_tokens": 2_000_000}]
    for extra in refusals:
        params = _lease(ctx, prompt)
        assert ctx.engine.kv.leases == 1
        refused = ctx.engine.kv.leases_refused
        r = gen.client.post("/v1/completions",
                            json={"prompt": prompt, **extra, "kv_transfer_params": params})
        assert r.status_code == 400, r.text
        start = time.monotonic()
        _wait(lambda: ctx.engine.kv.leases == 0 and ctx.engine.allocator.num_in_use == 0,
              "the refused request's lease still holds blocks", timeout=1.0)
        assert time.monotonic() - start < 1.0
        assert ctx.engine.kv.leases_refused == refused + 1
    expired = ctx.engine.kv.leases_expired
    r = httpx.post(router + "/v1/completions",
                   json={"model": "m", "prompt": prompt, "max_tokens": 1000}, timeout=60)
    assert r.status_code == 400, r.text
    assert "exceeds the model's context" in r.text
    _wait(lambda: ctx.engine.kv.leases == 0 and ctx.engine.allocator.num_in_use == 0,
          "the lease of the request refused through the router still holds blocks", timeout=1.0)
    assert ctx.engine.kv.leases_expired == expired
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_a_released_lease_and_an_unknown_engine_are_clear_errors(pair):
    """A second read of released blocks is a 410 naming remote_request_id; a side channel
    refuses a release without the lease's token; nothing is leaked either way."""
    ctx, gen = pair
    body = {"prompt": list(range(5, 30)), "max_tokens": 3, "ignore_eos": True}
    params, r = _routed(ctx, gen, "/v1/completions", body)
    assert r.status_code == 200
    _wait(lambda: ctx.engine.kv.leases == 0, "lease not released")
    again = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
    assert again.status_code == 410, again.text
    assert again.json()["error"]["message"].startswith(
        f"kv_transfer_params.remote_request_id: no KV lease of {params['remote_request_id']!r}")
    fresh = _lease(ctx, body["prompt"])
    r = ctx.client.delete("/v1/dwdp/kv_agent", params={"claim": fresh["remote_request_id"],
                                                        "token": "guess"})
    assert r.status_code == 403 and ctx.engine.kv.leases == 1
    assert httpx.delete(ctx.base + "/v1/dwdp/kv_agent", params={
        "claim": fresh["remote_request_id"], "token": fresh["remote_lease_token"]}
    ).status_code == 401  # the side channel needs the API key
    ok = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": fresh})
    assert ok.status_code == 200, ok.text
    _wait(lambda: ctx.engine.allocator.num_in_use == 0, "context blocks still held")
    _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_an_expired_lease_frees_the_blocks_and_the_late_reader_gets_an_error(checkpoint):
    with _server(checkpoint, lease_s=2.0) as ctx, _server(checkpoint) as gen:
        body = {"prompt": list(range(3, 25)), "max_tokens": 3, "ignore_eos": True}
        pre = {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
        params = ctx.client.post("/v1/completions", json=pre).json()["kv_transfer_params"]
        assert ctx.engine.kv.leases == 1
        _wait(lambda: ctx.engine.kv.leases == 0, "the lease never expired", timeout=10)
        assert ctx.engine.allocator.num_in_use == 0 and ctx.engine.kv.leases_expired == 1
        r = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert r.status_code == 410 and "it expired" in r.json()["error"]["message"]
        _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_a_context_server_gone_before_the_decode_is_a_clear_error(checkpoint):
    """The context server stops between prefill and decode: the generation server answers
    502 naming the side channel it could not reach, within its fetch timeout."""
    with _server(checkpoint) as gen:
        ctx = _server(checkpoint)
        with ctx:
            body = {"prompt": list(range(3, 25)), "max_tokens": 3, "ignore_eos": True}
            pre = {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
            params = ctx.client.post("/v1/completions", json=pre).json()["kv_transfer_params"]
        start = time.monotonic()
        r = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert r.status_code == 502, r.text
        assert "KV side channel" in r.json()["error"]["message"]
        assert time.monotonic() - start < 15
        _wait(lambda: gen.engine.allocator.num_in_use == 0, "generation blocks still held")


def test_the_side_channel_needs_the_api_key(pair):
    ctx, _gen = pair
    r = httpx.get(ctx.base + "/v1/dwdp/kv_agent")
    assert r.status_code == 401
    ok = ctx.client.get("/v1/dwdp/kv_agent")
    assert ok.status_code == 200 and ok.json()["layout"]["block_size"] == 4
    assert ctx.client.get("/v1/dwdp/kv_agent", params={"claim": "nope"}).status_code == 410


@pytest.mark.parametrize(("params", "needle"), [
    ({"do_remote_decod": True},
     "kv_transfer_params: unknown key 'do_remote_decod' (did you mean 'do_remote_decode'?)"),
    ({"do_remote_decode": "true"},
     "kv_transfer_params.do_remote_decode: Input should be a valid boolean"),
])
def test_a_context_server_refuses_a_misspelled_or_mistyped_key(pair, params, needle):
    """The rule of the generation side holds on the context side: a misspelled flag is not
    ignored (the prompt would be prefilled and decoded here without a word) and a mistyped one
    is named before any rule that reads it."""
    ctx, _gen = pair
    r = ctx.client.post("/v1/completions", json={"prompt": list(range(3, 30)), "max_tokens": 2,
                                                 "kv_transfer_params": params})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(needle), r.text


@pytest.fixture
def router(pair):
    """The real vllm-router (PD mode, static URLs) in front of the pair. It calls the workers
    with the key of ``OPENAI_API_KEY`` (its ``--api-key`` does not reach the PD calls)."""
    ctx, gen = pair
    with VllmRouter([ctx.base], [gen.base], api_key=KEY) as base:
        yield base


def test_through_vllm_router_every_request_decodes_from_remote_kv(pair, router):
    """Completions, chat and a stream sent to vllm-router: the tokens are the generation
    server's own, its prompt KV came over NIXL, and the context side's leases end at 0."""
    ctx, gen = pair
    before = gen.engine.stats.remote_prefill_tokens
    prompt = list(range(7, 40))
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
    r = httpx.post(router + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    alone = gen.engine.run_batch([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert r.json()["choices"][0]["token_ids"] == alone.token_ids
    assert gen.engine.stats.remote_prefill_tokens - before == len(prompt)
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    want = gen.client.post("/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]
    r = httpx.post(router + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    with httpx.stream(
        "POST", router + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60
    ) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [
        t for e in events[:-1] for t in json.loads(e)["choices"][0].get("token_ids", [])
    ] == want
    _wait(lambda: ctx.engine.kv.leases == 0, "leases not released")
    _wait(
        lambda: ctx.engine.allocator.num_in_use == 0 == gen.engine.allocator.num_in_use,
        "blocks still held",
    )
    # /dwdp/status carries the counters (what the cluster test reads through the pods)
    got = gen.client.get("/dwdp/status").json()["kv_transfer"]
    assert got["blocks_received"] > 0 and got["remote_prefill_tokens"] >= len(prompt)
    sent = ctx.client.get("/dwdp/status").json()["kv_transfer"]
    assert sent["leases_granted"] >= 3 and sent["leases"] == 0 == sent["leases_expired"]


def _where(server: EngineServer, identity: dict) -> dict:
    """The ``dwdp`` field's ``ServerRef`` of ``server``: its identity, engine id and address."""
    kv = server.engine.kv
    return {**identity, "engine_id": kv.agent.engine_id, "host": "127.0.0.1", "port": kv.port}


def test_the_dwdp_field_survives_vllm_router_and_names_prefill_and_decode(pair, router):
    """The extension field ``dwdp`` of an answer through the real vllm-router (completion,
    chat, and a stream's first event) names the context server that leased the blocks and the
    generation server that decoded; a prefill-only answer names no decode server and a local
    request names the server itself twice."""
    ctx, gen = pair
    want = {"prefill": _where(ctx, CTX), "decode": _where(gen, GEN)}
    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 3}
    r = httpx.post(router + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["dwdp"] == want
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(router + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["dwdp"] == want
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        with httpx.stream("POST", router + path, json={**req, "stream": True}, timeout=60) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert events[0]["dwdp"] == want, path
        assert all("dwdp" not in e for e in events[1:])
    pre = {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    prefilled = ctx.client.post("/v1/completions", json=pre).json()
    assert prefilled["dwdp"] == {"prefill": _where(ctx, CTX)}
    params = {"kv_transfer_params": prefilled["kv_transfer_params"]}
    assert gen.client.post("/v1/completions", json={**body, **params}).json()["dwdp"] == want
    alone = gen.client.post("/v1/completions", json=body).json()["dwdp"]
    assert alone == {"prefill": _where(gen, GEN), "decode": _where(gen, GEN)}
    _wait(lambda: ctx.engine.kv.leases == 0, "leases not released")


def test_a_failed_nixl_read_releases_the_lease_at_once(checkpoint):
    """The context server's KV memory is deregistered from NIXL after its prefill (a fault
    injected into the real agent): the generation server's READ fails (502 naming the read),
    and the lease ends at once instead of at its expiry."""
    with _server(checkpoint) as ctx, _server(checkpoint) as gen:
        body = {"prompt": list(range(3, 25)), "max_tokens": 3, "ignore_eos": True}
        params = _lease(ctx, body["prompt"])
        agent = ctx.engine.kv.agent
        agent._agent.deregister_memory(agent._registered)  # the fault
        agent._registered = None
        r = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "kv_transfer_error"
        assert r.json()["error"]["message"].startswith(f"KV read from {params['remote_engine_id']}")
        _wait(lambda: ctx.engine.kv.leases == 0 and ctx.engine.allocator.num_in_use == 0,
              "the failed read's lease still holds blocks", timeout=1.0)
        assert ctx.engine.kv.leases_refused == 1 and ctx.engine.kv.leases_expired == 0
        assert gen.engine.kv.blocks_received == 0


def test_a_speculating_generation_server_behind_vllm_router_answers_as_without(checkpoint):
    """A generation server with n-gram speculation (``engine.speculative``) behind vllm-router
    decodes from the context server's KV: its greedy answers, whole and streamed, are the tokens
    a plain engine gives the same prompt, and drafts were accepted on the way."""
    from dwdp.worker.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    phrase = list(range(7, 19))
    prompt = phrase * 3 + phrase[:4]  # a repeated phrase: the drafts find something to propose
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with _server(checkpoint, server=CTX) as ctx, EngineServer(
        checkpoint, api_key=KEY, max_model_len=128, block_size=4, server=GEN, speculative=spec,
    ) as gen, VllmRouter([ctx.base], [gen.base], api_key=KEY) as router:
        want = ctx.engine.run_batch([prompt], params)[0].token_ids
        body = {"model": "m", "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
        r = httpx.post(router + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert [t for e in events[:-1]
                for t in json.loads(e)["choices"][0].get("token_ids", [])] == want
        assert gen.engine.stats.remote_prefill_tokens >= 2 * len(prompt)
        assert gen.engine.stats.spec_accepted_tokens > 0
        metrics = gen.client.get("/metrics").text
        assert "vllm:spec_decode_num_accepted_tokens_total" in metrics


@pytest.fixture(scope="module")
def demo_mtp_checkpoint():
    from dwdp_dev.devcluster.paths import cache_dir
    from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model

    return cached_demo_mtp_model(cache_dir() / "models")


def _mtp_server(path: Path, server: dict, mtp: bool, **limits) -> EngineServer:
    from dwdp.worker.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2) if mtp else None
    return EngineServer(path, api_key=KEY, max_model_len=128, block_size=4, server=server,
                        speculative=spec, **limits)


def _recording(obj, name: str, seen: list, blocks) -> None:
    """Wrap ``obj.name`` so that each call's block list, ``blocks(args, result)``, lands in
    ``seen``."""
    real = getattr(obj, name)

    def call(*args):
        out = real(*args)
        seen.append(list(blocks(args, out)))
        return out

    setattr(obj, name, call)


def _mtp_kv(engine, blocks: list[int], n: int):
    """The MTP layer's cache entries (keys and values) of positions ``0..n-1`` in ``blocks``."""
    layer = engine.model.config.num_hidden_layers
    size = engine.allocator.block_size
    slots = torch.tensor([blocks[p // size] * size + p % size for p in range(n)])
    return [t.index_select(0, slots) for t in engine.runner.cache.layers[layer]]


def test_a_generation_servers_mtp_layer_drafts_from_the_context_servers_kv(
        demo_mtp_checkpoint):
    """MTP drafts on both sides: the context server fills its MTP layer's KV of the prompt
    before it answers the prefill, and the generation server reads it with the model's: after
    the decode, the generation server holds the MTP KV of every prompt position that an engine
    prefilling the prompt itself computes. The greedy answers are a plain engine's token for
    token, the first drafts are mostly accepted, and no block is left on either side."""
    from dwdp_dev.worker.demo_corpus import CAPITALS

    local = _mtp_server(demo_mtp_checkpoint, GEN, True, prefix_caching=False).engine
    with _mtp_server(demo_mtp_checkpoint, CTX, True) as ctx, \
            _mtp_server(demo_mtp_checkpoint, GEN, True) as gen:
        tok = ctx.engine.tokenizer
        prompts = [tok(f"What is the capital of {c}?")["input_ids"] for c, _ in CAPITALS[:6]]
        want = [o.token_ids for o in _mtp_server(demo_mtp_checkpoint, GEN, False).engine
                .run_batch(prompts, SamplingParams(max_tokens=16))]
        pulled: list[list[int]] = []
        prefilled: list[list[int]] = []
        _recording(gen.engine.kv, "load", pulled, lambda args, _: args[-1])  # local blocks
        _recording(local.allocator, "allocate", prefilled, lambda _, out: out)
        for prompt, tokens in zip(prompts, want, strict=True):
            body = {"model": "m", "prompt": prompt, "max_tokens": 16}
            _, r = _routed(ctx, gen, "/v1/completions", body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
            local.run_batch([prompt], SamplingParams(max_tokens=2))
            got, truth = (_mtp_kv(gen.engine, pulled[-1], len(prompt)),
                          _mtp_kv(local, prefilled[0], len(prompt)))
            prefilled.clear()
            for a, b in zip(got, truth, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        stats = gen.engine.stats
        assert stats.remote_prefill_tokens == sum(map(len, prompts))
        assert stats.spec_drafts > 0
        assert stats.spec_accepted_per_pos[0] >= 0.6 * stats.spec_drafts, stats
        _wait(lambda: ctx.engine.allocator.num_in_use == 0 == gen.engine.allocator.num_in_use,
              "blocks still held after the decodes")


def test_mtp_on_one_side_only_is_a_clear_kv_transfer_error(demo_mtp_checkpoint):
    """A generation server with MTP reading a context server without it: the layouts differ by
    the MTP layer, and the decode request's error says so (the operator refuses such a
    deployment before any pod starts; a hand-made pairing gets this)."""
    with _mtp_server(demo_mtp_checkpoint, CTX, False) as ctx, \
            _mtp_server(demo_mtp_checkpoint, GEN, True) as gen:
        _, r = _routed(ctx, gen, "/v1/completions",
                       {"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4})
        assert r.status_code >= 400, r.text
        message = r.json()["error"]["message"]
        assert "draft_layers 0 there, 1 here" in message
        assert "engine.speculative.method mtp on both servers" in message
        _wait(lambda: ctx.engine.kv.leases == 0, "the refused read's lease still held",
              timeout=5.0)
