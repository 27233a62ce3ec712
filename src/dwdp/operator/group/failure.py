"""Why an incarnation failed: the failed pod or rank (classified into ``lastFailure``'s
phase and reason), pods gone after it started, a rank restarted in place, or pods not
scheduled in time."""

from __future__ import annotations

from collections.abc import Sequence

from dwdp.api.contract import SERVING_WORDS, SETUP_WORDS, Stage
from dwdp.api.deployment import FailureRecord
from dwdp.operator.constants import GroupPhase
from dwdp.operator.group.commit import restarted_rank
from dwdp.operator.group.state import GroupState, RoleContext, failure_of
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.observe import ObservedPod
from dwdp.operator.times import seconds_since

__all__ = [
    "EXIT_WORD",
    "FailureClass",
    "classify_failure",
    "detect_failure",
    "unschedulable_too_long",
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


def detect_failure(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> FailureRecord | None:
    """Why the newest incarnation failed: a failed pod or rank (classified), pods gone
    after it started, or pods not scheduled in time; None when it did not."""
    inc = view.incarnation
    have = {p.pod_index for p in current}
    missing = [i for i in range(ctx.shape.pods_per_group) if i not in have]
    timeout = ctx.spec.failure_policy.scheduling_timeout_seconds
    if view.phase is GroupPhase.FAILED and view.failure is not None:
        bad = next((p for p in current if p.failed), None)
        rank_phase = view.failure.get("phase")
        phase, why = classify_failure(
            message=bad.termination_message if bad else None,
            exit_code=bad.exit_code if bad else None,
            terminated_reason=bad.terminated_reason if bad else None,
            rank_phase=rank_phase if rank_phase != EXIT_WORD else None,
            was_serving=any(p.gate for p in current)
            or g.recorded_phase == GroupPhase.SERVING.value,
        )
        return FailureRecord.model_validate({**view.failure, "phase": phase, "reason": why})
    restarted = restarted_rank(ctx, g, view, current)
    if restarted is not None:
        return failure_of(Stage.SERVE.value, restarted, FailureClass.RESTARTED_IN_PLACE)
    if missing and any(p.started for p in current):
        return failure_of(
            EXIT_WORD,
            f"pods {missing} of incarnation {inc} are gone",
            FailureClass.POD_MISSING,
        )
    if view.phase in (GroupPhase.SCHEDULING, GroupPhase.PENDING) and any(
        unschedulable_too_long(p, ctx.now, timeout) for p in current
    ):
        return failure_of(
            "scheduling",
            f"pods of incarnation {inc} not scheduled within {timeout} s",
            FailureClass.UNSCHEDULABLE,
        )
    return None


def unschedulable_too_long(pod: ObservedPod, now: str, timeout_s: int) -> bool:
    """Not bound to a node (or not started) ``timeout_s`` after its creation."""
    if pod.scheduled and pod.started:
        return False
    since = seconds_since(pod.created, now)
    return since is not None and since > timeout_s
