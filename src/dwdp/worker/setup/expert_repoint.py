"""Expert setup after the expert commit: gather check, repoint, drop (the expert P4-P6).

Beside the dense P4-P6 of ``dense``: every MoE layer's expert tables are gathered once into
their home slot (MoE order ``o`` -> slot ``o % num_slots``) on a created setup stream and
compared with the original tables on the host; one vote decides for every rank; then the
experts modules' ``gate_up_proj``/``down_proj`` are pointed into their slots for good and the
original tables are dropped, counting the ones still alive (leaks: a warning and a count,
never a failure).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dwdp.worker.dense.repoint import LeakReport, count_leaks, watch_storages
from dwdp.worker.dense.state import DenseDwdp
from dwdp.worker.expert.layout import LoadedExperts
from dwdp.worker.models.base import MoeLayer, expert_param_names
from dwdp.worker.setup.expert import ExpertDwdp
from dwdp.worker.setup.group_vote import vote
from dwdp.worker.setup.phases import SetupError, setup_stream
from dwdp.worker.transport.base import GroupTransport

log = logging.getLogger(__name__)

CHECK_PHASE = "attach"
"""The phase a failed expert gather check names (``SetupError.phase``)."""


@dataclass(frozen=True, slots=True)
class ExpertRepoint:
    """What dropping the original expert tables gave back: ``freed_bytes`` (their storages,
    bytes) and ``leaks`` (the ones still referenced elsewhere)."""

    freed_bytes: int
    leaks: LeakReport


def check_expert_gather(
    experts: ExpertDwdp,
    layers: Sequence[MoeLayer],
    transport: GroupTransport,
    *,
    dense: DenseDwdp | None,
    loaded: LoadedExperts | None = None,
) -> None:
    """Gather every MoE layer into its home slot and compare it with the original tables; a
    collective. With ``loaded`` (a sharded load) the originals are this rank's rows, compared
    with the same rows of the slot (the ranks' ranges together cover every expert). On a
    failure anywhere every rank releases the experts (and the committed dense state) and
    raises ``SetupError`` (``restored`` only without dense DWDP)."""
    error = None
    try:
        stream = setup_stream(experts.backend, "expert-setup")  # [Note: setup stream]
        for m in layers:
            slot = m.moe_index % experts.num_slots
            experts.launch(m.moe_index, slot, stream)
            stream.synchronize()  # setup only: the host compares the bytes below
            views = experts.slot_views(slot, m.moe_index)
            first = loaded.start if loaded is not None else 0
            for p, original in _originals(m, loaded).items():
                if loaded is not None:
                    views[p] = views[p][loaded.start : loaded.end]
                # a sharded load's rows are on the host: compared there (no device copy)
                gathered = views[p].to(original.device)
                if not torch.equal(gathered, original.detach()):
                    raise RuntimeError(
                        f"{m.prefix} {p}: the gathered slot differs from the original in "
                        f"experts {_differing(gathered, original, first)} (each copied from "
                        "the lowest rank that stores it: with a redundant partition, ranks "
                        "that share an expert hold other bytes for it)"
                    )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    verdict = vote(transport, "attach.expert_check", error)
    if not verdict.ok:
        experts.release()
        if dense is not None:
            dense.release()
        raise SetupError(
            CHECK_PHASE, "check the expert gather", verdict.errors, restored=dense is None
        )


def _differing(gathered: torch.Tensor, original: torch.Tensor, first: int) -> list[int]:
    """The expert indices (at most 4) whose rows differ; row 0 is expert ``first``."""
    rows = (gathered != original.detach()).flatten(1).any(1).nonzero().flatten()
    return [first + int(i) for i in rows[:4]]


def _originals(m: MoeLayer, loaded: LoadedExperts | None) -> dict[str, torch.Tensor]:
    """The layer's original tables: the module's, or the rows a sharded load read."""
    return m.expert_tensors() if loaded is None else dict(loaded.tables[m.prefix])


def repoint_experts(
    experts: ExpertDwdp,
    layers: Sequence[MoeLayer],
    *,
    rank: int,
    loaded: LoadedExperts | None = None,
) -> ExpertRepoint:
    """Point every experts module's tables into their home slot and drop the originals
    (with ``loaded``: the loaded rows, which it empties; the module's meta tables are
    replaced by parameters over the slot); returns the bytes freed and the leak report (one
    WARNING when any original is alive)."""
    originals = {m.moe_index: _originals(m, loaded) for m in layers}
    watched = watch_storages(
        [(f"{m.prefix}.experts.{p}", t) for m in layers for p, t in originals[m.moe_index].items()]
    )
    freed = sum(t.untyped_storage().nbytes() for d in originals.values() for t in d.values())
    for m in layers:
        views = experts.slot_views(m.moe_index % experts.num_slots, m.moe_index)
        for p in expert_param_names(m.experts):
            table = getattr(m.experts, p)
            if table.is_meta:  # a sharded load: nothing to keep, a new parameter
                setattr(m.experts, p, nn.Parameter(views[p], requires_grad=table.requires_grad))
            else:
                table.data = views[p]
    originals.clear()
    if loaded is not None:
        loaded.tables.clear()
    leaks = count_leaks(watched)
    if leaks.count:
        log.warning(
            "expert DWDP rank %d: %d original expert table(s) still alive (leaks=%d): %s",
            rank,
            leaks.count,
            leaks.count,
            ", ".join(leaks.names[:8]),
        )
    return ExpertRepoint(freed, leaks)
