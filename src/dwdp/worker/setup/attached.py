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

import torch
from torch import nn

from dwdp.api.partition import ExpertPartition
from dwdp.worker.backend.base import Backend
from dwdp.worker.dense.layout import DENSE_MIN_BYTES
from dwdp.worker.dense.repoint import LeakReport
from dwdp.worker.dense.state import DenseDwdp
from dwdp.worker.expert.layout import ExpertLayerWeights, LoadedExperts
from dwdp.worker.models.base import MoeLayer
from dwdp.worker.settings import CopySettings
from dwdp.worker.setup.dense import DenseSetupOptions, setup_dense
from dwdp.worker.setup.expert import ExpertDwdp, setup_experts
from dwdp.worker.setup.expert_repoint import check_expert_gather, repoint_experts
from dwdp.worker.setup.phases import ExpertPhase, FailureInjector, SetupError
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
    loaded: LoadedExperts | None = None,
    injector: FailureInjector | None = None,
) -> AttachedSetup:
    """Dense setup, expert setup, the expert gather check and the repoint (module
    docstring). Raises ``SetupError`` on every rank alike.

    ``loaded``: the expert rows a sharded load read (``dwdp.worker.loading.sharded``; on the
    host, and the layers' own tables are then meta tensors): expert setup writes the store
    from them instead of slicing the full tables, and the gather check compares the rank's
    range. ``injector``: failures to inject (tests only; ``dwdp.worker.setup.phases``)."""
    device = layers[0].experts.gate_up_proj.device
    if loaded is not None:  # the tables are meta and the rows on the host: the model's device
        device = next(t.device for t in model.parameters() if not t.is_meta)
    # every rank runs dense P1 (its collective carries each rank's enable_dense), so ranks
    # that disagree fail with that verdict instead of mismatched collectives
    dense = setup_dense(
        model,
        layers,
        backend=backend,
        transport=transport,
        enable_dense=enable_dense,
        options=DenseSetupOptions(copy=settings, device=device, min_bytes=dense_min_bytes),
        injector=injector,
    )
    experts = _setup_experts(
        layers,
        backend=backend,
        transport=transport,
        partition=partition,
        num_slots=num_slots,
        settings=settings,
        dense=dense,
        loaded=loaded,
        injector=injector,
    )
    check_expert_gather(experts, layers, transport, dense=dense, loaded=loaded)
    repointed = repoint_experts(experts, layers, rank=transport.rank, loaded=loaded)
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
    loaded: LoadedExperts | None,
    injector: FailureInjector | None,
) -> ExpertDwdp:
    """This rank's range of every MoE layer's tables into its store (expert setup): the
    loaded rows, or slices of the full tables."""
    start, end = partition.ranges[transport.rank]
    weights = [
        ExpertLayerWeights(
            name=m.prefix,
            tensors=_rows_of(m, start, end, loaded),
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
            injector=injector,
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


def _rows_of(
    m: MoeLayer, start: int, end: int, loaded: LoadedExperts | None
) -> dict[str, torch.Tensor]:
    if loaded is None:
        return {p: t.detach()[start:end].contiguous() for p, t in m.expert_tensors().items()}
    if (loaded.start, loaded.end) != (start, end):
        raise ValueError(
            f"{m.prefix}: the loaded expert rows [{loaded.start}, {loaded.end}) are not this "
            f"rank's range [{start}, {end})"
        )
    return dict(loaded.tables[m.prefix])

