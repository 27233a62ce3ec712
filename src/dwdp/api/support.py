"""What this worker runs: the settings it refuses, each written once for the models and the CRD.

docs/design.md §3.2 gives the launch rules; this worker runs a subset of them. It has
no tensor-, pipeline- or context-parallel engine and no attention data parallelism (every
rank serves one whole model), runs dense DWDP attached to expert DWDP only, has no gather
kernel on the cpu backend, its pods start their ranks with ``dwdp launch``, never under
an MPI launcher, and its engine runs the plain eager forward pass of the base checkpoint
(none of the engine switches: CUDA graphs, torch.compile, the overlap scheduler, LoRA,
speculative decoding, sleep mode). Each such limit here is one field, one Python test and
one CEL condition sharing one message that says "not supported by this worker", so the
pydantic models (``dwdp validate``, the operator's webhook) and the CRD refuse the same specs
with the same words before any pod starts, and no spec they accept meets a refusal of the
worker at startup or a setting the worker silently ignores.

Where a limit applies (:class:`Scope`): a launch config, the context section or the
generation section of a DwdpDeployment. Paths are relative to that object
(``parallel.tensorParallelSize``).
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
    from dwdp.api.launch import EngineSwitches, ParallelConfig

__all__ = [
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
    GENERATION = "generation"
    """``spec.generation`` of a DwdpDeployment (no DWDP settings)."""


@dataclass(frozen=True, slots=True)
class SectionView:
    """The settings a limit reads: a launch config or a serving section, seen alike.

    ``dwdp`` and ``handle_type`` are None for a generation section (it has neither).
    """

    parallel: ParallelConfig
    transport: Transport
    engine: EngineSwitches
    dwdp: DwdpConfig | None = None
    handle_type: HandleType | None = None


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


def _above_one(value: int) -> int | None:
    return value if value > 1 else None


def _dwdp_on(view: SectionView) -> bool:
    d = view.dwdp
    return d is not None and (d.expert_dwdp or d.enable_dense)


def _standalone(view: SectionView) -> bool | None:
    d = view.dwdp
    return True if d is not None and d.enable_dense and not d.enable_experts else None


def _shm_gather(view: SectionView) -> str | None:
    d = view.dwdp
    if view.handle_type is HandleType.SHM and d is not None and d.copy_mode is CopyMode.GATHER:
        return d.copy_mode.value
    return None


def _mpi_with_dwdp(view: SectionView) -> str | None:
    return view.transport.value if view.transport is Transport.MPI and _dwdp_on(view) else None


_EVERYWHERE = frozenset(Scope)
_WITH_DWDP = frozenset({Scope.LAUNCH, Scope.CONTEXT})
_ONE_MODEL = "each rank serves one whole model"


def _engine_switch(
    name: str, feature: str, remedy: str, on: Callable[[EngineSwitches], bool]
) -> WorkerLimit:
    """The limit of one engine switch (``engine.<name>``): refused when it is on, in every
    scope, since this worker's engine reads none of them."""
    return WorkerLimit(
        ("engine", name),
        f"{name} ({feature})",
        f"{remedy}; set it to false",
        f"!self.engine.{name}",
        lambda v: True if on(v.engine) else None,
        _EVERYWHERE,
    )


_EAGER = "this worker's engine runs the model's plain eager forward pass"

WORKER_LIMITS: tuple[WorkerLimit, ...] = (
    WorkerLimit(
        ("parallel", "tensorParallelSize"),
        "tensorParallelSize > 1 (tensor parallelism)",
        f"{_ONE_MODEL}; set it to 1",
        "self.parallel.tensorParallelSize == 1",
        lambda v: _above_one(v.parallel.tensor_parallel_size),
        _EVERYWHERE,
    ),
    WorkerLimit(
        ("parallel", "pipelineParallelSize"),
        "pipelineParallelSize > 1 (pipeline parallelism)",
        f"{_ONE_MODEL}; set it to 1",
        "self.parallel.pipelineParallelSize == 1",
        lambda v: _above_one(v.parallel.pipeline_parallel_size),
        _EVERYWHERE,
    ),
    WorkerLimit(
        ("parallel", "contextParallelSize"),
        "contextParallelSize > 1 (context parallelism)",
        f"{_ONE_MODEL}; set it to 1",
        "self.parallel.contextParallelSize == 1",
        lambda v: _above_one(v.parallel.context_parallel_size),
        _EVERYWHERE,
    ),
    WorkerLimit(
        ("parallel", "attentionDP"),
        "attentionDP (attention data parallelism, and with it expert DWDP on an attention-DP "
        "instance and standalone dense DWDP)",
        f"{_ONE_MODEL}; set it to false",
        "!self.parallel.attentionDP",
        lambda v: True if v.parallel.attention_dp else None,
        _EVERYWHERE,
    ),
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
        ("transport",),
        "transport mpi with DWDP on",
        "the pods start their ranks with dwdp launch, not under an MPI launcher, so no rank "
        "would find its group; use tcpStore",
        "self.transport != 'mpi' || !((self.dwdp.enableExperts && self.dwdp.dwdpSize > 1) "
        "|| self.dwdp.enableDense)",
        _mpi_with_dwdp,
        frozenset({Scope.CONTEXT}),
    ),
    _engine_switch(
        "cudaGraphs", "CUDA graph capture of the forward pass", _EAGER, lambda e: e.cuda_graphs
    ),
    _engine_switch(
        "torchCompile", "torch.compile of the model", _EAGER, lambda e: e.torch_compile
    ),
    _engine_switch(
        "overlapScheduler",
        "scheduling step n+1 while step n runs",
        "this worker's engine schedules each step after the previous one",
        lambda e: e.overlap_scheduler,
    ),
    _engine_switch(
        "lora", "LoRA adapters", "this worker serves the base checkpoint only", lambda e: e.lora
    ),
    _engine_switch(
        "speculativeDecoding",
        "draft tokens",
        "this worker's engine decodes without drafts",
        lambda e: e.speculative_decoding,
    ),
    _engine_switch(
        "sleepMode",
        "releasing GPU memory while idle",
        "this worker keeps its weights and KV cache resident",
        lambda e: e.sleep_mode,
    ),
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
