"""The Helm chart on the local control plane: it renders objects the apiserver accepts, and
an installed release runs ``dwdp operator`` as a pod under the chart's ServiceAccount (from
the operator image: the chart's default image, built into the local store), which
reconciles an example through a rollout, a role added and removed, and a delete (so the
RBAC is enough), is refused a verb the chart does not grant, and used every verb the chart
grants (derived from the apiserver's audit log: a grant it never used fails the test).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from dwdp_dev.devcluster.images import StoredImage
from dwdp_dev.devcluster.testing import TestCluster
from dwdp_dev.operator.cluster import STANDIN_IMAGE, pods
from dwdp_dev.operator.process import RANKPROG_COMMAND

REPO = Path(__file__).resolve().parents[2]
INSTALL_SETS = ("computeDomains=off",)  # 02-small is fabric across 2 pods; no ComputeDomain CRD
CHART = REPO / "charts" / "dwdp-operator"
RELEASE = "dwdp"
SA = f"{RELEASE}-dwdp-operator"


GPU_VALUES = CHART / "ci" / "gpu-cluster-values.yaml"
_BASE_KINDS = {
    "customresourcedefinition.apiextensions.k8s.io",
    "serviceaccount",
    "clusterrole.rbac.authorization.k8s.io",
    "clusterrolebinding.rbac.authorization.k8s.io",
    "role.rbac.authorization.k8s.io",
    "rolebinding.rbac.authorization.k8s.io",
    "deployment.apps",
}
_WEBHOOK_KINDS = {
    "secret",
    "service",
    "validatingwebhookconfiguration.admissionregistration.k8s.io",
}


@pytest.mark.parametrize(
    ("options", "kinds"),
    [
        ((), _BASE_KINDS),
        (("--set", "webhook.enabled=true"), _BASE_KINDS | _WEBHOOK_KINDS),
        (("-f", str(GPU_VALUES)), _BASE_KINDS | _WEBHOOK_KINDS),
    ],
    ids=["defaults", "webhook", "gpu-cluster"],
)
def test_helm_template_passes_server_dry_run(
    cluster: TestCluster, namespace: str, options: tuple[str, ...], kinds: set[str]
) -> None:
    """Every object the chart renders (CRD included), with the default values, with the
    webhook, and with the values of a GPU cluster (private registry, pull secret, placement),
    is accepted by the apiserver's server-side dry-run."""
    rendered = cluster.helm(
        "template", RELEASE, str(CHART), "-n", namespace, "--include-crds", *options
    ).stdout
    out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered)
    got = {line.split("/")[0] for line in out.stdout.splitlines()}
    assert got == kinds, out.stdout


def token_kubeconfig(cluster: TestCluster, token: str, folder: Path) -> Path:
    """A kubeconfig for the admin's cluster entry with only ``token`` as credentials."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    entry = admin["clusters"][0]
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [entry],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": entry["name"], "user": "sa"}}],
        "current-context": "sa",
    }
    path = folder / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


def small_example() -> dict:
    """``examples/02-small.yaml`` with its ranks' image the test rank program's (the
    chart's ``workerCommand`` runs that program, see :func:`install_release`)."""
    doc = yaml.safe_load((REPO / "examples" / "02-small.yaml").read_text())
    doc["spec"]["image"] = STANDIN_IMAGE
    return doc


def install_release(cluster: TestCluster, ns: str) -> None:
    """``helm install`` of the chart watching ``ns``, ranks run by the test rank program."""
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        ns,
        "--set",
        f"workerCommand={RANKPROG_COMMAND}",
        "--set",
        f"watchNamespaces[0]={ns}",
        *(a for v in INSTALL_SETS for a in ("--set", v)),
        "--wait",
        "--timeout",
        "120s",
    )


def test_helm_install_runs_the_operator_under_its_rbac(
    cluster: TestCluster, namespace: str, tmp_path: Path, operator_image: StoredImage
) -> None:
    """The operator runs from its image (the chart's default, built by the cached build)."""
    ns = namespace
    assert operator_image.reference.endswith(
        f":{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    )
    install_release(cluster, ns)
    try:
        pod = cluster.wait_for(
            lambda: next(
                (
                    p
                    for p in json.loads(
                        cluster.kubectl(
                            "get",
                            "pods",
                            "-n",
                            ns,
                            "-l",
                            f"app.kubernetes.io/instance={RELEASE}",
                            "-o",
                            "json",
                        ).stdout
                    )["items"]
                    if p["status"].get("phase") == "Running"
                ),
                None,
            ),
            timeout=60,
            message="operator pod running",
        )
        assert pod["spec"]["serviceAccountName"] == SA
        assert pod["spec"]["containers"][0]["command"] == ["dwdp", "operator"]
        assert pod["spec"]["containers"][0]["image"] == operator_image.reference
        assert pod["status"]["containerStatuses"][0]["imageID"] == operator_image.image_id

        doc = small_example()
        cluster.apply(ns, doc)

        def ready() -> bool:
            status = cluster.get("dwdp", "small", ns).get("status") or {}
            return status.get("phase") == "Ready" and status.get("readyGroups") == 1

        try:
            cluster.wait_for(ready, timeout=120, interval=0.5, message="small Ready")
        except AssertionError:
            log = cluster.pod_log(ns, pod["metadata"]["name"])
            raise AssertionError(f"not Ready; operator log:\n{log[-4000:]}") from None

        # The chart's ServiceAccount, with its own token: granted verbs work, others do not.
        token = cluster.kubectl("create", "token", SA, "-n", ns).stdout.strip()
        as_sa = ("--kubeconfig", str(token_kubeconfig(cluster, token, tmp_path)))
        allowed = cluster.kubectl("get", "dwdp", "-n", ns, *as_sa, check=False)
        assert allowed.returncode == 0, allowed.stderr
        for verb in (
            ("delete", "dwdp", "small", "-n", ns),
            ("get", "secrets", "-n", ns),
            ("patch", "dwdp", "small", "-n", ns, "--type=merge", "-p", '{"spec":{"image":"x"}}'),
        ):
            denied = cluster.kubectl(*verb, *as_sa, check=False)
            assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), (
                verb,
                denied.stderr,
            )
        assert cluster.exists("dwdp", "small", ns)
        can = cluster.kubectl(
            "auth",
            "can-i",
            "patch",
            "pods",
            "--subresource=status",
            "-n",
            ns,
            f"--as=system:serviceaccount:{ns}:{SA}",
            check=False,
        )
        assert can.stdout.strip() == "yes"
        exercise_rollout_and_roles(cluster, ns)
        cluster.kubectl("delete", "dwdp", "small", "-n", ns, "--wait=true", "--timeout=60s")
        granted = chart_grants(cluster, ns)
        used, refused = operator_api_calls(cluster, ns)
        assert not refused, f"the operator was refused: {sorted(refused)}"
        assert granted - used == set(), f"granted but never used: {sorted(granted - used)}"
        assert used - granted == set(), f"used but not granted: {sorted(used - granted)}"
    finally:
        cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", check=False)


def exercise_rollout_and_roles(cluster: TestCluster, ns: str) -> None:
    """Drive ``small`` through what the operator's RBAC exists for: a generation server
    added (its Service, its pod); a rollout to two ranks per pod (surge group, drained old
    group: pods, PodGroup, rendezvous Secret, NetworkPolicy and ConfigMap deleted; a second
    EndpointSlice); a rollout back to one rank per pod with the generation role removed (its
    Service and the second EndpointSlice deleted)."""

    def status() -> dict:
        return cluster.get("dwdp", "small", ns).get("status") or {}

    def settled(revision: str | None, generation: int) -> bool:
        st = status()
        groups = st.get("groups") or []
        return (
            st.get("phase") == "Ready"
            and (revision is None or st.get("revision") != revision)
            and len(groups) == 1
            and groups[0].get("phase") == "Serving"
            and (st.get("generation") or {}).get("readyReplicas", 0) == generation
        )

    def names(kind: str) -> list[str]:
        return cluster.kubectl("get", kind, "-n", ns, "-o", "name").stdout.split()

    def change(patch: dict, done: Callable[[], bool], what: str) -> None:
        cluster.kubectl("patch", "dwdp", "small", "-n", ns, "--type=merge", "-p", json.dumps(patch))
        cluster.wait_for(done, timeout=180, interval=0.5, message=what)

    change({"spec": {"generation": {"replicas": 1}}}, lambda: settled(None, 1), "generation up")
    first = status()["revision"]
    change(
        {"spec": {"context": {"ranksPerPod": 2}}},
        lambda: (
            settled(first, 1)
            and "endpointslice.discovery.k8s.io/small-rank-1" in names("endpointslices")
        ),
        "rolled out to 2 ranks per pod",
    )
    second = status()["revision"]
    change(
        {"spec": {"generation": None, "context": {"ranksPerPod": 1}}},
        lambda: (
            settled(second, 0)
            and "service/small-generation" not in names("services")
            and "endpointslice.discovery.k8s.io/small-rank-1" not in names("endpointslices")
        ),
        "rolled back to 1 rank per pod, generation removed",
    )


Grant = tuple[str, str, str]
"""(API group, resource[/subresource], verb)."""


def chart_grants(cluster: TestCluster, ns: str) -> set[Grant]:
    """Every (group, resource, verb) the chart's ClusterRole and Role grant, as installed."""
    rendered = cluster.helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        ns,
        *(a for v in INSTALL_SETS for a in ("--set", v)),
        "--show-only",
        "templates/rbac.yaml",
    ).stdout
    roles = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ClusterRole", "Role")]
    return {
        (group, resource, verb)
        for role in roles
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _counted(event: dict) -> bool:
    """A watch is counted when it starts (it is still open while the operator runs), every
    other request when it completes."""
    return event.get("stage") == (
        "ResponseStarted" if event.get("verb") == "watch" else "ResponseComplete"
    )


def operator_api_calls(cluster: TestCluster, ns: str) -> tuple[set[Grant], set[Grant]]:
    """``(used, refused)``: the resource requests the operator pod made under the chart's
    ServiceAccount, from the apiserver's audit log. A server-side apply that created its
    object (code 201) needed ``create`` as well as ``patch``. The test's own kubectl calls
    with the same token are left out (user agent kubectl)."""
    user = f"system:serviceaccount:{ns}:{SA}"
    used: set[Grant] = set()
    refused: set[Grant] = set()
    for line in cluster.cluster.audit_log.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef")
        if (
            not _counted(event)
            or event["user"].get("username") != user
            or event.get("userAgent", "").startswith("kubectl")
            or ref is None
        ):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        grant = (ref.get("apiGroup", ""), resource, event["verb"])
        code = (event.get("responseStatus") or {}).get("code", 0)
        if code == 403:
            refused.add(grant)
            continue
        used.add(grant)
        if event["verb"] == "patch" and code == 201:
            used.add((grant[0], resource, "create"))
    return used, refused


def test_two_replicas_hand_over_a_rollout_without_extra_pods(
    cluster: TestCluster, namespace: str
) -> None:
    """The chart's defaults run 2 operator replicas; one holds the Lease. The leader is
    killed (SIGKILL, no release) right after a rollout starts: the standby takes the Lease
    within the lease duration plus a retry period, finishes the rollout, and no pod is
    created twice (every pod creation in the audit log is a 201 of a distinct name). The
    standby answers liveness; a leader deleted gracefully releases the Lease at once."""
    ns = namespace
    install_release(cluster, ns)
    try:
        lease_name = f"{RELEASE}-dwdp-operator"

        def holder() -> str | None:
            got = cluster.kubectl("get", "lease", lease_name, "-n", ns, "-o", "json", check=False)
            if got.returncode != 0:
                return None
            return (json.loads(got.stdout).get("spec") or {}).get("holderIdentity") or None

        first = cluster.wait_for(holder, timeout=60, interval=0.5, message="a leader")
        operators = pods(cluster, ns, f"app.kubernetes.io/instance={RELEASE}")
        assert len(operators) == 2
        cluster.apply(ns, small_example())

        def status() -> dict:
            return cluster.get("dwdp", "small", ns).get("status") or {}

        cluster.wait_for(
            lambda: status().get("phase") == "Ready", timeout=120, interval=0.5, message="Ready"
        )
        before = status()["revision"]
        patch = {"spec": {"env": [{"name": "ROLLOUT", "value": "2"}]}}
        cluster.kubectl("patch", "dwdp", "small", "-n", ns, "--type=merge", "-p", json.dumps(patch))
        leader = next(p for p in operators if first.startswith(p["metadata"]["name"] + "_"))
        os.kill(cluster.container_pid(leader), signal.SIGKILL)
        killed = time.monotonic()
        second = cluster.wait_for(
            lambda: (h := holder()) not in (None, first) and h,
            timeout=60,
            interval=0.2,
            message="a new leader",
        )
        handover = time.monotonic() - killed
        print(f"leader killed -> {second} leads after {handover:.1f} s")
        assert handover < 20, handover
        cluster.wait_for(
            lambda: (
                status().get("revision") != before
                and status().get("phase") == "Ready"
                and [g["revision"] for g in status().get("groups") or ()] == [status()["revision"]]
            ),
            timeout=120,
            interval=0.5,
            message="the rollout finished by the new leader",
        )
        user = f"system:serviceaccount:{ns}:{SA}"
        creates = [
            e
            for e in map(json.loads, cluster.cluster.audit_log.read_text().splitlines())
            if e["user"].get("username") == user
            and e.get("stage") == "ResponseComplete"
            and e["verb"] == "create"
            and (e.get("objectRef") or {}).get("resource") == "pods"
            and (e.get("objectRef") or {}).get("namespace") == ns
        ]
        codes = [e["responseStatus"]["code"] for e in creates]
        names = [e["objectRef"].get("name") for e in creates]
        assert codes and set(codes) == {201}, codes
        assert len(names) == len(set(names)) == 4, names  # 2 pods per group, 2 revisions
        # The standby answers its liveness probe (kopf's endpoint is not up there).
        standby = next(
            p
            for p in pods(cluster, ns, f"app.kubernetes.io/instance={RELEASE}")
            if not second.startswith(p["metadata"]["name"] + "_")
        )
        url = f"http://{standby['status']['podIP']}:8080/healthz"
        with urllib.request.urlopen(url, timeout=5) as answer:
            assert json.loads(answer.read()) == {"standby": True}
        # A leader stopped gracefully (pod deleted: SIGTERM) releases the Lease: another
        # replica leads well before the 15 s the Lease would take to expire.
        leader = next(p for p in operators if second.startswith(p["metadata"]["name"] + "_"))
        cluster.kubectl("delete", "pod", leader["metadata"]["name"], "-n", ns, "--wait=false")
        deleted = time.monotonic()
        third = cluster.wait_for(
            lambda: (h := holder()) not in (None, second) and h,
            timeout=60,
            interval=0.2,
            message="a leader after the graceful stop",
        )
        graceful = time.monotonic() - deleted
        print(f"leader deleted (SIGTERM) -> {third} leads after {graceful:.1f} s")
        assert graceful < 10, graceful  # the standby or the replacement pod, whichever asks first
    finally:
        cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", check=False)
