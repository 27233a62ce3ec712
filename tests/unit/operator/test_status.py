"""Observed summaries, group phases, the deployment phase and the progress deadline,
table-style."""

from __future__ import annotations

import pytest

from dwdp.api.contract import StatusPhase
from dwdp.api.deployment import GroupStatus
from dwdp.api.enums import Role
from dwdp.operator.constants import GroupPhase
from dwdp.operator.group.rollout import stuck_groups
from dwdp.operator.group.verdict import evaluate_group
from dwdp.operator.observe import (
    Observed,
    ObservedPod,
    RankReport,
    pod_from_object,
    rank_report_from_json,
)
from dwdp.operator.status import deployment_phase


def raw_pod(**status) -> dict:
    return {
        "metadata": {
            "name": "demo-g0-i1-p0",
            "labels": {
                "dwdp.io/role": "context",
                "dwdp.io/group-index": "0",
                "dwdp.io/incarnation": "1",
                "dwdp.io/pod-index": "0",
                "dwdp.io/revision": "r1",
            },
        },
        "spec": {
            "nodeName": "node-0",
            "containers": [
                {"ports": [{"name": "rank-0"}, {"name": "rank-1"}, {"name": "rendezvous"}]}
            ],
        },
        "status": status,
    }


def test_pod_summary_of_a_running_gated_pod() -> None:
    pod = pod_from_object(
        raw_pod(
            phase="Running",
            podIP="127.0.0.9",
            conditions=[
                {"type": "Ready", "status": "True"},
                {"type": "dwdp.io/group-ready", "status": "True"},
            ],
            containerStatuses=[{"state": {"running": {}}}],
        )
    )
    assert pod == ObservedPod(
        name="demo-g0-i1-p0",
        role=Role.CONTEXT,
        group_index=0,
        incarnation=1,
        pod_index=0,
        revision="r1",
        phase="Running",
        scheduled=True,
        started=True,
        deleting=False,
        ip="127.0.0.9",
        gate=True,
        ready=True,
        ranks=2,
    )


def test_pod_summary_of_a_failed_pod_keeps_its_termination_message() -> None:
    pod = pod_from_object(
        raw_pod(
            phase="Failed",
            containerStatuses=[
                {"state": {"terminated": {"exitCode": 1, "message": "P3: rank 1 failed\n"}}}
            ],
        )
    )
    assert pod is not None
    assert (pod.failed, pod.termination_message, pod.exit_code) == (True, "P3: rank 1 failed", 1)


@pytest.mark.parametrize(("ready", "gate"), [(False, False), (True, False), (True, True),
                                            (False, True)])
def test_a_vllm_servers_readiness_stands_for_its_one_ranks_report(ready: bool, gate: bool):
    """A vLLM pod answers no /dwdp/status: once its /health passes its one rank reports
    ``disabled`` (committed, replicated weights); before, and after the commit when /health is
    slow, nothing (not reported yet), so only its exit fails it."""
    raw = raw_pod(
        phase="Running",
        podIP="127.0.0.9",
        conditions=[{"type": "dwdp.io/group-ready", "status": "True" if gate else "False"}],
        containerStatuses=[{"ready": ready, "state": {"running": {}}}],
    )
    raw["metadata"]["labels"].update({"dwdp.io/role": "generation", "dwdp.io/engine": "vllm"})
    raw["spec"]["containers"] = [{"ports": [{"name": "http"}]}]
    observed = Observed.from_objects(pods=[raw], children=[])
    (pod,) = observed.pods
    assert (pod.vllm, pod.containers_ready, pod.ranks) == (True, ready, 1)
    want = (RankReport(0, StatusPhase.DISABLED),) if ready else None
    assert observed.ranks.get(pod.name) == want
    plain = pod_from_object(raw_pod(phase="Running", containerStatuses=[{"ready": True}]))
    assert plain is not None and not plain.vllm and plain.vllm_report() is None


def test_pod_without_the_operators_labels_is_ignored() -> None:
    assert pod_from_object({"metadata": {"name": "x", "labels": {}}}) is None


@pytest.mark.parametrize(
    ("body", "want"),
    [
        (
            {
                "phase": "committed",
                "rank": 2,
                "revision": "r",
                "incarnation": 1,
                "layout_digest": "d",
            },
            RankReport(2, "committed", "r", 1, "d"),
        ),
        ({"phase": "P3"}, None),  # not a word of the rank contract: not reported
        ({"phase": "rendezvous"}, None),
        ({"phase": "disabled", "layout_digest": None}, RankReport(None, "disabled")),
        ({"rank": 1}, None),
        ("not json", None),
    ],
)
def test_rank_reports(body: object, want: RankReport | None) -> None:
    assert rank_report_from_json(body) == want


def pod(
    name: str,
    *,
    index: int = 0,
    phase: str = "Running",
    scheduled: bool = True,
    started: bool = True,
    gate: bool = False,
    message: str | None = None,
) -> ObservedPod:
    return ObservedPod(
        name=name,
        role=Role.CONTEXT,
        group_index=0,
        incarnation=1,
        pod_index=index,
        revision="r1",
        phase=phase,
        scheduled=scheduled,
        started=started,
        deleting=False,
        ip="127.0.0.2",
        gate=gate,
        ready=gate,
        ranks=2,
        termination_message=message,
        exit_code=1 if phase == "Failed" else None,
    )


P0, P1 = "demo-g0-i1-p0", "demo-g0-i1-p1"
OK = RankReport(0, "committed", "r1", 1, "d1")


def committed(rank: int, digest: str = "d1", revision: str = "r1", inc: int = 1) -> RankReport:
    return RankReport(rank, "committed", revision, inc, digest)


@pytest.mark.parametrize(
    ("name", "pods", "reports", "phase", "ready", "is_committed"),
    [
        ("no pods yet", [], {}, GroupPhase.PENDING, 0, False),
        ("one pod of two", [pod(P0)], {}, GroupPhase.PENDING, 0, False),
        (
            "unscheduled",
            [pod(P0), pod(P1, index=1, scheduled=False)],
            {},
            GroupPhase.SCHEDULING,
            0,
            False,
        ),
        (
            "not started",
            [pod(P0), pod(P1, index=1, started=False, phase="Pending")],
            {},
            GroupPhase.PENDING,
            0,
            False,
        ),
        (
            "running, nobody answered",
            [pod(P0), pod(P1, index=1)],
            {P0: (None, None), P1: (None, None)},
            GroupPhase.RENDEZVOUS,
            0,
            False,
        ),
        (
            "setting up",
            [pod(P0), pod(P1, index=1)],
            {P0: (None, committed(1)), P1: (None, None)},
            GroupPhase.SETTING_UP,
            1,
            False,
        ),
        (
            "all committed in agreement",
            [pod(P0), pod(P1, index=1)],
            {P0: (committed(0), committed(1)), P1: (committed(2), committed(3))},
            GroupPhase.SERVING,
            4,
            True,
        ),
        (
            "digests differ",
            [pod(P0), pod(P1, index=1)],
            {P0: (committed(0), committed(1)), P1: (committed(2), committed(3, digest="x"))},
            GroupPhase.SETTING_UP,
            4,
            False,
        ),
        (
            "a rank of another revision",
            [pod(P0), pod(P1, index=1)],
            {P0: (committed(0), committed(1)), P1: (committed(2), committed(3, revision="r0"))},
            GroupPhase.SETTING_UP,
            4,
            False,
        ),
        (
            "a rank of an old incarnation",
            [pod(P0), pod(P1, index=1)],
            {P0: (committed(0), committed(1)), P1: (committed(2), committed(3, inc=0))},
            GroupPhase.SETTING_UP,
            4,
            False,
        ),
        (
            "gate open everywhere",
            [pod(P0, gate=True), pod(P1, index=1, gate=True)],
            {},
            GroupPhase.SERVING,
            4,
            True,
        ),
        (
            "a pod failed",
            [pod(P0), pod(P1, index=1, phase="Failed", message="P3: boom")],
            {},
            GroupPhase.FAILED,
            0,
            False,
        ),
        (
            "a rank reports failure",
            [pod(P0), pod(P1, index=1)],
            {P0: (RankReport(0, "failed"), None), P1: (None, None)},
            GroupPhase.FAILED,
            0,
            False,
        ),
    ],
)
def test_group_phase(name, pods, reports, phase, ready, is_committed) -> None:
    view = evaluate_group(
        name="demo-g0",
        index=0,
        incarnation=1,
        revision="r1",
        pods=pods,
        pods_expected=2,
        ranks_expected=4,
        reports=reports,
    )
    assert (view.phase, view.ranks_ready, view.committed) == (phase, ready, is_committed), name
    assert view.ranks_total == 4


def test_failed_group_records_phase_and_message() -> None:
    view = evaluate_group(
        name="demo-g0",
        index=0,
        incarnation=1,
        revision="r1",
        pods=[pod(P0), pod(P1, index=1, phase="Failed", message="P3: rank 3 failed")],
        pods_expected=2,
        ranks_expected=4,
        reports={},
    )
    assert view.failure == {
        "phase": "P3",
        "message": "demo-g0-i1-p1: P3: rank 3 failed",
        "reason": "PodFailed",
    }
    assert view.to_model(restarts=2).to_yaml_dict() == {  # as the status writes it
        "name": "demo-g0",
        "revision": "r1",
        "incarnation": 1,
        "phase": "Failed",
        "ranksReady": 0,
        "ranksTotal": 4,
        "leaks": 0,
        "restarts": 2,
        "lastFailure": view.failure,
    }


@pytest.mark.parametrize(
    ("all_ready", "failed", "started", "want"),
    [
        (True, False, True, "Ready"),
        (False, True, True, "Degraded"),
        (False, False, True, "Progressing"),
        (False, False, False, "Pending"),
    ],
)
def test_deployment_phase(all_ready, failed, started, want) -> None:
    assert deployment_phase(all_ready=all_ready, failed=failed, started=started).value == want


def _entry(phase: str, started_at: str | None, revision: str = "new", **extra) -> GroupStatus:
    return GroupStatus.model_validate(
        {"name": "demo-g2", "revision": revision, "phase": phase, "startedAt": started_at, **extra}
    )


def test_a_group_past_the_progress_deadline_is_stuck_with_its_phase_and_failure() -> None:
    failure = {"phase": "P3", "message": "rank 1: out of memory", "reason": "SetupFailed"}
    entries = [
        _entry("SettingUp", "2026-01-01T00:00:00Z", restarts=2, lastFailure=failure),
        _entry("Serving", "2026-01-01T00:00:00Z"),  # committed: never stuck
        _entry("Rendezvous", "2026-01-01T00:00:00Z", revision="old"),  # not the rollout's
    ]
    kw = dict(revision="new", deadline_s=600)
    assert stuck_groups(entries, now="2026-01-01T00:10:00Z", **kw) == []  # 600 s: not yet
    (line,) = stuck_groups(entries, now="2026-01-01T00:10:01Z", **kw)
    assert line == (
        "group demo-g2 (revision new) has not committed 601 s after it started "
        "(progressDeadlineSeconds 600): phase SettingUp, last failure at P3: rank 1: out of memory"
    )
