"""What the operator saw, summarized: pods by group incarnation, ranks' reports, children.

The gather step (:mod:`dwdp.operator.reconcile`) lists the children and asks the ranks for
``/dwdp/status``; the pure functions here turn those raw answers into immutable summaries
that :func:`dwdp.operator.plan.plan` reads. Invariant: nothing here does I/O, and a
summary never holds a reference to a mutable API object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dwdp.api.contract import COMMITTED_PHASES, RankStatus, StatusPhase
from dwdp.api.enums import Role
from dwdp.operator import constants as c
from dwdp.operator.builders import applied_hash

__all__ = [
    "ChildKey",
    "Observed",
    "ObservedPod",
    "RankReport",
    "RouterPod",
    "pod_from_object",
    "rank_report_from_json",
]

@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's answer to ``GET /dwdp/status`` (the fields the operator reads)."""

    rank: int | None
    phase: StatusPhase
    revision: str | None = None
    incarnation: int | None = None
    layout_digest: str | None = None
    start_id: str | None = None
    """The rank process's start id (a new one each time it starts)."""

    @property
    def committed(self) -> bool:
        """The rank's DWDP setup committed (or it has none)."""
        return self.phase in COMMITTED_PHASES

    @property
    def failed(self) -> bool:
        """The rank reports it failed (its engine died after the commit)."""
        return self.phase == StatusPhase.FAILED


def rank_report_from_json(data: Any) -> RankReport | None:
    """Read a ``/dwdp/status`` body; None when it is not a mapping whose ``phase`` is one
    of the contract's :class:`~dwdp.api.contract.StatusPhase` words (an answer the operator
    cannot read counts as not reported yet)."""
    status = RankStatus.read(data)
    if status is None:
        return None
    return RankReport(
        rank=status.rank,
        phase=status.known_phase,
        revision=status.revision,
        incarnation=status.incarnation_number,
        layout_digest=status.layout_digest,
        start_id=status.start_id,
    )


@dataclass(frozen=True, slots=True)
class ObservedPod:
    """One worker pod as listed, reduced to what the plan reads."""

    name: str
    role: Role
    group_index: int
    incarnation: int
    pod_index: int
    revision: str
    phase: str
    """The pod's ``status.phase`` (Pending, Running, Succeeded, Failed, Unknown)."""
    scheduled: bool
    started: bool
    """Every container has started at least once (running or terminated)."""
    deleting: bool
    ip: str | None
    gate: bool
    """The ``dwdp.io/group-ready`` condition is True."""
    ready: bool
    """The pod's Ready condition is True."""
    ranks: int
    """Ranks this pod runs (its ``rank-k`` container ports)."""
    termination_message: str | None = None
    exit_code: int | None = None
    terminated_reason: str | None = None
    """The kubelet's reason for the ended container (``OOMKilled``, ``Error``...)."""
    draining: bool = False
    """The gate condition was closed with reason :data:`~dwdp.operator.constants.
    GATE_REASON_DRAINING`: the group is being drained (derivable after a restart)."""
    created: str | None = None
    """``metadata.creationTimestamp``."""
    deleted: str | None = None
    """``metadata.deletionTimestamp`` (when the pod is being deleted)."""
    grace_s: int | None = None
    """``spec.terminationGracePeriodSeconds``."""
    secret: str | None = None
    """The incarnation's rendezvous Secret the pod mounts (None: none)."""
    vllm: bool = False
    """A vLLM generation server's pod (label ``dwdp.io/engine: vllm``)."""
    containers_ready: bool = False
    """Every container passes its readiness probe (a vLLM server: ``/health`` answers)."""

    def vllm_report(self) -> RankReport | None:
        """The one rank report of a vLLM server's pod, read from its readiness: ``disabled``
        (serving with whole weights: committed, as a dwdp rank without DWDP reports) once its
        ``/health`` passes; None (not reported) before, as a dwdp rank that has not finished
        its setup, and after (vLLM exits when its engine dies: the pod then fails). None for
        any other pod."""
        if not self.vllm or not self.containers_ready:
            return None
        return RankReport(rank=0, phase=StatusPhase.DISABLED)

    @property
    def failed(self) -> bool:
        """The pod ended (with restartPolicy Never, any end is a failure of the group)."""
        return self.phase in ("Failed", "Succeeded")

    @property
    def live(self) -> bool:
        """The pod counts for its group: not being deleted."""
        return not self.deleting


def _condition(status: Mapping[str, Any], kind: str) -> bool:
    return any(
        cond.get("type") == kind and cond.get("status") == "True"
        for cond in status.get("conditions") or ()
    )


def _condition_reason(status: Mapping[str, Any], kind: str) -> str | None:
    return next(
        (cond.get("reason") for cond in status.get("conditions") or () if cond.get("type") == kind),
        None,
    )


def pod_from_object(obj: Mapping[str, Any]) -> ObservedPod | None:
    """Summarize a worker pod object; None when its labels are not the operator's."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        role = Role(labels[c.LABEL_ROLE])
        group_index = int(labels[c.LABEL_GROUP_INDEX])
        incarnation = int(labels[c.LABEL_INCARNATION])
        pod_index = int(labels[c.LABEL_POD_INDEX])
        revision = labels[c.LABEL_REVISION]
    except (KeyError, ValueError):
        return None
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    containers = spec.get("containers") or []
    ranks = sum(
        1
        for ctr in containers[:1]
        for port in ctr.get("ports") or ()
        if str(port.get("name", "")).startswith("rank-")
    )
    cstats = status.get("containerStatuses") or []
    started = bool(cstats) and all(
        "running" in (cs.get("state") or {})
        or "terminated" in (cs.get("state") or {})
        or "terminated" in (cs.get("lastState") or {})
        for cs in cstats
    )
    message, code, why = None, None, None
    for cs in cstats:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            message = (term.get("message") or "").strip() or None
            code = term.get("exitCode")
            why = term.get("reason")
            break
    return ObservedPod(
        name=meta["name"],
        role=role,
        group_index=group_index,
        incarnation=incarnation,
        pod_index=pod_index,
        revision=revision,
        phase=status.get("phase") or "Pending",
        scheduled=bool(spec.get("nodeName")),
        started=started,
        deleting=bool(meta.get("deletionTimestamp")),
        ip=status.get("podIP") or None,
        gate=_condition(status, c.GATE_CONDITION),
        ready=_condition(status, "Ready"),
        ranks=ranks or 1,
        termination_message=message,
        exit_code=code,
        terminated_reason=why,
        draining=_condition_reason(status, c.GATE_CONDITION) == c.GATE_REASON_DRAINING,
        created=meta.get("creationTimestamp"),
        deleted=meta.get("deletionTimestamp"),
        grace_s=spec.get("terminationGracePeriodSeconds"),
        secret=next(
            (
                str(v["secret"].get("secretName"))
                for v in spec.get("volumes") or ()
                if v.get("name") == c.RENDEZVOUS_VOLUME and "secret" in v
            ),
            None,
        ),
        vllm=labels.get(c.LABEL_ENGINE) == c.ENGINE_VLLM,
        containers_ready=bool(cstats) and all(cs.get("ready") is True for cs in cstats),
    )


@dataclass(frozen=True, slots=True)
class RouterPod:
    """One router pod as listed (the router Deployment's pods carry the deployment label)."""

    name: str
    ready: bool
    deleting: bool
    servers: str | None
    """The server-list hash of its template (``dwdp.io/router-servers``)."""


def router_pod_from_object(obj: Mapping[str, Any]) -> RouterPod | None:
    """Summarize a router pod; None for any other pod."""
    meta = obj.get("metadata") or {}
    if (meta.get("labels") or {}).get(c.LABEL_COMPONENT) != c.Component.ROUTER.value:
        return None
    return RouterPod(
        name=meta["name"],
        ready=_condition(obj.get("status") or {}, "Ready"),
        deleting=bool(meta.get("deletionTimestamp")),
        servers=(meta.get("annotations") or {}).get(c.ANNOTATION_ROUTER_SERVERS),
    )


@dataclass(frozen=True, slots=True)
class ChildKey:
    """Kind and name of a child other than a pod."""

    kind: str
    name: str


def _ours(obj: Mapping[str, Any]) -> bool:
    """The operator made this child. EndpointSlices need a look: the endpoint-slice
    controller copies a Service's labels onto the slices it makes for the headless
    Services, so only the managed-by label tells ours apart (deleting theirs would start
    a delete/recreate loop)."""
    if obj.get("kind") != "EndpointSlice":
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(c.LABEL_SLICE_MANAGED_BY) == c.SLICE_MANAGED_BY


@dataclass(frozen=True)
class Observed:
    """Everything the plan reads about the cluster for one deployment.

    ``children`` maps every listed non-pod child (ConfigMap, Service, EndpointSlice,
    PodGroup, ComputeDomain; never a Secret) to its applied-hash annotation; ``ranks`` maps
    a pod name to its ranks' reports in local-rank order (None for a rank that did not
    answer) and holds only the pods that were asked, and every vLLM server pod whose
    readiness reports (:meth:`ObservedPod.vllm_report`).
    """

    pods: tuple[ObservedPod, ...] = ()
    children: Mapping[ChildKey, str | None] = field(default_factory=dict)
    ranks: Mapping[str, tuple[RankReport | None, ...]] = field(default_factory=dict)
    gang: bool = False
    """The apiserver serves the Workload/PodGroup scheduling API (gang PodGroups)."""
    compute_domains: bool = False
    """The apiserver serves NVIDIA's ComputeDomain API (resource.nvidia.com)."""
    create_error: str | None = None
    """The API's message of the last refused creation (quota, admission), if the last
    attempt failed; the plan reports it as a condition."""
    create_blocked: bool = False
    """A refused creation is in its retry backoff: plan no creation this cycle."""
    router_pods: tuple[RouterPod, ...] = ()
    """The pods of the router Deployment (any ReplicaSet)."""

    @classmethod
    def from_objects(
        cls,
        *,
        pods: Iterable[Mapping[str, Any]],
        children: Iterable[Mapping[str, Any]],
        ranks: Mapping[str, tuple[RankReport | None, ...]] | None = None,
        **extra: Any,
    ) -> Observed:
        """Build the summary from listed objects (worker and router pods) and the ranks'
        reports, adding the vLLM server pods' reports from their readiness."""
        pods = list(pods)
        summaries = tuple(
            sorted(
                (p for p in (pod_from_object(o) for o in pods) if p is not None),
                key=lambda p: p.name,
            )
        )
        kids = {
            ChildKey(o["kind"], o["metadata"]["name"]): applied_hash(o)
            for o in children
            if _ours(o)
        }
        routers = tuple(
            sorted(
                (r for r in map(router_pod_from_object, pods) if r is not None),
                key=lambda r: r.name,
            )
        )
        reports = dict(ranks or {})
        for p in summaries:
            if (report := p.vllm_report()) is not None:
                reports[p.name] = (report,)
        return cls(pods=summaries, children=kids, ranks=reports, router_pods=routers, **extra)

    def group_pods(self, role: Role, index: int) -> list[ObservedPod]:
        """Every pod of one group (all incarnations, deleting ones included)."""
        return [p for p in self.pods if p.role is role and p.group_index == index]
