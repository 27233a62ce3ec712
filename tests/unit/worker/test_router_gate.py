"""The router's gate (``dwdp router-gate``) in front of the real vllm-router in PD mode, over a
real context server and a real generation server (NIXL over TCP), every key read from one file
as the operator mounts it.

vllm-router authenticates no client (it calls the workers with its own ``OPENAI_API_KEY``), so
the gate must: a request without the key, or with another, gets 401 in OpenAI's error shape and
reaches no server; the key gets the answer the servers give; the router's admin paths need the
key too, the probes do not; a key written into the file takes over (the old one refused) within
the gate's bound, with the servers re-reading the same file.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from dwdp.worker.apikey import ApiKey  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, RouterGate, wait_for  # noqa: E402

KEY, NEW_KEY = "gate-key-1", "gate-key-2"
ROTATION_BOUND_S = 15.0
"""What docs/operations.md promises once the file changed: RECHECK_S, a drain of the requests in
flight (none here) and a new vllm-router's start (about a second)."""
BODY = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 6, "ignore_eos": True}


def _write_key(path: Path, key: str) -> None:
    """Replace the key file atomically, as the kubelet swaps a Secret volume's files."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(key)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """(gate URL, context server, generation server, key file)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("gate")
    ckpt = make_checkpoint("qwen3_moe", folder / "q", num_experts=5)
    key_file = folder / "key"
    _write_key(key_file, KEY)
    servers = [
        EngineServer(ckpt, api_key=ApiKey(path=key_file), max_model_len=128, block_size=4)
        for _ in range(2)
    ]
    with (
        servers[0] as ctx,
        servers[1] as gen,
        RouterGate([ctx.base], [gen.base], key_file=key_file) as url,
    ):
        yield url, ctx, gen, key_file


def _served(server: EngineServer) -> float:
    """Requests a server answered on anything but probes and scrapes (the OpenAI paths and any
    other path vllm-router may call, e.g. its ``/render``)."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    total = 0.0
    for endpoint, value in re.findall(r'^dwdp_requests_total\{endpoint="([^"]*)"[^}]*\} (\S+)$',
                                      text, flags=re.M):
        if endpoint not in ("/health", "/ready", "/metrics", "/dwdp/status", "/v1/models"):
            total += float(value)
    return total


def _post(url: str, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(url + "/v1/completions", json=body or BODY, headers=headers, timeout=60)


def test_no_key_or_another_key_gets_401_and_reaches_no_server(routed) -> None:
    url, ctx, gen, _ = routed
    before = (_served(ctx), _served(gen), ctx.engine.kv.status()["leases_granted"])
    for key in (None, "wrong", KEY.upper(), f"{KEY}x"):
        r = _post(url, key)
        assert r.status_code == 401, (key, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {
            "message": "missing or wrong API key: send Authorization: Bearer <key>",
            "type": "authentication_error", "code": 401}}
    for path in ("/workers", "/list_workers", "/get_loads", "/v1/models"):  # its admin paths
        assert httpx.get(url + path, timeout=10).status_code == 401, path
    assert (_served(ctx), _served(gen), ctx.engine.kv.status()["leases_granted"]) == before
    for path in ("/health", "/liveness", "/readiness"):  # the kubelet's probes
        assert httpx.get(url + path, timeout=10).status_code == 200, path


def test_the_key_gets_the_servers_answer_plain_and_streamed(routed) -> None:
    url, ctx, gen, _ = routed
    granted = ctx.engine.kv.status()["leases_granted"]
    r = _post(url, KEY)
    assert r.status_code == 200, r.text
    alone = gen.engine.run_batch([BODY["prompt"]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert r.json()["choices"][0]["token_ids"] == alone[0].token_ids
    assert ctx.engine.kv.status()["leases_granted"] == granted + 1  # prefilled there
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True},
                      headers=headers, timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0].get("token_ids") or ()]
    assert tokens == alone[0].token_ids


def test_the_key_lists_the_model_through_the_router(routed) -> None:
    """``GET /v1/models`` (what OpenAI clients call first) answers with the key, as
    completions do: the servers behind vllm-router check the key on it too."""
    url, ctx, _gen, _ = routed
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    direct = httpx.get(ctx.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=10).json()
    assert [m["id"] for m in r.json()["data"]] == [m["id"] for m in direct["data"]]


def test_a_rotated_key_takes_over_within_the_bound(routed) -> None:
    """Runs last: the key file gets a new key; the gate restarts vllm-router with it and the
    servers re-read it; within the bound the new key answers and the old one gets 401."""
    url, _ctx, _gen, key_file = routed
    assert _post(url, KEY).status_code == 200
    _write_key(key_file, NEW_KEY)
    start = time.monotonic()
    wait_for(lambda: _post(url, NEW_KEY).status_code == 200, "the new key was not accepted",
             timeout=ROTATION_BOUND_S)
    took = time.monotonic() - start
    assert _post(url, KEY).status_code == 401
    assert took <= ROTATION_BOUND_S


def test_a_dead_prefill_server_costs_latency_not_errors(tmp_path) -> None:
    """Two context servers and a generation server behind the gate, prefills round robin (the
    operator's default); one context server dies (its server stops: connection refused, as a
    killed rank's). vllm-router answers the requests it sent there with a 5xx and retries
    none itself; the gate sends them again and every client request is answered."""
    torch.set_num_threads(1)
    ckpt = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=5)
    key_file = tmp_path / "key"
    _write_key(key_file, KEY)
    servers = [EngineServer(ckpt, api_key=ApiKey(path=key_file), max_model_len=128,
                            block_size=4) for _ in range(3)]
    with servers[0] as live, servers[2] as gen:
        dying = servers[1].__enter__()
        try:
            with RouterGate([dying.base, live.base], [gen.base], key_file=key_file,
                            prefill_policy="round_robin") as url:
                assert _post(url, KEY).status_code == 200
                dying.__exit__(None, None, None)
                dying = None
                codes = [_post(url, KEY).status_code for _ in range(8)]
                assert codes == [200] * 8
                streamed = httpx.post(url + "/v1/completions", json={**BODY, "stream": True},
                                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                assert streamed.status_code == 200 and "[DONE]" in streamed.text
        finally:
            if dying is not None:
                dying.__exit__(None, None, None)
