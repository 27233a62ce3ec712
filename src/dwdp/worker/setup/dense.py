"""Dense DWDP setup: six phases, six collectives, one verdict on every rank (docs/design.md §6.3).

P1 collect the layout, digest and checksums, compare them across ranks, check the free
memory; P2 allocate the row store and the slots and write this rank's rows; P3 map every
peer's row store and build the copy plans; P4 gather every layer into its slot and compare
the bytes with the originals; P5 repoint the module tensors into the slots and check every
layer again; P6 drop the originals, count leaks, and agree on the commit.

See [Note: fail-together] in ``phases``. A failure reported at the collective of P1-P5:
every rank restores its original tensors, releases what it allocated and raises
:class:`SetupError` (``restored=True``). A failure reported at the last collective: the
originals are gone, every rank releases its DWDP state and raises (``restored=False``);
the process must exit. A leaked original is a warning and a count, not a failure.

Ranks that disagree on ``enable_dense`` still meet at P1's collective (a rank with dense
DWDP off sends only its flag), so they all raise there instead of blocking.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dwdp.worker.backend.base import Backend, Stream
from dwdp.worker.dense.architecture import DenseLayerLike
from dwdp.worker.dense.layout import (
    DEFAULT_ALIGN,
    DENSE_MIN_BYTES,
    DenseLayout,
    Segment,
    collect_dense_layout,
    tensor_bytes,
    view_in,
)
from dwdp.worker.dense.repoint import count_leaks, current_tensor, watch_storages
from dwdp.worker.dense.rows import row_store_layout, write_rows
from dwdp.worker.dense.state import DenseDwdp, DenseState, SlotRings
from dwdp.worker.settings import CopySettings
from dwdp.worker.setup.group_vote import vote
from dwdp.worker.setup.phases import (
    DensePhase,
    FailureInjector,
    SetupError,
    describe,
    run_phase,
    setup_stream,
)
from dwdp.worker.transport.base import GroupTransport
from dwdp.worker.transport.codec import wire_record

log = logging.getLogger(__name__)


class SetupCheckError(RuntimeError):
    """A byte check of P4 or P5 found a slot that differs from the original weights."""


class MemoryFitError(RuntimeError):
    """The row store and the slots do not fit in the free memory (P1)."""


@dataclass(frozen=True, slots=True)
class DenseSetupOptions:
    """Knobs of dense setup. ``rings``: slots per segment; ``align``: bytes; ``min_bytes``:
    storages under this many bytes stay replicated (the seed's 1 MiB; tests of the protocol
    on toy models pass 0); ``dtype`` /
    ``device``: the final form every moved tensor must have (``None``: unchecked);
    ``copy``: the effective copy settings (``dwdp.worker.settings``); the gather kernel is
    resolved from them once at P1."""

    rings: SlotRings = field(default_factory=SlotRings)
    copy: CopySettings = field(default_factory=CopySettings)
    align: int = DEFAULT_ALIGN
    min_bytes: int = DENSE_MIN_BYTES
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None


@wire_record("dense.layout_summary")
@dataclass(frozen=True, slots=True)
class LayoutSummary:
    """What P1 exchanges: the flag, the layout digest, the blob checksums, bytes needed."""

    enable_dense: bool
    digest: str = ""
    checksums: tuple[tuple[str, str], ...] = ()
    need_bytes: int = 0


def setup_dense(
    model: nn.Module,
    layers: Sequence[DenseLayerLike],
    *,
    backend: Backend,
    transport: GroupTransport,
    enable_dense: bool,
    options: DenseSetupOptions | None = None,
    injector: FailureInjector | None = None,
) -> DenseDwdp | None:
    """Set dense DWDP up on this rank; a collective over ``transport`` (every rank calls it).

    ``layers`` are the model's MoE decoder layers in order (a model adapter's ``moe_layers``
    or :meth:`DenseArchitecture.moe_layers`). Returns the committed :class:`DenseDwdp`, or
    ``None`` when every rank has ``enable_dense`` off (after P1's collective only). Raises
    :class:`SetupError` on every rank alike (naming the phase and the failing ranks);
    transport errors (a rank that vanished) propagate after a local rollback.
    """
    options = options or DenseSetupOptions()
    injector = injector if injector is not None else FailureInjector()
    rank, n = transport.rank, transport.world_size
    dense: DenseDwdp | None = None
    try:
        dense = _p1_collect(model, layers, backend=backend, transport=transport,
                            enable_dense=enable_dense, options=options, injector=injector)
        if dense is None:
            return None
        undo = dense.restore_and_release
        run_phase(DensePhase.P2, transport, injector, lambda: _p2_allocate(dense), undo)
        run_phase(DensePhase.P3, transport, injector, lambda: _p3_map(dense, transport), undo)
        run_phase(DensePhase.P4, transport, injector, lambda: _p4_gather_check(dense), undo)
        run_phase(DensePhase.P5, transport, injector, lambda: _p5_repoint(dense), undo)
        _p6_commit(dense, transport, injector)
    except BaseException:
        if dense is not None and dense.state is DenseState.SETTING_UP:
            dense.restore_and_release()
        raise
    log.info("dense DWDP rank %d of %d committed: digest=%s moved=%d bytes store=%d bytes "
             "leaks=%d", rank, n, dense.layout.digest, dense.layout.sharded_bytes,
             dense.rows.nbytes, dense.leaks.count)
    return dense


def _p1_collect(model: nn.Module, layers: Sequence[DenseLayerLike], *, backend: Backend,
                transport: GroupTransport, enable_dense: bool, options: DenseSetupOptions,
                injector: FailureInjector) -> DenseDwdp | None:
    phase = DensePhase.P1
    error: str | None = None
    summary = LayoutSummary(enable_dense=enable_dense)
    dense: DenseDwdp | None = None
    try:
        if enable_dense:
            layout = collect_dense_layout(model, layers, world_size=transport.world_size,
                                          align=options.align, device=options.device,
                                          dtype=options.dtype, min_bytes=options.min_bytes)
            rows = row_store_layout(layout)
            need = rows.nbytes + sum(rows.slot_bytes[s] * options.rings.count(s)
                                     for s in rows.slot_bytes)
            free = backend.free_bytes()
            if need > free:
                raise MemoryFitError(
                    f"the row store ({rows.nbytes} bytes) and the prefetch slots "
                    f"({need - rows.nbytes} bytes) need {need} bytes but {free} bytes are free: "
                    "raise dwdp.dwdpSize (a smaller row shard per rank), turn dwdp.enableDense "
                    "off, or free the device memory other processes hold")
            gather = backend.resolve_gather(options.copy.gather_kernel,
                                            options.copy.gather_blocks)
            dense = DenseDwdp(backend=backend, layout=layout, rows=rows, rank=transport.rank,
                              rings=options.rings, settings=options.copy, gather=gather)
            summary = LayoutSummary(True, layout.digest, tuple(layout.checksums.items()), need)
        injector.check(phase, transport.rank)
    except Exception as exc:
        error = describe(exc)
    exchange = vote(transport, f"dense.{phase}", error, summary)
    errors = dict(exchange.errors) or _p1_disagreements(exchange.payloads)
    if errors:
        if dense is not None:
            dense.restore_and_release()
        raise SetupError(phase, phase.what, errors, restored=True)
    return dense


def _p1_disagreements(summaries: Sequence[LayoutSummary]) -> dict[int, str]:
    """The ranks whose P1 summary differs from the others', with why (same on every
    rank: computed from the one exchange). The reference is the most common value."""
    flags = [s.enable_dense for s in summaries]
    if len(set(flags)) > 1:
        on = [r for r, f in enumerate(flags) if f]
        off = [r for r, f in enumerate(flags) if not f]
        odd = on if len(on) < len(off) else off
        msg = f"ranks disagree on enable_dense (on: {on}, off: {off})"
        return dict.fromkeys(odd, msg)
    if not flags[0]:
        return {}
    for attr, what in (("digest", "layout digest"), ("checksums", "weights")):
        values = [getattr(s, attr) for s in summaries]
        common = max(set(values), key=values.count)
        odd = [r for r, v in enumerate(values) if v != common]
        if odd:
            if attr == "checksums":
                ref = dict(common)
                msgs = {}
                for r in odd:
                    blobs = [k for k, v in summaries[r].checksums if ref.get(k) != v]
                    msgs[r] = f"weights differ from the other ranks' in {blobs[:4]}"
                return msgs
            return {r: f"{what} {values[r][:16]} differs from {common[:16]}" for r in odd}
    return {}


def _p2_allocate(dense: DenseDwdp) -> None:
    dense.allocate()
    assert dense.store is not None
    write_rows(dense.layout, dense.rows, dense.rank, dense.store.tensor())
    dense.backend.current_stream().synchronize()  # setup only: peers read it after the vote


def _p3_map(dense: DenseDwdp, transport: GroupTransport) -> None:
    assert dense.store is not None
    dense.build_plans(dense.backend.map_peers(dense.store, transport))


def _gather(dense: DenseDwdp, layer: int, segment: Segment, slot: int, stream: Stream) -> None:
    """One blob into its slot on setup's created stream (see [Note: setup stream] in
    ``phases``), then wait: the byte check reads the slot on the host."""
    dense.launch(layer, segment, slot, stream)
    stream.synchronize()  # setup only


def _p4_gather_check(dense: DenseDwdp) -> None:
    stream = setup_stream(dense.backend, "dense-setup")
    for blob in dense.layout.blobs:
        slot = dense.home_slot(blob.layer, blob.segment)
        _gather(dense, blob.layer, blob.segment, slot, stream)
        data = dense.slot_buffers(blob.segment)[slot].tensor()
        for entry in blob.entries:
            assert entry.source is not None
            if not torch.equal(data[entry.offset : entry.end], entry.source):
                raise SetupCheckError(
                    f"{blob.prefix}/{blob.segment}: slot {slot} differs from the original "
                    f"bytes of {entry.tensors[0].name} after the gather")


def _p5_repoint(dense: DenseDwdp) -> None:
    for blob in dense.layout.blobs:
        slot = dense.slot_buffers(blob.segment)[dense.home_slot(blob.layer, blob.segment)]
        for entry in blob.entries:
            for ref in entry.tensors:
                dense.originals.repoint(ref, view_in(slot.tensor(), 0, ref, entry))
    stream = setup_stream(dense.backend, "dense-setup")
    for blob in dense.layout.blobs:
        slot_index = dense.home_slot(blob.layer, blob.segment)
        _gather(dense, blob.layer, blob.segment, slot_index, stream)
        slot_ptr = dense.slot_buffers(blob.segment)[slot_index].tensor().untyped_storage()
        for ref in blob.tensors():
            now = current_tensor(ref)
            if now.untyped_storage().data_ptr() != slot_ptr.data_ptr():
                raise SetupCheckError(f"{ref.name} does not point into its prefetch slot")
            if not torch.equal(tensor_bytes(now), tensor_bytes(dense.originals.original(ref))):
                raise SetupCheckError(f"{ref.name} reads other bytes through its slot than the "
                                      "original held")


def _p6_commit(dense: DenseDwdp, transport: GroupTransport, injector: FailureInjector) -> None:
    phase = DensePhase.P6
    error: str | None = None
    leaks = None
    try:
        layout: DenseLayout = dense.layout
        watched = watch_storages([(e.tensors[0].name, e.source) for b in layout.blobs
                                  for e in b.entries if e.source is not None])
        dense.originals.saved.clear()  # the originals are gone: no restore past this point
        layout.drop_sources()
        leaks = count_leaks(watched)
        if leaks.count:
            log.warning("dense DWDP rank %d: %d original storage(s) (%d bytes) still alive "
                        "after the drop (leaks=%d): %s", transport.rank, leaks.count,
                        leaks.nbytes, leaks.count, ", ".join(leaks.names[:8]))
        injector.check(phase, transport.rank)
    except Exception as exc:
        error = describe(exc)
    verdict = vote(transport, "dense.commit", error, leaks.count if leaks else None)
    if not verdict.ok:
        dense.release()
        raise SetupError(phase, phase.what, verdict.errors, restored=False)
    assert leaks is not None
    dense.commit(leaks)
