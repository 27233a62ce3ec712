"""Issue 8 on the local control plane, failures from outside the rank program: a rank
process killed (SIGKILL) while its group serves, and a ResourceQuota that refuses a group's
pods.

One ``dwdp operator`` process serves the module; the deployments are small (1-2 pods per
group, 2 groups) and each test deletes what it made. A rank is killed on the host by the pid
of its pod's container (``TestCluster.container_pid``: the real node's containerd task).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

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


def groups(st: dict) -> dict[str, dict]:
    return {g["name"]: g for g in st.get("groups") or ()}


def group_of(pod: dict) -> str:
    return pod["metadata"]["labels"]["dwdp.io/group"]


def test_rank_killed_while_serving_replaces_its_group_once_as_a_crash(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "kill"
    obj = deployment(
        name,
        replicas=2,
        ranks_per_pod=1,
        dwdp_size=2,  # 2 pods of 1 rank per group
        failurePolicy={"backoffInitialSeconds": 1, "backoffMaxSeconds": 4},
    )
    cluster.apply(ns, obj)
    g0, g1 = f"{name}-g0", f"{name}-g1"

    def ready() -> dict | None:
        st = status(cluster, ns, name)
        gs = groups(st)
        ok = (
            st.get("phase") == "Ready"
            and st.get("readyGroups") == 2
            and all(gs.get(g, {}).get("phase") == "Serving" for g in (g0, g1))
        )
        return st if ok else None

    st = cluster.wait_for(ready, timeout=90, interval=0.5, message=f"{name} Ready")
    assert {g["incarnation"] for g in st["groups"]} == {0}
    before = pods(cluster, ns)
    old_g1 = {p["metadata"]["name"] for p in before if group_of(p) == g1}
    g0_pods = {p["metadata"]["name"] for p in before if group_of(p) == g0}
    assert len(old_g1) == 2 and len(g0_pods) == 2

    # SIGKILL the rank process of one pod of g1 (check that it is that pod's rank first).
    victim = next(p for p in before if group_of(p) == g1)
    pid = cluster.container_pid(victim)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"DWDP_GROUP={g1}".encode() in environ, "containerID pid is not the g1 rank"
    assert b"rankprog" in Path(f"/proc/{pid}/cmdline").read_bytes()
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    failure_seen: float | None = None
    serving_again: float | None = None
    looks = 0
    deadline = killed_at + 90
    while time.monotonic() < deadline:
        st = status(cluster, ns, name)
        gs = groups(st)
        # The other group keeps serving: same incarnation, its pods gated at every look.
        assert gs[g0]["incarnation"] == 0 and gs[g0].get("restarts", 0) == 0, gs[g0]
        assert gs[g0]["phase"] == "Serving", gs[g0]
        live = pods(cluster, ns)
        assert {p["metadata"]["name"] for p in live if group_of(p) == g0} == g0_pods
        assert all(gated(p) for p in live if group_of(p) == g0)
        looks += 1
        g = gs.get(g1) or {}
        assert g.get("restarts", 0) <= 1, f"g1 replaced more than once: {g}"
        if g.get("restarts") == 1 and failure_seen is None:
            failure_seen = time.monotonic()
            print(f"lastFailure: {g['lastFailure']}")
            assert g["lastFailure"]["reason"] == "Crash", g["lastFailure"]
        if (
            g.get("restarts") == 1
            and g.get("incarnation") == 1
            and g.get("phase") == "Serving"
            and serving_again is None
        ):
            serving_again = time.monotonic()
            new_g1 = [p for p in live if group_of(p) == g1]
            # The whole group was replaced: no pod of incarnation 0 is left, both new pods
            # carry incarnation 1 (label and environment).
            assert len(new_g1) == 2 and not old_g1 & {p["metadata"]["name"] for p in new_g1}
            for p in new_g1:
                assert p["metadata"]["labels"]["dwdp.io/incarnation"] == "1"
                env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
                assert env["DWDP_INCARNATION"] == "1"
        if serving_again is not None and time.monotonic() > serving_again + 3:
            break  # a few more looks: still once, g0 still untouched
        time.sleep(0.25)
    assert failure_seen is not None, f"no failure recorded for {g1}: {st}"
    assert serving_again is not None, f"{g1} not serving again: {st}"
    print(
        f"kill -9 of {victim['metadata']['name']} (pid {pid}): failure recorded after "
        f"{failure_seen - killed_at:.1f} s, group serving again (incarnation 1) after "
        f"{serving_again - killed_at:.1f} s; {looks} looks, g0 gated at every one"
    )
    st = status(cluster, ns, name)
    assert groups(st)[g1]["restarts"] == 1 and groups(st)[g1]["incarnation"] == 1
    messages = event_messages(cluster, ns, "GroupFailed")
    assert any(g1 in m for m in messages), messages
    assert not any(g0 in m for m in messages), messages
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


# A refused creation is retried after 5 s, doubling to 60 s (CREATE_BACKOFF_INITIAL_S,
# CREATE_BACKOFF_MAX_S in operator/reconcile.py): attempts at t = 0, 5, 15, 35, 75, 135...
# so any 60 s window holds at most 4 attempts (0, 5, 15, 35). One attempt writes: the refused
# pod create (creations stop at the first refusal) and two status applies (the cycle that is
# refused and the next one): 3 writes; no CreatedGroup Event for a refused group; the gang
# PodGroup is created once, by the first attempt, and kept while the retry waits. A Serving
# group at rest writes nothing. Hence at most 4 x 3 + 1 = 13 writes in the minute and at
# most 4 pod creates (a storm would be one create every reconcile cycle, ~0.3 s: ~200 a
# minute).
MAX_WRITES_PER_MINUTE = 13
MAX_POD_CREATES_PER_MINUTE = 4


def fresh_writes(operator: OperatorProcess) -> dict:
    """The operator's write counters read now (kopf caches probe results for 10 s)."""
    w = operator.fresh_writes()
    assert w["at"] >= time.time() - 2, w
    return w


def test_quota_refusing_pods_is_a_condition_and_no_write_storm(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "quota"
    # 2 groups of 1 pod (2 ranks each); the quota admits one pod: g1 is refused.
    cluster.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "pods"},
            "spec": {"hard": {"pods": "1"}},
        },
    )
    cluster.wait_for(
        lambda: (cluster.get("resourcequota", "pods", ns).get("status") or {}).get("hard"),
        timeout=30,
        interval=0.5,
        message="quota status computed",
    )
    cluster.apply(ns, deployment(name, replicas=2, ranks_per_pod=2, dwdp_size=2))
    g0 = f"{name}-g0"

    def refused() -> dict | None:
        st = status(cluster, ns, name)
        cond = next(
            (c for c in st.get("conditions") or () if c.get("type") == "ReplicaFailure"), None
        )
        serving = groups(st).get(g0, {}).get("phase") == "Serving"
        return cond if cond and cond.get("status") == "True" and serving else None

    cond = cluster.wait_for(refused, timeout=90, interval=0.5, message="ReplicaFailure")
    print(f"condition: {cond}")
    assert cond["reason"] == "FailedCreate"
    assert "exceeded quota" in cond["message"] and "pods" in cond["message"], cond
    assert f"{name}-g1" in cond["message"], cond

    w0 = fresh_writes(operator)
    time.sleep(max(0.0, w0["at"] + 60 - time.time()))
    w1 = fresh_writes(operator)
    window = w1["at"] - w0["at"]
    total = w1["total"] - w0["total"]
    by = {k: v - w0["by"].get(k, 0) for k, v in w1["by"].items() if v != w0["by"].get(k, 0)}
    print(f"operator API writes under the quota in {window:.1f} s: {total} {by}")
    assert 60 <= window < 63, window
    assert total <= MAX_WRITES_PER_MINUTE, by
    assert by.get("POST Pod", 0) <= MAX_POD_CREATES_PER_MINUTE, by
    assert total >= 1, "no retry at all within a minute"  # it does keep retrying
    assert len([p for p in pods(cluster, ns) if group_of(p) == g0]) == 1
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "reason=CreatedGroup", "-o", "json"
    ).stdout
    created = [e["message"] for e in json.loads(events)["items"]]
    assert not any(f"{name}-g1 " in m for m in created), created  # it was refused

    # The quota lifted: the next retry (at most 60 s away) creates g1, the condition clears.
    cluster.kubectl("delete", "resourcequota", "pods", "-n", ns)
    lifted = time.monotonic()

    def recovered() -> dict | None:
        st = status(cluster, ns, name)
        conds = {c["type"]: c for c in st.get("conditions") or ()}
        rf = conds.get("ReplicaFailure")
        ok = st.get("readyGroups") == 2 and (rf is None or rf.get("status") != "True")
        return st if ok else None

    cluster.wait_for(recovered, timeout=90, interval=1.0, message="g1 created after the quota")
    print(f"quota lifted: both groups ready after {time.monotonic() - lifted:.1f} s")
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


def test_ranks_restarted_in_place_behind_an_open_gate_fail_their_group(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """The pod's rank process re-executes itself 3 s after the commit (same pod, same pid,
    restartCount 0, a new start id), as a runtime that restarts a container without telling
    would: the operator, asking committed groups every 30 s, sees ranks that are not the
    processes that committed, closes the gate and replaces the whole group."""
    ns, name = namespace, "inplace"
    obj = deployment(
        name, replicas=1, ranks_per_pod=2, dwdp_size=2, env={"RANKPROG_REEXEC_AFTER_S": "3"}
    )
    cluster.apply(ns, obj)

    def serving(incarnation: int) -> dict | None:
        st = status(cluster, ns, name)
        g = next(iter(st.get("groups") or ()), {})
        ok = g.get("phase") == "Serving" and g.get("incarnation") == incarnation
        return g if ok else None

    g = cluster.wait_for(lambda: serving(0), timeout=90, interval=0.5, message="i0 serving")
    assert len(g["rankStarts"]) == 2
    committed = time.monotonic()
    g = cluster.wait_for(lambda: serving(1), timeout=120, interval=0.5, message="i1 serving")
    took = time.monotonic() - committed
    print(f"in-place restart 3 s after the commit -> incarnation 1 serving {took:.1f} s later")
    assert g["restarts"] == 1
    assert g["lastFailure"]["reason"] == "RestartedInPlace", g["lastFailure"]
    assert "no longer the process that committed" in g["lastFailure"]["message"]
    assert any("RestartedInPlace" in m for m in event_messages(cluster, ns, "GroupFailed"))
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


def test_scale_down_takes_the_failing_group_and_names_are_never_reused(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """Three groups, g0 failing at P3 on every start (long backoff): scaling to 2 removes
    g0, not a serving group; scaling back to 3 creates g3, so no later group takes the name
    of one that lived and went."""
    ns, name = namespace, "shrink"
    obj = deployment(
        name,
        replicas=3,
        ranks_per_pod=2,
        dwdp_size=2,
        env={"RANKPROG_FAIL_PHASE": "P3", "RANKPROG_FAIL_GROUP": f"{name}-g0"},
        failurePolicy={"backoffInitialSeconds": 300, "backoffMaxSeconds": 300},
    )
    cluster.apply(ns, obj)

    def phases() -> dict[str, tuple[str, int]]:
        return {
            g["name"]: (g["phase"], g["incarnation"])
            for g in groups(status(cluster, ns, name)).values()
        }

    def settle(want: dict[str, str], message: str, timeout: float = 60) -> None:
        """Wait until the groups are exactly ``want`` (name suffix -> phase), incarnation 0."""
        full = {f"{name}-{g}": (phase, 0) for g, phase in want.items()}
        cluster.wait_for(lambda: phases() == full, timeout=timeout, interval=0.5, message=message)

    serving = {"g1": "Serving", "g2": "Serving"}
    settle({"g0": "Restarting", **serving}, "g0 failed, g1 and g2 serving", timeout=90)
    obj["spec"]["context"]["replicas"] = 2
    cluster.apply(ns, obj)
    settle(serving, "g0 removed, g1 and g2 untouched")
    obj["spec"]["context"]["replicas"] = 3
    cluster.apply(ns, obj)
    settle({**serving, "g3": "Serving"}, "a new group g3, g1 and g2 untouched")
    assert status(cluster, ns, name)["nextGroupIndex"] == 4
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")


def test_a_deleted_pod_fails_its_group_which_restarts_under_its_own_index(
    cluster: TestCluster, namespace: str, operator: OperatorProcess
) -> None:
    """``kubectl delete pod`` of a serving group of one pod (the demo's shape): the same group
    fails (PodMissing: Event and lastFailure) while its pod still terminates, and comes back
    as incarnation 1 of the same index with restarts 1, never as a new group index. A
    finalizer holds the pod terminating for a few seconds (a worker's graceful shutdown)."""
    ns, name = namespace, "delpod"
    obj = deployment(
        name,
        replicas=2,
        ranks_per_pod=2,
        dwdp_size=2,  # 1 pod of 2 ranks per group
        failurePolicy={"backoffInitialSeconds": 1, "backoffMaxSeconds": 4},
    )
    cluster.apply(ns, obj)
    g0, g1 = f"{name}-g0", f"{name}-g1"

    def serving(incarnation: int) -> dict | None:
        st = status(cluster, ns, name)
        gs = groups(st)
        ok = st.get("readyGroups") == 2 and all(
            gs.get(g, {}).get("phase") == "Serving" for g in (g0, g1)
        )
        return st if ok and gs[g1]["incarnation"] == incarnation else None

    cluster.wait_for(lambda: serving(0), timeout=90, interval=0.5, message=f"{name} Ready")
    (victim,) = [p["metadata"]["name"] for p in pods(cluster, ns) if group_of(p) == g1]
    hold = '{"metadata":{"finalizers":["test.dwdp.io/hold"]}}'
    cluster.kubectl("patch", "pod", victim, "-n", ns, "--type=merge", "-p", hold)
    try:
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")

        def failed() -> dict | None:
            g = groups(status(cluster, ns, name)).get(g1) or {}
            return g if g.get("restarts") == 1 else None

        g = cluster.wait_for(failed, timeout=30, interval=0.25, message=f"{g1} failed")
        assert g["lastFailure"]["reason"] == "PodMissing", g
        assert victim in g["lastFailure"]["message"], g
        assert g["phase"] in ("Restarting", "Pending", "Scheduling"), g
        assert cluster.get("pod", victim, ns)["metadata"].get("deletionTimestamp")
    finally:
        cluster.kubectl(
            "patch",
            "pod",
            victim,
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
    st = cluster.wait_for(lambda: serving(1), timeout=90, interval=0.5, message=f"{g1} i1")
    g = groups(st)[g1]
    assert (g["incarnation"], g["restarts"]) == (1, 1), g
    assert g["lastFailure"]["reason"] == "PodMissing", g
    assert sorted(groups(st)) == [g0, g1] and st["nextGroupIndex"] == 2, st
    assert groups(st)[g0]["incarnation"] == 0 and groups(st)[g0].get("restarts", 0) == 0
    failures = event_messages(cluster, ns, "GroupFailed")
    assert len([m for m in failures if g1 in m]) == 1, failures
    assert all("PodMissing" in m for m in failures), failures
    created = event_messages(cluster, ns, "CreatedGroup")
    assert not any(f"{name}-g2 " in m for m in created), created
    assert any(f"{g1} incarnation 1" in m for m in created), created
    cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
