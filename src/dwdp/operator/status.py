"""The status block of a DwdpDeployment (``status``), built through the API's status models
(:class:`~dwdp.api.deployment.DwdpDeploymentStatus`) from the role decisions of
:func:`dwdp.operator.plan.plan`: the phase, the conditions (made in
:mod:`dwdp.operator.conditions`), the group counts and entries, the generation servers and the
router. Invariant: the same inputs give the same status, byte for byte (no clock inside;
``now`` is an argument and an unchanged condition keeps its old ``lastTransitionTime``), so a
deployment at rest is never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dwdp.api.deployment import (
    Condition,
    DeploymentPhase,
    DwdpDeploymentSpec,
    DwdpDeploymentStatus,
    GenerationStatus,
    RouterStatus,
)
from dwdp.api.enums import Role
from dwdp.operator import builders, conditions, naming, router
from dwdp.operator import constants as c
from dwdp.operator.actions import Actions
from dwdp.operator.constants import GroupPhase
from dwdp.operator.group.state import RoleDecision
from dwdp.operator.observe import Observed

__all__ = ["deployment_phase", "deployment_status", "with_router"]


def deployment_phase(
    *, all_ready: bool, failed: bool, started: bool, stuck: bool = False
) -> DeploymentPhase:
    """``status.phase``: Degraded while a rollout is past its progress deadline (even
    though the old groups serve: ``kubectl get dwdp`` shows it), else Ready when everything
    serves, Degraded when some group failed, Progressing while groups start, Pending before
    any exists."""
    if stuck:
        return DeploymentPhase.DEGRADED
    if all_ready:
        return DeploymentPhase.READY
    if failed:
        return DeploymentPhase.DEGRADED
    return DeploymentPhase.PROGRESSING if started else DeploymentPhase.PENDING


def deployment_status(
    spec: DwdpDeploymentSpec,
    owner: builders.Owner,
    body: Mapping[str, Any],
    observed: Observed,
    roles: Mapping[Role, RoleDecision],
    actions: Actions,
    revisions: Mapping[Role, str],
    now: str,
    stuck: Sequence[str],
) -> dict[str, Any]:
    """The status to write (camelCase), built through :class:`DwdpDeploymentStatus`;
    ``stuck``: a line for each group past the progress deadline
    (:func:`~dwdp.operator.group.rollout.stuck_groups`)."""
    ctx_role = roles[Role.CONTEXT]
    gen_role = roles.get(Role.GENERATION)
    views = [*ctx_role.views, *(gen_role.views if gen_role else ())]
    ready = sum(1 for v in ctx_role.views if v.committed)
    gen_ready = sum(1 for v in gen_role.views if v.committed) if gen_role else 0
    failed = [v.name for v in views if v.phase in (GroupPhase.FAILED, GroupPhase.RESTARTING)]
    existing = len(ctx_role.views) + ctx_role.draining
    generation = (body.get("metadata") or {}).get("generation")
    conds = conditions.deployment_conditions(
        desired=ctx_role.replicas,
        ready=ready,
        existing=existing,
        failed=failed,
        outdated=sum(d.outdated for d in roles.values()),
        generation_desired=gen_role.replicas if gen_role else 0,
        generation_ready=gen_ready,
        observed_generation=generation,
        stuck=stuck,
    )
    if observed.create_error:
        conds.append(conditions.replica_failure(observed.create_error, generation))
    all_ready = conds[0]["status"] == "True"
    phase = deployment_phase(
        all_ready=all_ready,
        failed=bool(failed),
        started=bool(observed.pods or actions.pods),
        stuck=bool(stuck),
    )
    old_conditions = (body.get("status") or {}).get("conditions")
    generation_status = None
    if gen_role is not None:
        kept = [  # generation entries only where they carry restart bookkeeping
            e.to_yaml_dict() for e in gen_role.entries if e.restarts or e.last_failure
        ]
        generation_status = GenerationStatus.model_validate(
            {
                "replicas": len(gen_role.views),
                "readyReplicas": gen_ready,
                "nextIndex": gen_role.next_index,
                **({"groups": kept} if kept else {}),
            }
        )
    status = DwdpDeploymentStatus(
        phase=phase.value,
        conditions=[
            Condition.model_validate(x)
            for x in conditions.carry_transition_times(conds, old_conditions, now)
        ],
        observed_generation=generation,
        replicas=existing,
        ready_groups=ready,
        updated_groups=sum(1 for e in ctx_role.entries if e.revision == revisions[Role.CONTEXT]),
        next_group_index=ctx_role.next_index,
        selector=f"{c.LABEL_DEPLOYMENT}={owner.name},{c.LABEL_ROLE}={Role.CONTEXT.value}",
        revision=revisions[Role.CONTEXT],
        groups=list(ctx_role.entries),
        generation=generation_status,
        endpoint=(
            f"http://{naming.client_service(owner.name)}.{owner.namespace}.svc:{spec.server.port}"
        ),
    )
    return status.to_yaml_dict()


def with_router(
    status: dict[str, Any],
    spec: DwdpDeploymentSpec,
    owner: builders.Owner,
    observed: Observed,
    servers: router.RouterServers,
    body: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """``status`` with ``router`` and the ``RouterReady`` condition when the spec runs the
    router (unchanged otherwise: the entries go with it)."""
    if not spec.router_enabled:
        return status
    wanted = spec.router.replicas if servers.complete else 0
    ready = router.ready_router_pods(observed.router_pods, servers)
    generation = (body.get("metadata") or {}).get("generation")
    cond = conditions.router_ready(
        servers=servers, wanted=wanted, ready=ready, observed_generation=generation
    )
    old = (body.get("status") or {}).get("conditions")
    (cond,) = conditions.carry_transition_times([cond], old, now)
    entry = RouterStatus(
        replicas=wanted,
        ready_replicas=min(ready, wanted),
        prefill_servers=len(servers.prefill),
        decode_servers=len(servers.decode),
        endpoint=router.router_endpoint(spec, owner),
    )
    return {
        **status,
        "conditions": [*status["conditions"], Condition.model_validate(cond).to_yaml_dict()],
        "router": entry.to_yaml_dict(),
    }
