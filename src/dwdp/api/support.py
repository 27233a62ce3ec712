"""What this worker runs: the settings it refuses, each written once for the models and the CRD.

docs/design.md §3.2 gives the reference's launch rules; this worker runs a subset of them. It runs
dense DWDP attached to expert DWDP only, has no gather kernel on the cpu backend, its
pods start their ranks with ``dwdp launch``, never under an MPI launcher, and it captures no
CUDA graph with DWDP on (the prefetch schedule's host hooks cannot be replayed). Each such limit
here is one field, one Python test and one CEL condition sharing one message that says "not
supported by this worker", so the pydantic models (``dwdp validate``, the operator's
webhook) and the CRD refuse the same specs with the same words before any pod starts, and no
spec they accept meets a refusal of the worker at startup. Settings the worker never runs at
any value are not fields at all (:mod:`dwdp.api.dropped`).

Where a limit applies (:class:`Scope`): a launch config or the context section of a
DwdpDeployment. Paths are relative to that object (``dwdp.enableDense``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dwdp.api.base import cel_rule
from dwdp.api.enums import CopyMode, HandleType, Transport
from dwdp.api.errors import Problem

if TYPE_CHECKING:
    from dwdp.api.config import DwdpConfig

__all__ = [
    "CUDA_GRAPHS_WITH_DWDP",
    "NOT_SUPPORTED",
    "WORKER_LIMITS",
    "Scope",
    "SectionView",
    "WorkerLimit",
    "worker_limit_problems",
    "worker_limit_rules",
]

NOT_SUPPORTED = "is not supported by this worker"
"""The words every limit's message carries."""


class Scope(enum.Enum):
    """The objects a limit is checked on."""

    LAUNCH = "launch"
    """A worker's launch config (``dwdp worker``/``dwdp launch``, any rank starter)."""
    CONTEXT = "context"
    """``spec.context`` of a DwdpDeployment (pods started by ``dwdp launch``)."""


@dataclass(frozen=True, slots=True)
class SectionView:
    """The settings a limit reads: a launch config or a context section, seen alike."""

    transport: Transport
    dwdp: DwdpConfig
    handle_type: HandleType
    cuda_graphs: bool | None = None
    """``engine.cudaGraphs`` (None: unset)."""


Refused = Callable[[SectionView], object | None]
"""The refused value a section holds at the limit's field, or None when the worker runs it."""


@dataclass(frozen=True, slots=True)
class WorkerLimit:
    """One setting this worker refuses: where, in words, in CEL and in Python."""

    path: tuple[str, ...]
    """Field path (camelCase) relative to the checked object."""
    setting: str
    """The refused setting in words (the subject of the message)."""
    remedy: str
    """Why, and what to set instead."""
    allowed: str
    """CEL over the checked object (``self``): true when the worker runs the setting."""
    refused: Refused
    """The Python test (see :data:`Refused`)."""
    scopes: frozenset[Scope]
    """Where the limit applies."""

    @property
    def rule(self) -> str:
        """The message: the same text in the CRD, ``dwdp validate`` and the webhook."""
        return f"{self.setting} {NOT_SUPPORTED}: {self.remedy}"


def _dwdp_on(view: SectionView) -> bool:
    return view.dwdp.expert_dwdp or view.dwdp.enable_dense


def _standalone(view: SectionView) -> bool | None:
    d = view.dwdp
    return True if d.enable_dense and not d.enable_experts else None


def _shm_gather(view: SectionView) -> str | None:
    d = view.dwdp
    if view.handle_type is HandleType.SHM and d.copy_mode is CopyMode.GATHER:
        return d.copy_mode.value
    return None


def _shm_sm_reserve(view: SectionView) -> object | None:
    return view.dwdp.sm_reserve if view.handle_type is HandleType.SHM else None


def _mpi_with_dwdp(view: SectionView) -> str | None:
    return view.transport.value if view.transport is Transport.MPI and _dwdp_on(view) else None


def _graphs_with_dwdp(view: SectionView) -> bool | None:
    return True if view.cuda_graphs is True and _dwdp_on(view) else None


_WITH_DWDP = frozenset({Scope.LAUNCH, Scope.CONTEXT})
_DWDP_ON_CEL = "((self.dwdp.enableExperts && self.dwdp.dwdpSize > 1) || self.dwdp.enableDense)"

CUDA_GRAPHS_WITH_DWDP = WorkerLimit(
    ("engine", "cudaGraphs"),
    "engine.cudaGraphs true with DWDP on",
    "the prefetch schedule runs host hooks around every MoE layer, which a CUDA graph "
    "cannot replay; leave it unset or false",
    "!has(self.engine) || !has(self.engine.cudaGraphs) || !self.engine.cudaGraphs || "
    f"!{_DWDP_ON_CEL}",
    _graphs_with_dwdp,
    _WITH_DWDP,
)
"""CUDA graphs on a rank with DWDP on (expert DWDP over more than one rank, or dense DWDP);
the worker's own resolution (``dwdp.worker.settings.resolve_cuda_graphs``) refuses it with
the same words."""

WORKER_LIMITS: tuple[WorkerLimit, ...] = (
    WorkerLimit(
        ("dwdp", "enableDense"),
        "enableDense without enableExperts (standalone dense DWDP)",
        "this worker runs dense DWDP attached to expert DWDP only; set enableExperts true "
        "with dwdpSize > 1",
        "!self.dwdp.enableDense || self.dwdp.enableExperts",
        _standalone,
        _WITH_DWDP,
    ),
    WorkerLimit(
        ("dwdp", "copyMode"),
        "copyMode gather with handleType shm",
        "the gather kernel needs CUDA and shm is the cpu backend; use per_slice or batched "
        "(or handleType posixFd or fabric)",
        "self.handleType != 'shm' || !has(self.dwdp) || !has(self.dwdp.copyMode) || "
        "self.dwdp.copyMode != 'gather'",
        _shm_gather,
        _WITH_DWDP,
    ),
    WorkerLimit(
        ("dwdp", "smReserve"),
        "smReserve with handleType shm",
        "shm is the cpu backend, which has no SMs to reserve; leave smReserve unset (or use "
        "handleType posixFd or fabric)",
        "self.handleType != 'shm' || !has(self.dwdp) || !has(self.dwdp.smReserve)",
        _shm_sm_reserve,
        _WITH_DWDP,
    ),
    WorkerLimit(
        ("transport",),
        "transport mpi with DWDP on",
        "the pods start their ranks with dwdp launch, not under an MPI launcher, so no rank "
        "would find its group; use tcpStore",
        f"self.transport != 'mpi' || !{_DWDP_ON_CEL}",
        _mpi_with_dwdp,
        frozenset({Scope.CONTEXT}),
    ),
    CUDA_GRAPHS_WITH_DWDP,
)
"""Every limit, in the order their problems are reported."""


def worker_limit_problems(view: SectionView, scope: Scope) -> list[Problem]:
    """The limits of ``scope`` that ``view`` breaks, in table order; paths relative to it."""
    problems = []
    for limit in WORKER_LIMITS:
        if scope not in limit.scopes:
            continue
        value = limit.refused(view)
        if value is not None:
            problems.append(Problem(limit.path, value, limit.rule))
    return problems


def worker_limit_rules(scope: Scope) -> list[dict[str, str]]:
    """The limits of ``scope`` as ``x-kubernetes-validations`` entries of the section."""
    return [
        cel_rule(limit.allowed, limit.rule, field_path="." + ".".join(limit.path))
        for limit in WORKER_LIMITS
        if scope in limit.scopes
    ]
