"""Which MoE layers DWDP manages, which keep their full expert table, which repeat.

DWDP manages a MoE decoder layer whose experts are the fused ``[E, ...]`` tables of the
model's expert count (the partition's). Any other MoE layer keeps its full expert table on
every rank instead of failing setup or being skipped in silence (seed 000, "Unmanaged MoE
layers"; docs/design.md §6.4): the first layer of each reason logs a WARNING, setup logs how many
layers each reason covers, and the counts are part of ``/dwdp/status``.

Managed layers get consecutive MoE orders (the order the expert prefetch ring cycles over);
an unmanaged layer takes no order, no slot and no hook.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dwdp.worker.models.base import ArchitectureAdapter, MoeLayer

log = logging.getLogger(__name__)


class UnmanagedReason(enum.StrEnum):
    """Why DWDP does not manage a MoE layer (the words of the WARNING and the status)."""

    NOT_FUSED = "experts_not_fused"
    """The experts are not fused ``gate_up_proj`` / ``down_proj`` tables."""
    EXPERT_COUNT = "expert_count"
    """The layer has another number of experts than the expert partition splits."""


_EXPLAIN = {
    UnmanagedReason.NOT_FUSED: "its experts are not fused [E, ...] gate_up_proj/down_proj "
                               "tables",
    UnmanagedReason.EXPERT_COUNT: "its expert count differs from the expert partition's",
}


@dataclass(frozen=True, slots=True)
class UnmanagedLayer:
    """A MoE decoder layer that keeps its full expert table, and why."""

    layer_index: int
    prefix: str
    reason: UnmanagedReason
    detail: str


@dataclass(frozen=True, slots=True)
class LayerSelection:
    """The outcome: ``managed`` layers (consecutive MoE orders), ``unmanaged`` layers, and
    ``repeated``: the MoE orders of the managed layers declared repeated."""

    managed: tuple[MoeLayer, ...]
    unmanaged: tuple[UnmanagedLayer, ...]
    repeated: frozenset[int]

    def unmanaged_counts(self) -> dict[str, int]:
        """``reason -> number of layers`` (JSON-able, for ``/dwdp/status``)."""
        counts: dict[str, int] = {}
        for layer in self.unmanaged:
            counts[str(layer.reason)] = counts.get(str(layer.reason), 0) + 1
        return counts


class RepeatedLayerError(ValueError):
    """A declared repeated layer is not a MoE layer DWDP manages."""


def select_layers(
    model: nn.Module, adapter: ArchitectureAdapter, num_experts: int | None
) -> LayerSelection:
    """Split ``model``'s MoE layers into managed and unmanaged ones.

    ``num_experts``: the expert count the partition splits (``None``: the first fused
    layer's). Raises :class:`RepeatedLayerError` when the adapter declares a repeated layer
    that is not a managed MoE layer (naming it and the managed ones).
    """
    fused = adapter.moe_layers(model)
    if num_experts is None and fused:
        num_experts = fused[0].num_experts
    managed: list[MoeLayer] = []
    not_fused = UnmanagedReason.NOT_FUSED
    unmanaged = [
        UnmanagedLayer(index, prefix, not_fused, _EXPLAIN[not_fused])
        for index, prefix in adapter.unfused_moe_layers(model)
    ]
    for layer in fused:
        if layer.num_experts != num_experts:
            unmanaged.append(UnmanagedLayer(
                layer.layer_index, layer.prefix, UnmanagedReason.EXPERT_COUNT,
                f"{_EXPLAIN[UnmanagedReason.EXPERT_COUNT]} ({layer.num_experts} experts, the "
                f"partition splits {num_experts})"))
            continue
        managed.append(dataclasses.replace(layer, moe_index=len(managed)))
    unmanaged.sort(key=lambda u: u.layer_index)
    order = {m.layer_index: m.moe_index for m in managed}
    declared = adapter.repeated_layers(model)
    unknown = sorted(declared - set(order))
    if unknown:
        raise RepeatedLayerError(
            f"repeated layers: decoder layer(s) {unknown} are not MoE layers DWDP manages "
            f"(managed: {sorted(order)})")
    return LayerSelection(tuple(managed), tuple(unmanaged),
                          frozenset(order[i] for i in declared))


def log_unmanaged(unmanaged: Sequence[UnmanagedLayer], rank: int) -> None:
    """One WARNING for the first layer of each reason, then one INFO line with the count of
    every reason (nothing when every MoE layer is managed)."""
    if not unmanaged:
        return
    first: dict[UnmanagedReason, UnmanagedLayer] = {}
    counts: dict[UnmanagedReason, int] = {}
    for layer in unmanaged:
        first.setdefault(layer.reason, layer)
        counts[layer.reason] = counts.get(layer.reason, 0) + 1
    for reason, layer in first.items():
        log.warning("DWDP does not manage MoE layer %s: %s; it keeps its full expert table "
                    "on every rank (reason %s)", layer.prefix, layer.detail, reason)
    log.info("DWDP rank %d: MoE layers kept whole: %s", rank,
             ", ".join(f"{r}={n}" for r, n in counts.items()))
