"""Every status condition the operator writes, built here and nowhere else.

A condition follows the Kubernetes conventions (``metav1.Condition``): ``type``,
``status`` (``"True"``/``"False"``), ``reason`` (CamelCase, a
:class:`~dwdp.operator.constants.Reason`), ``message``, ``observedGeneration`` (the
``metadata.generation`` it was computed from, left out when unknown) and
``lastTransitionTime`` (RFC 3339; :func:`carry_transition_times` keeps the old one while
the status does not change).

The DwdpDeployment's conditions:

- ``Ready``, ``Progressing``, ``Degraded`` (:func:`deployment_conditions`), as a
  Deployment's;
- ``ReplicaFailure`` (:func:`replica_failure`) while the apiserver refuses to create pods;
- ``Ready`` False and ``Invalid`` True (:func:`invalid_conditions`) for a refused spec;
- ``RouterReady`` (:func:`router_ready`) when the spec runs the router.

A worker pod's readiness gate ``dwdp.io/group-ready`` (:func:`gate_condition`) is its
group's commit gate. Invariant: nothing here reads a clock (``now`` is an argument), so
the same inputs give the same conditions, byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dwdp.operator import constants as c
from dwdp.operator.constants import Reason

if TYPE_CHECKING:
    from dwdp.operator.router import RouterServers

__all__ = [
    "MESSAGE_LIMIT",
    "carry_transition_times",
    "condition",
    "deployment_conditions",
    "gate_condition",
    "invalid_conditions",
    "replica_failure",
    "router_ready",
]

MESSAGE_LIMIT = 4000
"""Characters kept of a message that quotes the apiserver or a spec's problems."""


def condition(
    kind: str, ok: bool, reason: Reason | str, message: str, generation: int | None
) -> dict[str, Any]:
    """One condition without ``lastTransitionTime``: ``{type, status, reason, message,
    observedGeneration}`` (the last one only when ``generation`` is not None)."""
    out: dict[str, Any] = {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason.value if isinstance(reason, Reason) else reason,
        "message": message,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def carry_transition_times(
    new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]] | None, now: str
) -> list[dict[str, Any]]:
    """``new`` conditions with ``lastTransitionTime``: the old one where the status did
    not change, else ``now``."""
    before = {cond.get("type"): cond for cond in old or ()}
    out = []
    for cond in new:
        prev = before.get(cond["type"]) or {}
        same = prev.get("status") == cond["status"]
        stamp = prev.get("lastTransitionTime") if same and prev.get("lastTransitionTime") else now
        out.append({**cond, "lastTransitionTime": stamp})
    return out


def deployment_conditions(
    *,
    desired: int,
    ready: int,
    existing: int,
    failed: Sequence[str],
    outdated: int,
    generation_desired: int,
    generation_ready: int,
    observed_generation: int | None,
    stuck: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded, in that order, without transition times.

    ``desired``/``ready``/``existing`` count context groups; ``failed`` names the failed
    groups (any role); ``outdated`` counts groups at an older revision; ``stuck`` says, one
    line each, which groups at the current revision missed the progress deadline
    (:func:`~dwdp.operator.status.stuck_groups`). Progressing looks at the rollout first
    (stuck, then outdated groups), then at scaling, then at groups starting, as a
    Deployment's does.
    """
    all_ready = ready >= desired and generation_ready >= generation_desired and not failed
    ready_msg = (
        f"{ready}/{desired} context groups serving, "
        f"{generation_ready}/{generation_desired} generation servers serving"
    )
    if failed:  # counts alone read as ready while a surge group fails
        ready_msg += "; failed: " + ", ".join(sorted(failed))
    ready_reason = Reason.ALL_GROUPS_SERVING if all_ready else Reason.GROUPS_NOT_READY
    if stuck:
        progressing = (False, Reason.PROGRESS_DEADLINE_EXCEEDED, "; ".join(stuck))
    elif outdated:
        progressing = (
            True,
            Reason.ROLLING_OUT,
            f"rolling out: {outdated} groups run an older revision",
        )
    elif existing != desired:
        progressing = (True, Reason.SCALING, f"{existing} context groups, {desired} desired")
    elif not all_ready and not failed:
        progressing = (True, Reason.GROUPS_STARTING, ready_msg)
    else:
        progressing = (False, Reason.STABLE, "no change under way")
    if failed:
        degraded = (True, Reason.GROUP_FAILED, "failed: " + ", ".join(sorted(failed)))
    elif stuck:
        degraded = (True, Reason.PROGRESS_DEADLINE_EXCEEDED, "rollout stuck: " + "; ".join(stuck))
    else:
        degraded = (False, Reason.HEALTHY, "no group failed")
    return [
        condition(c.COND_READY, all_ready, ready_reason, ready_msg, observed_generation),
        condition(c.COND_PROGRESSING, *progressing, observed_generation),
        condition(c.COND_DEGRADED, *degraded, observed_generation),
    ]


def replica_failure(error: str, generation: int | None) -> dict[str, Any]:
    """``ReplicaFailure`` True (reason FailedCreate): the apiserver refused a creation;
    ``error`` is its answer (cut to :data:`MESSAGE_LIMIT` characters)."""
    return condition(
        c.COND_REPLICA_FAILURE, True, Reason.FAILED_CREATE, error[:MESSAGE_LIMIT], generation
    )


def invalid_conditions(
    reason: Reason, message: str, generation: int | None
) -> list[dict[str, Any]]:
    """``Ready`` False and ``Invalid`` True, both with ``reason``, for a spec the operator
    refuses; ``message`` lists the problems."""
    return [
        condition(
            c.COND_READY,
            False,
            reason,
            "the spec is invalid; no child was created or changed",
            generation,
        ),
        condition(c.COND_INVALID, True, reason, message, generation),
    ]


def router_ready(
    *, servers: RouterServers, wanted: int, ready: int, observed_generation: int | None
) -> dict[str, Any]:
    """The ``RouterReady`` condition: True once ``ready`` (router pods Ready that run the
    current server list) reaches ``wanted`` (> 0); False with reason NoServers while no
    group committed or no generation server is ready, else RouterNotReady."""
    if not servers.complete:
        missing = [
            what
            for what, urls in (
                ("a committed context group", servers.prefill),
                ("a ready generation server", servers.decode),
            )
            if not urls
        ]
        message = "the router waits for " + " and ".join(missing)
        return condition(
            c.COND_ROUTER_READY, False, Reason.NO_SERVERS, message, observed_generation
        )
    ok = ready >= wanted > 0
    message = (
        f"{ready}/{wanted} router pods ready, routing to {len(servers.prefill)} context "
        f"rank(s) and {len(servers.decode)} generation server(s)"
    )
    reason = Reason.ROUTER_AVAILABLE if ok else Reason.ROUTER_NOT_READY
    return condition(c.COND_ROUTER_READY, ok, reason, message, observed_generation)


def gate_condition(*, ready: bool, message: str, reason: str | None, now: str) -> dict[str, Any]:
    """A worker pod's ``dwdp.io/group-ready`` condition (its commit gate), stamped ``now``;
    ``reason`` None: GroupCommitted when ``ready``, else GroupNotCommitted."""
    reason = reason or (c.GATE_REASON_COMMITTED if ready else c.GATE_REASON_NOT_COMMITTED)
    return {
        **condition(c.GATE_CONDITION, ready, reason, message, None),
        "lastTransitionTime": now,
    }
