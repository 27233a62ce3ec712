"""Rollout by whole groups (scale and revision), and the progress deadline of a rollout.

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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dwdp.api.deployment import GroupStatus
from dwdp.operator import constants as c
from dwdp.operator import naming
from dwdp.operator.actions import Actions, Event, GateChange
from dwdp.operator.constants import GroupPhase, Reason
from dwdp.operator.group.create import create_incarnation
from dwdp.operator.group.state import (
    GroupDecision,
    GroupSlot,
    RoleContext,
    draining_entry,
    entry,
)
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.times import seconds_since

__all__ = [
    "RolloutStep",
    "deadline_left_s",
    "next_index",
    "rollout",
    "rollout_step",
    "stuck_groups",
]


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


def next_index(used: Iterable[int], recorded: int | None) -> int:
    """The next group index: the recorded one (``status``), or past every index in ``used``
    if higher. Indices only grow, so a group name is never given to two lifetimes."""
    return max([recorded or 0, *(i + 1 for i in used)])


def rollout(
    ctx: RoleContext, decisions: Mapping[int, GroupDecision]
) -> tuple[Actions, dict[int, GroupDecision], tuple[int, ...]]:
    """Scale and revision rollout in whole groups (:func:`rollout_step`): drained
    groups get their gates closed (reason GroupDraining) and are listed as draining; new
    groups start at the target revision. Returns the actions, the decisions after it and
    the drained group indices."""
    slots = [d.slot for d in decisions.values() if d.slot is not None]
    step = rollout_step(
        slots,
        replicas=ctx.shape.replicas,
        max_surge=ctx.spec.rollout.max_surge,
        max_unavailable=ctx.spec.rollout.max_unavailable,
    )
    out = dict(decisions)
    gates: list[GateChange] = []
    events: list[Event] = []
    for index in step.drain:
        name = naming.group_name(ctx.owner.name, ctx.role, index)
        current = [p for p in ctx.observed.group_pods(ctx.role, index) if p.live]
        gates += [
            GateChange(p.name, False, f"{name} drained", c.GATE_REASON_DRAINING) for p in current
        ]
        view = decisions[index].view
        events.append(
            Event(
                Reason.DRAINING_GROUP,
                f"draining {ctx.role.value} group {name} (revision "
                f"{view.revision if view else None}, target {ctx.target}, replicas "
                f"{ctx.shape.replicas}): gate closed first, pods deleted next",
            )
        )
        drained = draining_entry(name, current, ctx.shape, 0) if current else None
        out[index] = GroupDecision(entry=drained, draining=True)
    actions = Actions(gates=tuple(gates), events=tuple(events))
    if step.create and not ctx.observed.create_blocked:
        used = {p.group_index for p in ctx.observed.pods if p.role is ctx.role}
        used |= {i for i, d in out.items() if d.entry is not None or d.slot is not None}
        first = next_index(used, ctx.next_index)
        for index in range(first, first + step.create):
            actions += create_incarnation(
                ctx, index, 0, ctx.target, range(ctx.shape.pods_per_group)
            )
            name = naming.group_name(ctx.owner.name, ctx.role, index)
            view = GroupView(
                name=name,
                index=index,
                incarnation=0,
                revision=ctx.target,
                phase=GroupPhase.PENDING,
                ranks_ready=0,
                ranks_total=ctx.shape.world_size,
            )
            out[index] = GroupDecision(view=view, entry=entry(view, 0, None))
    return actions, out, step.drain


def _starting(
    entries: Iterable[GroupStatus], revision: str, now: str
) -> list[tuple[GroupStatus, float]]:
    """The groups at ``revision`` still starting (neither serving nor draining), each with
    the seconds since its ``startedAt`` (those without a readable time left out)."""
    out = []
    for g in entries:
        if g.revision != revision or g.phase in (GroupPhase.SERVING, GroupPhase.DRAINING):
            continue
        since = seconds_since(g.started_at, now)
        if since is not None:
            out.append((g, since))
    return out


def deadline_left_s(
    entries: Iterable[GroupStatus], *, revision: str, deadline_s: int, now: str
) -> list[float]:
    """Seconds until each group at ``revision`` that is still starting reaches the progress
    deadline (the plan looks again then, even while the old groups keep it Ready)."""
    return [
        deadline_s - since + 1.0
        for _, since in _starting(entries, revision, now)
        if since <= deadline_s
    ]


def stuck_groups(
    entries: Iterable[GroupStatus], *, revision: str, deadline_s: int, now: str
) -> list[str]:
    """One line for each group at ``revision`` that has not committed ``deadline_s``
    seconds after its ``startedAt`` (restarts included): its name, revision, phase and
    last failure. Draining and serving groups are never stuck."""
    out = []
    for g, since in _starting(entries, revision, now):
        if since <= deadline_s:
            continue
        line = (
            f"group {g.name} (revision {g.revision}) has not committed {int(since)} s after "
            f"it started (progressDeadlineSeconds {deadline_s}): phase {g.phase}"
        )
        if g.last_failure is not None:
            line += f", last failure at {g.last_failure.phase}: {g.last_failure.message[:300]}"
        out.append(line)
    return out
