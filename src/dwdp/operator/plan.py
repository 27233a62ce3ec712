"""``plan(body, observed)``: the desired children of one DwdpDeployment and the actions.

The reconcile loop gathers (:class:`~dwdp.operator.observe.Observed`), calls :func:`plan`
and applies the returned :class:`Plan` in its fixed order. Invariants:

- an invalid spec plans no action on children at all (only status and one Event);
- a child is applied only when its applied-hash differs from the cluster's, pods are only
  created (live pods are never patched), and the status only when it changed: at rest the
  plan is empty;
- every decision that changes the cluster carries an Event.

:func:`plan` is a composition: refuse an invalid spec; per role, one named step per group
(:mod:`dwdp.operator.group`: draining, vanished, failed, waiting to restart, live) and the
rollout step; then the static children (configs, services, endpoint slices) and what to
delete; then the status, built through the API's status models
(:class:`~dwdp.api.deployment.DwdpDeploymentStatus`), and the time of the next look.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dwdp.api.deployment import (
    DeploymentPhase,
    DwdpDeploymentSpec,
    deployment_problems,
    parse_deployment,
)
from dwdp.api.enums import HandleType, Role
from dwdp.api.errors import Problem
from dwdp.operator import builders, conditions, naming, router
from dwdp.operator import constants as c
from dwdp.operator.actions import NO_ACTIONS, Actions, Delete, Event, GateChange, PlanOptions
from dwdp.operator.constants import Reason
from dwdp.operator.group.role import decide_role
from dwdp.operator.group.rollout import deadline_left_s, stuck_groups
from dwdp.operator.group.state import RoleContext, RoleDecision, recorded_groups
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.observe import ChildKey, Observed, ObservedPod
from dwdp.operator.status import deployment_status, with_router

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
REQUEUE_IDLE_S = 30.0
"""Seconds to the next look at rest (reads only: the pods, and every committed rank's
``/dwdp/status`` once per :data:`~dwdp.operator.probe.VERIFY_INTERVAL_S`; pod events wake
the loop sooner)."""


@dataclass(frozen=True)
class Plan:
    """What one reconcile does, in this order: apply, create pods, gates, endpoint
    slices, deletes, status, events."""

    apply: tuple[dict[str, Any], ...] = ()
    """Non-pod children to server-side apply (ConfigMaps, Services)."""
    create: tuple[dict[str, Any], ...] = ()
    """Per-incarnation children created before its pods (rendezvous Secret without its
    value, gang PodGroup, ComputeDomain)."""
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
    body: Mapping[str, Any],
    problems: Sequence[Problem | str],
    now: str,
    reason: Reason = Reason.INVALID_SPEC,
) -> Plan:
    old = body.get("status") or {}
    generation = (body.get("metadata") or {}).get("generation")
    message = "; ".join(str(p) for p in problems)[: conditions.MESSAGE_LIMIT]
    conds = conditions.invalid_conditions(reason, message, generation)
    status = {
        **{k: v for k, v in _strip(old).items() if k not in ("conditions", "phase")},
        "phase": DeploymentPhase.FAILED.value,
        "conditions": conditions.carry_transition_times(conds, old.get("conditions"), now),
        "observedGeneration": generation,
    }
    changed = status_differs(status, old)
    old_msg = next(
        (x.get("message") for x in old.get("conditions") or () if x.get("type") == c.COND_INVALID),
        None,
    )
    events = (Event(reason, f"spec refused: {message}", "Warning"),) if old_msg != message else ()
    return Plan(status=status if changed else None, events=events)


def _fabric_problem(shape: builders.RoleShape) -> str:
    return (
        f"handleType fabric across {shape.pods_per_group} pods per group needs one NVIDIA "
        "ComputeDomain (resource.nvidia.com/v1beta1 computedomains) per group "
        "incarnation for its NVLink/IMEX channel, and this cluster does not serve "
        "that API: install the NVIDIA DRA driver for GPUs, or put every rank of a "
        "group in one pod (ranksPerPod) with handleType posixFd"
    )


def plan(body: Mapping[str, Any], observed: Observed, *, options: PlanOptions, now: str) -> Plan:
    """Decide the children and actions for the DwdpDeployment ``body`` (the object as
    read, status included) given what was ``observed``; ``now`` (RFC 3339) stamps changed
    conditions. Never raises for a bad spec: it plans the Invalid condition instead."""
    document = {k: v for k, v in body.items() if k != "status"}  # status never invalidates
    problems = deployment_problems(document)
    if problems:
        return _invalid_plan(body, problems, now)
    spec = parse_deployment(document).spec
    owner = builders.Owner.from_body(body)
    old_status = body.get("status") or {}
    shapes = builders.role_shapes(spec)
    revisions = builders.revisions(spec, command=options.command)
    context = shapes[Role.CONTEXT]
    fabric_pods = (
        spec.context.handle_type is HandleType.FABRIC
        and context.pods_per_group > 1
        and options.compute_domains
    )
    if fabric_pods and not observed.compute_domains:
        problem = _fabric_problem(context)
        return _invalid_plan(body, [problem], now, reason=Reason.COMPUTE_DOMAIN_UNAVAILABLE)
    roles: dict[Role, RoleDecision] = {}
    for role, shape in shapes.items():
        ctx = RoleContext(
            spec=spec,
            owner=owner,
            options=options,
            observed=observed,
            now=now,
            role=role,
            shape=shape,
            target=revisions[role],
            fabric_pods=fabric_pods,
            rendezvous_secret=builders.rendezvous_secret_needed(spec, role),
            next_index=_recorded_next_index(role, old_status),
        )
        roles[role] = decide_role(ctx, recorded_groups(owner.name, role, old_status))
    actions = sum((d.actions for d in roles.values()), NO_ACTIONS)
    orphans = tuple(  # roles the spec no longer runs (generation removed): drain every pod
        Delete("Pod", p.name) for p in observed.pods if p.role not in shapes and p.live
    )
    actions += Actions(delete=orphans)
    actions += Actions(delete=_secret_deletes(observed, actions.delete))
    servers = _router_servers(spec, observed, roles)
    apply, slices, stale = _children(
        spec, owner, observed, roles, actions, revisions, options, servers
    )
    actions += Actions(delete=stale)
    stuck, left = _progress(spec, roles, revisions, now)
    actions += Actions(requeue_s=tuple(left))
    status = deployment_status(spec, owner, body, observed, roles, actions, revisions, now, stuck)
    status = with_router(status, spec, owner, observed, servers, body, now)
    all_ready = status["conditions"][0]["status"] == "True"
    return Plan(
        apply=apply,
        create=actions.create,
        create_pods=actions.pods,
        gates=actions.gates,
        slices=slices,
        delete=actions.delete,
        status=status if status_differs(status, old_status) else None,
        events=actions.events,
        requeue_after_s=_requeue_after(actions, all_ready),
        groups=tuple(v for d in roles.values() for v in d.views),
    )


def _recorded_next_index(role: Role, status: Mapping[str, Any]) -> int | None:
    """``status.nextGroupIndex`` (context) or ``status.generation.nextIndex``."""
    if role is Role.CONTEXT:
        value = status.get("nextGroupIndex")
    else:
        value = (status.get("generation") or {}).get("nextIndex")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _secret_deletes(observed: Observed, deletes: Sequence[Delete]) -> tuple[Delete, ...]:
    """The rendezvous Secrets to delete in the same step as their incarnation: those whose
    pods (the ones mounting them) this plan deletes, leaving none of them live. Secrets are
    never listed (the operator cannot read them), so the pods name them; a Secret whose
    pods vanished unseen is deleted by the vanished step, and every one goes with the
    deployment through its owner reference."""
    gone = {d.name for d in deletes if d.kind == "Pod"}
    by_secret: dict[str, list[ObservedPod]] = {}
    for p in observed.pods:
        if p.secret is not None:
            by_secret.setdefault(p.secret, []).append(p)
    return tuple(
        Delete("Secret", name)
        for name, members in sorted(by_secret.items())
        if any(p.name in gone for p in members)
        and all(p.name in gone or not p.live for p in members)
    )


def _committed_pods(
    observed: Observed, decision: RoleDecision | None, role: Role
) -> list[ObservedPod]:
    """The live pods, with an address, of the committed incarnation of every committed
    group (context) or server (generation) of ``role``: the ones that take traffic."""
    if decision is None:
        return []
    return [
        p
        for view in decision.views
        if view.committed
        for p in observed.group_pods(role, view.index)
        if p.live and p.incarnation == view.incarnation and p.ip is not None
    ]


def _router_servers(
    spec: DwdpDeploymentSpec, observed: Observed, roles: Mapping[Role, RoleDecision]
) -> router.RouterServers:
    """Every rank URL of the committed context groups and the ready generation servers
    ([Note: static router URLs] in :mod:`dwdp.operator.router`)."""
    port = spec.server.port
    return router.RouterServers(
        prefill=router.rank_urls(
            _committed_pods(observed, roles.get(Role.CONTEXT), Role.CONTEXT), base_port=port
        ),
        decode=router.rank_urls(
            _committed_pods(observed, roles.get(Role.GENERATION), Role.GENERATION),
            base_port=port,
        ),
    )


def _children(
    spec: DwdpDeploymentSpec,
    owner: builders.Owner,
    observed: Observed,
    roles: Mapping[Role, RoleDecision],
    actions: Actions,
    revisions: Mapping[Role, str],
    options: PlanOptions,
    servers: router.RouterServers,
) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...], tuple[Delete, ...]]:
    """The static children: ``(apply, slices, deletes)``: the configs of the revisions in
    use, the services, the NetworkPolicies, the router (routing to ``servers``) and the
    endpoint slices whose applied-hash differs, and every child nothing needs any more."""
    in_use = {(p.role, p.revision) for p in observed.pods if p.live}
    in_use |= {(role, revisions[role]) for role in roles}
    in_use |= {
        (Role(pod["metadata"]["labels"][c.LABEL_ROLE]), pod["metadata"]["labels"][c.LABEL_REVISION])
        for pod in actions.pods
    }
    wanted = [
        builders.config_map(spec, owner, role, rev)
        for role, rev in sorted(in_use)
        if role in roles and rev == revisions[role] and builders.reads_launch_config(spec, role)
    ]
    wanted += [builders.headless_service(spec, owner, role) for role in roles]
    wanted.append(builders.client_service(spec, owner))
    wanted += _network_policies(spec, owner, observed, roles, actions, options)
    wanted += router.router_objects(spec, owner, servers)
    serving = [
        builders.Endpoint(p.name, p.ip)
        for p in _committed_pods(observed, roles[Role.CONTEXT], Role.CONTEXT)
        if p.ip is not None
    ]
    slices = builders.endpoint_slices(spec, owner, serving)
    keep = {ChildKey(o["kind"], o["metadata"]["name"]) for o in wanted + slices}
    keep |= {ChildKey("ConfigMap", naming.config_map(owner.name, r, rev)) for r, rev in in_use}
    keep |= actions.keep
    for p in observed.pods:  # an incarnation's PodGroup and ComputeDomain live as its pods do
        group = naming.group_name(owner.name, p.role, p.group_index)
        name = naming.incarnation(group, p.incarnation)
        keep |= {ChildKey("PodGroup", name), ChildKey("ComputeDomain", name)}
    if observed.create_blocked:
        # A refused creation waits for its retry: keep the PodGroups, ComputeDomains and
        # group NetworkPolicies it made (the retry reuses them) rather than delete and
        # re-create them every attempt.
        kinds = ("PodGroup", "ComputeDomain", "NetworkPolicy")
        keep |= {k for k in observed.children if k.kind in kinds}

    def changed(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        return tuple(
            o
            for o in objs
            if observed.children.get(ChildKey(o["kind"], o["metadata"]["name"]), "")
            != builders.applied_hash(o)
        )

    stale = tuple(
        Delete(k.kind, k.name)
        for k in sorted(observed.children, key=lambda k: (k.kind, k.name))
        if k not in keep
    )
    return changed(wanted), changed(slices), stale


def _network_policies(
    spec: DwdpDeploymentSpec,
    owner: builders.Owner,
    observed: Observed,
    roles: Mapping[Role, RoleDecision],
    actions: Actions,
    options: PlanOptions,
) -> list[dict[str, Any]]:
    """The serving NetworkPolicy, the KV-transfer one (with generation servers) and one per
    group that has or gets pods (none when
    ``spec.networkPolicy.enabled`` is false). They are applied before this plan's pods
    are created, so a new group's ranks reach each other from their first packet."""
    if not spec.network_policy.enabled:
        return []
    names = {naming.group_name(owner.name, p.role, p.group_index) for p in observed.pods}
    names |= {v.name for d in roles.values() for v in d.views}
    names |= {pod["metadata"]["labels"][c.LABEL_GROUP] for pod in actions.pods}
    serving = builders.serving_policy(spec, owner, operator_namespace=options.operator_namespace)
    kv = [builders.kv_transfer_policy(owner)] if spec.generation is not None else []
    return [serving, *kv, *(builders.group_policy(owner, g) for g in sorted(names))]


def _progress(
    spec: DwdpDeploymentSpec,
    roles: Mapping[Role, RoleDecision],
    revisions: Mapping[Role, str],
    now: str,
) -> tuple[list[str], list[float]]:
    """``(stuck, left)``: a line for each current-revision group past
    ``rollout.progressDeadlineSeconds``, and the seconds until each other starting one
    gets there (the next look is then at the latest, even while old groups keep it Ready)."""
    stuck: list[str] = []
    left: list[float] = []
    deadline = spec.rollout.progress_deadline_seconds
    for role, decision in roles.items():
        rev = revisions[role]
        stuck += stuck_groups(decision.entries, revision=rev, deadline_s=deadline, now=now)
        left += deadline_left_s(decision.entries, revision=rev, deadline_s=deadline, now=now)
    return stuck, left


def _requeue_after(actions: Actions, all_ready: bool) -> float:
    """Seconds to the next look: soon while something changes or starts, at the earliest
    backoff a step waits for, else at rest."""
    changing = bool(actions.pods or actions.delete or actions.gates)
    busy = not all_ready or changing
    delay = REQUEUE_BUSY_S if busy else REQUEUE_IDLE_S
    if actions.requeue_s:
        delay = min(REQUEUE_IDLE_S, max(min(actions.requeue_s), 0.5))
        if busy and not changing:
            delay = min(delay, REQUEUE_BUSY_S)
    return delay
