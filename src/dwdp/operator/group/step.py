"""The step of one group (a role's group index), which is in exactly one case, checked in
this order:

- **draining**: some live pod carries the draining gate reason: delete its pods
  (:mod:`~dwdp.operator.group.drain`);
- **vanished**: no live pod, and the operator removed none: the recorded phase says pods
  existed, or pods the operator never deleted are terminating (``kubectl delete pod``,
  eviction): a failure (counted once), after which the same group waits to restart;
- **waiting to restart**: no live pod, the recorded group failed: restart it after its
  backoff (or keep it failed past the restart limit) (:mod:`~dwdp.operator.group.restart`);
- **terminating**: no live pod, some still terminating: list it as draining until gone;
- **failed**: the newest live incarnation failed (a pod or rank failed, pods went missing,
  pods not scheduled in time: :mod:`~dwdp.operator.group.failure`): fail together, gates
  down, every pod deleted;
- **live**: complete a starting gang (:mod:`~dwdp.operator.group.create`), open or close
  the commit gates (:mod:`~dwdp.operator.group.commit`).

Pods stuck terminating are force-deleted in every case. Invariant: nothing here does I/O or
reads a clock; the same inputs give the same decisions.
"""

from __future__ import annotations

from dataclasses import replace

from dwdp.operator.actions import NO_ACTIONS, Actions, Delete
from dwdp.operator.group.commit import gates, rank_starts
from dwdp.operator.group.create import create_incarnation
from dwdp.operator.group.drain import draining, force_deletes
from dwdp.operator.group.failure import detect_failure
from dwdp.operator.group.restart import (
    DOWN_PHASES,
    fail_together,
    lost_pods,
    vanished,
    waiting_to_restart,
)
from dwdp.operator.group.state import (
    GroupDecision,
    GroupSlot,
    GroupState,
    RoleContext,
    draining_entry,
    entry,
)
from dwdp.operator.group.verdict import evaluate_group

__all__ = [
    "decide_group",
    "live",
    "without_live_pods",
]


def live(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """The newest live incarnation (older ones deleted): failed, or starting and serving:
    complete a starting gang, open the gates once every rank committed, close them when
    the group no longer is."""
    pods = g.live
    inc = max(p.incarnation for p in pods)
    current = [p for p in pods if p.incarnation == inc]
    rev = current[0].revision
    older = Actions(delete=tuple(Delete("Pod", p.name) for p in pods if p.incarnation != inc))
    view = evaluate_group(
        name=g.name,
        index=g.index,
        incarnation=inc,
        revision=rev,
        pods=current,
        pods_expected=ctx.shape.pods_per_group,
        ranks_expected=ctx.shape.world_size,
        reports=ctx.observed.ranks,
        previous_digest=g.recorded_digest,
    )
    failure = detect_failure(ctx, g, view, current)
    if failure is not None:
        decision = fail_together(ctx, g, view, current, failure)
        return replace(decision, actions=older + decision.actions)
    actions = older
    have = {p.pod_index for p in current}
    missing = [i for i in range(ctx.shape.pods_per_group) if i not in have]
    if missing and not any(p.started for p in current) and not ctx.observed.create_blocked:
        actions += create_incarnation(ctx, g.index, inc, rev, missing, fresh=False)
    actions += gates(ctx, g, view, current)
    starts = rank_starts(ctx, g, view, current)
    return GroupDecision(
        actions=actions,
        view=view,
        entry=entry(view, g.restarts, g.last_failure).model_copy(
            update={"rank_starts": list(starts) or None}
        ),
        slot=GroupSlot(g.index, new=rev == ctx.target, serving=view.committed),
    )


def without_live_pods(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """No live pod: vanished, waiting to restart, still terminating, or gone."""
    actions = NO_ACTIONS
    if lost_pods(g):
        g, actions = vanished(ctx, g)
    if g.recorded_phase in DOWN_PHASES and g.last_failure is not None:
        decision = waiting_to_restart(ctx, g)
        return replace(decision, actions=actions + decision.actions)
    if g.terminating:
        entry_ = draining_entry(g.name, g.terminating, ctx.shape, g.restarts)
        return GroupDecision(actions=actions, entry=entry_, draining=True)
    return GroupDecision(actions=actions)


def decide_group(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """The step of one group (the cases of the module docstring), after the force
    deletes of its pods stuck terminating."""
    forced = force_deletes(ctx, g)
    live_pods = g.live
    if live_pods and any(p.draining for p in live_pods):
        decision = draining(ctx, g)
    elif not live_pods:
        decision = without_live_pods(ctx, g)
    else:
        decision = live(ctx, g)
    return replace(decision, actions=forced + decision.actions)
