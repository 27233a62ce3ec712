"""Disaggregated serving through the operator's router on a real local control plane (issue 16).

The operator (installed by its Helm chart) runs examples/04-demo.yaml with one context DWDP
group of 4 ranks (expert + dense DWDP, cpu backend) and one generation server; ``spec.router``
is left unset, so the router is on (there are generation servers). Its pod runs the real
vllm-router (the worker image's) with a ``--prefill`` URL per committed rank and the generation
server's ``--decode`` URL. Completions, chat and a stream sent to the router answer exactly
the replicated reference's tokens; every context rank prefilled some of them; the generation
server read every prompt's KV over NIXL (blocks received > 0, remote prefill tokens = the
prompts' tokens); the leases end at 0.

The test runs on the session's cluster in its own namespace, as test_e2e_demo.py does
(``testing.demo_namespace``; 5 ``nvidia.com/gpu``: 4 ranks and the generation server).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dwdp_dev.devcluster.testing import TestCluster, demo_driver, demo_namespace

NS = "pd"
NAME = "pd"
RANKS = 4

pytestmark = pytest.mark.timeout(1800)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


demo = demo_driver()


def _reference(model_dir: Path) -> list[dict[str, Any]]:
    """The demo's requests answered by one process with replicated weights (no DWDP, no
    disaggregation): each answer's choice (text or message, token ids)."""
    import torch
    from fastapi.testclient import TestClient

    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.server.app import build_app

    torch.set_num_threads(1)
    model, tok = load_checkpoint(str(model_dir))
    engine = ContinuousEngine(model, tok, model_name=demo.MODEL_DIR).start()
    try:
        with TestClient(build_app(engine, served_name=demo.MODEL_DIR)) as client:
            out = []
            for path, req in demo.requests_of():
                r = client.post(path, json=req)
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0])
            return out
    finally:
        engine.stop()


def _pods(tc: Any, selector: str) -> list[dict[str, Any]]:
    out = tc.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def _router_ready(tc: Any) -> dict[str, Any] | None:
    st = tc.get("dwdp", NAME, NS).get("status") or {}
    cond = {c["type"]: c for c in st.get("conditions") or ()}.get("RouterReady") or {}
    router = st.get("router") or {}
    if cond.get("status") == "True" and router.get("readyReplicas") == 1:
        return st
    return None


@pytest.fixture(scope="module")
def deployed(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestCluster, list[dict[str, Any]], dict[str, Any]]]:
    """The session cluster with the operator, the deployment Ready and its router Ready in
    namespace ``NS``; yields (cluster, reference choices, status)."""
    tc = cluster
    models = tmp_path_factory.mktemp("pd-models")
    with demo_namespace(tc, NS, models) as model_dir:
        try:
            doc = demo.manifest(models, name=NAME)
            doc["spec"]["context"]["replicas"] = 1
            assert doc["spec"]["generation"]["replicas"] == 1 and "router" not in doc["spec"]
            tc.apply(NS, demo.api_key_secret(), doc)
            took = demo.wait_ready(tc, NS, NAME, groups=1, timeout=900)
            st = tc.wait_for(
                lambda: _router_ready(tc), timeout=300, interval=1.0, message="RouterReady"
            )
            print(f"apply -> Ready: {took:.1f} s; router {st['router']}")
            yield tc, _reference(model_dir), st
        finally:
            for pod in _pods(tc, "app.kubernetes.io/component=router"):
                print(tc.pod_log(NS, pod["metadata"]["name"])[-3000:])


def _status(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(url + "/dwdp/status", timeout=10).json()


def _stream_tokens(url: str, path: str, req: dict[str, Any]) -> list[int]:
    import httpx

    headers = {"Authorization": f"Bearer {demo.API_KEY}"}
    body = {**req, "stream": True}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as s:
        assert s.status_code == 200, s.read()
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0].get("token_ids") or ()]


def test_requests_through_the_router_decode_from_remote_kv_of_every_rank(deployed) -> None:
    import httpx

    tc, want, st = deployed
    assert st["router"]["endpoint"] == f"http://{NAME}-router.{NS}.svc:8000"
    assert st["router"]["prefillServers"] == RANKS and st["router"]["decodeServers"] == 1
    (router_pod,) = _pods(tc, "app.kubernetes.io/component=router")
    ctr = router_pod["spec"]["containers"][0]
    assert ctr["command"] == ["dwdp", "router-gate"] and "--vllm-pd-disaggregation" in ctr["args"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["DWDP_API_KEY_FILE"]["value"] == "/var/run/secrets/dwdp/api-key/key"
    (volume,) = [v for v in router_pod["spec"]["volumes"] if v["name"] == "api-key"]
    assert volume["secret"]["secretName"] == demo.API_KEY_SECRET
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": 8000, "scheme": "HTTP"}
    assert demo.API_KEY not in json.dumps(router_pod)
    url = f"http://{router_pod['status']['podIP']}:8000"
    (ctx_pod,) = _pods(tc, "dwdp.io/role=context")
    ranks = [f"http://{ctx_pod['status']['podIP']}:{8000 + k}" for k in range(RANKS)]
    prefill = [ctr["args"][i + 1] for i, a in enumerate(ctr["args"]) if a == "--prefill"]
    assert prefill == ranks  # every committed rank, one URL per local-rank port
    (gen_pod,) = _pods(tc, "dwdp.io/role=generation")
    gen = f"http://{gen_pod['status']['podIP']}:8000"
    headers = {"Authorization": f"Bearer {demo.API_KEY}"}
    prompt_tokens = 0
    for _ in range(2):  # round robin over 4 ranks: every rank prefills at least one
        for (path, req), ref in zip(demo.requests_of(), want, strict=True):
            r = httpx.post(url + path, json=req, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["token_ids"] == ref["token_ids"], (path, got, ref)
            assert got["choices"][0].get("text") == ref.get("text")
            assert got["choices"][0].get("message") == ref.get("message")
            prompt_tokens += got["usage"]["prompt_tokens"]
    path, req = demo.requests_of()[-1]  # the chat, streamed
    assert _stream_tokens(url, path, req) == want[-1]["token_ids"]
    prompt_tokens += got["usage"]["prompt_tokens"]  # the stream's prompt: the same chat
    kv = _status(gen)["kv_transfer"]
    assert kv["blocks_received"] > 0
    assert kv["remote_prefill_tokens"] == prompt_tokens  # every routed prompt's KV was read
    granted = [_status(r)["kv_transfer"]["leases_granted"] for r in ranks]
    assert all(n >= 1 for n in granted), granted
    assert sum(granted) == 2 * len(want) + 1

    def at_rest() -> bool:
        return all(_status(r)["kv_transfer"]["leases"] == 0 for r in ranks)

    tc.wait_for(at_rest, timeout=60, interval=0.5, message="context leases back to 0")
    assert all(_status(r)["kv_transfer"]["leases_expired"] == 0 for r in ranks)


def test_kubectl_shows_the_router_and_its_service_and_policy(deployed) -> None:
    tc, _want, _st = deployed
    table = tc.kubectl("get", "dwdp", "-n", NS).stdout.splitlines()
    head = table[0].split()
    assert "ROUTER" in head
    assert table[1].split()[head.index("ROUTER")] == f"http://{NAME}-router.{NS}.svc:8000"
    policies = json.loads(tc.kubectl("get", "networkpolicy", "-n", NS, "-o", "json").stdout)
    by_name = {p["metadata"]["name"]: p["spec"] for p in policies["items"]}
    router = by_name[f"{NAME}-router"]
    assert router["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert [p["port"] for p in router["ingress"][0]["ports"]] == [8000, 29000]
    svc = tc.get("service", f"{NAME}-router", NS)
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000, 29000]


def _served(url: str) -> float:
    """Requests a server answered on anything but probes and scrapes (its ``/metrics``)."""
    import re

    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    rows = re.findall(r'^dwdp_requests_total\{endpoint="([^"]*)"[^}]*\} (\S+)$', text, re.M)
    quiet = ("/health", "/ready", "/metrics", "/dwdp/status", "/v1/models")
    return sum(float(v) for endpoint, v in rows if endpoint not in quiet)


def _servers(tc: Any) -> tuple[str, list[str]]:
    """The router's URL and every server's (the context ranks, the generation server)."""
    (router_pod,) = _pods(tc, "app.kubernetes.io/component=router")
    (ctx_pod,) = _pods(tc, "dwdp.io/role=context")
    (gen_pod,) = _pods(tc, "dwdp.io/role=generation")
    ranks = [f"http://{ctx_pod['status']['podIP']}:{8000 + k}" for k in range(RANKS)]
    return (
        f"http://{router_pod['status']['podIP']}:8000",
        [*ranks, f"http://{gen_pod['status']['podIP']}:8000"],
    )


def test_the_router_refuses_a_request_without_the_key_and_no_rank_sees_it(deployed) -> None:
    """No key, another key: 401 in OpenAI's error shape from the router; no server's request
    counter moves and no context rank grants a lease (nothing was prefilled)."""
    import httpx

    tc, _want, _st = deployed
    url, servers = _servers(tc)
    path, req = demo.requests_of()[0]
    before = [(_served(s), _status(s)["kv_transfer"]["leases_granted"]) for s in servers]
    for headers in (
        {},
        {"Authorization": "Bearer not-the-key"},
        {"Authorization": f"Bearer {demo.API_KEY}x"},
        {"Authorization": "Basic x"},
    ):
        r = httpx.post(url + path, json=req, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/list_workers", timeout=10).status_code == 401  # admin paths too
    assert [(_served(s), _status(s)["kv_transfer"]["leases_granted"]) for s in servers] == before
    r = httpx.post(
        url + path, json=req, headers={"Authorization": f"Bearer {demo.API_KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert (
        sum(_status(s)["kv_transfer"]["leases_granted"] for s in servers)
        == sum(g for _, g in before) + 1
    )


def test_the_key_reads_back_as_the_docs_show(deployed) -> None:
    """docs/operations.md: kubectl get secret ... -o jsonpath='{.data.api-key}' | base64 -d."""
    import base64

    tc, _want, _st = deployed
    out = tc.kubectl(
        "get", "secret", demo.API_KEY_SECRET, "-n", NS, "-o", "jsonpath={.data.api-key}"
    ).stdout
    assert base64.b64decode(out).decode() == demo.API_KEY


def _choices_by_index(body: dict[str, Any]) -> dict[int, list[int]]:
    return {c["index"]: c["token_ids"] for c in body["choices"]}


def test_n_2_and_a_streamed_n_2_through_the_router(deployed) -> None:
    """``n: 2`` (seeded sampling) through the router: the choices the generation server gives
    when it prefills the prompt itself, from one read of the context rank's blocks (its
    ``blocks_received`` grows by the prompt's blocks once); a streamed ``n: 2`` chat streams
    each choice's tokens of the same chat unstreamed."""
    import httpx

    tc, _want, _st = deployed
    (router_pod,) = _pods(tc, "app.kubernetes.io/component=router")
    url = f"http://{router_pod['status']['podIP']}:8000"
    (gen_pod,) = _pods(tc, "dwdp.io/role=generation")
    gen = f"http://{gen_pod['status']['podIP']}:8000"
    headers = {"Authorization": f"Bearer {demo.API_KEY}"}
    path, req = demo.requests_of()[0]
    body = {**req, "n": 2, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    local = httpx.post(gen + path, json=body, headers=headers, timeout=120)
    assert local.status_code == 200, local.text
    before = _status(gen)["kv_transfer"]
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert _choices_by_index(r.json()) == _choices_by_index(local.json())
    after = _status(gen)["kv_transfer"]
    prompt = r.json()["usage"]["prompt_tokens"]
    assert after["remote_prefill_tokens"] - before["remote_prefill_tokens"] == prompt  # once
    chat_path, chat = demo.requests_of()[-1]
    chat = {**chat, "n": 2, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    whole = httpx.post(url + chat_path, json=chat, headers=headers, timeout=120)
    assert whole.status_code == 200, whole.text
    streamed: dict[int, list[int]] = {0: [], 1: []}
    with httpx.stream(
        "POST", url + chat_path, json={**chat, "stream": True}, headers=headers, timeout=120
    ) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c.get("token_ids") or []
    assert streamed == _choices_by_index(whole.json())


def test_a_refused_decode_frees_the_context_ranks_blocks_within_a_second(deployed) -> None:
    """A request the generation server refuses after its prefill (max_tokens beyond the
    model's context): a 4xx through the router, and every context rank's leases are back to 0
    within 1 s; what was leased was released as refused, nothing waits for its expiry."""
    import time

    import httpx

    tc, _want, _st = deployed
    url, servers = _servers(tc)
    ranks = servers[:-1]
    before = [_status(r)["kv_transfer"] for r in ranks]
    path, req = demo.requests_of()[0]
    r = httpx.post(
        url + path,
        json={**req, "max_tokens": 999_999},
        headers={"Authorization": f"Bearer {demo.API_KEY}"},
        timeout=120,
    )
    assert 400 <= r.status_code < 500, r.text
    start = time.monotonic()
    tc.wait_for(
        lambda: all(_status(x)["kv_transfer"]["leases"] == 0 for x in ranks),
        timeout=1.0,
        interval=0.05,
        message="context leases back to 0 within 1 s",
    )
    assert time.monotonic() - start <= 1.0
    after = [_status(r)["kv_transfer"] for r in ranks]
    pairs = list(zip(after, before, strict=True))
    granted = sum(a["leases_granted"] - b["leases_granted"] for a, b in pairs)
    refused = sum(a["leases_refused"] - b["leases_refused"] for a, b in pairs)
    # a context rank prefilled it (the router sent it max_tokens 1); should the context ranks
    # ever refuse such a request first, this test needs a refusal only a decode server makes
    assert granted >= 1
    assert refused == granted  # each lease the refused request got was released at once
    assert [a["leases_expired"] for a in after] == [b["leases_expired"] for b in before]


ROTATION_BOUND_S = 60.0
"""The local bound (docs/operations.md, "Rotating the key"): the local node's kubelet sync
period (``realnode.SYNC_FREQUENCY``, 5 s; with the default minute two runs took 59.5 s and
78.9 s, with 5 s one took 2.9 s), the servers' second, the router's restart behind its gate,
and room for a loaded 2-core machine."""


def test_a_rotated_key_takes_over_without_a_restart(deployed) -> None:
    """Last of the module: the Secret gets a new key; within the bound the router answers the
    new key (the reference answer) and refuses the old one, and no pod was replaced or
    restarted."""
    import base64
    import time

    import httpx

    tc, want, _st = deployed
    url = _servers(tc)[0]
    children = "app.kubernetes.io/managed-by=dwdp-operator"
    pods = {p["metadata"]["uid"] for p in _pods(tc, children)}
    path, req = demo.requests_of()[0]
    new_key = demo.API_KEY[::-1] + "-rotated"
    patch = {"data": {"api-key": base64.b64encode(new_key.encode()).decode()}}
    tc.kubectl("patch", "secret", demo.API_KEY_SECRET, "-n", NS, "-p", json.dumps(patch))
    start = time.monotonic()

    def new_key_served() -> bool:
        r = httpx.post(
            url + path, json=req, headers={"Authorization": f"Bearer {new_key}"}, timeout=120
        )
        return r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want[0]["token_ids"]

    tc.wait_for(
        new_key_served,
        timeout=ROTATION_BOUND_S,
        interval=0.5,
        message="the router serving the rotated key",
    )
    took = time.monotonic() - start
    old = httpx.post(
        url + path, json=req, headers={"Authorization": f"Bearer {demo.API_KEY}"}, timeout=30
    )
    assert old.status_code == 401, old.text
    print(f"rotated key served after {took:.1f} s")
    assert {p["metadata"]["uid"] for p in _pods(tc, children)} == pods  # nothing rolled
    for p in _pods(tc, children):
        assert all(c.get("restartCount", 0) == 0 for c in p["status"]["containerStatuses"]), p
