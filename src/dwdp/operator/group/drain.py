"""Drain a group (its gates were closed with reason GroupDraining: delete every live pod)
and force-delete pods stuck terminating (their kubelet is gone)."""

from __future__ import annotations

from dwdp.operator.actions import Actions, Delete, Event
from dwdp.operator.constants import Reason
from dwdp.operator.group.state import GroupDecision, GroupState, RoleContext, draining_entry
from dwdp.operator.observe import ObservedPod
from dwdp.operator.times import seconds_since

__all__ = [
    "STUCK_TERMINATING_MARGIN_S",
    "draining",
    "force_deletes",
]


STUCK_TERMINATING_MARGIN_S = 30
"""Seconds past a pod's grace period after which a terminating pod counts as stuck."""


def _stuck_terminating(pod: ObservedPod, now: str) -> bool:
    """Deleted longer ago than its grace period plus the margin, and still there."""
    since = seconds_since(pod.deleted, now)
    grace = pod.grace_s if pod.grace_s is not None else 30
    return since is not None and since > grace + STUCK_TERMINATING_MARGIN_S


def force_deletes(ctx: RoleContext, g: GroupState) -> Actions:
    """Pods stuck terminating (their kubelet is gone): delete with grace period 0."""
    stuck = [p for p in g.pods if p.deleting and _stuck_terminating(p, ctx.now)]
    return Actions(
        delete=tuple(Delete("Pod", p.name, grace_s=0) for p in stuck),
        events=tuple(
            Event(
                Reason.FORCE_DELETED,
                f"pod {p.name} stuck terminating since {p.deleted}; deleted with grace period 0",
                "Warning",
            )
            for p in stuck
        ),
    )


def draining(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """The gates were closed (reason GroupDraining): now delete every live pod."""
    live = g.live
    message = f"deleting {ctx.role.value} group {g.name} ({len(live)} pods, gate closed)"
    return GroupDecision(
        actions=Actions(
            delete=tuple(Delete("Pod", p.name, grace_s=p.grace_s) for p in live),
            events=(Event(Reason.DELETED_GROUP, message),),
        ),
        entry=draining_entry(g.name, live, ctx.shape, g.restarts),
        draining=True,
    )
