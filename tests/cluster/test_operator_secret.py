"""Issue 17 on the local control plane: the rendezvous Secret of every DWDP group
incarnation, made by the operator, mounted into that incarnation's pods only, replaced with
the incarnation and gone with the deployment.

The workers (the test rank program) do not read the file: the test looks at what the
kubelet mounts at the pod's mount path (its Secret volume folder on the host,
``TestCluster.secret_volume``).
"""

from __future__ import annotations

import base64
import json
import stat
from collections.abc import Iterator

import pytest

from dwdp.api.contract import (
    RENDEZVOUS_SECRET_BYTES,
    RENDEZVOUS_SECRET_DIR,
    RENDEZVOUS_SECRET_KEY,
    RENDEZVOUS_SECRET_PATH,
    Env,
)
from dwdp_dev.devcluster.testing import TestCluster
from dwdp_dev.operator.cluster import deployment, pods, running_operator
from dwdp_dev.operator.process import OperatorProcess


@pytest.fixture(scope="module")
def operator(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator-secret") / "operator.log"
    with running_operator(cluster, log) as op:
        yield op


def secrets(cluster: TestCluster, ns: str, name: str) -> dict[str, dict]:
    """The Secrets labelled with deployment ``name``, by name."""
    out = cluster.kubectl(
        "get", "secrets", "-n", ns, "-l", f"dwdp.io/deployment={name}", "-o", "json"
    )
    return {s["metadata"]["name"]: s for s in json.loads(out.stdout)["items"]}


def incarnation_pods(cluster: TestCluster, ns: str, inc: int) -> list[dict]:
    """The live pods of incarnation ``inc`` once both of them exist and run, else []."""
    items = [
        p
        for p in pods(cluster, ns)
        if p["metadata"]["labels"]["dwdp.io/incarnation"] == str(inc)
        and not p["metadata"].get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") == "Running"
    ]
    return items if len(items) == 2 else []


def mounted_secret(cluster: TestCluster, pod: dict) -> bytes:
    """The secret file the kubelet mounts at the pod's rendezvous mount (read from its volume
    folder on the host), after checking the pod spec mounts it there read-only."""
    ctr = pod["spec"]["containers"][0]
    mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == RENDEZVOUS_SECRET_DIR)
    assert mount["readOnly"] is True
    path = cluster.secret_volume(pod, mount["name"]) / RENDEZVOUS_SECRET_KEY
    # 0o400 for the pod's user, readable by its fsGroup (as the kubelet's volume ownership
    # makes it): the worker runs as uid 1000, not as the file's owner (root)
    fs_group = pod["spec"]["securityContext"]["fsGroup"]
    assert (stat.S_IMODE(path.stat().st_mode), path.stat().st_gid) == (0o440, fs_group)
    return path.read_bytes()


def check_incarnation(cluster: TestCluster, ns: str, name: str, inc: int, uid: str) -> bytes:
    """Incarnation ``inc``'s Secret: 32 bytes, owned by the deployment, labelled like its
    pods, mounted into both of them and named by their env (the path, not the value)."""
    secret_name = f"{name}-g0-i{inc}-rdzv"
    secret = secrets(cluster, ns, name)[secret_name]
    value = base64.b64decode(secret["data"][RENDEZVOUS_SECRET_KEY])
    assert len(value) == RENDEZVOUS_SECRET_BYTES and secret["type"] == "Opaque"
    assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [uid]
    labels = secret["metadata"]["labels"]
    assert labels["dwdp.io/group"] == f"{name}-g0"
    assert labels["dwdp.io/incarnation"] == str(inc)
    members = cluster.wait_for(
        lambda: incarnation_pods(cluster, ns, inc), timeout=60, message=f"incarnation {inc}"
    )
    for pod in members:
        vols = [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert [v["secret"]["secretName"] for v in vols] == [secret_name]
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env[Env.RENDEZVOUS_SECRET_FILE.value] == {
            "name": Env.RENDEZVOUS_SECRET_FILE.value,
            "value": RENDEZVOUS_SECRET_PATH,
        }
        assert secret["data"][RENDEZVOUS_SECRET_KEY] not in json.dumps(pod)
        assert mounted_secret(cluster, pod) == value
    return value


def test_rendezvous_secret_per_incarnation(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "rdzv"
    obj = deployment(
        name,
        replicas=1,
        ranks_per_pod=1,
        dwdp_size=2,
        failurePolicy={"backoffInitialSeconds": 1, "backoffMaxSeconds": 2},
    )
    cluster.apply(ns, obj)
    uid = cluster.get("dwdpdeployment", name, ns)["metadata"]["uid"]
    cluster.wait_for(
        lambda: f"{name}-g0-i0-rdzv" in secrets(cluster, ns, name), timeout=30, message="Secret"
    )
    first = check_incarnation(cluster, ns, name, 0, uid)

    # A lost pod fails the incarnation: its Secret goes with its pods, the next one gets
    # a new Secret with a new value.
    cluster.kubectl("delete", "pod", f"{name}-g0-i0-p1", "-n", ns, "--wait=false")
    cluster.wait_for(
        lambda: list(secrets(cluster, ns, name)) == [f"{name}-g0-i1-rdzv"],
        timeout=90,
        message="only incarnation 1's Secret",
    )
    second = check_incarnation(cluster, ns, name, 1, uid)
    assert second != first

    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
    cluster.wait_for(
        lambda: not secrets(cluster, ns, name), timeout=60, message="Secrets garbage-collected"
    )


def test_a_refused_creation_retries_the_pod_not_the_secret(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """A quota refuses g1's pod: each retry (5 s, 15 s, ... apart) sends the pod again but
    not its Secret, which the first attempt made (Secrets are never read back, so the
    operator's loop remembers it). The operator's write counters cover every namespace, so
    the test first waits until no other DwdpDeployment is left (an earlier module's, in a
    namespace being deleted, would be reconciled by this operator too)."""
    ns, name = namespace, "rdzvquota"
    cluster.wait_for(
        lambda: not cluster.kubectl("get", "dwdp", "-A", "-o", "name").stdout.strip(),
        timeout=120,
        message="no DwdpDeployment of an earlier test left",
    )
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "pods"},
        "spec": {"hard": {"pods": "1"}},
    }
    cluster.apply(ns, quota)
    cluster.wait_for(
        lambda: (cluster.get("resourcequota", "pods", ns).get("status") or {}).get("hard"),
        timeout=30,
        message="quota status computed",
    )
    before = operator.fresh_writes()["by"]
    cluster.apply(ns, deployment(name, replicas=2, ranks_per_pod=2, dwdp_size=2))

    def retried() -> dict | None:
        by = operator.writes()["by"]
        pod_posts = by.get("POST Pod", 0) - before.get("POST Pod", 0)
        return by if pod_posts >= 3 else None  # g0's pod, g1's first attempt and a retry

    by = cluster.wait_for(retried, timeout=90, interval=1.0, message="a retry of g1's pod")
    assert by.get("POST Secret", 0) - before.get("POST Secret", 0) == 2, by
    assert set(secrets(cluster, ns, name)) == {f"{name}-g0-i0-rdzv", f"{name}-g1-i0-rdzv"}
    cluster.kubectl("delete", "resourcequota", "pods", "-n", ns)
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
