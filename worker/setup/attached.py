"""Attached DWDP setup of one rank's model, in order: dense P1-P6 (its commit returns the
replicated dense memory before the expert ring exists), expert setup (handshake, allocate,
map, commit), then the expert gather check, repoint and drop (``expert_repoint``).

A collective over the group transport: every rank calls it with the same arguments. A
failure after the dense commit releases the dense state too and says ``restored=False``
(the originals are gone; the process must exit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dwdp.api.partition import ExpertPartition
from dwdp.worker.backend.base import Backend
from dwdp.worker.dense.layout import DENSE_MIN_BYTES
from dwdp.worker.dense.repoint import LeakReport
from dwdp.worker.dense.state import DenseDwdp
from dwdp.worker.expert.layout import ExpertLayerWeights
from dwdp.worker.models.base import MoeLayer
from dwdp.worker.settings import CopySettings
from dwdp.worker.setup.dense import DenseSetupOptions, setup_dense
from dwdp.worker.setup.expert import ExpertDwdp, setup_experts
from dwdp.worker.setup.expert_repoint import check_expert_gather, repoint_experts
from dwdp.worker.setup.phases import ExpertPhase, SetupError
from dwdp.worker.transport.base import GroupTransport


@dataclass(frozen=True, slots=True)
class AttachedSetup:
    """The committed state: ``dense`` (``None`` without dense DWDP), ``experts``, the expert
    bytes freed and the expert leak report."""

    dense: DenseDwdp | None
    experts: ExpertDwdp
    expert_freed: int
    expert_leaks: LeakReport


def setup_attached(
    model: nn.Module,
    layers: Sequence[MoeLayer],
    *,
    backend: Backend,
    transport: GroupTransport,
    partition: ExpertPartition,
    enable_dense: bool,
    num_slots: int,
    settings: CopySettings,
    dense_min_bytes: int = DENSE_MIN_BYTES,
) -> AttachedSetup:
    """Dense setup, expert setup, the expert gather check and the repoint (module
    docstring). Raises ``SetupError`` on every rank alike."""
    device = layers[0].experts.gate_up_proj.device
    dense = None
    if enable_dense:
        dense = setup_dense(
            model,
            layers,
            backend=backend,
            transport=transport,
            enable_dense=True,
            options=DenseSetupOptions(copy=settings, device=device, min_bytes=dense_min_bytes),
        )
    experts = _setup_experts(
        layers,
        backend=backend,
        transport=transport,
        partition=partition,
        num_slots=num_slots,
        settings=settings,
        dense=dense,
    )
    check_expert_gather(experts, layers, transport, dense=dense)
    repointed = repoint_experts(experts, layers, rank=transport.rank)
    return AttachedSetup(dense, experts, repointed.freed_bytes, repointed.leaks)


def _setup_experts(
    layers: Sequence[MoeLayer],
    *,
    backend: Backend,
    transport: GroupTransport,
    partition: ExpertPartition,
    num_slots: int,
    settings: CopySettings,
    dense: DenseDwdp | None,
) -> ExpertDwdp:
    """This rank's range of every MoE layer's tables into its store (expert setup)."""
    start, end = partition.ranges[transport.rank]
    weights = [
        ExpertLayerWeights(
            name=m.prefix,
            tensors={p: t.detach()[start:end].contiguous() for p, t in m.expert_tensors().items()},
        )
        for m in layers
    ]
    try:
        return setup_experts(
            weights,
            partition=partition,
            backend=backend,
            transport=transport,
            num_slots=num_slots,
            settings=settings,
        )
    except SetupError as exc:
        if dense is None:
            raise
        dense.release()  # past the dense commit: no fallback, the process must exit
        raise SetupError(
            exc.phase, ExpertPhase(exc.phase).what, exc.errors, restored=False
        ) from exc
    except BaseException:
        if dense is not None:
            dense.release()
        raise

