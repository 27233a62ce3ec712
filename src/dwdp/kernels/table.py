"""Descriptor tables of the gather kernels: packing, chunk counts and checks (pure Python).

A gather launch reads a device table of ``GatherDesc`` rows (``gather_common.cuh``): four
little-endian ``uint64`` per descriptor, ``(src, dst, nbytes, chunk_begin)``, 32 bytes a
row. ``src`` is an absolute device pointer, ``dst`` an offset from the launch's
``dst_base``, ``chunk_begin`` the number of ``chunk_bytes`` chunks owned by the earlier
rows. Nothing here touches a device, so it is unit-tested without CUDA.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

ROW_BYTES = 32
"""Bytes of one packed ``GatherDesc`` row (four uint64)."""

_ROW = struct.Struct("<4Q")
_U64_MAX = (1 << 64) - 1


class GatherTableError(ValueError):
    """A descriptor cannot be packed (negative or too large a field, bad chunk size)."""


@dataclass(frozen=True, slots=True)
class GatherEntry:
    """One contiguous copy of a gather: ``nbytes`` bytes from device address ``src`` to
    ``dst_base + dst_offset``."""

    src: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PackedTable:
    """A packed table ready for upload: ``data`` (``len(entries) * 32`` bytes), the row
    count and the total chunk count (the launch's ``total_chunks``)."""

    data: bytes
    rows: int
    total_chunks: int
    nbytes: int
    chunk_bytes: int


def chunks_of(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` that cover ``nbytes`` bytes (ceil division)."""
    return -(-nbytes // chunk_bytes)


def pack_table(entries: Iterable[GatherEntry], *, chunk_bytes: int) -> PackedTable:
    """Pack ``entries`` into ``GatherDesc`` rows with their ``chunk_begin`` prefix sums.

    Zero-byte entries are dropped (they own no chunk). ``chunk_bytes`` must be a positive
    multiple of 16 (the kernels' chunk, ``DWDP_CHUNK``). Raises ``GatherTableError``.
    """
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise GatherTableError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    out = bytearray()
    begin = 0
    total = 0
    rows = 0
    for i, e in enumerate(entries):
        for field in ("src", "dst_offset", "nbytes"):
            value = getattr(e, field)
            if not 0 <= value <= _U64_MAX:
                raise GatherTableError(f"descriptor {i}: {field}={value} is not a uint64")
        if e.nbytes == 0:
            continue
        out += _ROW.pack(e.src, e.dst_offset, e.nbytes, begin)
        begin += chunks_of(e.nbytes, chunk_bytes)
        total += e.nbytes
        rows += 1
    return PackedTable(bytes(out), rows, begin, total, chunk_bytes)


def unpack_table(data: bytes) -> list[tuple[int, int, int, int]]:
    """The rows of a packed table as ``(src, dst, nbytes, chunk_begin)`` tuples."""
    if len(data) % ROW_BYTES:
        raise GatherTableError(f"table of {len(data)} bytes is not whole {ROW_BYTES}-byte rows")
    return [_ROW.unpack_from(data, off) for off in range(0, len(data), ROW_BYTES)]


def chunk_owner(rows: list[tuple[int, int, int, int]], chunk: int) -> int:
    """The row index that owns global ``chunk`` (what the kernel's cursor computes)."""
    owner = 0
    while owner + 1 < len(rows) and rows[owner + 1][3] <= chunk:
        owner += 1
    return owner
