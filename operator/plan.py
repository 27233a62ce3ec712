"""``plan(body, observed)``: the desired children of one DwdpDeployment and the actions.

The reconcile loop gathers (:class:`~dwdp.operator.observe.Observed`), calls :func:`plan`
and applies the returned :class:`Plan` in its fixed order. Invariants:

- an invalid spec plans no action on children at all (only status and one Event);
- a child is applied only when its applied-hash differs from the cluster's, pods are only
  created (live pods are never patched), and the status only when it changed: at rest the
  plan is empty;
- every decision that changes the cluster carries an Event.

The cases of one desired group (index below ``replicas``), in order:
  1. no live pod: create incarnation ``n`` (one above any incarnation seen, else 0);
  2. live pods of several incarnations: delete all but the newest;
  3. the newest incarnation lacks pods and none has started: create the missing ones
     (a gang completes); if some started, the group is Failed (issue 8 restarts it);
  4. committed and the gate closed on some pod: open it; gate open but no longer
     committed: close it.
Groups at or above ``replicas`` are drained: their pods deleted, their endpoints removed
first. Fail-together restarts, backoff and rollouts build on this (issue 8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dwdp.api.deployment import DeploymentPhase, deployment_problems, parse_deployment
from dwdp.api.enums import HandleType, Role
from dwdp.operator import builders, groups, naming
from dwdp.operator import constants as c
from dwdp.operator.constants import GroupPhase, Reason
from dwdp.operator.observe import ChildKey, Observed, ObservedPod
from dwdp.operator.status import (
    GroupView,
    carry_transition_times,
    conditions,
    deployment_phase,
    evaluate_group,
)

__all__ = [
    "Delete",
    "Event",
    "GateChange",
    "Plan",
    "PlanOptions",
    "plan",
    "status_differs",
]

REQUEUE_BUSY_S = 2.0
"""Seconds to the next look while some group is starting (the ranks are polled)."""
REQUEUE_IDLE_S = 60.0
"""Seconds to the next look at rest (reads only; pod events wake the loop sooner)."""


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


@dataclass(frozen=True)
class Plan:
    """What one reconcile does, in this order: apply, create pods, gates, endpoint
    slices, deletes, status, events."""

    apply: tuple[dict[str, Any], ...] = ()
    """Non-pod children to server-side apply (ConfigMaps, Services)."""
    create: tuple[dict[str, Any], ...] = ()
    """Per-incarnation children created before its pods (gang PodGroup, ComputeDomain)."""
    create_pods: tuple[dict[str, Any], ...] = ()
    gates: tuple[GateChange, ...] = ()
    slices: tuple[dict[str, Any], ...] = ()
    """EndpointSlices to apply (after the gates: a slice lists only committed groups)."""
    delete: tuple[Delete, ...] = ()
    status: dict[str, Any] | None = None
    """The full status to write, or None when it is unchanged."""
    events: tuple[Event, ...] = ()
    requeue_after_s: float = REQUEUE_IDLE_S
    groups: tuple[GroupView, ...] = field(default=(), compare=False)

    @property
    def writes(self) -> int:
        """Number of API writes this plan sends."""
        return (
            len(self.apply)
            + len(self.create)
            + len(self.create_pods)
            + len(self.gates)
            + len(self.slices)
            + len(self.delete)
            + (self.status is not None)
            + len(self.events)
        )


def _strip(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The part of a status the plan owns (kopf's bookkeeping left out)."""
    return {k: v for k, v in (status or {}).items() if k != "kopf"}


def _covers(old: Any, new: Any) -> bool:
    """``old`` holds everything ``new`` says: equal scalars, equally long lists covered
    item by item, and mappings whose keys in ``new`` are covered (keys only in ``old`` are
    defaults the apiserver filled in, such as a group's ``leaks: 0``)."""
    if isinstance(new, Mapping):
        return isinstance(old, Mapping) and all(
            k in old and _covers(old[k], v) for k, v in new.items()
        )
    if isinstance(new, list):
        return (
            isinstance(old, list)
            and len(old) == len(new)
            and all(_covers(o, n) for o, n in zip(old, new, strict=True))
        )
    return old == new


def status_differs(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    """True when the operator-owned part of ``old`` does not already say all of ``new``
    (apiserver defaults in ``old`` do not count as a difference)."""
    return not _covers(_strip(old), {k: v for k, v in new.items() if v is not None})


def _invalid_plan(
    body: Mapping[str, Any], problems: list, now: str, reason: Reason = Reason.INVALID_SPEC
) -> Plan:
    old = body.get("status") or {}
    generation = (body.get("metadata") or {}).get("generation")
    message = "; ".join(str(p) for p in problems)[:4000]
    conds = [
        {
            "type": c.COND_READY,
            "status": "False",
            "reason": reason.value,
            "message": "the spec is invalid; no child was created or changed",
        },
        {
            "type": c.COND_INVALID,
            "status": "True",
            "reason": reason.value,
            "message": message,
        },
    ]
    for cond in conds:
        if generation is not None:
            cond["observedGeneration"] = generation
    status = {
        **{k: v for k, v in _strip(old).items() if k not in ("conditions", "phase")},
        "phase": DeploymentPhase.FAILED.value,
        "conditions": carry_transition_times(conds, old.get("conditions"), now),
        "observedGeneration": generation,
    }
    changed = status_differs(status, old)
    old_msg = next(
        (x.get("message") for x in old.get("conditions") or () if x.get("type") == c.COND_INVALID),
        None,
    )
    events = (Event(reason, f"spec refused: {message}", "Warning"),) if old_msg != message else ()
    return Plan(status=status if changed else None, events=events)


def _next_incarnation(pods: list[ObservedPod], recorded: int | None) -> int:
    seen = [p.incarnation for p in pods]
    if recorded is not None:
        seen.append(recorded)
    return max(seen) + 1 if seen else 0


def plan(body: Mapping[str, Any], observed: Observed, *, options: PlanOptions, now: str) -> Plan:
    """Decide the children and actions for the DwdpDeployment ``body`` (the object as
    read, status included) given what was ``observed``; ``now`` (RFC 3339) stamps changed
    conditions. Never raises for a bad spec: it plans the Invalid condition instead."""
    document = {k: v for k, v in body.items() if k != "status"}  # status never invalidates
    problems = deployment_problems(document)
    if problems:
        return _invalid_plan(body, problems, now)
    dep = parse_deployment(document)
    spec = dep.spec
    owner = builders.Owner.from_body(body)
    meta = body.get("metadata") or {}
    old_status = body.get("status") or {}
    recorded = {g.get("name"): g for g in old_status.get("groups") or () if isinstance(g, Mapping)}
    shapes = builders.role_shapes(spec)
    revisions = builders.revisions(spec, command=options.command)

    del recorded  # per role below (context in status.groups, generation in generation.groups)
    fabric_pods = (
        spec.context.handle_type is HandleType.FABRIC
        and shapes[Role.CONTEXT].pods_per_group > 1
        and options.compute_domains
    )
    if fabric_pods and not observed.compute_domains:
        return _invalid_plan(
            body,
            [
                "handleType fabric across "
                f"{shapes[Role.CONTEXT].pods_per_group} pods per group needs one NVIDIA "
                "ComputeDomain (resource.nvidia.com/v1beta1 computedomains) per group "
                "incarnation for its NVLink/IMEX channel, and this cluster does not serve "
                "that API: install the NVIDIA DRA driver for GPUs, or put every rank of a "
                "group in one pod (ranksPerPod) with handleType posixFd"
            ],
            now,
            reason=Reason.COMPUTE_DOMAIN_UNAVAILABLE,
        )

    pre_creates: list[dict[str, Any]] = []
    creates: list[dict[str, Any]] = []
    gates: list[GateChange] = []
    deletes: list[Delete] = []
    events: list[Event] = []
    views: dict[Role, list[GroupView]] = {Role.CONTEXT: [], Role.GENERATION: []}
    serving_endpoints: list[builders.Endpoint] = []
    outdated = 0
    requeue: list[float] = []
    entries: dict[Role, list[dict[str, Any]]] = {}
    draining_count: dict[Role, int] = {}
    incarnation_objects: set[ChildKey] = set()

    def _create_incarnation(
        role: Role,
        shape: builders.RoleShape,
        index: int,
        inc: int,
        rev: str,
        pod_indices: Any,
        *,
        fresh: bool = True,
    ) -> None:
        """Pods of one incarnation, after its gang PodGroup and ComputeDomain."""
        group = naming.group_name(owner.name, role, index)
        gang_name = cd_template = None
        if options.gang and observed.gang:
            gang_name = naming.incarnation(group, inc)
            obj = builders.pod_group(
                owner,
                role=role,
                group_index=index,
                incarnation=inc,
                min_count=shape.pods_per_group,
            )
            key = ChildKey("PodGroup", gang_name)
            incarnation_objects.add(key)
            if key not in observed.children:
                pre_creates.append(obj)
        if role is Role.CONTEXT and fabric_pods:
            obj = builders.compute_domain(
                owner,
                role=role,
                group_index=index,
                incarnation=inc,
                nodes=shape.pods_per_group,
            )
            key = ChildKey("ComputeDomain", obj["metadata"]["name"])
            incarnation_objects.add(key)
            cd_template = naming.channel_claim_template(group, inc)
            if key not in observed.children:
                pre_creates.append(obj)
        for i in pod_indices:
            creates.append(
                builders.worker_pod(
                    spec,
                    owner,
                    role=role,
                    group_index=index,
                    incarnation=inc,
                    pod_index=i,
                    revision=rev,
                    command=options.command,
                    pod_group=gang_name,
                    channel_template=cd_template,
                )
            )
        if fresh:
            events.append(
                Event(
                    Reason.CREATED_GROUP,
                    f"created {role.value} group {group} incarnation {inc} "
                    f"({shape.pods_per_group} pods, {shape.world_size} ranks, revision {rev})",
                    group=group,
                )
            )

    for role, shape in shapes.items():
        target = revisions[role]
        role_records = _records(owner.name, role, old_status)
        role_pods = [p for p in observed.pods if p.role is role]
        indices = sorted({p.group_index for p in role_pods} | set(role_records))
        slots: list[groups.GroupSlot] = []
        role_views: dict[int, GroupView] = {}
        role_entries: dict[int, dict[str, Any]] = {}
        draining_idx: set[int] = set()
        for index in indices:
            name = naming.group_name(owner.name, role, index)
            all_pods = observed.group_pods(role, index)
            live = [p for p in all_pods if p.live]
            prev = role_records.get(index) or {}
            restarts = int(prev.get("restarts", 0))
            last_failure = prev.get("lastFailure")
            for p in all_pods:  # stuck Terminating: force the delete (the kubelet is gone)
                if p.deleting and _stuck_terminating(p, now):
                    deletes.append(Delete("Pod", p.name, grace_s=0))
                    events.append(
                        Event(
                            Reason.FORCE_DELETED,
                            f"pod {p.name} stuck terminating since {p.deleted}; "
                            "deleted with grace period 0",
                            "Warning",
                        )
                    )
            if live and any(p.draining for p in live):
                # Draining: the gates were closed (reason GroupDraining); now delete.
                for p in live:
                    deletes.append(Delete("Pod", p.name, grace_s=p.grace_s))
                events.append(
                    Event(
                        Reason.DELETED_GROUP,
                        f"deleting {role.value} group {name} ({len(live)} pods, gate closed)",
                    )
                )
                draining_idx.add(index)
                role_entries[index] = _draining_entry(name, live, shape, restarts)
                continue
            if not live:
                terminating = [p for p in all_pods if p.deleting]
                waiting = prev.get("phase") in (
                    GroupPhase.RESTARTING.value,
                    GroupPhase.FAILED.value,
                ) and isinstance(last_failure, Mapping)
                vanished = prev.get("phase") in _RUNNING_PHASES and not terminating
                if vanished:  # every pod of a running incarnation is gone: a failure
                    restarts += 1
                    last_failure = {
                        "phase": "exit",
                        "message": f"every pod of incarnation {prev.get('incarnation', 0)} is gone",
                        "reason": groups.FailureClass.POD_MISSING,
                        "time": now,
                        "incarnation": int(prev.get("incarnation", 0)),
                    }
                    events.append(
                        Event(
                            Reason.GROUP_FAILED,
                            f"{role.value} group {name}: {last_failure['message']}; "
                            f"restart {restarts} follows its backoff",
                            "Warning",
                        )
                    )
                    prev = {**prev, "phase": GroupPhase.RESTARTING.value}
                    waiting = True
                if not waiting:
                    if terminating:
                        draining_idx.add(index)
                        role_entries[index] = _draining_entry(name, terminating, shape, restarts)
                    continue
                inc = int(prev.get("incarnation", 0))
                limit = spec.failure_policy.restart_limit
                if limit is not None and restarts > limit:
                    view = GroupView(
                        name=name,
                        index=index,
                        incarnation=inc,
                        revision=target,
                        phase=GroupPhase.FAILED,
                        ranks_ready=0,
                        ranks_total=shape.world_size,
                    )
                else:
                    wait = groups.backoff_s(
                        restarts,
                        initial_s=spec.failure_policy.backoff_initial_seconds,
                        max_s=spec.failure_policy.backoff_max_seconds,
                    )
                    since = groups.seconds_since(last_failure.get("time"), now)
                    left = wait - since if since is not None else 0.0
                    if terminating or left > 0 or observed.create_blocked:
                        requeue.append(max(0.5, left))
                        view = GroupView(
                            name=name,
                            index=index,
                            incarnation=inc,
                            revision=target,
                            phase=GroupPhase.RESTARTING,
                            ranks_ready=0,
                            ranks_total=shape.world_size,
                        )
                    else:
                        inc = _next_incarnation(all_pods, inc)
                        _create_incarnation(
                            role, shape, index, inc, target, range(shape.pods_per_group)
                        )
                        events.append(
                            Event(
                                Reason.RESTARTED_GROUP,
                                f"restarted {role.value} group {name} as incarnation {inc} "
                                f"(restart {restarts}, after {wait} s backoff, revision {target})",
                            )
                        )
                        view = GroupView(
                            name=name,
                            index=index,
                            incarnation=inc,
                            revision=target,
                            phase=GroupPhase.PENDING,
                            ranks_ready=0,
                            ranks_total=shape.world_size,
                        )
                role_views[index] = view
                role_entries[index] = _entry(view, restarts, last_failure)
                slots.append(groups.GroupSlot(index, new=True, serving=False))
                continue
            inc = max(p.incarnation for p in live)
            current = [p for p in live if p.incarnation == inc]
            rev = current[0].revision
            for p in live:
                if p.incarnation != inc:
                    deletes.append(Delete("Pod", p.name))
            have = {p.pod_index for p in current}
            missing = [i for i in range(shape.pods_per_group) if i not in have]
            young = not any(p.started for p in current)
            view = evaluate_group(
                name=name,
                index=index,
                incarnation=inc,
                revision=rev,
                pods=current,
                pods_expected=shape.pods_per_group,
                ranks_expected=shape.world_size,
                reports=observed.ranks,
                previous_digest=prev.get("layoutDigest"),
            )
            failure = view.failure
            if view.phase is GroupPhase.FAILED and failure is not None:
                bad = next((p for p in current if p.failed), None)
                phase, why = groups.classify_failure(
                    message=bad.termination_message if bad else None,
                    exit_code=bad.exit_code if bad else None,
                    terminated_reason=bad.terminated_reason if bad else None,
                    rank_phase=failure.get("phase") if failure.get("phase") != "exit" else None,
                    was_serving=any(p.gate for p in current)
                    or prev.get("phase") == GroupPhase.SERVING.value,
                )
                failure = {**failure, "phase": phase, "reason": why}
            elif missing and not young:
                failure = {
                    "phase": "exit",
                    "message": f"pods {missing} of incarnation {inc} are gone",
                    "reason": groups.FailureClass.POD_MISSING,
                }
            elif view.phase in (GroupPhase.SCHEDULING, GroupPhase.PENDING) and any(
                _unschedulable_too_long(p, now, spec.failure_policy.scheduling_timeout_seconds)
                for p in current
            ):
                failure = {
                    "phase": "scheduling",
                    "message": f"pods of incarnation {inc} not scheduled within "
                    f"{spec.failure_policy.scheduling_timeout_seconds} s",
                    "reason": groups.FailureClass.UNSCHEDULABLE,
                }
            else:
                failure = None
            if failure is not None:
                # Fail together: gates down, the whole incarnation deleted, restart later.
                counted = (
                    isinstance(last_failure, Mapping) and last_failure.get("incarnation") == inc
                )
                if not counted:
                    restarts += 1
                    last_failure = {**failure, "time": now, "incarnation": inc}
                for p in current:
                    if p.gate and not p.failed:
                        gates.append(GateChange(p.name, False, f"{name} is Failed"))
                    deletes.append(Delete("Pod", p.name))
                limit = spec.failure_policy.restart_limit
                out = limit is not None and restarts > limit
                wait = groups.backoff_s(
                    restarts,
                    initial_s=spec.failure_policy.backoff_initial_seconds,
                    max_s=spec.failure_policy.backoff_max_seconds,
                )
                if not counted:
                    events.append(
                        Event(
                            Reason.GROUP_FAILED,
                            f"{role.value} group {name} incarnation {inc} failed at "
                            f"{last_failure['phase']} ({last_failure['reason']}): "
                            f"{last_failure['message']}; "
                            + (
                                f"restart limit {limit} reached, it stays failed"
                                if out
                                else f"whole incarnation deleted, restart {restarts} in {wait} s"
                            ),
                            "Warning",
                        )
                    )
                requeue.append(float(wait))
                view = GroupView(
                    name=name,
                    index=index,
                    incarnation=inc,
                    revision=rev,
                    phase=GroupPhase.FAILED if out else GroupPhase.RESTARTING,
                    ranks_ready=0,
                    ranks_total=shape.world_size,
                    failure=last_failure,
                )
                role_views[index] = view
                role_entries[index] = _entry(view, restarts, last_failure)
                slots.append(groups.GroupSlot(index, new=True, serving=False))
                continue
            if missing and young and not observed.create_blocked:
                _create_incarnation(role, shape, index, inc, rev, missing, fresh=not current)
            for p in current:
                if p.failed:
                    continue
                if view.committed and not p.gate:
                    gates.append(GateChange(p.name, True, f"{name} committed"))
                elif not view.committed and p.gate:
                    gates.append(GateChange(p.name, False, f"{name} is {view.phase.value}"))
            if view.committed and not all(p.gate for p in current):
                events.append(
                    Event(
                        Reason.GATE_OPENED,
                        f"{role.value} group {name} incarnation {inc}: every rank committed "
                        f"(revision {rev}, layout digest {view.layout_digest}); gate opened",
                    )
                )
            elif not view.committed and any(p.gate for p in current if not p.failed):
                events.append(
                    Event(
                        Reason.GATE_CLOSED,
                        f"{role.value} group {name}: {view.phase.value}; gate closed",
                        "Warning",
                    )
                )
            role_views[index] = view
            role_entries[index] = _entry(view, restarts, last_failure)
            slots.append(groups.GroupSlot(index, new=rev == target, serving=view.committed))

        # Rollout and scale, counted in whole groups.
        step = groups.rollout_step(
            slots,
            replicas=shape.replicas,
            max_surge=spec.rollout.max_surge,
            max_unavailable=spec.rollout.max_unavailable,
        )
        outdated += sum(1 for s in slots if not s.new)
        drained_pods = {p.name for p in role_pods if p.group_index in step.drain}
        gates[:] = [g for g in gates if g.pod not in drained_pods]
        for index in step.drain:
            name = naming.group_name(owner.name, role, index)
            current_pods = [p for p in observed.group_pods(role, index) if p.live]
            for p in current_pods:
                gates.append(GateChange(p.name, False, f"{name} drained", c.GATE_REASON_DRAINING))
            events.append(
                Event(
                    Reason.DRAINING_GROUP,
                    f"draining {role.value} group {name} (revision "
                    f"{role_views[index].revision}, target {target}, replicas "
                    f"{shape.replicas}): gate closed first, pods deleted next",
                )
            )
            draining_idx.add(index)
            if current_pods:
                role_entries[index] = _draining_entry(name, current_pods, shape, 0)
            else:
                role_entries.pop(index, None)
            role_views.pop(index, None)
        if step.create and not observed.create_blocked:
            used = {p.group_index for p in role_pods} | set(role_entries)
            for index in groups.free_indices(used, step.create):
                inc = 0
                _create_incarnation(
                    role, shape, index, inc, target, range(shape.pods_per_group), fresh=True
                )
                view = GroupView(
                    name=naming.group_name(owner.name, role, index),
                    index=index,
                    incarnation=inc,
                    revision=target,
                    phase=GroupPhase.PENDING,
                    ranks_ready=0,
                    ranks_total=shape.world_size,
                )
                role_views[index] = view
                role_entries[index] = _entry(view, 0, None)
        for index in sorted(role_views):
            view = role_views[index]
            views[role].append(view)
            if view.committed and role is Role.CONTEXT:
                serving_endpoints += [
                    builders.Endpoint(p.name, p.ip)
                    for p in observed.group_pods(role, index)
                    if p.live and p.incarnation == view.incarnation and p.ip is not None
                ]
        entries[role] = [role_entries[i] for i in sorted(role_entries)]
        draining_count[role] = sum(1 for i in draining_idx if i in role_entries)
    # Roles that the spec no longer runs (generation removed): drain every pod.
    for p in observed.pods:
        if p.role not in shapes and p.live:
            deletes.append(Delete("Pod", p.name))

    # Static children: configs of the revisions in use, services, endpoint slices.
    wanted: list[dict[str, Any]] = []
    in_use = {(p.role, p.revision) for p in observed.pods if p.live}
    in_use |= {(role, revisions[role]) for role in shapes}
    in_use |= {
        (Role(pod["metadata"]["labels"][c.LABEL_ROLE]), pod["metadata"]["labels"][c.LABEL_REVISION])
        for pod in creates
    }
    for role, rev in sorted(in_use):
        if role in shapes and rev == revisions[role]:
            wanted.append(builders.config_map(spec, owner, role, rev))
    for role in shapes:
        wanted.append(builders.headless_service(spec, owner, role))
    wanted.append(builders.client_service(spec, owner))
    slices = builders.endpoint_slices(spec, owner, serving_endpoints)
    keep = {ChildKey(o["kind"], o["metadata"]["name"]) for o in wanted + slices}
    keep |= {
        ChildKey("ConfigMap", naming.config_map(owner.name, role, rev)) for role, rev in in_use
    }
    keep |= incarnation_objects
    for p in observed.pods:  # an incarnation's PodGroup and ComputeDomain live as its pods do
        inc_name = naming.incarnation(
            naming.group_name(owner.name, p.role, p.group_index), p.incarnation
        )
        keep |= {ChildKey("PodGroup", inc_name), ChildKey("ComputeDomain", inc_name)}
    if observed.create_blocked:
        # A refused creation waits for its retry: keep the PodGroups and ComputeDomains it
        # made (the retry reuses them) rather than delete and re-create them every attempt.
        keep |= {k for k in observed.children if k.kind in ("PodGroup", "ComputeDomain")}
    apply = tuple(
        o
        for o in wanted
        if observed.children.get(ChildKey(o["kind"], o["metadata"]["name"]), "")
        != builders.applied_hash(o)
    )
    slice_writes = tuple(
        o
        for o in slices
        if observed.children.get(ChildKey(o["kind"], o["metadata"]["name"]), "")
        != builders.applied_hash(o)
    )
    for key in sorted(observed.children, key=lambda k: (k.kind, k.name)):
        if key not in keep:
            deletes.append(Delete(key.kind, key.name))

    # Status.
    ctx_views = views[Role.CONTEXT]
    gen_views = views[Role.GENERATION]
    ready = sum(1 for v in ctx_views if v.committed)
    gen_ready = sum(1 for v in gen_views if v.committed)
    down = (GroupPhase.FAILED, GroupPhase.RESTARTING)
    failed = [v.name for v in ctx_views + gen_views if v.phase in down]
    existing = len(ctx_views) + draining_count.get(Role.CONTEXT, 0)
    desired = shapes[Role.CONTEXT].replicas
    gen_desired = shapes[Role.GENERATION].replicas if Role.GENERATION in shapes else 0
    generation = meta.get("generation")
    conds = conditions(
        desired=desired,
        ready=ready,
        existing=existing,
        failed=failed,
        outdated=outdated,
        generation_desired=gen_desired,
        generation_ready=gen_ready,
        observed_generation=generation,
    )
    if observed.create_error:
        conds.append(
            {
                "type": c.COND_REPLICA_FAILURE,
                "status": "True",
                "reason": Reason.FAILED_CREATE.value,
                "message": observed.create_error[:4000],
                **({"observedGeneration": generation} if generation is not None else {}),
            }
        )
    all_ready = conds[0]["status"] == "True"
    phase = deployment_phase(
        all_ready=all_ready, failed=bool(failed), started=bool(observed.pods or creates)
    )
    status: dict[str, Any] = {
        "phase": phase.value,
        "conditions": carry_transition_times(conds, old_status.get("conditions"), now),
        "observedGeneration": generation,
        "replicas": existing,
        "readyGroups": ready,
        "selector": f"{c.LABEL_DEPLOYMENT}={owner.name},{c.LABEL_ROLE}={Role.CONTEXT.value}",
        "revision": revisions[Role.CONTEXT],
        "groups": entries.get(Role.CONTEXT, []),
        "endpoint": (
            f"http://{naming.client_service(owner.name)}.{owner.namespace}.svc:{spec.server.port}"
        ),
    }
    if Role.GENERATION in shapes:
        status["generation"] = {"replicas": len(gen_views), "readyReplicas": gen_ready}
        kept = [  # generation entries only where they carry restart bookkeeping
            e for e in entries.get(Role.GENERATION, []) if e.get("restarts") or e.get("lastFailure")
        ]
        if kept:
            status["generation"]["groups"] = kept
    busy = not all_ready or bool(creates or deletes or gates)
    delay = REQUEUE_BUSY_S if busy else REQUEUE_IDLE_S
    if requeue:
        delay = min(REQUEUE_IDLE_S, max(min(requeue), 0.5))
        if busy and not (creates or deletes or gates):
            delay = min(delay, REQUEUE_BUSY_S)
    return Plan(
        apply=apply,
        create=tuple(pre_creates),
        create_pods=tuple(creates),
        gates=tuple(gates),
        slices=slice_writes,
        delete=tuple(deletes),
        status=status if status_differs(status, old_status) else None,
        events=tuple(events),
        requeue_after_s=delay,
        groups=tuple(ctx_views + gen_views),
    )


def _records(deployment: str, role: Role, status: Mapping[str, Any]) -> dict[int, dict]:
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


def _entry(view: GroupView, restarts: int, last_failure: Any) -> dict[str, Any]:
    """The status entry of a group: the view, its restarts and its last failure."""
    out = view.to_status(restarts=restarts)
    if isinstance(last_failure, Mapping):
        out["lastFailure"] = dict(last_failure)
    return out


def _draining_entry(
    name: str, pods: list[ObservedPod], shape: builders.RoleShape, restarts: int
) -> dict[str, Any]:
    return {
        "name": name,
        "revision": pods[0].revision,
        "incarnation": max(p.incarnation for p in pods),
        "phase": GroupPhase.DRAINING.value,
        "ranksReady": 0,
        "ranksTotal": shape.world_size,
        "leaks": 0,
        "restarts": restarts,
    }


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

STUCK_TERMINATING_MARGIN_S = 30
"""Seconds past a pod's grace period after which a terminating pod counts as stuck."""


def _stuck_terminating(pod: ObservedPod, now: str) -> bool:
    """Deleted longer ago than its grace period plus the margin, and still there."""
    since = groups.seconds_since(pod.deleted, now)
    grace = pod.grace_s if pod.grace_s is not None else 30
    return since is not None and since > grace + STUCK_TERMINATING_MARGIN_S


def _unschedulable_too_long(pod: ObservedPod, now: str, timeout_s: int) -> bool:
    """Not bound to a node (or not started) ``timeout_s`` after its creation."""
    if pod.scheduled and pod.started:
        return False
    since = groups.seconds_since(pod.created, now)
    return since is not None and since > timeout_s
