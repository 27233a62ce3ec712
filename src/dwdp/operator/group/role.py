"""Every group of one role, then its rollout step: the :class:`RoleDecision` the plan
composes (:func:`dwdp.operator.plan.plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dwdp.api.deployment import GroupStatus
from dwdp.operator.actions import NO_ACTIONS
from dwdp.operator.constants import GroupPhase
from dwdp.operator.group.rollout import next_index, rollout
from dwdp.operator.group.state import RoleContext, RoleDecision, group_state
from dwdp.operator.group.step import decide_group

__all__ = [
    "decide_role",
]


def decide_role(ctx: RoleContext, records: Mapping[int, Mapping[str, Any]]) -> RoleDecision:
    """Every group of one role, then its rollout step."""
    indices = sorted(
        {p.group_index for p in ctx.observed.pods if p.role is ctx.role} | set(records)
    )
    decisions = {i: decide_group(ctx, group_state(ctx, i, records.get(i) or {})) for i in indices}
    stepped = sum((d.actions for d in decisions.values()), NO_ACTIONS)
    outdated = sum(1 for d in decisions.values() if d.slot is not None and not d.slot.new)
    drain_actions, after, drained_groups = rollout(ctx, decisions)
    drained = {
        p.name for p in ctx.observed.pods if p.role is ctx.role and p.group_index in drained_groups
    }
    stepped = replace(stepped, gates=tuple(g for g in stepped.gates if g.pod not in drained))
    ordered = [after[i] for i in sorted(after)]
    entries = tuple(
        _with_start(ctx, i, entry, records.get(i) or {})
        for i in sorted(after)
        if (entry := after[i].entry) is not None
    )
    return RoleDecision(
        actions=stepped + drain_actions,
        views=tuple(d.view for d in ordered if d.view is not None),
        entries=entries,
        replicas=ctx.shape.replicas,
        draining=sum(1 for d in ordered if d.draining and d.entry is not None),
        outdated=outdated,
        next_index=next_index(
            {p.group_index for p in ctx.observed.pods if p.role is ctx.role}, ctx.next_index
        ),
    )


def _with_start(
    ctx: RoleContext, index: int, entry: GroupStatus, record: Mapping[str, Any]
) -> GroupStatus:
    """``entry`` with ``startedAt``: the recorded one while the group stays at the same
    revision (restarts keep it), else the creation of its oldest pod at that revision, else
    now (created by this plan). Draining groups get none."""
    if entry.phase == GroupPhase.DRAINING:
        return entry
    started = record.get("startedAt")
    if record.get("revision") != entry.revision or not isinstance(started, str):
        created = [
            p.created
            for p in ctx.observed.group_pods(ctx.role, index)
            if p.revision == entry.revision and p.created
        ]
        started = min(created) if created else ctx.now
    return entry.model_copy(update={"started_at": started})
