"""The per-group steps of :func:`dwdp.operator.plan.plan`, each a pure function returning a
small immutable decision.

One group (a role's group index) is in exactly one case, checked in this order:

- **draining**: some live pod carries the draining gate reason: delete its pods;
- **vanished**: no live pod, and the operator removed none: the recorded phase says pods
  existed, or pods the operator never deleted are terminating (``kubectl delete pod``,
  eviction): a failure (counted once), after which the same group waits to restart;
- **waiting to restart**: no live pod, the recorded group failed: restart it after its
  backoff (or keep it failed past the restart limit);
- **terminating**: no live pod, some still terminating: list it as draining until gone;
- **failed**: the newest live incarnation failed (a pod or rank failed, pods went missing,
  pods not scheduled in time): fail together, gates down, every pod deleted;
- **live**: complete a starting gang, open or close the commit gates.

Pods stuck terminating are force-deleted in every case. The rollout (scale and revision, in
whole groups) then works on the decisions of a role. Invariant: nothing here does I/O or
reads a clock; the same inputs give the same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dwdp.api.contract import Stage
from dwdp.api.deployment import DwdpDeploymentSpec, FailureRecord, GroupStatus
from dwdp.api.enums import Role
from dwdp.operator import builders, groups, naming
from dwdp.operator import constants as c
from dwdp.operator.constants import GroupPhase, Reason
from dwdp.operator.observe import ChildKey, Observed, ObservedPod, RankReport
from dwdp.operator.status import GroupView, evaluate_group

__all__ = [
    "NO_ACTIONS",
    "Actions",
    "Delete",
    "Event",
    "GateChange",
    "GroupDecision",
    "GroupState",
    "PlanOptions",
    "RoleContext",
    "RoleDecision",
    "decide_group",
    "decide_role",
    "recorded_groups",
]

STUCK_TERMINATING_MARGIN_S = 30
"""Seconds past a pod's grace period after which a terminating pod counts as stuck."""

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
_DOWN_PHASES = frozenset({GroupPhase.RESTARTING.value, GroupPhase.FAILED.value})


# ----------------------------------------------------------------------------- values
@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Operator settings that reach the plan (not part of the spec)."""

    command: tuple[str, ...] = c.DEFAULT_WORKER_COMMAND
    """Container command of every worker pod."""
    gang: bool = True
    """Make a gang PodGroup per incarnation where the apiserver serves the API."""
    compute_domains: bool = True
    """Fabric groups across pods get a ComputeDomain per incarnation (refused where the
    API is not served); False: never (CPU test clusters, where fabric is nominal)."""
    operator_namespace: str | None = None
    """The operator's own namespace (``POD_NAMESPACE``): a NetworkPolicy that limits the
    serving ports lets its pods through (the operator reads ``/dwdp/status``)."""


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete one child (``grace_s`` None: the object's own grace period)."""

    kind: str
    name: str
    grace_s: int | None = None


@dataclass(frozen=True, slots=True)
class GateChange:
    """Set the ``dwdp.io/group-ready`` condition of one pod."""

    pod: str
    ready: bool
    message: str = ""
    reason: str | None = None
    """The condition's reason (None: committed / not committed)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One Kubernetes Event on the DwdpDeployment."""

    reason: Reason
    message: str
    type: str = "Normal"
    group: str = ""
    """The group a CreatedGroup Event reports (not posted when its creation was refused)."""


@dataclass(frozen=True, slots=True)
class Actions:
    """Cluster actions a step decided; ``a + b`` keeps the order (a's first)."""

    create: tuple[dict[str, Any], ...] = ()
    """Per-incarnation children created before its pods (rendezvous Secret, gang PodGroup,
    ComputeDomain)."""
    pods: tuple[dict[str, Any], ...] = ()
    gates: tuple[GateChange, ...] = ()
    delete: tuple[Delete, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_s: tuple[float, ...] = ()
    """Seconds after which a step wants the next look (a backoff running out)."""
    keep: frozenset[ChildKey] = frozenset()
    """Per-incarnation children the planned incarnations need (never deleted)."""

    def __add__(self, other: Actions) -> Actions:
        return Actions(
            create=self.create + other.create,
            pods=self.pods + other.pods,
            gates=self.gates + other.gates,
            delete=self.delete + other.delete,
            events=self.events + other.events,
            requeue_s=self.requeue_s + other.requeue_s,
            keep=self.keep | other.keep,
        )


NO_ACTIONS = Actions()


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
class GroupDecision:
    """The outcome of one group's step."""

    actions: Actions = NO_ACTIONS
    view: GroupView | None = None
    """The group's verdict; None for a draining or gone group."""
    entry: GroupStatus | None = None
    """Its ``status.groups[]`` entry; None: not listed."""
    slot: groups.GroupSlot | None = None
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


# ----------------------------------------------------------------------------- records
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


def _failure_incarnation(failure: FailureRecord | None) -> object:
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


def _view(
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


# ----------------------------------------------------------------------------- creation
def create_incarnation(
    ctx: RoleContext,
    index: int,
    inc: int,
    revision: str,
    pod_indices: Iterable[int],
    *,
    fresh: bool = True,
) -> Actions:
    """Pods of one incarnation, after its rendezvous Secret (without its value: the apply
    step adds a random one; Secrets are never listed, so it is always planned and the apply
    step skips one it already made), gang PodGroup and ComputeDomain (created only when not
    there yet); a CreatedGroup Event when ``fresh``."""
    group = naming.group_name(ctx.owner.name, ctx.role, index)
    create: list[dict[str, Any]] = []
    keep: set[ChildKey] = set()
    gang_name = cd_template = secret = None
    if ctx.rendezvous_secret:
        obj = builders.rendezvous_secret(
            ctx.owner, role=ctx.role, group_index=index, incarnation=inc
        )
        secret = obj["metadata"]["name"]
        create.append(obj)
    if ctx.options.gang and ctx.observed.gang:
        gang_name = naming.incarnation(group, inc)
        obj = builders.pod_group(
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            min_count=ctx.shape.pods_per_group,
        )
        keep.add(ChildKey("PodGroup", gang_name))
        if ChildKey("PodGroup", gang_name) not in ctx.observed.children:
            create.append(obj)
    if ctx.role is Role.CONTEXT and ctx.fabric_pods:
        obj = builders.compute_domain(
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            nodes=ctx.shape.pods_per_group,
        )
        key = ChildKey("ComputeDomain", obj["metadata"]["name"])
        keep.add(key)
        cd_template = naming.channel_claim_template(group, inc)
        if key not in ctx.observed.children:
            create.append(obj)
    pods = tuple(
        builders.worker_pod(
            ctx.spec,
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            pod_index=i,
            revision=revision,
            command=ctx.options.command,
            pod_group=gang_name,
            channel_template=cd_template,
            secret=secret,
        )
        for i in pod_indices
    )
    events: tuple[Event, ...] = ()
    if fresh:
        shape = ctx.shape
        message = (
            f"created {ctx.role.value} group {group} incarnation {inc} "
            f"({shape.pods_per_group} pods, {shape.world_size} ranks, revision {revision})"
        )
        events = (Event(Reason.CREATED_GROUP, message, group=group),)
    return Actions(create=tuple(create), pods=pods, events=events, keep=frozenset(keep))


# ----------------------------------------------------------------------------- steps
def _stuck_terminating(pod: ObservedPod, now: str) -> bool:
    """Deleted longer ago than its grace period plus the margin, and still there."""
    since = groups.seconds_since(pod.deleted, now)
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


def lost_pods(g: GroupState) -> bool:
    """No live pod, and the operator deleted none of them: the recorded phase says the
    incarnation's pods existed (Scheduling to Serving), or it is Pending and pods of it are
    terminating. Pods the operator deletes are recorded first (Restarting or Failed) or carry
    the draining gate reason, so a pod deleted by someone else, gone or still terminating in
    its grace period, is a failure of its group (never a drained group whose index goes)."""
    if g.live or g.recorded_phase in _DOWN_PHASES or any(p.draining for p in g.terminating):
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
        groups.EXIT_WORD,
        _lost_message(g),
        groups.FailureClass.POD_MISSING,
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
        view = _view(ctx, g, inc, GroupPhase.FAILED)
    else:
        wait = groups.backoff_s(
            g.restarts, initial_s=policy.backoff_initial_seconds, max_s=policy.backoff_max_seconds
        )
        failed_at = g.last_failure.time if g.last_failure is not None else None
        since = groups.seconds_since(failed_at, ctx.now)
        left = wait - since if since is not None else 0.0
        if g.terminating or left > 0 or ctx.observed.create_blocked:
            actions = Actions(requeue_s=(max(0.5, left),))
            view = _view(ctx, g, inc, GroupPhase.RESTARTING)
        else:
            inc = _next_incarnation(g.pods, inc)
            restarted = Event(
                Reason.RESTARTED_GROUP,
                f"restarted {ctx.role.value} group {g.name} as incarnation {inc} "
                f"(restart {g.restarts}, after {wait} s backoff, revision {ctx.target})",
            )
            actions = create_incarnation(
                ctx, g.index, inc, ctx.target, range(ctx.shape.pods_per_group)
            ) + Actions(events=(restarted,))
            view = _view(ctx, g, inc, GroupPhase.PENDING)
    return GroupDecision(
        actions=actions,
        view=view,
        entry=entry(view, g.restarts, g.last_failure),
        slot=groups.GroupSlot(g.index, new=True, serving=False),
    )


def without_live_pods(ctx: RoleContext, g: GroupState) -> GroupDecision:
    """No live pod: vanished, waiting to restart, still terminating, or gone."""
    actions = NO_ACTIONS
    if lost_pods(g):
        g, actions = vanished(ctx, g)
    if g.recorded_phase in _DOWN_PHASES and g.last_failure is not None:
        decision = waiting_to_restart(ctx, g)
        return replace(decision, actions=actions + decision.actions)
    if g.terminating:
        entry_ = draining_entry(g.name, g.terminating, ctx.shape, g.restarts)
        return GroupDecision(actions=actions, entry=entry_, draining=True)
    return GroupDecision(actions=actions)


def _detect_failure(
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
        phase, why = groups.classify_failure(
            message=bad.termination_message if bad else None,
            exit_code=bad.exit_code if bad else None,
            terminated_reason=bad.terminated_reason if bad else None,
            rank_phase=rank_phase if rank_phase != groups.EXIT_WORD else None,
            was_serving=any(p.gate for p in current)
            or g.recorded_phase == GroupPhase.SERVING.value,
        )
        return FailureRecord.model_validate({**view.failure, "phase": phase, "reason": why})
    restarted = _restarted_rank(ctx, g, view, current)
    if restarted is not None:
        return failure_of(Stage.SERVE.value, restarted, groups.FailureClass.RESTARTED_IN_PLACE)
    if missing and any(p.started for p in current):
        return failure_of(
            groups.EXIT_WORD,
            f"pods {missing} of incarnation {inc} are gone",
            groups.FailureClass.POD_MISSING,
        )
    if view.phase in (GroupPhase.SCHEDULING, GroupPhase.PENDING) and any(
        _unschedulable_too_long(p, ctx.now, timeout) for p in current
    ):
        return failure_of(
            "scheduling",
            f"pods of incarnation {inc} not scheduled within {timeout} s",
            groups.FailureClass.UNSCHEDULABLE,
        )
    return None


def _answers_by_rank(
    ctx: RoleContext, current: Sequence[ObservedPod]
) -> dict[int, RankReport] | None:
    """Every rank's ``/dwdp/status`` answer of this cycle by rank; None unless each rank of
    ``current`` was asked and answered (a committed group is asked every
    ``VERIFY_INTERVAL_S``, see :mod:`dwdp.operator.probe`)."""
    out: dict[int, RankReport] = {}
    for p in current:
        got = ctx.observed.ranks.get(p.name)
        if got is None or len(got) != p.ranks:
            return None
        for k, report in enumerate(got):
            if report is None:
                return None
            first = p.pod_index * ctx.shape.ranks_per_pod
            out[report.rank if report.rank is not None else first + k] = report
    return out


def _restarted_rank(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> str | None:
    """Why a committed group (every gate open) no longer runs the processes that committed:
    a rank answering with another start id than the recorded one, or not committed; None
    when every rank is the one that committed, or not every rank answered this cycle."""
    if not view.committed or not all(p.gate for p in current):
        return None
    answers = _answers_by_rank(ctx, current)
    if answers is None:
        return None
    recorded = g.recorded_starts if g.recorded_incarnation == view.incarnation else ()
    for rank, report in sorted(answers.items()):
        was = recorded[rank] if 0 <= rank < len(recorded) else None
        if was is not None and report.start_id is not None and report.start_id != was:
            return (
                f"rank {rank} is no longer the process that committed (start id "
                f"{report.start_id}, committed as {was}): it was restarted in place"
            )
        if not report.committed:
            return f"rank {rank} of the committed group reports {report.phase.value}"
    return None


def _rank_starts(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> tuple[str, ...]:
    """The start ids to record for a committed incarnation: the recorded ones while it is
    the same incarnation, else those its ranks answered with (every rank, in rank order)."""
    if not view.committed:
        return ()
    if g.recorded_starts and g.recorded_incarnation == view.incarnation:
        return g.recorded_starts
    answers = _answers_by_rank(ctx, current)
    if answers is None or any(r.start_id is None for r in answers.values()):
        return ()
    return tuple(str(answers[k].start_id) for k in sorted(answers))


def failed(
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
    counted = g.last_failure is not None and _failure_incarnation(g.last_failure) == inc
    if g.last_failure is not None and counted:
        last_failure = g.last_failure
    else:
        restarts += 1
        last_failure = FailureRecord.model_validate(
            {**failure.model_dump(exclude_none=True), "time": ctx.now, "incarnation": inc}
        )
    policy = ctx.spec.failure_policy
    out = policy.restart_limit is not None and restarts > policy.restart_limit
    wait = groups.backoff_s(
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
    down = _view(ctx, g, inc, phase, revision=view.revision, failure=last_failure)
    return GroupDecision(
        actions=actions,
        view=down,
        entry=entry(down, restarts, last_failure),
        slot=groups.GroupSlot(g.index, new=True, serving=False),
    )


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
    failure = _detect_failure(ctx, g, view, current)
    if failure is not None:
        decision = failed(ctx, g, view, current, failure)
        return replace(decision, actions=older + decision.actions)
    actions = older
    have = {p.pod_index for p in current}
    missing = [i for i in range(ctx.shape.pods_per_group) if i not in have]
    if missing and not any(p.started for p in current) and not ctx.observed.create_blocked:
        actions += create_incarnation(ctx, g.index, inc, rev, missing, fresh=False)
    actions += _gates(ctx, g, view, current)
    starts = _rank_starts(ctx, g, view, current)
    return GroupDecision(
        actions=actions,
        view=view,
        entry=entry(view, g.restarts, g.last_failure).model_copy(
            update={"rank_starts": list(starts) or None}
        ),
        slot=groups.GroupSlot(g.index, new=rev == ctx.target, serving=view.committed),
    )


def _gates(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> Actions:
    """Open the gates of a committed incarnation, close them on one that is no longer."""
    running = [p for p in current if not p.failed]
    changes = [
        GateChange(p.name, True, f"{g.name} committed")
        if view.committed
        else GateChange(p.name, False, f"{g.name} is {view.phase.value}")
        for p in running
        if p.gate != view.committed
    ]
    events: list[Event] = []
    if view.committed and not all(p.gate for p in current):
        events.append(
            Event(
                Reason.GATE_OPENED,
                f"{ctx.role.value} group {g.name} incarnation {view.incarnation}: every rank "
                f"committed (revision {view.revision}, layout digest {view.layout_digest}); "
                "gate opened",
            )
        )
    elif not view.committed and any(p.gate for p in running):
        events.append(
            Event(
                Reason.GATE_CLOSED,
                f"{ctx.role.value} group {g.name}: {view.phase.value}; gate closed",
                "Warning",
            )
        )
    return Actions(gates=tuple(changes), events=tuple(events))


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


def rollout(
    ctx: RoleContext, decisions: Mapping[int, GroupDecision]
) -> tuple[Actions, dict[int, GroupDecision], tuple[int, ...]]:
    """Scale and revision rollout in whole groups (:func:`groups.rollout_step`): drained
    groups get their gates closed (reason GroupDraining) and are listed as draining; new
    groups start at the target revision. Returns the actions, the decisions after it and
    the drained group indices."""
    slots = [d.slot for d in decisions.values() if d.slot is not None]
    step = groups.rollout_step(
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
        first = groups.next_index(used, ctx.next_index)
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
        next_index=groups.next_index(
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


def _next_incarnation(pods: Iterable[ObservedPod], recorded: int | None) -> int:
    seen = [p.incarnation for p in pods]
    if recorded is not None:
        seen.append(recorded)
    return max(seen) + 1 if seen else 0


def _unschedulable_too_long(pod: ObservedPod, now: str, timeout_s: int) -> bool:
    """Not bound to a node (or not started) ``timeout_s`` after its creation."""
    if pod.scheduled and pod.started:
        return False
    since = groups.seconds_since(pod.created, now)
    return since is not None and since > timeout_s
