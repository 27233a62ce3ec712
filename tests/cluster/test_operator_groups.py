"""Issue 8 on the local control plane: fail-together restarts with backoff, group rollouts
that never drop below capacity nor mix revisions in a group, a quota that refuses pods.

One ``dwdp operator`` process serves the module (ComputeDomains off: fabric is nominal on
the CPU cluster; gang PodGroups on where the apiserver serves them). Deployments are small
(1-2 pods of 1-2 ranks per group) with short backoffs, and each test cleans up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from dwdp_dev.devcluster.testing import TestCluster
from dwdp_dev.operator.cluster import (
    deployment,
    event_messages,
    gated,
    pods,
    running_operator,
    status,
)
from dwdp_dev.operator.process import OperatorProcess


@pytest.fixture(scope="module")
def operator(
    cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with running_operator(cluster, log) as op:
        yield op


def wait_ready(cluster: TestCluster, ns: str, name: str, ready: int, timeout: float = 90) -> dict:
    def check():
        obj = cluster.get("dwdpdeployment", name, ns)
        st = obj.get("status") or {}
        ok = (
            st.get("phase") == "Ready"
            and st.get("readyGroups") == ready
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and len(st.get("groups") or ()) == ready
            and all(g.get("revision") == st.get("revision") for g in st.get("groups") or ())
        )
        return st if ok else None

    return cluster.wait_for(check, timeout=timeout, interval=0.5, message=f"{name} Ready")


def test_rank_failing_at_p3_restarts_its_group_only_with_growing_backoff(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "failp3"
    obj = deployment(
        name,
        replicas=2,
        ranks_per_pod=1,
        dwdp_size=2,
        env={
            "RANKPROG_FAIL_PHASE": "P3",
            "RANKPROG_FAIL_RANK": "1",
            "RANKPROG_FAIL_GROUP": f"{name}-g1",
        },
        failurePolicy={"backoffInitialSeconds": 5, "backoffMaxSeconds": 40},
    )
    cluster.apply(ns, obj)
    seen: dict[int, float] = {}  # restarts -> first time seen (monotonic)
    created: dict[int, float] = {}  # incarnation of g1 -> first time one of its pods is seen
    deadline = time.monotonic() + 180
    g0_incarnations = set()
    while time.monotonic() < deadline and (len(seen) < 4 or 3 not in created):
        st = status(cluster, ns, name)
        groups = {g["name"]: g for g in st.get("groups") or ()}
        g1 = groups.get(f"{name}-g1") or {}
        if g1.get("restarts") and g1["restarts"] not in seen:
            seen[g1["restarts"]] = time.monotonic()
            assert g1["lastFailure"]["phase"] == "P3"
            assert g1["lastFailure"]["reason"] == "SetupFailed"
        if f"{name}-g0" in groups:
            g0_incarnations.add(groups[f"{name}-g0"]["incarnation"])
        for p in pods(cluster, ns):
            labels = p["metadata"]["labels"]
            env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
            assert env["DWDP_INCARNATION"] == labels["dwdp.io/incarnation"]
            if labels.get("dwdp.io/group") == f"{name}-g1":
                created.setdefault(int(labels["dwdp.io/incarnation"]), time.monotonic())
        time.sleep(0.25)
    assert sorted(seen) == [1, 2, 3, 4], seen
    # The wait from the k-th failure to the pods of incarnation k is the operator's backoff
    # (5, 10, 20 s) plus its reaction, not a rank's start-up (which varies by seconds on a
    # loaded machine and made failure-to-failure gaps flaky).
    waits = [created[k] - seen[k] for k in (1, 2, 3)]
    print(f"failure -> next incarnation (s) for backoffs 5/10/20: {[round(w, 1) for w in waits]}")
    # each wait is at least its backoff, which doubles: a backoff that did not grow fails the
    # second and third bounds. No upper bound and no order between the waits: the operator's
    # reaction on a loaded machine added 6 s to the first one once (11.7, 10.4, 19.4 s).
    assert [w >= b - 1 for w, b in zip(waits, (5, 10, 20), strict=True)] == [True] * 3, waits
    assert g0_incarnations == {0}  # the other group kept running
    st = status(cluster, ns, name)
    g0 = next(g for g in st["groups"] if g["name"] == f"{name}-g0")
    assert g0["phase"] == "Serving" and g0.get("restarts", 0) == 0
    assert any("P3" in m for m in event_messages(cluster, ns, "GroupFailed"))
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


def _watch_rollout(
    cluster: TestCluster, ns: str, name: str, revision: str, floor: int, timeout: float = 150
) -> int:
    """Poll until every group is at ``revision`` and Ready; assert at every look that at
    least ``floor`` groups are gated ready and no group has pods of two revisions. Returns
    the number of looks."""
    deadline = time.monotonic() + timeout
    looks = 0
    while True:
        items = [p for p in pods(cluster, ns) if not p["metadata"].get("deletionTimestamp")]
        by_group: dict[str, list[dict]] = {}
        for p in pods(cluster, ns):
            by_group.setdefault(p["metadata"]["labels"]["dwdp.io/group"], []).append(p)
        for group, members in by_group.items():
            revs = {m["metadata"]["labels"]["dwdp.io/revision"] for m in members}
            assert len(revs) == 1, f"group {group} has pods of revisions {revs}"
        live: dict[str, list[dict]] = {}
        for p in items:
            live.setdefault(p["metadata"]["labels"]["dwdp.io/group"], []).append(p)
        serving = sum(1 for members in live.values() if all(gated(m) for m in members))
        assert serving >= floor, f"only {serving} groups gated ready (floor {floor})"
        looks += 1
        st = status(cluster, ns, name)
        if (
            st.get("phase") == "Ready"
            and st.get("revision") == revision
            and all(g["revision"] == revision for g in st.get("groups") or ())
            and len(st.get("groups") or ()) == 3
        ):
            return looks
        assert time.monotonic() < deadline, f"rollout to {revision} not done: {st}"
        time.sleep(0.2)


def _new_revision(cluster: TestCluster, ns: str, name: str, old: str) -> str:
    def check():
        st = status(cluster, ns, name)
        return st.get("revision") if st.get("revision") not in (None, old) else None

    return cluster.wait_for(check, timeout=30, interval=0.2, message="new revision")


def test_rollouts_keep_capacity_and_never_mix_revisions(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "roll"
    obj = deployment(name, replicas=3, ranks_per_pod=2, dwdp_size=2, env={"V": "1"})
    cluster.apply(ns, obj)
    st = wait_ready(cluster, ns, name, 3)
    # maxSurge 1, maxUnavailable 0: never fewer than 3 serving.
    obj["spec"]["env"] = [{"name": "V", "value": "2"}]
    cluster.apply(ns, obj)
    rev2 = _new_revision(cluster, ns, name, st["revision"])
    looks = _watch_rollout(cluster, ns, name, rev2, floor=3)
    print(f"surge rollout: {looks} looks, never below 3")
    # maxSurge 0, maxUnavailable 1: never fewer than 2; a second update mid-rollout
    # converges to the newest revision.
    obj["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 1}
    obj["spec"]["env"] = [{"name": "V", "value": "3"}]
    cluster.apply(ns, obj)
    rev3 = _new_revision(cluster, ns, name, rev2)
    cluster.wait_for(
        lambda: any(
            g["revision"] == rev3 and g["phase"] == "Serving"
            for g in status(cluster, ns, name).get("groups") or ()
        ),
        timeout=60,
        interval=0.2,
        message="one group at rev3",
    )
    obj["spec"]["env"] = [{"name": "V", "value": "4"}]
    cluster.apply(ns, obj)
    rev4 = _new_revision(cluster, ns, name, rev3)
    _watch_rollout(cluster, ns, name, rev4, floor=2)
    # Operator killed mid-rollout: the restarted one resumes, and groups already at the
    # newest revision keep their incarnation (they are not restarted).
    obj["spec"]["env"] = [{"name": "V", "value": "5"}]
    cluster.apply(ns, obj)
    rev5 = _new_revision(cluster, ns, name, rev4)
    cluster.wait_for(
        lambda: any(
            g["revision"] == rev5 and g["phase"] == "Serving"
            for g in status(cluster, ns, name).get("groups") or ()
        ),
        timeout=60,
        interval=0.2,
        message="one group at rev5",
    )
    up_to_date = {
        p["metadata"]["name"]
        for p in pods(cluster, ns)
        if p["metadata"]["labels"]["dwdp.io/revision"] == rev5 and gated(p)
    }
    assert up_to_date
    operator.stop(grace_s=0.1)
    operator.start()
    _watch_rollout(cluster, ns, name, rev5, floor=2)
    names = {p["metadata"]["name"] for p in pods(cluster, ns)}
    assert up_to_date <= names, "an up-to-date group was restarted"
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


def test_a_revision_that_never_commits_reports_its_deadline_and_old_groups_serve(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """maxSurge 1 / maxUnavailable 0, a new revision whose ranks never commit and a 20 s
    progress deadline: Progressing turns False (ProgressDeadlineExceeded) naming the
    surge group, its revision and phase, Degraded says the rollout is stuck, the old group
    keeps serving its incarnation, and reverting the spec returns to the old revision
    without touching the old group."""
    ns, name = namespace, "stuck"
    obj = deployment(
        name, replicas=1, ranks_per_pod=1, dwdp_size=2, rollout={"progressDeadlineSeconds": 20}
    )
    cluster.apply(ns, obj)
    st = wait_ready(cluster, ns, name, 1)
    old_rev = st["revision"]
    old_pods = sorted(p["metadata"]["name"] for p in pods(cluster, ns))
    obj["spec"]["env"] = [{"name": "RANKPROG_COMMIT", "value": "0"}]
    cluster.apply(ns, obj)
    new_rev = _new_revision(cluster, ns, name, old_rev)
    applied = time.monotonic()

    def deadline_exceeded() -> dict | None:
        st = status(cluster, ns, name)
        conds = {c["type"]: c for c in st.get("conditions") or ()}
        prog = conds.get("Progressing") or {}
        return conds if prog.get("reason") == "ProgressDeadlineExceeded" else None

    try:
        conds = cluster.wait_for(deadline_exceeded, timeout=60, interval=0.5, message="deadline")
    except AssertionError:
        raise AssertionError(f"no deadline: {json.dumps(status(cluster, ns, name))}") from None
    took = time.monotonic() - applied
    print(f"ProgressDeadlineExceeded {took:.1f} s after the update (deadline 20 s)")
    assert 20 <= took < 40, took
    message = conds["Progressing"]["message"]
    assert f"group {name}-g1 (revision {new_rev})" in message, message
    assert conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "True"
    assert conds["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    assert conds["Ready"]["status"] == "True"
    st = status(cluster, ns, name)
    g0 = next(g for g in st["groups"] if g["name"] == f"{name}-g0")
    assert (g0["revision"], g0["phase"], g0["incarnation"]) == (old_rev, "Serving", 0)
    assert st["updatedGroups"] == 1
    table = cluster.kubectl("get", "dwdp", name, "-n", ns).stdout.splitlines()
    assert table[1].split()[:5] == [name, "1", "1", "1", "Degraded"], table
    # Revert: back to the old revision; the old group's pods are the same pods.
    obj["spec"].pop("env")
    cluster.apply(ns, obj)
    st = wait_ready(cluster, ns, name, 1)
    assert st["revision"] == old_rev
    assert sorted(p["metadata"]["name"] for p in pods(cluster, ns)) == old_pods
    prog = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert prog["reason"] == "Stable"
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
