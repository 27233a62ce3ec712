"""What the group steps read and return: the role's context, one group's state (its pods and
what the status recorded about it), the decisions (with the slot the rollout counts a group
in), and the ``status.groups[]`` records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dwdp.api.deployment import DwdpDeploymentSpec, FailureRecord, GroupStatus
from dwdp.api.enums import Role
from dwdp.operator import builders, naming
from dwdp.operator.actions import NO_ACTIONS, Actions, PlanOptions
from dwdp.operator.constants import GroupPhase
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.observe import Observed, ObservedPod

__all__ = [
    "GroupDecision",
    "GroupSlot",
    "GroupState",
    "RoleContext",
    "RoleDecision",
    "draining_entry",
    "entry",
    "failure_incarnation",
    "failure_of",
    "group_state",
    "recorded_groups",
    "unready_view",
]


@dataclass(frozen=True, slots=True)
class RoleContext:
    """What every step of one role reads."""

    spec: DwdpDeploymentSpec
    owner: builders.Owner
    options: PlanOptions
    observed: Observed
    now: str
    """RFC 3339; stamps failures."""
    role: Role
    shape: builders.RoleShape
    target: str
    """The revision the spec asks for."""
    fabric_pods: bool
    """Context incarnations get a ComputeDomain."""
    rendezvous_secret: bool = False
    """Incarnations of this role get a rendezvous Secret (their ranks meet at a TCP store:
    :func:`~dwdp.operator.builders.rendezvous_secret_needed`)."""
    next_index: int | None = None
    """The recorded index of this role's next new group (None: not recorded yet)."""


@dataclass(frozen=True, slots=True)
class GroupState:
    """One group index of a role: its pods and what the status recorded about it."""

    index: int
    name: str
    pods: tuple[ObservedPod, ...]
    """Every pod of the group (all incarnations, deleting ones included)."""
    recorded_phase: str | None = None
    recorded_incarnation: int = 0
    recorded_digest: str | None = None
    restarts: int = 0
    last_failure: FailureRecord | None = None
    recorded_starts: tuple[str, ...] = ()
    """Start ids of the ranks that committed (``rankStarts``), by rank."""

    @property
    def live(self) -> list[ObservedPod]:
        return [p for p in self.pods if p.live]

    @property
    def terminating(self) -> list[ObservedPod]:
        return [p for p in self.pods if p.deleting]


@dataclass(frozen=True, slots=True)
class GroupSlot:
    """One group of a role as the rollout sees it (draining groups are left out)."""

    index: int
    new: bool
    """At the target revision (or waiting to restart at it)."""
    serving: bool
    """Committed with its gate open: it carries traffic."""


@dataclass(frozen=True, slots=True)
class GroupDecision:
    """The outcome of one group's step."""

    actions: Actions = NO_ACTIONS
    view: GroupView | None = None
    """The group's verdict; None for a draining or gone group."""
    entry: GroupStatus | None = None
    """Its ``status.groups[]`` entry; None: not listed."""
    slot: GroupSlot | None = None
    """How the rollout sees it; None: draining or gone (not counted)."""
    draining: bool = False


@dataclass(frozen=True, slots=True)
class RoleDecision:
    """The outcome of one role: actions, the groups' views and entries by index."""

    actions: Actions
    views: tuple[GroupView, ...]
    entries: tuple[GroupStatus, ...]
    replicas: int
    """Groups the spec asks for."""
    draining: int
    """Listed groups that are draining."""
    outdated: int
    """Groups at an older revision."""
    next_index: int = 0
    """The index past every group whose pods were seen (recorded in the status): an index
    is spent once a pod of it existed, so a creation the apiserver refused retries under the
    same name (and Secret) while a group that lived is never named again."""


def _failure(data: Any) -> FailureRecord | None:
    """A recorded ``lastFailure``; None when absent or unreadable."""
    if not isinstance(data, Mapping):
        return None
    try:
        return FailureRecord.model_validate(dict(data))
    except ValueError:
        return None


def failure_of(
    phase: str,
    message: str,
    reason: str,
    *,
    time: str | None = None,
    incarnation: int | None = None,
) -> FailureRecord:
    """A ``lastFailure`` (``incarnation`` is kept as an extra field: the failure is counted
    once per incarnation)."""
    data: dict[str, Any] = {"phase": phase, "message": message, "reason": reason}
    if time is not None:
        data["time"] = time
    if incarnation is not None:
        data["incarnation"] = incarnation
    return FailureRecord.model_validate(data)


def failure_incarnation(failure: FailureRecord | None) -> object:
    return (failure.model_extra or {}).get("incarnation") if failure is not None else None


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def recorded_groups(deployment: str, role: Role, status: Mapping[str, Any]) -> dict[int, dict]:
    """The recorded status entries of ``role``'s groups by index (context in
    ``status.groups``, generation in ``status.generation.groups``)."""
    if role is Role.CONTEXT:
        items = status.get("groups") or ()
    else:
        items = (status.get("generation") or {}).get("groups") or ()
    prefix = naming.group_name(deployment, role, 0)[:-1]
    out: dict[int, dict] = {}
    for g in items:
        if not isinstance(g, Mapping):
            continue
        name = str(g.get("name", ""))
        rest = name[len(prefix) :]
        if name.startswith(prefix) and rest.isdigit():
            out[int(rest)] = dict(g)
    return out


def group_state(ctx: RoleContext, index: int, record: Mapping[str, Any]) -> GroupState:
    """The state of group ``index`` from the observed pods and its recorded entry."""
    digest = record.get("layoutDigest")
    starts = record.get("rankStarts")
    return GroupState(
        index=index,
        name=naming.group_name(ctx.owner.name, ctx.role, index),
        pods=tuple(ctx.observed.group_pods(ctx.role, index)),
        recorded_phase=record.get("phase"),
        recorded_incarnation=_int(record.get("incarnation", 0)),
        recorded_digest=digest if isinstance(digest, str) else None,
        restarts=_int(record.get("restarts", 0)),
        last_failure=_failure(record.get("lastFailure")),
        recorded_starts=tuple(str(x) for x in starts) if isinstance(starts, list) else (),
    )


def entry(view: GroupView, restarts: int, last_failure: FailureRecord | None) -> GroupStatus:
    """The status entry of a group: the view, its restarts and its last failure."""
    out = view.to_model(restarts=restarts)
    if last_failure is not None:
        out = out.model_copy(update={"last_failure": last_failure})
    return out


def draining_entry(
    name: str, pods: Sequence[ObservedPod], shape: builders.RoleShape, restarts: int
) -> GroupStatus:
    """The status entry of a group whose pods are being deleted."""
    return GroupStatus(
        name=name,
        revision=pods[0].revision,
        incarnation=max(p.incarnation for p in pods),
        phase=GroupPhase.DRAINING.value,
        ranks_ready=0,
        ranks_total=shape.world_size,
        layout_digest=None,
        leaks=0,
        restarts=restarts,
    )


def unready_view(
    ctx: RoleContext,
    g: GroupState,
    inc: int,
    phase: GroupPhase,
    *,
    revision: str | None = None,
    failure: FailureRecord | None = None,
) -> GroupView:
    """The view of a group with no rank ready (``revision`` None: the target)."""
    return GroupView(
        name=g.name,
        index=g.index,
        incarnation=inc,
        revision=ctx.target if revision is None else revision,
        phase=phase,
        ranks_ready=0,
        ranks_total=ctx.shape.world_size,
        failure=failure.model_dump(mode="json", exclude_none=True) if failure else None,
    )
