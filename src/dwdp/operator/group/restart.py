"""Fail together and restart with backoff: a failed incarnation has its gates closed and
every pod deleted, its failure counted once, and the group restarts as its next
incarnation after ``initial * 2**(n-1)`` seconds (capped), or stays Failed past the
restart limit. Pods that vanished without the operator deleting them are such a failure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dwdp.api.deployment import FailureRecord
from dwdp.operator import naming
from dwdp.operator.actions import NO_ACTIONS, Actions, Delete, Event, GateChange
from dwdp.operator.constants import GroupPhase, Reason
from dwdp.operator.group.create import create_incarnation, next_incarnation
from dwdp.operator.group.failure import EXIT_WORD, FailureClass
from dwdp.operator.group.state import (
    GroupDecision,
    GroupSlot,
    GroupState,
    RoleContext,
    entry,
    failure_incarnation,
    failure_of,
    unready_view,
)
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.observe import ObservedPod
from dwdp.operator.times import seconds_since

__all__ = [
    "DOWN_PHASES",
    "backoff_s",
    "fail_together",
    "lost_pods",
    "vanished",
    "waiting_to_restart",
]


_RUNNING_PHASES = frozenset(
    {
        GroupPhase.SCHEDULING.value,
        GroupPhase.RENDEZVOUS.value,
        GroupPhase.SETTING_UP.value,
        GroupPhase.SERVING.value,
    }
)
"""Recorded phases of an incarnation whose pods existed (their vanishing is a failure;
a Pending group may never have been created, e.g. refused by a quota)."""

DOWN_PHASES = frozenset({GroupPhase.RESTARTING.value, GroupPhase.FAILED.value})
"""Recorded phases of a failed group: it waits to restart, or stays failed."""


def backoff_s(restarts: int, *, initial_s: int, max_s: int) -> int:
    """Wait before restart number ``restarts`` (1 = the first): ``initial * 2**(n-1)``,
    capped at ``max_s``; 0 for ``restarts`` < 1."""
    if restarts < 1:
        return 0
    return min(max_s, initial_s * 2 ** min(restarts - 1, 30))


def fail_together(
    ctx: RoleContext,
    g: GroupState,
    view: GroupView,
    current: Sequence[ObservedPod],
    failure: FailureRecord,
) -> GroupDecision:
    """Fail together: gates down, the whole incarnation deleted, restart after the backoff
    (the failure is counted once per incarnation)."""
    inc = view.incarnation
    restarts = g.restarts
    counted = g.last_failure is not None and failure_incarnation(g.last_failure) == inc
    if g.last_failure is not None and counted:
        last_failure = g.last_failure
    else:
        restarts += 1
        last_failure = FailureRecord.model_validate(
            {**failure.model_dump(exclude_none=True), "time": ctx.now, "incarnation": inc}
        )
    policy = ctx.spec.failure_policy
    out = policy.restart_limit is not None and restarts > policy.restart_limit
    wait = backoff_s(
        restarts, initial_s=policy.backoff_initial_seconds, max_s=policy.backoff_max_seconds
    )
    events: tuple[Event, ...] = ()
    if not counted:
        then = (
            f"restart limit {policy.restart_limit} reached, it stays failed"
            if out
            else f"whole incarnation deleted, restart {restarts} in {wait} s"
        )
        events = (
            Event(
                Reason.GROUP_FAILED,
                f"{ctx.role.value} group {g.name} incarnation {inc} failed at "
                f"{last_failure.phase} ({last_failure.reason}): {last_failure.message}; {then}",
                "Warning",
            ),
        )
    actions = Actions(
        gates=tuple(
            GateChange(p.name, False, f"{g.name} is Failed")
            for p in current
            if p.gate and not p.failed
        ),
        delete=tuple(Delete("Pod", p.name) for p in current),
        events=events,
        requeue_s=(float(wait),),
    )
    phase = GroupPhase.FAILED if out else GroupPhase.RESTARTING
    down = unready_view(ctx, g, inc, phase, revision=view.revision, failure=last_failure)
    return GroupDecision(
        actions=actions,
        view=down,
        entry=entry(down, restarts, last_failure),
        slot=GroupSlot(g.index, new=True, serving=False),
    )


def lost_pods(g: GroupState) -> bool:
    """No live pod, and the operator deleted none of them: the recorded phase says the
    incarnation's pods existed (Scheduling to Serving), or it is Pending and pods of it are
    terminating. Pods the operator deletes are recorded first (Restarting or Failed) or carry
    the draining gate reason, so a pod deleted by someone else, gone or still terminating in
    its grace period, is a failure of its group (never a drained group whose index goes)."""
    if g.live or g.recorded_phase in DOWN_PHASES or any(p.draining for p in g.terminating):
        return False
    if g.recorded_phase in _RUNNING_PHASES:
        return True
    return g.recorded_phase == GroupPhase.PENDING.value and any(
        p.incarnation == g.recorded_incarnation for p in g.terminating
    )


def _lost_message(g: GroupState) -> str:
    inc = g.recorded_incarnation
    deleted = sorted(p.name for p in g.terminating if p.incarnation == inc)
    if deleted:
        return f"pods {deleted} of incarnation {inc} were deleted, not by the operator"
    return f"every pod of incarnation {inc} is gone"


def vanished(ctx: RoleContext, g: GroupState) -> tuple[GroupState, Actions]:
    """The pods of a running incarnation are gone or terminating, not deleted by the
    operator (:func:`lost_pods`): a failure; the same group then waits to restart (the
    returned state records it). Its rendezvous Secret goes too (no step deleted its pods,
    so none deleted it)."""
    failure = failure_of(
        EXIT_WORD,
        _lost_message(g),
        FailureClass.POD_MISSING,
        time=ctx.now,
        incarnation=g.recorded_incarnation,
    )
    restarts = g.restarts + 1
    limit = ctx.spec.failure_policy.restart_limit
    then = (
        f"restart limit {limit} reached, it stays failed"
        if limit is not None and restarts > limit
        else f"restart {restarts} follows its backoff"
    )
    event = Event(
        Reason.GROUP_FAILED,
        f"{ctx.role.value} group {g.name} incarnation {g.recorded_incarnation} failed "
        f"({failure.reason}): {failure.message}; {then}",
        "Warning",
    )
    state = replace(
        g, restarts=restarts, last_failure=failure, recorded_phase=GroupPhase.RESTARTING.value
    )
    deletes: tuple[Delete, ...] = ()
    if ctx.rendezvous_secret:
        deletes = (Delete("Secret", naming.rendezvous_secret(g.name, g.recorded_incarnation)),)
    return state, Actions(delete=deletes, events=(event,))


def waiting_to_restart(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """A failed group without live pods: past the restart limit it stays Failed; else,
    once its backoff ran out and no pod of it is terminating, its next incarnation starts."""
    policy = ctx.spec.failure_policy
    inc = g.recorded_incarnation
    actions = NO_ACTIONS
    if policy.restart_limit is not None and g.restarts > policy.restart_limit:
        view = unready_view(ctx, g, inc, GroupPhase.FAILED)
    else:
        wait = backoff_s(
            g.restarts, initial_s=policy.backoff_initial_seconds, max_s=policy.backoff_max_seconds
        )
        failed_at = g.last_failure.time if g.last_failure is not None else None
        since = seconds_since(failed_at, ctx.now)
        left = wait - since if since is not None else 0.0
        if g.terminating or left > 0 or ctx.observed.create_blocked:
            actions = Actions(requeue_s=(max(0.5, left),))
            view = unready_view(ctx, g, inc, GroupPhase.RESTARTING)
        else:
            inc = next_incarnation(g.pods, inc)
            restarted = Event(
                Reason.RESTARTED_GROUP,
                f"restarted {ctx.role.value} group {g.name} as incarnation {inc} "
                f"(restart {g.restarts}, after {wait} s backoff, revision {ctx.target})",
            )
            actions = create_incarnation(
                ctx, g.index, inc, ctx.target, range(ctx.shape.pods_per_group)
            ) + Actions(events=(restarted,))
            view = unready_view(ctx, g, inc, GroupPhase.PENDING)
    return GroupDecision(
        actions=actions,
        view=view,
        entry=entry(view, g.restarts, g.last_failure),
        slot=GroupSlot(g.index, new=True, serving=False),
    )
