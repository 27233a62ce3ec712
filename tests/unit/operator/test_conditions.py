"""Every condition the operator writes (``dwdp.operator.conditions``), table-style."""

from __future__ import annotations

import pytest

from dwdp.operator.conditions import (
    carry_transition_times,
    deployment_conditions,
    gate_condition,
    invalid_conditions,
    replica_failure,
    router_ready,
)
from dwdp.operator.constants import Reason
from dwdp.operator.router import RouterServers

SERVERS = RouterServers(prefill=("http://10.0.0.1:8000",), decode=("http://10.0.0.2:8000",))


def test_conditions_when_everything_serves() -> None:
    got = deployment_conditions(
        desired=2,
        ready=2,
        existing=2,
        failed=[],
        outdated=0,
        generation_desired=1,
        generation_ready=1,
        observed_generation=3,
    )
    assert got == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "AllGroupsServing",
            "message": "2/2 context groups serving, 1/1 generation servers serving",
            "observedGeneration": 3,
        },
        {
            "type": "Progressing",
            "status": "False",
            "reason": "Stable",
            "message": "no change under way",
            "observedGeneration": 3,
        },
        {
            "type": "Degraded",
            "status": "False",
            "reason": "Healthy",
            "message": "no group failed",
            "observedGeneration": 3,
        },
    ]


@pytest.mark.parametrize(
    ("kwargs", "ready", "progressing", "degraded"),
    [
        (dict(desired=3, ready=2, existing=2, failed=[]), "GroupsNotReady", "Scaling", "Healthy"),
        (dict(desired=1, ready=1, existing=2, failed=[]), "AllGroupsServing", "Scaling", "Healthy"),
        (
            dict(desired=2, ready=1, existing=2, failed=[]),
            "GroupsNotReady",
            "GroupsStarting",
            "Healthy",
        ),
        (
            dict(desired=2, ready=1, existing=2, failed=["demo-g1"]),
            "GroupsNotReady",
            "Stable",
            "GroupFailed",
        ),
    ],
)
def test_condition_reasons(kwargs, ready, progressing, degraded) -> None:
    got = deployment_conditions(
        **kwargs, outdated=0, generation_desired=0, generation_ready=0, observed_generation=None
    )
    assert [x["reason"] for x in got] == [ready, progressing, degraded]
    assert all("observedGeneration" not in x for x in got)


def test_transition_times_carry_over_only_when_status_is_unchanged() -> None:
    old = [
        {"type": "Ready", "status": "False", "lastTransitionTime": "T0"},
        {"type": "Degraded", "status": "False", "lastTransitionTime": "T0"},
    ]
    new = [
        {"type": "Ready", "status": "True"},
        {"type": "Degraded", "status": "False"},
        {"type": "Progressing", "status": "True"},
    ]
    assert carry_transition_times(new, old, "T1") == [
        {"type": "Ready", "status": "True", "lastTransitionTime": "T1"},
        {"type": "Degraded", "status": "False", "lastTransitionTime": "T0"},
        {"type": "Progressing", "status": "True", "lastTransitionTime": "T1"},
    ]


@pytest.mark.parametrize(
    ("servers", "wanted", "ready", "status", "reason"),
    [
        (RouterServers(), 0, 0, "False", "NoServers"),
        (RouterServers(prefill=SERVERS.prefill), 0, 0, "False", "NoServers"),
        (SERVERS, 1, 0, "False", "RouterNotReady"),
        (SERVERS, 2, 1, "False", "RouterNotReady"),
        (SERVERS, 2, 2, "True", "RouterAvailable"),
    ],
)
def test_router_ready_condition(servers, wanted, ready, status, reason) -> None:
    cond = router_ready(servers=servers, wanted=wanted, ready=ready, observed_generation=3)
    assert (cond["type"], cond["status"], cond["reason"]) == ("RouterReady", status, reason)
    assert cond["observedGeneration"] == 3
    if reason == "NoServers" and servers.prefill:
        assert cond["message"] == "the router waits for a ready generation server"


def test_the_rollout_comes_before_scaling_and_a_stuck_one_is_progressing_false() -> None:
    base = dict(
        desired=2,
        ready=2,
        failed=[],
        generation_desired=0,
        generation_ready=0,
        observed_generation=None,
    )
    surge = deployment_conditions(existing=3, outdated=2, **base)  # maxSurge 1: 3 groups, 2 old
    assert [(x["status"], x["reason"]) for x in surge[1:]] == [
        ("True", "RollingOut"),
        ("False", "Healthy"),
    ]
    stuck = deployment_conditions(existing=3, outdated=2, stuck=["group demo-g2 ..."], **base)
    assert [(x["status"], x["reason"], x["message"]) for x in stuck[1:]] == [
        ("False", "ProgressDeadlineExceeded", "group demo-g2 ..."),
        ("True", "ProgressDeadlineExceeded", "rollout stuck: group demo-g2 ..."),
    ]
    assert stuck[0]["status"] == "True"  # the old groups keep serving


def test_ready_false_for_a_failed_group_says_which_one() -> None:
    got = deployment_conditions(
        desired=2,
        ready=2,
        existing=3,
        failed=["demo-g4"],
        outdated=2,
        generation_desired=0,
        generation_ready=0,
        observed_generation=None,
    )
    assert got[0]["status"] == "False"
    assert got[0]["message"] == (
        "2/2 context groups serving, 0/0 generation servers serving; failed: demo-g4"
    )


def test_an_invalid_spec_is_ready_false_and_invalid_true_with_its_reason() -> None:
    got = invalid_conditions(Reason.INVALID_SPEC, "spec.image: required", 4)
    assert [(x["type"], x["status"], x["reason"]) for x in got] == [
        ("Ready", "False", "InvalidSpec"),
        ("Invalid", "True", "InvalidSpec"),
    ]
    assert got[1]["message"] == "spec.image: required"
    assert all(x["observedGeneration"] == 4 for x in got)


def test_a_refused_creation_is_replica_failure_with_the_apiservers_answer_cut() -> None:
    got = replica_failure("quota exceeded " + "x" * 5000, None)
    assert (got["type"], got["status"], got["reason"]) == ("ReplicaFailure", "True", "FailedCreate")
    assert len(got["message"]) == 4000 and got["message"].startswith("quota exceeded")
    assert "observedGeneration" not in got


@pytest.mark.parametrize(
    ("ready", "reason", "want"),
    [
        (True, None, ("True", "GroupCommitted")),
        (False, None, ("False", "GroupNotCommitted")),
        (False, "GroupDraining", ("False", "GroupDraining")),
    ],
)
def test_the_gate_condition_of_a_pod(ready, reason, want) -> None:
    got = gate_condition(ready=ready, message="demo-g0 committed", reason=reason, now="T1")
    assert got == {
        "type": "dwdp.io/group-ready",
        "status": want[0],
        "reason": want[1],
        "message": "demo-g0 committed",
        "lastTransitionTime": "T1",
    }
