"""The operator on the local control plane, running as a real ``dwdp operator`` process with
the test rank program as the worker (issue 7's acceptance).

One operator process serves the module (it watches every namespace and serves the
validating webhook on 127.0.0.1); each test has its own namespace. Pods run on the session
cluster's real node from the test rank program's image; the tests stay within 8 GPUs (the
node has 16:
``testing.SESSION_GPUS``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dwdp_dev.devcluster.testing import TestCluster
from dwdp_dev.operator.cluster import STANDIN_IMAGE, running_operator
from dwdp_dev.operator.process import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
WEBHOOK = "operator-test.dwdp.io"


def _load(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


caselib = _load("caselib", REPO / "tests" / "cases" / "caselib.py")


@pytest.fixture(scope="module")
def operator(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with running_operator(cluster, log, webhook=WEBHOOK) as op:
        yield op


def example(name: str) -> dict:
    """``examples/<name>`` with the test rank program's image (this module's operator runs
    that program in worker pods: ``OperatorProcess``'s worker command)."""
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["spec"]["image"] = STANDIN_IMAGE
    return doc


def dwdp(cluster: TestCluster, ns: str, name: str) -> dict:
    return cluster.get("dwdpdeployment", name, ns)


def wait_phase(
    cluster: TestCluster,
    ns: str,
    name: str,
    phase: str,
    *,
    ready: int | None = None,
    timeout: float = 120,
    op: OperatorProcess | None = None,
) -> dict:
    def check():
        obj = dwdp(cluster, ns, name)
        status = obj.get("status") or {}
        if status.get("phase") != phase:
            return None
        if ready is not None and status.get("readyGroups") != ready:
            return None
        if status.get("observedGeneration") != obj["metadata"]["generation"]:
            return None
        return obj

    try:
        return cluster.wait_for(check, timeout=timeout, interval=0.5, message=f"{name} {phase}")
    except AssertionError:
        status = dwdp(cluster, ns, name).get("status") or {}
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(
            f"{name} never reached {phase} (ready {ready}); status: {json.dumps(status)}\n"
            f"{pods}\n{op.log()[-3000:] if op else ''}"
        ) from None


def pods_of(cluster: TestCluster, ns: str, selector: str = "dwdp.io/deployment") -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def delete_and_wait(cluster: TestCluster, ns: str, name: str) -> None:
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
    cluster.wait_for(lambda: not pods_of(cluster, ns), timeout=60, message="pods gone")


def test_two_groups_of_two_pods_exact_objects_and_ready(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    cluster.apply(ns, example("01-two-groups.yaml"))
    obj = wait_phase(cluster, ns, "two-groups", "Ready", ready=2, op=operator)
    status = obj["status"]
    rev = status["revision"]
    assert [
        (g["name"], g["phase"], g["incarnation"], g["ranksReady"], g["ranksTotal"])
        for g in status["groups"]
    ] == [
        ("two-groups-g0", "Serving", 0, 4, 4),
        ("two-groups-g1", "Serving", 0, 4, 4),
    ]
    assert len({g["layoutDigest"] for g in status["groups"]}) == 2  # one per group
    conds = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conds == {
        "Ready": ("True", "AllGroupsServing"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "Healthy"),
    }

    def all_ready() -> list[dict] | None:
        pods = pods_of(cluster, ns)
        ok = all(
            c["status"] == "True"
            for p in pods
            for c in p["status"].get("conditions", [])
            if c["type"] == "Ready"
        )
        return sorted(pods, key=lambda p: p["metadata"]["name"]) if ok else None

    pods = cluster.wait_for(all_ready, timeout=30, message="pods Ready after the gate")
    assert [p["metadata"]["name"] for p in pods] == [
        "two-groups-g0-i0-p0",
        "two-groups-g0-i0-p1",
        "two-groups-g1-i0-p0",
        "two-groups-g1-i0-p1",
    ]
    for pod in pods:
        labels = pod["metadata"]["labels"]
        group, pidx = labels["dwdp.io/group"], int(labels["dwdp.io/pod-index"])
        env = env_of(pod)
        assert env["DWDP_GROUP"] == group
        assert env["DWDP_INCARNATION"] == "0" == labels["dwdp.io/incarnation"]
        assert env["DWDP_RANK"] == str(2 * pidx)
        assert env["DWDP_WORLD_SIZE"] == "4"
        assert env["DWDP_LOCAL_WORLD_SIZE"] == "2"
        assert env["DWDP_RENDEZVOUS"] == f"{group}-i0-p0.two-groups-context.{ns}.svc:29500"
        assert env["DWDP_ROLE"] == "context"
        assert env["DWDP_REVISION"] == rev == labels["dwdp.io/revision"]
        assert env["DWDP_CONFIG"] == "/etc/dwdp/context.yaml"
        assert labels["dwdp.io/deployment"] == "two-groups"
        assert labels["dwdp.io/role"] == "context"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        spec = pod["spec"]
        assert spec["restartPolicy"] == "Never"
        assert spec["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert spec["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
        conds = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert conds["dwdp.io/group-ready"] == "True"
        assert conds["Ready"] == "True"

    svcs = json.loads(cluster.kubectl("get", "svc", "-n", ns, "-o", "json").stdout)["items"]
    by_name = {s["metadata"]["name"]: s for s in svcs}
    assert set(by_name) == {"two-groups", "two-groups-context"}
    headless = by_name["two-groups-context"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert "selector" not in by_name["two-groups"]["spec"]
    cms = cluster.kubectl("get", "cm", "-n", ns, "-l", "dwdp.io/deployment", "-o", "name").stdout
    assert cms.split() == [f"configmap/two-groups-context-{rev}"]
    slices = json.loads(
        cluster.kubectl(
            "get",
            "endpointslices",
            "-n",
            ns,
            "-l",
            "kubernetes.io/service-name=two-groups",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert sorted(s["metadata"]["name"] for s in slices) == [
        "two-groups-rank-0",
        "two-groups-rank-1",
    ]
    pod_ips = sorted(p["status"]["podIP"] for p in pods)
    for s in slices:
        assert sorted(a for e in s["endpoints"] for a in e["addresses"]) == pod_ips

    table = cluster.kubectl("get", "dwdp", "-n", ns).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "READY",
        "GROUPS",
        "UP-TO-DATE",
        "PHASE",
        "DWDP",
        "DENSE",
        "ROUTER",  # empty here: no generation servers, no router
        "AGE",
    ]
    assert table[1].split()[:6] == ["two-groups", "2", "2", "2", "Ready", "4"]
    events = cluster.kubectl(
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        "involvedObject.kind=DwdpDeployment",
        "-o",
        "jsonpath={.items[*].reason}",
    ).stdout.split()
    assert events.count("CreatedGroup") == 2 and events.count("GateOpened") == 2
    delete_and_wait(cluster, ns, "two-groups")


def test_scale_adds_and_removes_whole_groups(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    cluster.apply(ns, example("02-small.yaml"))
    wait_phase(cluster, ns, "small", "Ready", ready=1, op=operator)
    first = {p["metadata"]["uid"] for p in pods_of(cluster, ns)}

    def groups() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for p in pods_of(cluster, ns):
            out.setdefault(p["metadata"]["labels"]["dwdp.io/group"], []).append(
                p["metadata"]["name"]
            )
        return {g: sorted(n) for g, n in sorted(out.items())}

    cluster.kubectl("scale", "dwdp/small", "-n", ns, "--replicas=3")
    wait_phase(cluster, ns, "small", "Ready", ready=3, op=operator)
    assert groups() == {f"small-g{i}": [f"small-g{i}-i0-p0", f"small-g{i}-i0-p1"] for i in range(3)}
    assert first <= {p["metadata"]["uid"] for p in pods_of(cluster, ns)}  # g0 untouched
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/dwdp.io/v1alpha1/namespaces/{ns}/dwdpdeployments/small/scale"
        ).stdout
    )
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "dwdp.io/deployment=small,dwdp.io/role=context"

    cluster.kubectl("scale", "dwdp/small", "-n", ns, "--replicas=1")
    wait_phase(cluster, ns, "small", "Ready", ready=1, op=operator)
    cluster.wait_for(lambda: list(groups()) == ["small-g0"], timeout=60, message="one group")
    assert {p["metadata"]["uid"] for p in pods_of(cluster, ns)} == first
    slices = json.loads(
        cluster.kubectl(
            "get",
            "endpointslices",
            "-n",
            ns,
            "-l",
            "kubernetes.io/service-name=small",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert [len(s["endpoints"]) for s in slices] == [2]
    delete_and_wait(cluster, ns, "small")


def test_delete_removes_children_even_while_the_operator_is_down(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    cluster.apply(ns, example("02-small.yaml"))
    obj = wait_phase(cluster, ns, "small", "Ready", ready=1, op=operator)
    assert not obj["metadata"].get("finalizers")
    operator.stop()
    try:
        cluster.kubectl("delete", "dwdp", "small", "-n", ns, "--wait=true", "--timeout=30s")
        for kind in ("pods", "services", "configmaps", "endpointslices"):
            cluster.wait_for(
                lambda k=kind: (
                    not cluster.kubectl(
                        "get", k, "-n", ns, "-l", "dwdp.io/deployment=small", "-o", "name"
                    ).stdout.strip()
                ),
                timeout=60,
                message=f"{kind} collected",
            )
        # A deployment made while the operator is down is picked up when it returns.
        doc = example("02-small.yaml")
        doc["metadata"]["name"] = "later"
        cluster.apply(ns, doc)
    finally:
        operator.start()
    wait_phase(cluster, ns, "later", "Ready", ready=1, op=operator)
    assert not dwdp(cluster, ns, "later")["metadata"].get("finalizers")
    delete_and_wait(cluster, ns, "later")
    assert not cluster.exists("dwdp", "later", ns)


def test_every_invalid_case_is_refused_naming_its_field(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = client.CustomObjectsApi(cluster.api_client())
    refused = 0
    for case in caselib.load_cases():
        if case.valid:
            continue
        try:
            api.create_namespaced_custom_object(
                "dwdp.io",
                "v1alpha1",
                namespace,
                "dwdpdeployments",
                case.document,
                field_validation="Strict",  # as kubectl sends: unknown fields refused
            )
        except ApiException as exc:
            assert exc.status in (400, 422), (case.name, exc.status, exc.body)
            message = json.loads(exc.body).get("message", "")
            assert case.field_named_in(message), (case.name, case.field, message)
            refused += 1
            continue
        raise AssertionError(f"case {case.name} was admitted")
    assert refused >= 10
    assert cluster.kubectl("get", "dwdp", "-n", namespace, "-o", "name").stdout.strip() == ""
    time.sleep(1)
    for kind in ("pods", "services", "configmaps", "endpointslices"):
        assert (
            cluster.kubectl(
                "get", kind, "-n", namespace, "-l", "dwdp.io/deployment", "-o", "name"
            ).stdout.strip()
            == ""
        ), kind


def test_webhook_refuses_what_it_is_asked_and_admits_valid(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """The webhook is registered and answers: a valid spec passes it (a server-side
    dry-run goes through every admission step), and its configuration names our path."""
    hook = json.loads(
        cluster.kubectl("get", "validatingwebhookconfiguration", WEBHOOK, "-o", "json").stdout
    )
    assert hook["webhooks"][0]["clientConfig"]["url"].endswith("/validate/spec-rules")
    out = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", str(EXAMPLES / "01-two-groups.yaml")
    )
    assert "server dry run" in out.stdout


def test_ready_deployment_is_not_written_at_rest(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """At rest nothing the operator owns changes: the DwdpDeployment (status included),
    its ConfigMap, Services and EndpointSlices keep their resourceVersions, and no Event is
    added (bench/operator_writes.py counts the writes themselves over a minute)."""
    ns = namespace
    cluster.apply(ns, example("02-small.yaml"))
    wait_phase(cluster, ns, "small", "Ready", ready=1, op=operator)
    time.sleep(3)  # the last gate, slice and status writes land

    def versions() -> dict[str, str]:
        out = {}
        for kind in ("dwdp", "configmaps", "services", "endpointslices", "events"):
            items = json.loads(cluster.kubectl("get", kind, "-n", ns, "-o", "json").stdout)["items"]
            for item in items:
                out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
        return out

    before = versions()
    time.sleep(10)
    after = versions()
    ours = {k for k in after if not k.startswith("endpointslices/small-context-")}
    assert {k: after[k] for k in ours} == {k: before.get(k) for k in ours}
    delete_and_wait(cluster, ns, "small")
