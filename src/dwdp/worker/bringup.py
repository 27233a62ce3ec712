"""Bringing DWDP up on a loaded transformers model: set it up, build the schedules, hook them in.

``setup_dwdp`` runs on a loaded model, after every weight transform: dense DWDP first (its
commit returns the replicated dense memory), then expert DWDP (store, prefetch ring, copy
plans), then the module tensors of every MoE layer are pointed into the prefetch slots for
good (``dwdp.worker.setup.attached``); ``attach`` then builds the two schedules on one copy
stream and the attachment (``dwdp.worker.attachment``: hooks, guards, updates, status).

[Note: one slot per MoE order] MoE order ``o`` reads expert slot ``o % num_prefetch_slots``
and dense slots ``o % 2`` (attention) and ``o % 3`` (MoE-dense), in both schedules and in the
module tensors, so the schedules' layer ids are MoE orders, not decoder-layer indices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from dwdp.api.launch import LaunchConfig, dwdp_active
from dwdp.api.partition import ExpertPartition
from dwdp.worker.attachment import CopyCounters, DwdpAttachment, SetupFacts
from dwdp.worker.backend.base import Backend, CopyPlan, Stream
from dwdp.worker.dense.layout import Segment
from dwdp.worker.dense.state import DenseDwdp
from dwdp.worker.expert.layout import LoadedExperts
from dwdp.worker.models.base import ArchitectureAdapter, MoeLayer
from dwdp.worker.rendezvous import DwdpConfigError, make_backend
from dwdp.worker.schedule.dense import DenseSlotSchedule
from dwdp.worker.schedule.expert import ExpertPrefetchSchedule
from dwdp.worker.settings import DENSE_MIN_BYTES, CopySettings
from dwdp.worker.setup.expert import ExpertDwdp
from dwdp.worker.setup.phases import FailureInjector
from dwdp.worker.status_source import DwdpStatusSource, NoDwdp
from dwdp.worker.transport.base import GroupTransport

log = logging.getLogger(__name__)


def setup_dwdp(
    model: nn.Module,
    adapter: ArchitectureAdapter,
    cfg: LaunchConfig,
    *,
    group: GroupTransport | None,
    settings: CopySettings,
    dense_min_bytes: int = DENSE_MIN_BYTES,
    loaded: LoadedExperts | None = None,
) -> DwdpStatusSource:
    """Set DWDP up on ``model`` as the launch asks; returns the status source the server
    reads (``DwdpAttachment``, or ``NoDwdp`` when DWDP is off).

    Raises ``DwdpConfigError`` (a setting this worker cannot run), ``SetupError`` (on every
    rank alike), ``UnsupportedArchitectureError``. ``group``: ``join_group``'s transport
    (``None`` exactly when DWDP is off); ``settings``: the effective copy settings
    (``dwdp.worker.settings.resolve_copy_settings``), for the backend and both managers;
    ``dense_min_bytes``: dense storages below it stay replicated
    (``dwdp.worker.settings.resolve_dense_min_bytes``); ``loaded``: the expert rows of a
    sharded load (``dwdp.worker.loading.sharded``), ``None`` for a model loaded whole.
    """
    if not dwdp_active(cfg) or group is None:
        return NoDwdp()
    from dwdp.api.launch import dense_mode

    d = cfg.dwdp
    if d.enable_dense and str(dense_mode(cfg)) != "attached":
        raise DwdpConfigError(
            "dwdp.enableDense: this worker runs dense DWDP attached to expert DWDP only "
            "(enableExperts true, dwdpSize > 1); standalone dense DWDP needs a "
            "tensor-parallel engine"
        )
    backend = make_backend(cfg, group, settings)
    partition = d.partition(_num_experts(model, adapter)) if d.expert_dwdp else None
    return attach(
        model,
        adapter,
        backend=backend,
        transport=group,
        partition=partition,
        enable_dense=d.enable_dense,
        num_slots=d.num_prefetch_slots,
        settings=settings,
        checkpoint_dtypes=checkpoint_dtypes(Path(cfg.model.path)),
        dense_min_bytes=dense_min_bytes,
        loaded=loaded,
    )


def checkpoint_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> dtype name (``float32``) of the checkpoint directory ``path``, from its
    safetensors headers (no weight is read); empty for a model that did not come from a
    checkpoint directory (the scalar exchange then compares every scalar bitwise)."""
    from dwdp.worker.loading.validate import read_headers

    if not path.is_dir():
        return {}
    return {name: dtype for name, (_shape, dtype) in read_headers(path).items()}


def _num_experts(model: nn.Module, adapter: ArchitectureAdapter) -> int:
    layers = adapter.moe_layers(model)
    return layers[0].num_experts if layers else 0


def attach(
    model: nn.Module,
    adapter: ArchitectureAdapter,
    *,
    backend: Backend,
    transport: GroupTransport,
    partition: ExpertPartition | None,
    enable_dense: bool,
    num_slots: int = 2,
    settings: CopySettings | None = None,
    checkpoint_dtypes: Mapping[str, str] | None = None,
    dense_min_bytes: int = DENSE_MIN_BYTES,
    loaded: LoadedExperts | None = None,
    injector: FailureInjector | None = None,
) -> DwdpAttachment:
    """Set DWDP up on ``model`` over ``transport`` (a collective: every rank calls it with
    the same arguments) and attach the schedules; returns the committed attachment.

    ``partition``: the expert partition (``None``: no expert DWDP; dense DWDP alone is the
    standalone mode this worker does not run); ``settings``: the effective copy settings
    (``None``: the defaults, per_slice); each manager (dense, expert) resolves its gather
    kernel from them once and passes it to every copy launch; ``checkpoint_dtypes``: tensor
    name -> checkpoint dtype name, for the scalar exchange's one-ULP rule (``None``: unknown,
    every scalar bitwise); ``dense_min_bytes``: dense storages below it stay replicated
    (default 1 MiB, the reference's); ``loaded``: the expert rows of a sharded load (the
    managed layers' tables are meta until the repoint), ``None`` for a model loaded whole;
    ``injector``: setup failures to inject (tests only: the worker never passes one).
    MoE layers DWDP cannot manage keep their full expert table
    (``dwdp.worker.expert.managed``); the adapter's repeated layers keep their slot across
    repeats. Raises ``SetupError`` on every rank alike, ``UnsupportedArchitectureError`` when
    ``enable_dense`` and the architecture declares no dense roots, ``DwdpConfigError`` for a
    model without MoE layers.
    """
    from dwdp.worker.expert.managed import log_unmanaged, select_layers
    from dwdp.worker.models import require_adapter
    from dwdp.worker.setup.attached import setup_attached
    from dwdp.worker.setup.scalars import exchange_scalars

    require_adapter(model, dense=enable_dense)
    # Dense tensors are checked for their device and contiguity, not for one dtype: the
    # DeepSeek-V3 router keeps float32 weights in a bfloat16 model.
    selection = select_layers(
        model, adapter, partition.num_experts if partition is not None else None
    )
    layers = list(selection.managed)
    if not layers:
        raise DwdpConfigError(
            "dwdp: the model has no fused-experts MoE layer; DWDP has nothing to distribute"
        )
    if partition is None:
        raise DwdpConfigError(
            "dwdp.enableExperts: this worker runs dense DWDP attached to expert DWDP only"
        )
    log_unmanaged(selection.unmanaged, transport.rank)
    scalars = exchange_scalars(layers, transport, checkpoint_dtypes or {})
    state = setup_attached(
        model,
        layers,
        backend=backend,
        transport=transport,
        partition=partition,
        enable_dense=enable_dense,
        num_slots=num_slots,
        settings=settings if settings is not None else CopySettings(),
        dense_min_bytes=dense_min_bytes,
        loaded=loaded,
        injector=injector,
    )
    counters = CopyCounters()
    expert_schedule, dense_schedule = _schedules(
        backend, layers, state.experts, state.dense, counters, num_slots, selection.repeated
    )
    attachment = DwdpAttachment(
        model=model,
        layers=layers,
        backend=backend,
        transport=transport,
        partition=partition,
        dense=state.dense,
        experts=state.experts,
        expert_schedule=expert_schedule,
        dense_schedule=dense_schedule,
        counters=counters,
        expert_freed=state.expert_freed,
        expert_leaks=state.expert_leaks.count,
        facts=SetupFacts(
            unmanaged=selection.unmanaged_counts(),
            repeated=tuple(sorted(selection.repeated)),
            scalars=scalars.as_dict(),
        ),
    )
    attachment.install_hooks()
    attachment.install_guards()
    if state.experts.settings.reserve_model_sms:
        attachment.reserve_model_sms(state.experts.settings.sm_reserve_sms)
    log.info(
        "DWDP rank %d of %d attached: %d MoE layers, partition %s, dense %s, %d expert slots",
        transport.rank,
        transport.world_size,
        len(layers),
        partition.describe(),
        "on" if state.dense is not None else "off",
        num_slots,
    )
    return attachment


def _count(counters: CopyCounters, plan: CopyPlan) -> None:
    counters.bytes_moved += plan.nbytes
    counters.bytes_moved_remote += sum(d.nbytes for d in plan.remote)
    counters.copies += 1


def _schedules(
    backend: Backend,
    layers: list[MoeLayer],
    experts: ExpertDwdp,
    dense: DenseDwdp | None,
    counters: CopyCounters,
    num_slots: int,
    repeated: frozenset[int] = frozenset(),
) -> tuple[ExpertPrefetchSchedule, DenseSlotSchedule | None]:
    """Both schedules on one copy stream, each launch counted; attached dense starts the
    expert prefetch at H0. ``repeated``: MoE orders that keep their slot across repeats."""
    copy_stream = backend.new_stream("dwdp-copy")
    orders = [m.moe_index for m in layers]

    def expert_launch(order: int, slot: int, stream: Stream) -> None:
        _count(counters, experts.plan(order, slot))
        experts.launch(order, slot, stream)

    expert_schedule = ExpertPrefetchSchedule(
        backend=backend,
        copy_stream=copy_stream,
        moe_layers=orders,
        num_slots=num_slots,
        launch=expert_launch,
        repeated_layers=repeated,
    )
    if dense is None:
        return expert_schedule, None

    def dense_launch(order: int, segment: Segment, slot: int, stream: Stream) -> None:
        _count(counters, dense.plan(order, segment, slot))
        dense.launch(order, segment, slot, stream)

    dense_schedule = DenseSlotSchedule(
        backend=backend,
        copy_stream=copy_stream,
        layers=orders,
        launch=dense_launch,
        attached=True,
        attention_slots=dense.rings.attention,
        moe_slots=dense.rings.moe_dense,
        expert_schedule=expert_schedule,
    )
    if num_slots > 2:
        log.info(
            "DWDP: %d expert prefetch slots: each expert copy runs ahead of its "
            "layer's dense copy on the shared copy stream",
            num_slots,
        )
    return expert_schedule, dense_schedule
