"""The demo end to end on a real local control plane (issue 9), plus a rank killed while serving.

The steps come from scripts/demo.py (README command 1): the operator installed by its Helm
chart, a tiny DeepSeek-V3-family checkpoint, examples/04-demo.yaml (2 context DWDP groups of
4 ranks with expert + dense DWDP on the cpu backend, one generation server). Every rank of
every group, reached through the client Service's EndpointSlice addresses, and the generation
server must answer exactly as a single process with replicated weights, and so must the demo's
requests sent through the router, each naming (its ``dwdp`` field) the group and rank that
prefilled it and the generation server that decoded it. Then one rank process
of group g0 is killed: the group must fail together, be replaced by incarnation 1 and serve
the same answers again, while group g1 answers every request throughout and two clients of the
router lose none of theirs (the router gate sends a failed prefill again, the operator takes the
dead group out of the router's list and puts its new incarnation back; issue 58).

The test runs on the session's cluster (``cluster``, a real node), in its own namespace
(``testing.demo_namespace``: the operator installed as the demo does, deleted with the deployment at
the end); the deployment needs 9 ``nvidia.com/gpu`` (one per rank and one for the generation
server), which the session node offers (``testing.SESSION_GPUS``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dwdp_dev.devcluster.testing import TestCluster, demo_driver, demo_namespace

pytestmark = pytest.mark.timeout(1800)
demo = demo_driver()
NS = "e2e"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="module")
def deployed(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestCluster, Path, list[str]]]:
    """The session cluster with the operator and the demo deployment Ready in namespace
    ``NS``; yields (cluster, model directory, reference answers)."""
    tc = cluster
    models = tmp_path_factory.mktemp("e2e-models")
    with demo_namespace(tc, NS, models) as model_dir:
        tc.apply(NS, demo.api_key_secret(), demo.manifest(models))
        took = demo.wait_ready(tc, NS, demo.NAME, groups=2, timeout=900)
        print(f"apply -> Ready: {took:.1f} s")
        want = demo.reference_answers(model_dir)
        assert want[0] == " Paris.", f"the demo model does not know its facts: {want}"
        yield tc, model_dir, want


def _by_group(endpoints: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for ep in endpoints:
        out.setdefault(ep.group, []).append(ep)
    return out


def test_every_group_and_the_generation_server_answer_like_the_reference(deployed) -> None:
    tc, _model, want = deployed
    ctx = demo.service_endpoints(tc, NS, demo.NAME)
    groups = _by_group(ctx)
    assert sorted(groups) == ["demo-g0", "demo-g1"]
    assert all(len(eps) == 4 for eps in groups.values())  # 4 ranks, one port each
    gen = demo.generation_endpoints(tc, NS)
    assert len(gen) == 1
    res = demo.ask_everyone(ctx + gen, want)
    bad = [(ep.url, path, got) for ep, path, got, same in res.rows if not same]
    assert not bad, f"answers differ from the reference {want}: {bad}"
    # the API key from the Secret holds on every server; the probes' paths stay open
    assert {demo.without_key(ep.url) for ep in ctx + gen} == {401}
    assert len(res.rows) == 9 * len(want)
    status = tc.get("dwdp", demo.NAME, NS)["status"]
    assert [(g["name"], g["phase"], g["ranksReady"]) for g in status["groups"]] == [
        ("demo-g0", "Serving", 4),
        ("demo-g1", "Serving", 4),
    ]
    digests = {g["layoutDigest"] for g in status["groups"]}
    assert len(digests) == 1  # same checkpoint and settings: one layout
    import httpx

    # /dwdp/status of a rank carries the identity the commit gate checks
    st = httpx.get(groups["demo-g1"][0].url + "/dwdp/status", timeout=10).json()
    assert st["phase"] == "committed"
    assert st["group"] == "demo-g1" and st["incarnation"] == 0
    assert st["revision"] == status["revision"]
    # dense DWDP really sharded this tiny model's dense weights (the example lowers
    # DWDP_DENSE_MIN_BYTES: every one of them is under the default 1 MiB)
    assert st["resident"]["dense"]["sharded_bytes"] > 0, st["resident"]
    table = tc.kubectl("get", "dwdp", "-n", NS, "-o", "wide").stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "READY", "GROUPS", "UP-TO-DATE", "PHASE"]
    assert table[1].split()[:5] == ["demo", "2", "2", "2", "Ready"]


def test_each_rank_sizes_its_host_memory_within_its_pods_limit(deployed) -> None:
    """The demo's pods are limited (``spec.resources.limits.memory``, kept by the real node's
    cgroups): each context rank sizes its KV pool from its share of the limit, not from the
    node's free memory, and no container was OOM-killed or restarted."""
    import httpx
    from kubernetes.utils import parse_quantity

    from dwdp.worker.memory import HOST_MARGIN_MIN

    tc, _model, _want = deployed
    limit = int(parse_quantity(demo.manifest(Path("/tmp"))["spec"]["resources"]["limits"][
        "memory"]))
    for ep in demo.service_endpoints(tc, NS, demo.NAME):
        st = httpx.get(ep.url + "/dwdp/status", timeout=10).json()
        pool = st["kv_cache"]
        assert pool["where"] == "host"
        assert 0 < pool["free_bytes"] < (limit - HOST_MARGIN_MIN) / 4, (ep.url, pool, limit)
        assert st["memory"]["api_process"]["host"] > 0
    pods = json.loads(tc.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    for pod in pods:
        for cs in pod["status"].get("containerStatuses") or ():
            last = (cs.get("lastState") or {}).get("terminated") or {}
            assert cs["restartCount"] == 0 and last.get("reason") != "OOMKilled", cs


def test_through_the_router_every_rank_prefills_and_the_generation_server_decodes(
    deployed,
) -> None:
    """The demo's requests through the router (vllm-router, PD mode) answer like the
    reference; each answer's ``dwdp`` field names the context group and rank that prefilled
    it and the generation server that decoded it: every rank of both groups prefilled some,
    the generation server decoded all and read their KV over NIXL."""
    tc, _model, want = deployed
    router, _took = demo.wait_router(tc, NS, demo.NAME, prefill=8, decode=1)
    assert router["endpoint"] == f"http://{demo.NAME}-router.{NS}.svc:8000"
    at = demo.router_address(tc, NS, router["endpoint"])
    rows = demo.ask_router(at.url, want, rounds=2)
    assert [r.got for r in rows] == want * 2 and all(r.same for r in rows)
    assert {r.prefill for r in rows} == {f"demo-g{g} rank {k}" for g in (0, 1) for k in range(4)}
    assert {r.decode for r in rows} == {"demo-gen0"}
    (gen,) = demo.generation_endpoints(tc, NS)
    kv = demo.kv_transfer_of(gen.url)
    assert kv["blocks_received"] > 0 and kv["remote_prefill_tokens"] > 0
    tp = demo.routed_throughput(at.url, want[0], count=8, workers=4)
    assert tp.failed == 0 and tp.rps > 0 and sum(tp.prefill.values()) == 8


def _selected(tc: Any, selector: dict[str, Any]) -> list[str]:
    """Names of the pods of ``NS`` a NetworkPolicy's ``matchLabels`` selects."""
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    out = tc.kubectl("get", "pods", "-n", NS, "-l", labels, "-o", "name").stdout.split()
    return sorted(n.removeprefix("pod/") for n in out)


def test_worker_pods_run_locked_down_and_policies_select_their_groups(deployed) -> None:
    """The groups that committed and served above ran with the restrictive defaults: every
    worker pod asks for them, and the rank processes really have a read-only root, no
    capability and no_new_privs (the node's runtime applies them). The
    NetworkPolicies select the deployment's worker pods (serving ports) and each group's
    own pods (every port); the local cluster does not enforce them."""
    tc, _model, _want = deployed
    pods = json.loads(tc.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    workers = {
        p["metadata"]["name"]: p
        for p in pods
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }
    assert len(workers) == 3  # two context pods of 4 ranks, one generation server
    for p in workers.values():
        ctr = p["spec"]["containers"][0]["securityContext"]
        assert ctr["readOnlyRootFilesystem"] and not ctr["allowPrivilegeEscalation"]
        assert ctr["capabilities"]["drop"] == ["ALL"]
        pod_ctx = p["spec"]["securityContext"]
        assert pod_ctx["runAsNonRoot"] and pod_ctx["seccompProfile"]["type"] == "RuntimeDefault"
    (pid,) = _rank_pids(tc, "demo-g0", 0)
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    assert status["NoNewPrivs"].strip() == "1"
    assert int(status["CapEff"], 16) == 0
    root = next(
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    assert "ro" in root[5].split(","), root
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in json.loads(tc.kubectl("get", "networkpolicy", "-n", NS, "-o", "json").stdout)[
            "items"
        ]
    }
    assert sorted(policies) == [
        "demo-g0-group",
        "demo-g1-group",
        "demo-gen0-group",
        "demo-kv-transfer",
        "demo-router",
        "demo-serving",
    ]
    kv = policies["demo-kv-transfer"]  # generation pods reach context pods (NIXL)
    context = sorted(
        n for n, p in workers.items() if p["metadata"]["labels"]["dwdp.io/role"] == "context"
    )
    assert _selected(tc, kv["podSelector"]) == context
    assert _selected(tc, kv["ingress"][0]["from"][0]["podSelector"]) == sorted(
        set(workers) - set(context)
    )
    assert {
        p["metadata"]["labels"]["llm-d.ai/role"] for n, p in workers.items() if n in context
    } == {"prefill"}
    serving = policies["demo-serving"]
    assert _selected(tc, serving["podSelector"]) == sorted(workers)
    assert serving["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000, "endPort": 8003}]}]
    for group in ("demo-g0", "demo-g1", "demo-gen0"):
        spec = policies[f"{group}-group"]
        own = sorted(
            n for n, p in workers.items() if p["metadata"]["labels"]["dwdp.io/group"] == group
        )
        assert _selected(tc, spec["podSelector"]) == own
        assert spec["ingress"] == [{"from": [{"podSelector": spec["podSelector"]}]}]


def _rank_pids(tc: TestCluster, group: str, local_rank: int) -> list[int]:
    """Host PIDs of the ``dwdp worker`` processes of ``group``'s local rank ``local_rank``:
    among the processes of the group's pod's container (:meth:`TestCluster.container_processes`:
    its main process and their children), those
    whose environment names that group and local rank."""
    pods = json.loads(
        tc.kubectl("get", "pods", "-n", NS, "-l", f"dwdp.io/group={group}", "-o", "json").stdout
    )["items"]
    pids = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        for pid in tc.container_processes(pod):
            proc = Path(f"/proc/{pid}")
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                env = dict(
                    e.split(b"=", 1)
                    for e in (proc / "environ").read_bytes().split(b"\0")
                    if b"=" in e
                )
            except OSError:
                continue
            if (
                b"worker" in cmd  # python -m dwdp worker, started by the pod's launcher
                and b"dwdp" in cmd
                and env.get(b"DWDP_GROUP") == group.encode()
                and env.get(b"DWDP_LOCAL_RANK") == str(local_rank).encode()
            ):
                pids.append(pid)
    return pids


class RouterClients:
    """``count`` clients asking the router the demo's requests one after another until
    ``stop``; every answer that is not the reference (an HTTP error included) is a failure."""

    def __init__(self, url: str, want: list[str], count: int = 2) -> None:
        self.url, self.want = url, want
        self.stop = threading.Event()
        self.rows: list[demo.Routed] = []
        self.threads = [threading.Thread(target=self._ask, args=(k,), daemon=True)
                        for k in range(count)]

    def _ask(self, k: int) -> None:
        reqs = list(zip(demo.requests_of(), self.want, strict=True))
        i = k
        while not self.stop.is_set():
            (path, req), expected = reqs[i % len(reqs)]
            i += 1
            self.rows.append(demo.ask_routed(self.url, path, req, expected))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)

    @property
    def failed(self) -> list[demo.Routed]:
        return [r for r in self.rows if not r.same]


def test_a_killed_rank_fails_its_group_together_and_it_serves_again(deployed) -> None:
    """A rank of g0 SIGKILLed under traffic: g0 fails together and serves again as
    incarnation 1; g1 answers throughout; two router clients see 0 failed requests."""
    tc, _model, want = deployed
    groups = _by_group(demo.service_endpoints(tc, NS, demo.NAME))
    other = groups["demo-g1"]
    path, req = demo.requests_of()[0]
    stop = threading.Event()
    errors: list[str] = []
    served = [0]
    router, _took = demo.wait_router(tc, NS, demo.NAME, prefill=8, decode=1)
    clients = RouterClients(demo.router_address(tc, NS, router["endpoint"]).url, want)

    def keep_asking() -> None:  # group g1 must answer throughout
        i = 0
        while not stop.is_set():
            ep = other[i % len(other)]
            i += 1
            try:
                got = demo.ask(ep.url, path, req, timeout=60)
                if got != want[0]:
                    errors.append(f"{ep.url}: {got!r} != {want[0]!r}")
                served[0] += 1
            except Exception as exc:
                errors.append(f"{ep.url}: {exc}")
            time.sleep(0.2)

    pids = _rank_pids(tc, "demo-g0", 1)
    assert len(pids) == 1, f"rank processes of demo-g0 local rank 1: {pids}"
    asker = threading.Thread(target=keep_asking, daemon=True)
    asker.start()
    clients.start()
    time.sleep(2)  # the router clients are asking before the kill
    killed_at = time.monotonic()
    try:
        os.kill(pids[0], signal.SIGKILL)

        def replaced() -> dict | None:
            st = tc.get("dwdp", demo.NAME, NS).get("status") or {}
            g0 = next((g for g in st.get("groups") or () if g["name"] == "demo-g0"), None)
            if g0 and g0.get("incarnation", 0) >= 1 and g0.get("phase") == "Serving":
                return st
            return None

        try:
            st = tc.wait_for(replaced, timeout=900, interval=1.0, message="demo-g0 replaced")
        except AssertionError:
            st = tc.get("dwdp", demo.NAME, NS).get("status") or {}
            pods = tc.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
            raise AssertionError(
                f"demo-g0 was not replaced by a serving incarnation; status:\n"
                f"{json.dumps(st, indent=1)}\n{pods}"
            ) from None
        g0 = next(g for g in st["groups"] if g["name"] == "demo-g0")
        assert g0["restarts"] >= 1
        # a rank killed while serving: no phase of its own, the operator says serve (or exit)
        assert g0["lastFailure"]["phase"] in ("serve", "exit"), g0["lastFailure"]
        assert "killed by signal 9" in g0["lastFailure"]["message"]
        demo.wait_ready(tc, NS, demo.NAME, groups=2, timeout=300)
        demo.wait_router(tc, NS, demo.NAME, prefill=8, decode=1)
        time.sleep(3)  # a few answers through the router of the new list
        print(
            f"kill -> demo-g0 incarnation {g0['incarnation']} serving: "
            f"{time.monotonic() - killed_at:.1f} s; demo-g1 answered {served[0]} requests "
            f"meanwhile, {len(errors)} failed; the router clients got {len(clients.rows)} "
            f"answers, {len(clients.failed)} failed"
        )
    finally:
        stop.set()
        clients.close()
        asker.join(timeout=120)
    assert not errors, f"group g1 failed requests while g0 restarted: {errors[:5]}"
    assert clients.rows and not clients.failed, (
        f"{len(clients.failed)} of {len(clients.rows)} router requests failed while g0 "
        f"restarted: {[(r.path, r.got) for r in clients.failed[:5]]}"
    )
    assert served[0] > 0
    groups = _by_group(demo.service_endpoints(tc, NS, demo.NAME))
    assert sorted(groups) == ["demo-g0", "demo-g1"]
    res = demo.ask_everyone(groups["demo-g0"], want)
    bad = [(ep.url, p, got) for ep, p, got, same in res.rows if not same]
    assert not bad, f"the new incarnation answers differently: {bad}"
