"""The vocabulary of a plan: the operator settings it reads (:class:`PlanOptions`) and the
cluster actions its steps decide (:class:`Actions`: children to create, pods, commit gate
changes, deletes, Events, when to look again). Values only; nothing here does I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dwdp.operator import constants as c
from dwdp.operator.constants import Reason
from dwdp.operator.observe import ChildKey

__all__ = [
    "NO_ACTIONS",
    "Actions",
    "Delete",
    "Event",
    "GateChange",
    "PlanOptions",
]


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
