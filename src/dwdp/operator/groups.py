"""Pure decisions about DWDP groups: failure classification, restart backoff, stuck pods,
and the rollout step counted in whole groups.

Every function here is a tiny named predicate or calculator with no I/O and no clock (times
are arguments), so :func:`dwdp.operator.plan.plan` stays a composition of decisions that the
unit tests check table by table.

The rollout cases of one role (``replicas`` R, ``maxSurge`` S, ``maxUnavailable`` U), each
group either *new* (at the target revision, or waiting to restart at it) or *old*:

  1. fewer than R new groups: create new ones while the total stays within R + S;
  2. more than R new groups (scale-down): drain the extra ones, unready first, highest
     index first;
  3. old groups that are not serving: drain them (they carry no traffic; a spec change
     mid-rollout drops half-started groups of the intermediate revision at once);
  4. old serving groups: drain as many as keeps the serving groups at or above R - U.

At rest (every group new and serving, R of them) no case applies: the step is empty.
Invariant: a group never holds pods of two revisions (a group index is reused only after
every pod of it is gone), and a draining group has its gate closed before any pod is deleted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dwdp.api.contract import SERVING_WORDS, SETUP_WORDS, Stage

__all__ = [
    "EXIT_WORD",
    "FailureClass",
    "GroupSlot",
    "RolloutStep",
    "backoff_s",
    "classify_failure",
    "next_index",
    "parse_time",
    "rollout_step",
    "seconds_since",
]


EXIT_WORD = "exit"
"""``lastFailure.phase`` of a failure no rank named (the operator's word, not a rank's)."""


class FailureClass:
    """Values of ``lastFailure.reason`` (classified failures)."""

    SETUP_FAILED = "SetupFailed"
    RENDEZVOUS_FAILED = "RendezvousFailed"
    CONFIG_ERROR = "ConfigError"
    HOST_REFUSED = "HostRefused"
    CRASH = "Crash"
    OOM_KILLED = "OOMKilled"
    EXITED = "Exited"
    POD_MISSING = "PodMissing"
    RESTARTED_IN_PLACE = "RestartedInPlace"
    UNSCHEDULABLE = "Unschedulable"


def parse_time(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time of the API (``2026-01-02T03:04:05Z``); None when absent or bad."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def seconds_since(then: str | None, now: str) -> float | None:
    """Seconds from ``then`` to ``now`` (both RFC 3339); None when ``then`` is unknown."""
    a, b = parse_time(then), parse_time(now)
    if a is None or b is None:
        return None
    return (b - a).total_seconds()


def backoff_s(restarts: int, *, initial_s: int, max_s: int) -> int:
    """Wait before restart number ``restarts`` (1 = the first): ``initial * 2**(n-1)``,
    capped at ``max_s``; 0 for ``restarts`` < 1."""
    if restarts < 1:
        return 0
    return min(max_s, initial_s * 2 ** min(restarts - 1, 30))


def classify_failure(
    *,
    message: str | None,
    exit_code: int | None,
    terminated_reason: str | None,
    rank_phase: str | None,
    was_serving: bool,
) -> tuple[str, str]:
    """``(phase, reason)`` of a failed rank pod.

    The phase is the one the rank named in its termination message (``"P3: ..."``), else
    the phase a rank reported as failed, else ``serve`` when the group was serving, else
    ``exit``. The reason: OOMKilled from the kubelet; a named setup phase gives
    SetupFailed (rendezvous: RendezvousFailed, config: ConfigError, host: HostRefused); a
    serving group that lost a rank, or a rank killed by a signal (exit code above 128), is a
    Crash; else Exited.
    """
    head = None
    if message and ":" in message:
        first = message.split(":", 1)[0].strip()
        head = first if first and " " not in first and len(first) <= 32 else None
    phase = head or rank_phase or (Stage.SERVE.value if was_serving else EXIT_WORD)
    if terminated_reason == "OOMKilled":
        return phase, FailureClass.OOM_KILLED
    if phase == Stage.RENDEZVOUS:
        return phase, FailureClass.RENDEZVOUS_FAILED
    if phase == Stage.CONFIG:
        return phase, FailureClass.CONFIG_ERROR
    if phase == Stage.HOST:
        return phase, FailureClass.HOST_REFUSED
    if phase in SETUP_WORDS:
        return phase, FailureClass.SETUP_FAILED
    if phase in SERVING_WORDS or was_serving or (exit_code is not None and exit_code > 128):
        return phase, FailureClass.CRASH
    return phase, FailureClass.EXITED


def next_index(used: Iterable[int], recorded: int | None) -> int:
    """The next group index: the recorded one (``status``), or past every index in ``used``
    if higher. Indices only grow, so a group name is never given to two lifetimes."""
    return max([recorded or 0, *(i + 1 for i in used)])


@dataclass(frozen=True, slots=True)
class GroupSlot:
    """One group of a role as the rollout sees it (draining groups are left out)."""

    index: int
    new: bool
    """At the target revision (or waiting to restart at it)."""
    serving: bool
    """Committed with its gate open: it carries traffic."""


@dataclass(frozen=True, slots=True)
class RolloutStep:
    """What one reconcile does to a role's groups: how many to create, which to drain."""

    create: int = 0
    drain: tuple[int, ...] = ()


def rollout_step(
    groups: Sequence[GroupSlot], *, replicas: int, max_surge: int, max_unavailable: int
) -> RolloutStep:
    """The step of the rollout cases in the module docstring."""
    new = [g for g in groups if g.new]
    old = [g for g in groups if not g.new]
    total = len(groups)
    create = max(0, min(replicas - len(new), replicas + max_surge - total))
    drain: list[int] = []
    if len(new) > replicas:  # case 2
        extra = sorted(new, key=lambda g: (g.serving, -g.index))
        drain += [g.index for g in extra[: len(new) - replicas]]
    drain += [g.index for g in sorted(old, key=lambda g: -g.index) if not g.serving]  # case 3
    serving = sum(1 for g in groups if g.serving and g.index not in drain)
    spare = serving - max(0, replicas - max_unavailable)
    for g in sorted((g for g in old if g.serving), key=lambda g: -g.index):  # case 4
        if spare <= 0:
            break
        drain.append(g.index)
        spare -= 1
    return RolloutStep(create=create, drain=tuple(drain))
