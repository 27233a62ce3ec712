"""The pure group decisions: backoff, failure classification, free indices, rollout step
(expected values written by hand)."""

from __future__ import annotations

import pytest

from dwdp.operator.group.failure import classify_failure
from dwdp.operator.group.restart import backoff_s
from dwdp.operator.group.rollout import RolloutStep, next_index, rollout_step
from dwdp.operator.group.state import GroupSlot
from dwdp.operator.times import seconds_since


@pytest.mark.parametrize(
    ("restarts", "expected"),
    [(0, 0), (1, 2), (2, 4), (3, 8), (4, 16), (5, 20), (50, 20)],
)
def test_backoff_doubles_up_to_the_maximum(restarts: int, expected: int) -> None:
    assert backoff_s(restarts, initial_s=2, max_s=20) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(message="P3: rank 1 failed", exit_code=1), ("P3", "SetupFailed")),
        (dict(message="commit: timed out", exit_code=1), ("commit", "SetupFailed")),
        (dict(message="rendezvous: no store", exit_code=1), ("rendezvous", "RendezvousFailed")),
        (dict(message="config: bad yaml", exit_code=1), ("config", "ConfigError")),
        (
            dict(message="host: HostGateError: FABRIC handles need IMEX", exit_code=1),
            ("host", "HostRefused"),
        ),
        (dict(message="serve: rank died", exit_code=1), ("serve", "Crash")),
        (dict(message="engine: forward raised", exit_code=1), ("engine", "Crash")),
        (dict(message="P6: leak", exit_code=1), ("P6", "SetupFailed")),
        (dict(message="map: no peer", exit_code=1), ("map", "SetupFailed")),
        (dict(message=None, exit_code=137), ("exit", "Crash")),
        (dict(message=None, exit_code=137, was_serving=True), ("serve", "Crash")),
        (dict(message=None, exit_code=1), ("exit", "Exited")),
        (dict(message="some log line with spaces: x", exit_code=1), ("exit", "Exited")),
        (dict(message=None, exit_code=137, terminated_reason="OOMKilled"), ("exit", "OOMKilled")),
        (dict(message=None, exit_code=1, rank_phase="P4"), ("P4", "SetupFailed")),
    ],
)
def test_classify_failure(kwargs: dict, expected: tuple[str, str]) -> None:
    args = dict(terminated_reason=None, rank_phase=None, was_serving=False) | kwargs
    assert classify_failure(**args) == expected


def test_group_indices_only_grow() -> None:
    assert next_index({0, 2}, None) == 3  # never the gap at 1
    assert next_index(set(), None) == 0
    assert next_index({0, 1}, 5) == 5  # groups 2-4 lived and went: not reused
    assert next_index({7}, 5) == 8


def test_seconds_since() -> None:
    assert seconds_since("2026-01-01T00:00:00Z", "2026-01-01T00:01:30Z") == 90
    assert seconds_since(None, "2026-01-01T00:00:00Z") is None
    assert seconds_since("T", "2026-01-01T00:00:00Z") is None


def _g(spec: str) -> list[GroupSlot]:
    """``"N3 o1 s"``-style: per group index, n/N new (N serving), o/O old (O serving)."""
    out = []
    for i, ch in enumerate(spec):
        out.append(GroupSlot(i, new=ch in "nN", serving=ch in "NO"))
    return out


@pytest.mark.parametrize(
    ("groups", "replicas", "surge", "unavailable", "expected"),
    [
        # at rest: nothing
        ("NNN", 3, 1, 0, RolloutStep()),
        # first start: create all
        ("", 3, 1, 0, RolloutStep(create=3)),
        # surge 1 / unavailable 0: one new group at a time, old drained after commit
        ("OOO", 3, 1, 0, RolloutStep(create=1)),
        ("OOOn", 3, 1, 0, RolloutStep()),
        ("OOON", 3, 1, 0, RolloutStep(drain=(2,))),
        ("OONN", 3, 1, 0, RolloutStep(drain=(1,))),
        ("ONN", 3, 1, 0, RolloutStep(create=1)),
        # surge 0 / unavailable 1: drain first, then create
        ("OOO", 3, 0, 1, RolloutStep(drain=(2,))),
        ("OO", 3, 0, 1, RolloutStep(create=1)),
        ("OOn", 3, 0, 1, RolloutStep()),
        ("OON", 3, 0, 1, RolloutStep(drain=(1,))),
        # old groups not serving go at once (a spec change mid-rollout)
        ("NOo", 3, 1, 0, RolloutStep(create=1, drain=(2,))),
        # scale down: extra new groups, unready and highest first
        ("NNN", 1, 1, 0, RolloutStep(drain=(2, 1))),
        ("NnN", 2, 1, 0, RolloutStep(drain=(1,))),
        # scale up
        ("NN", 3, 1, 0, RolloutStep(create=1)),
    ],
)
def test_rollout_step(groups: str, replicas: int, surge: int, unavailable: int, expected) -> None:
    assert (
        rollout_step(_g(groups), replicas=replicas, max_surge=surge, max_unavailable=unavailable)
        == expected
    )
