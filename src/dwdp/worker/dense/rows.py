"""The row store and the dense copy plans.

Rank r's row store holds row r of every blob, one after another in blob order, each at
``RowStoreLayout.offsets[i]`` (identical on every rank: the layout is). A prefetch slot of
a segment holds one whole padded blob of that segment; the copy plan of (blob, slot)
copies every rank's row from its store (this rank's row: a local descriptor; the others:
from their peer views) to ``rank * row_bytes`` in the slot. Only data bytes are copied;
the padding at the end of the last rows is never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dwdp.worker.backend.base import Buffer, CopyDescriptor, CopyPlan, PeerView
from dwdp.worker.dense.layout import Blob, DenseLayout, Segment


@dataclass(frozen=True, slots=True)
class RowStoreLayout:
    """Where each blob's row sits in a rank's row store, and the slot sizes.

    ``offsets[i]`` is the byte offset of blob ``layout.blobs[i]``'s row; ``nbytes`` the
    store size in bytes (the sum of row sizes); ``slot_bytes[segment]`` the largest padded
    blob of that segment (bytes of one prefetch slot).
    """

    offsets: tuple[int, ...]
    nbytes: int
    slot_bytes: dict[Segment, int]


def row_store_layout(layout: DenseLayout) -> RowStoreLayout:
    """Place one row of every blob, in blob order (rows are already aligned)."""
    offsets, cursor = [], 0
    slot_bytes = dict.fromkeys(Segment, 0)
    for blob in layout.blobs:
        offsets.append(cursor)
        cursor += blob.row_bytes
        slot_bytes[blob.segment] = max(slot_bytes[blob.segment], blob.padded_bytes)
    return RowStoreLayout(tuple(offsets), cursor, slot_bytes)


def write_rows(layout: DenseLayout, rows: RowStoreLayout, rank: int, store: torch.Tensor) -> None:
    """Write ``rank``'s row of every blob into the uint8 ``store`` tensor (P2); padding
    bytes are written as zeros."""
    for blob, offset in zip(layout.blobs, rows.offsets, strict=True):
        start, end = blob.row_span(rank)
        target = store[offset : offset + blob.row_bytes]
        target.zero_()
        if end > start:
            blob.read_into(start, end, target[: end - start])


def blob_plan(
    blob: Blob,
    store_offset: int,
    *,
    rank: int,
    store: Buffer,
    peers: Sequence[PeerView | None],
    slot: Buffer,
) -> CopyPlan:
    """The copies that gather ``blob`` into ``slot``: one descriptor per rank whose row
    holds data; this rank's row goes to ``local``, the peers' rows to ``remote``."""
    local: list[CopyDescriptor] = []
    remote: list[CopyDescriptor] = []
    for peer in range(blob.world_size):
        start, end = blob.row_span(peer)
        if end <= start:
            continue
        source = store if peer == rank else peers[peer]
        if source is None:
            raise ValueError(f"no peer view of rank {peer} for {blob.prefix}/{blob.segment}")
        descriptor = CopyDescriptor(source, store_offset, slot, start, end - start)
        (local if peer == rank else remote).append(descriptor)
    return CopyPlan(remote=tuple(remote), local=tuple(local))
