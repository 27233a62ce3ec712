"""The dense layout collector: blobs A(l) and D(l) of every MoE decoder layer, cut in rows.

For each MoE decoder layer l the tensors under its attention roots form blob A(l) and those
under its MoE-dense roots blob D(l) (docs/design.md §6.5). A blob is a sequence of *storages*
(the memory of one or more tensors: a fused weight and its row views, aliases), each placed
at an ``align``-byte boundary, and is cut into ``world_size`` rows of ``row_bytes`` each
(the last ones padded): rank r keeps row r in its row store.

Rules (seed 000, "how dense DWDP works"):
- a storage that any tensor outside its own blob also uses (another layer, the other blob,
  the rest of the model) stays replicated: only storages owned by one blob move;
- a storage under :data:`DENSE_MIN_BYTES` (1 MiB) stays replicated: a norm or a small
  router is not worth a copy per forward;
- never-move names (scratch, routing bias) and the routed experts stay;
- a tensor that is not in its final form (meta, non-contiguous, on another device, or in
  another dtype than the model runs in, FP8 weights and their scales excepted) is refused
  with :class:`LayoutError`: setup runs after every weight transform, never before.

The layout digest (sha256 over names, shapes, strides, dtypes and offsets) is equal on
every rank that built the same model; the per-blob checksums (blake2b over the bytes)
are equal on every rank that loaded the same weights. Setup compares both in P1.
"""

from __future__ import annotations

import enum
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dwdp.worker.dense.architecture import DenseLayerLike
from dwdp.worker.quant.fp8 import is_quantized
from dwdp.worker.settings import DENSE_MIN_BYTES

DEFAULT_ALIGN = 64
"""Bytes: storages start and rows end on this boundary (any dtype view stays aligned; the
gather kernels' 16-byte vector loads stay aligned)."""




class LayoutError(ValueError):
    """The model cannot be laid out for dense DWDP; the message names the tensor and the fix."""


class Segment(enum.StrEnum):
    """The two blobs of an MoE decoder layer."""

    ATTENTION = "attention"
    """Blob A(l): the attention weights (read between hooks H1 and H2)."""
    MOE_DENSE = "moe_dense"
    """Blob D(l): router, shared expert, latent projections, norms (read H1..H3)."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    """One module attribute that views a placed storage.

    ``kind`` is ``"parameter"``, ``"buffer"`` or ``"attribute"`` (a plain tensor attribute
    from the movable table). ``storage_offset`` and ``stride`` are in elements of ``dtype``.
    """

    name: str
    module: nn.Module = field(compare=False, repr=False)
    attr: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def get(self) -> torch.Tensor:
        """The tensor the module holds now."""
        return getattr(self.module, self.attr)


@dataclass(slots=True)
class StorageEntry:
    """One storage of a blob: ``nbytes`` bytes at byte ``offset`` of the blob.

    ``source`` is a 1-D ``torch.uint8`` view of the original storage; it is the only
    reference the layout keeps to the original weights and :meth:`DenseLayout.drop_sources`
    clears it (P6).
    """

    offset: int
    nbytes: int
    tensors: tuple[TensorRef, ...]
    source: torch.Tensor | None = field(repr=False, default=None)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(slots=True)
class Blob:
    """Blob A(l) or D(l) of the MoE layer with order ``layer`` (0-based among MoE layers).

    ``nbytes`` is the data extent in bytes; ``row_bytes`` the bytes of each of the
    ``world_size`` rows (multiple of the alignment); ``padded_bytes = row_bytes *
    world_size`` is what a prefetch slot holds.
    """

    layer: int
    prefix: str
    segment: Segment
    entries: tuple[StorageEntry, ...]
    nbytes: int
    row_bytes: int
    world_size: int
    checksum: str = ""

    @property
    def padded_bytes(self) -> int:
        return self.row_bytes * self.world_size

    @property
    def padding_bytes(self) -> int:
        return self.padded_bytes - self.nbytes

    def row_span(self, rank: int) -> tuple[int, int]:
        """Blob byte range ``[start, end)`` of ``rank``'s row, clipped to the data (the
        rest of the row is padding); ``start == end`` for an all-padding row."""
        start = min(rank * self.row_bytes, self.nbytes)
        return start, min(start + self.row_bytes, self.nbytes)

    def read_into(self, start: int, end: int, out: torch.Tensor) -> None:
        """Write the blob bytes ``[start, end)`` into the uint8 tensor ``out`` (``end -
        start`` elements); gaps between storages read as zero. Needs the sources."""
        out.zero_()
        for entry in self.entries:
            lo, hi = max(start, entry.offset), min(end, entry.end)
            if lo >= hi:
                continue
            source = _source(entry)
            out[lo - start : hi - start].copy_(source[lo - entry.offset : hi - entry.offset])

    def tensors(self) -> Iterable[TensorRef]:
        for entry in self.entries:
            yield from entry.tensors


@dataclass(frozen=True, slots=True)
class Replicated:
    """A tensor under the dense roots that stays on every rank, and why."""

    name: str
    nbytes: int
    reason: str


@dataclass(slots=True)
class DenseLayout:
    """Every blob of the model (in MoE layer order, A before D) and what stays replicated."""

    world_size: int
    align: int
    blobs: tuple[Blob, ...]
    replicated: tuple[Replicated, ...]
    digest: str = ""

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the weights that move (the replicated copy each rank held before)."""
        return sum(b.nbytes for b in self.blobs)

    @property
    def padded_bytes(self) -> int:
        """Sharded bytes plus row padding: ``world_size`` times one rank's row store."""
        return sum(b.padded_bytes for b in self.blobs)

    @property
    def checksums(self) -> dict[str, str]:
        """``"<prefix>/<segment>" -> checksum`` of every blob."""
        return {f"{b.prefix}/{b.segment}": b.checksum for b in self.blobs}

    def drop_sources(self) -> None:
        """Forget the original storages (P6): afterwards only the slots hold the weights."""
        for blob in self.blobs:
            for entry in blob.entries:
                entry.source = None

    def sources(self) -> list[torch.Tensor]:
        """The original storages still referenced (uint8 views)."""
        return [e.source for b in self.blobs for e in b.entries if e.source is not None]


def _source(entry: StorageEntry) -> torch.Tensor:
    if entry.source is None:
        raise LayoutError("the original weights were dropped (after P6); the blob is gone")
    return entry.source


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def _storage_key(tensor: torch.Tensor) -> tuple[str, int | None, int]:
    storage = tensor.untyped_storage()
    return tensor.device.type, tensor.device.index, storage.data_ptr()


@dataclass(slots=True)
class _Candidate:
    ref: TensorRef
    tensor: torch.Tensor
    owner: tuple[int, Segment]


def _candidates(layer_index: int, spec: DenseLayerLike, segment: Segment) -> list[_Candidate]:
    """Parameters, buffers and movable plain attributes under the segment's roots."""
    roots = spec.attention_roots if segment is Segment.ATTENTION else spec.moe_dense_roots
    never = set(spec.never_move)
    skip = set(getattr(spec, "skip", ()))
    experts = getattr(spec, "experts", None)
    movable = set(getattr(spec, "movable", ()))
    layer = spec.decoder_layer
    out: list[_Candidate] = []
    seen: set[tuple[int, str]] = set()
    for root in roots:
        root_module = layer.get_submodule(root)
        for rel, module in root_module.named_modules(prefix=root):
            if rel in skip or module is experts or any(rel.startswith(s + ".") for s in skip):
                continue
            tables: list[tuple[str, dict[str, Any]]] = [
                ("parameter", module._parameters),
                ("buffer", module._buffers),
                ("attribute", {k: v for k, v in vars(module).items()
                               if isinstance(v, torch.Tensor) and f"{rel}.{k}" in movable}),
            ]
            for kind, table in tables:
                for attr, tensor in table.items():
                    local = f"{rel}.{attr}"
                    if tensor is None or local in never or (id(module), attr) in seen:
                        continue
                    seen.add((id(module), attr))
                    ref = TensorRef(
                        name=f"{spec.prefix}.{local}",
                        module=module,
                        attr=attr,
                        kind=kind,
                        dtype=tensor.dtype,
                        shape=tuple(tensor.shape),
                        stride=tuple(tensor.stride()),
                        storage_offset=tensor.storage_offset(),
                    )
                    out.append(_Candidate(ref, tensor, (layer_index, segment)))
    return out


def _check_final_form(c: _Candidate, device: torch.device | None,
                      dtype: torch.dtype | None) -> None:
    t, name = c.tensor, c.ref.name
    if t.is_meta:
        raise LayoutError(f"{name} is on the meta device: load the weights before DWDP setup")
    if device is not None and t.device != device:
        raise LayoutError(f"{name} is on {t.device}, the DWDP backend on {device}: move the "
                          "model before DWDP setup")
    if not t.is_contiguous():
        raise LayoutError(f"{name} (shape {tuple(t.shape)}, stride {tuple(t.stride())}) is not "
                          "contiguous: finish the weight transforms (.contiguous()) before DWDP "
                          "setup")
    if dtype is not None and t.is_floating_point() and t.dtype != dtype \
            and not is_quantized(name, t):  # FP8 weights and scales keep their dtype
        raise LayoutError(f"{name} is {t.dtype} but the model runs in {dtype}: cast it before "
                          "DWDP setup (dense DWDP moves tensors in their final form)")


def collect_dense_layout(
    model: nn.Module,
    layers: Sequence[DenseLayerLike],
    *,
    world_size: int,
    align: int = DEFAULT_ALIGN,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    min_bytes: int = DENSE_MIN_BYTES,
) -> DenseLayout:
    """Collect blobs A(l) and D(l) of ``layers`` (the model's MoE decoder layers in order).

    ``world_size`` is N, the rows per blob; ``align`` the byte alignment of storages and
    rows; ``min_bytes``: storages smaller than this stay replicated (0: every storage a blob
    owns moves); ``device`` and ``dtype`` the final device and floating dtype every moved tensor
    must have (``None``: not checked). Raises :class:`LayoutError` for a tensor that is not
    in its final form, and ``ValueError`` for N < 1 or an alignment that is not a power of 2.
    The layout keeps uint8 views of the original storages until :meth:`drop_sources`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    device = torch.device(device) if isinstance(device, str) else device

    per_blob: dict[tuple[int, Segment], list[_Candidate]] = {}
    collected: dict[tuple[int, str], tuple[int, Segment]] = {}
    for index, spec in enumerate(layers):
        for segment in Segment:
            cands = _candidates(index, spec, segment)
            per_blob[(index, segment)] = cands
            for c in cands:
                collected.setdefault((id(c.ref.module), c.ref.attr), c.owner)

    # Who uses each storage: a blob, or "outside" (any other tensor of the model).
    users: dict[tuple[str, int | None, int], set[Any]] = defaultdict(set)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is None or tensor.is_meta or tensor.untyped_storage().nbytes() == 0:
                    continue
                owner = collected.get((id(module), attr), "outside")
                users[_storage_key(tensor)].add(owner)
    for cands in per_blob.values():
        for c in cands:
            if not c.tensor.is_meta:
                users[_storage_key(c.tensor)].add(c.owner)

    blobs: list[Blob] = []
    replicated: list[Replicated] = []
    for index, spec in enumerate(layers):
        for segment in Segment:
            groups: dict[tuple[str, int | None, int], list[_Candidate]] = {}
            for c in per_blob[(index, segment)]:
                if c.tensor.is_meta:
                    _check_final_form(c, device, dtype)  # raises
                key = _storage_key(c.tensor)
                if users[key] != {c.owner}:
                    others = sorted(str(u) for u in users[key] if u != c.owner)
                    replicated.append(Replicated(
                        c.ref.name, c.tensor.untyped_storage().nbytes(),
                        f"its storage is shared with {', '.join(others)}"))
                    continue
                if c.tensor.untyped_storage().nbytes() < min_bytes:
                    replicated.append(Replicated(
                        c.ref.name, c.tensor.untyped_storage().nbytes(),
                        f"its storage is under {min_bytes} bytes"))
                    continue
                _check_final_form(c, device, dtype)
                groups.setdefault(key, []).append(c)
            entries: list[StorageEntry] = []
            offset = 0
            for cands in groups.values():
                storage = cands[0].tensor.untyped_storage()
                source = torch.empty(0, dtype=torch.uint8, device=cands[0].tensor.device)
                source.set_(storage)
                entries.append(StorageEntry(offset, storage.nbytes(),
                                            tuple(c.ref for c in cands), source))
                offset = _round_up(offset + storage.nbytes(), align)
            nbytes = entries[-1].end if entries else 0
            row_bytes = _round_up(-(-nbytes // world_size), align) if nbytes else 0
            blob = Blob(index, spec.prefix, segment, tuple(entries), nbytes, row_bytes,
                        world_size)
            blob.checksum = blob_checksum(blob)
            blobs.append(blob)
    layout = DenseLayout(world_size, align, tuple(blobs), tuple(replicated))
    layout.digest = layout_digest(layout)
    return layout


def layout_digest(layout: DenseLayout) -> str:
    """sha256 (hex) over N, the alignment, and per blob its rows and every tensor's name,
    kind, dtype, shape, stride and offsets, plus the replicated names: equal on every rank
    that built the same model with the same settings."""
    h = hashlib.sha256()

    def put(*parts: object) -> None:
        h.update(("\x1f".join(str(p) for p in parts) + "\x1e").encode())

    put("dwdp-dense-layout-v1", layout.world_size, layout.align)
    for blob in layout.blobs:
        put("blob", blob.layer, blob.prefix, blob.segment, blob.nbytes, blob.row_bytes)
        for entry in blob.entries:
            put("storage", entry.offset, entry.nbytes)
            for t in entry.tensors:
                put("tensor", t.name, t.kind, t.dtype, t.shape, t.stride, t.storage_offset)
    for r in layout.replicated:
        put("replicated", r.name, r.nbytes)
    return h.hexdigest()


def blob_checksum(blob: Blob) -> str:
    """blake2b-128 (hex) over the blob's storages' bytes, in order: equal on every rank
    that holds the same weights."""
    h = hashlib.blake2b(digest_size=16)
    for entry in blob.entries:
        data = _source(entry).detach().cpu().numpy()
        h.update(entry.offset.to_bytes(8, "little"))
        h.update(data.data)
    return h.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (for bitwise comparisons:
    NaNs compare equal to themselves)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def view_in(buffer: torch.Tensor, base: int, ref: TensorRef, entry: StorageEntry) -> torch.Tensor:
    """``ref``'s tensor inside the uint8 ``buffer`` whose byte ``base`` holds the blob's
    first byte (a prefetch slot): same dtype, shape, stride and storage offset as the
    original, over the bytes of ``entry``."""
    itemsize = torch.empty((), dtype=ref.dtype).element_size()
    region = buffer[base + entry.offset : base + entry.offset + entry.nbytes // itemsize * itemsize]
    typed = region.view(ref.dtype)
    return typed.as_strided(ref.shape, ref.stride, typed.storage_offset() + ref.storage_offset)
