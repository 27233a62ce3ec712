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
from dwdp.api.enums import Role
from dwdp.operator import builders, naming
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


@dataclass(frozen=True, slots=True)
class Event:
    """One Kubernetes Event on the DwdpDeployment."""

    reason: Reason
    message: str
    type: str = "Normal"


@dataclass(frozen=True)
class Plan:
    """What one reconcile does, in this order: apply, create pods, gates, endpoint
    slices, deletes, status, events."""

    apply: tuple[dict[str, Any], ...] = ()
    """Non-pod children to server-side apply (ConfigMaps, Services)."""
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


def _invalid_plan(body: Mapping[str, Any], problems: list, now: str) -> Plan:
    old = body.get("status") or {}
    generation = (body.get("metadata") or {}).get("generation")
    message = "; ".join(str(p) for p in problems)[:4000]
    conds = [
        {
            "type": c.COND_READY,
            "status": "False",
            "reason": Reason.INVALID_SPEC.value,
            "message": "the spec is invalid; no child was created or changed",
        },
        {
            "type": c.COND_INVALID,
            "status": "True",
            "reason": Reason.INVALID_SPEC.value,
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
    events = (
        (Event(Reason.INVALID_SPEC, f"spec refused: {message}", "Warning"),)
        if old_msg != message
        else ()
    )
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

    creates: list[dict[str, Any]] = []
    gates: list[GateChange] = []
    deletes: list[Delete] = []
    events: list[Event] = []
    views: dict[Role, list[GroupView]] = {Role.CONTEXT: [], Role.GENERATION: []}
    serving_endpoints: list[builders.Endpoint] = []
    outdated = 0
    draining: list[dict[str, Any]] = []

    for role, shape in shapes.items():
        revision = revisions[role]
        for index in range(shape.replicas):
            name = naming.group_name(owner.name, role, index)
            all_pods = observed.group_pods(role, index)
            live = [p for p in all_pods if p.live]
            prev = recorded.get(name) or {}
            if not live:
                inc = _next_incarnation(all_pods, prev.get("incarnation"))
                rev = revision
                current: list[ObservedPod] = []
            else:
                inc = max(p.incarnation for p in live)
                current = [p for p in live if p.incarnation == inc]
                rev = current[0].revision
                for p in live:
                    if p.incarnation != inc:
                        deletes.append(Delete("Pod", p.name))
            if rev != revision:
                outdated += 1
            have = {p.pod_index for p in current}
            missing = [i for i in range(shape.pods_per_group) if i not in have]
            young = not any(p.started for p in current)
            if missing and young:
                for i in missing:
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
                        )
                    )
                if not current:
                    events.append(
                        Event(
                            Reason.CREATED_GROUP,
                            f"created {role.value} group {name} incarnation {inc} "
                            f"({shape.pods_per_group} pods, {shape.world_size} ranks, "
                            f"revision {rev})",
                        )
                    )
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
            if missing and not young and view.phase is not GroupPhase.FAILED:
                view = GroupView(
                    name=name,
                    index=index,
                    incarnation=inc,
                    revision=rev,
                    phase=GroupPhase.FAILED,
                    ranks_ready=0,
                    ranks_total=shape.world_size,
                    failure={
                        "phase": "exit",
                        "message": f"pods {missing} of incarnation {inc} are gone",
                        "reason": "PodMissing",
                    },
                )
            views[role].append(view)
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
            if view.committed and role is Role.CONTEXT:
                serving_endpoints += [
                    builders.Endpoint(p.name, p.ip) for p in current if p.ip is not None
                ]
        # Groups beyond the desired count: drain (endpoints go first, then the pods).
        extra = sorted(
            {
                p.group_index
                for p in observed.pods
                if p.role is role and p.group_index >= shape.replicas
            }
        )
        for index in extra:
            name = naming.group_name(owner.name, role, index)
            pods = observed.group_pods(role, index)
            live = [p for p in pods if p.live]
            for p in live:
                deletes.append(Delete("Pod", p.name))
            if live:
                events.append(
                    Event(
                        Reason.DELETED_GROUP,
                        f"deleting {role.value} group {name} ({len(live)} pods): beyond "
                        f"replicas {shape.replicas}",
                    )
                )
            if role is Role.CONTEXT:
                draining.append(
                    {
                        "name": name,
                        "revision": pods[0].revision,
                        "incarnation": max(p.incarnation for p in pods),
                        "phase": GroupPhase.DRAINING.value,
                        "ranksReady": 0,
                        "ranksTotal": shape.world_size,
                        "leaks": 0,
                        "restarts": int((recorded.get(name) or {}).get("restarts", 0)),
                    }
                )
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
    failed = [v.name for v in ctx_views + gen_views if v.phase is GroupPhase.FAILED]
    existing = len(ctx_views) + len(draining)
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
    all_ready = conds[0]["status"] == "True"
    phase = deployment_phase(
        all_ready=all_ready, failed=bool(failed), started=bool(observed.pods or creates)
    )
    groups = [
        v.to_status(restarts=int((recorded.get(v.name) or {}).get("restarts", 0)))
        for v in ctx_views
    ] + draining
    status: dict[str, Any] = {
        "phase": phase.value,
        "conditions": carry_transition_times(conds, old_status.get("conditions"), now),
        "observedGeneration": generation,
        "replicas": existing,
        "readyGroups": ready,
        "selector": f"{c.LABEL_DEPLOYMENT}={owner.name},{c.LABEL_ROLE}={Role.CONTEXT.value}",
        "revision": revisions[Role.CONTEXT],
        "groups": groups,
        "endpoint": (
            f"http://{naming.client_service(owner.name)}.{owner.namespace}.svc:{spec.server.port}"
        ),
    }
    if Role.GENERATION in shapes:
        status["generation"] = {"replicas": len(gen_views), "readyReplicas": gen_ready}
    busy = not all_ready or bool(creates or deletes or gates)
    return Plan(
        apply=apply,
        create_pods=tuple(creates),
        gates=tuple(gates),
        slices=slice_writes,
        delete=tuple(deletes),
        status=status if status_differs(status, old_status) else None,
        events=tuple(events),
        requeue_after_s=REQUEUE_BUSY_S if busy else REQUEUE_IDLE_S,
        groups=tuple(ctx_views + gen_views),
    )
