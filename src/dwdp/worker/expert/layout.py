"""Expert store and slot layout, and the expert copy plans.

Each rank's expert store holds, per MoE layer and per expert tensor (``gate_up_proj``,
``down_proj``), its range's experts back to back: ``local_count`` chunks of one expert
each (a chunk is one expert's slice, shape ``chunk_shape``). A prefetch slot holds one MoE
layer's full expert table per tensor (``[num_experts, *chunk_shape]``). The copy plan of
(layer, slot) copies each expert from the lowest rank that stores it (the owner: ranges may
overlap in the redundant partition), one descriptor per run of experts with one owner;
runs this rank owns are local descriptors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dwdp.worker.backend.base import Buffer, CopyDescriptor, CopyPlan, PeerView
from dwdp.worker.transport.codec import wire_record

ALIGN = 64
"""Bytes: every tensor block in the store and the slots starts on this boundary."""


def _round_up(value: int, align: int = ALIGN) -> int:
    return -(-value // align) * align


@dataclass(frozen=True, slots=True)
class ExpertLayerWeights:
    """One MoE layer's expert tensors as this rank holds them: ``name -> [local_count,
    *chunk_shape]`` tensors for its range (contiguous, in the final dtype)."""

    name: str
    tensors: Mapping[str, torch.Tensor]


@dataclass(slots=True)
class LoadedExperts:
    """The expert rows a sharded load read for this rank (``dwdp.worker.loading.sharded``):
    the rows ``[start, end)`` of every managed MoE layer's fused tables, ``tables[layer
    prefix][name]`` of shape ``[end - start, *chunk_shape]`` (contiguous, final dtype and
    device). The model's own tables of those layers stay on the meta device until the
    repoint; the repoint empties ``tables`` so the rows die with the last reference."""

    start: int
    end: int
    tables: dict[str, dict[str, torch.Tensor]]


@wire_record("expert.chunk_spec")
@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One expert tensor of one layer: name, one expert's shape and dtype, bytes."""

    name: str
    chunk_shape: tuple[int, ...]
    dtype: str
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class ExpertStoreLayout:
    """Offsets (bytes) of every (layer, tensor) block in each rank's store and in a slot.

    ``store_offsets[rank][layer][t]``; ``store_bytes[rank]``; ``slot_offsets[layer][t]``;
    ``slot_bytes``: the largest layer's full table (bytes of one slot).
    """

    chunks: tuple[tuple[ChunkSpec, ...], ...]
    ranges: tuple[tuple[int, int], ...]
    store_offsets: tuple[tuple[tuple[int, ...], ...], ...]
    store_bytes: tuple[int, ...]
    slot_offsets: tuple[tuple[int, ...], ...]
    slot_bytes: int
    num_experts: int


def chunk_specs(layer: ExpertLayerWeights) -> tuple[ChunkSpec, ...]:
    """The chunk of every tensor of ``layer`` (sorted by name, so ranks agree on order)."""
    out = []
    for name in sorted(layer.tensors):
        t = layer.tensors[name]
        shape = tuple(t.shape[1:])
        nbytes = torch.Size(shape).numel() * t.element_size()
        out.append(ChunkSpec(name, shape, str(t.dtype), nbytes))
    return tuple(out)


def expert_store_layout(chunks: Sequence[Sequence[ChunkSpec]],
                        ranges: Sequence[tuple[int, int]], num_experts: int) -> ExpertStoreLayout:
    """Lay out every rank's store (from its range) and one slot, identically on every rank."""
    store_offsets, store_bytes = [], []
    for start, end in ranges:
        cursor, per_layer = 0, []
        for layer in chunks:
            offs = []
            for chunk in layer:
                offs.append(cursor)
                cursor = _round_up(cursor + (end - start) * chunk.chunk_bytes)
            per_layer.append(tuple(offs))
        store_offsets.append(tuple(per_layer))
        store_bytes.append(cursor)
    slot_offsets, slot_bytes = [], 0
    for layer in chunks:
        cursor, offs = 0, []
        for chunk in layer:
            offs.append(cursor)
            cursor = _round_up(cursor + num_experts * chunk.chunk_bytes)
        slot_offsets.append(tuple(offs))
        slot_bytes = max(slot_bytes, cursor)
    return ExpertStoreLayout(tuple(tuple(c) for c in chunks), tuple(ranges),
                             tuple(store_offsets), tuple(store_bytes), tuple(slot_offsets),
                             slot_bytes, num_experts)


def owner_runs(ranges: Sequence[tuple[int, int]], num_experts: int) -> list[tuple[int, int, int]]:
    """``(owner, first, end)`` runs over experts ``[0, num_experts)``: the owner of an
    expert is the lowest rank whose range holds it."""
    runs: list[tuple[int, int, int]] = []
    for expert in range(num_experts):
        owner = next(r for r, (s, e) in enumerate(ranges) if s <= expert < e)
        if runs and runs[-1][0] == owner and runs[-1][2] == expert:
            runs[-1] = (owner, runs[-1][1], expert + 1)
        else:
            runs.append((owner, expert, expert + 1))
    return runs


def expert_plan(layout: ExpertStoreLayout, layer: int, *, rank: int, store: Buffer,
                peers: Sequence[PeerView | None], slot: Buffer) -> CopyPlan:
    """The copies that fill ``slot`` with layer ``layer``'s full expert table."""
    local: list[CopyDescriptor] = []
    remote: list[CopyDescriptor] = []
    for owner, first, end in owner_runs(layout.ranges, layout.num_experts):
        source = store if owner == rank else peers[owner]
        if source is None:
            raise ValueError(f"no peer view of rank {owner}")
        start = layout.ranges[owner][0]
        for t, chunk in enumerate(layout.chunks[layer]):
            d = CopyDescriptor(
                src=source,
                src_offset=(layout.store_offsets[owner][layer][t]
                            + (first - start) * chunk.chunk_bytes),
                dst=slot,
                dst_offset=layout.slot_offsets[layer][t] + first * chunk.chunk_bytes,
                nbytes=(end - first) * chunk.chunk_bytes,
            )
            (local if owner == rank else remote).append(d)
    return CopyPlan(remote=tuple(remote), local=tuple(local))
