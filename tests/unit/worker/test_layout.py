"""The dense layout collector: what moves, what stays, rows, digest, checksums, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dwdp.worker.dense.architecture import DenseLayerSpec
from dwdp.worker.dense.layout import LayoutError, Segment, collect_dense_layout, view_in
from dwdp.worker.dense.rows import row_store_layout, write_rows


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(12, 8))
        self.register_buffer("q_view", self.qkv.data[0:4], persistent=False)  # a row view
        self.o = nn.Linear(8, 8, bias=False)
        self.o_alias = self.o.weight  # the same Parameter, a second name
        self.scale_copy = torch.randn(3)  # a plain attribute, movable by name table
        self.register_buffer("scratch", torch.zeros(5), persistent=False)


class Layer(nn.Module):
    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.self_attn = Attn()
        self.norm = nn.Parameter(torch.randn(8, dtype=torch.float16))
        self.self_attn.shared = shared  # one parameter used by every layer


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Parameter(torch.randn(4))
        self.layers = nn.ModuleList(Layer(shared) for _ in range(layers))


def specs(model: Model) -> list[DenseLayerSpec]:
    return [
        DenseLayerSpec(
            prefix=f"layers.{i}",
            decoder_layer=layer,
            attention_roots=("self_attn",),
            moe_dense_roots=(),
            never_move=frozenset({"self_attn.scratch"}),
            movable=("self_attn.scale_copy",),
        )
        for i, layer in enumerate(model.layers)
    ]


def names(layout, segment=Segment.ATTENTION, layer=0) -> set[str]:
    blob = next(b for b in layout.blobs if b.layer == layer and b.segment is segment)
    return {t.name for t in blob.tensors()}


def test_what_moves_and_what_stays():
    model = Model()
    layout = collect_dense_layout(model, specs(model), world_size=4, min_bytes=0)
    moved = names(layout)
    assert {
        "layers.0.self_attn.qkv",
        "layers.0.self_attn.q_view",
        "layers.0.self_attn.o.weight",
        "layers.0.self_attn.scale_copy",
    } <= moved
    assert "layers.0.self_attn.scratch" not in moved  # never-move table
    assert "layers.0.self_attn.shared" not in moved
    assert [r.name for r in layout.replicated] == [
        "layers.0.self_attn.shared",
        "layers.1.self_attn.shared",
    ]
    assert "layers.0.norm" not in moved  # not under a root


def test_views_and_aliases_share_one_storage_entry():
    model = Model()
    layout = collect_dense_layout(model, specs(model), world_size=3, min_bytes=0)
    blob = layout.blobs[0]
    by_name = {t.name: e for e in blob.entries for t in e.tensors}
    assert by_name["layers.0.self_attn.qkv"] is by_name["layers.0.self_attn.q_view"]
    assert all(e.offset % layout.align == 0 for e in blob.entries)
    slot = torch.zeros(blob.padded_bytes, dtype=torch.uint8)
    blob.read_into(0, blob.nbytes, slot[: blob.nbytes])
    for entry in blob.entries:
        for ref in entry.tensors:
            assert torch.equal(view_in(slot, 0, ref, entry), ref.get())


def test_rows_cover_the_blob_with_padding_only_at_the_end():
    model = Model()
    n = 4
    layout = collect_dense_layout(model, specs(model), world_size=n, min_bytes=0)
    rows = row_store_layout(layout)
    stores = [torch.full((rows.nbytes,), 0xAA, dtype=torch.uint8) for _ in range(n)]
    for rank in range(n):
        write_rows(layout, rows, rank, stores[rank])
    for blob, offset in zip(layout.blobs, rows.offsets, strict=True):
        assert blob.row_bytes % layout.align == 0
        assert blob.padding_bytes < n * layout.align
        gathered = torch.cat([s[offset : offset + blob.row_bytes] for s in stores])
        expect = torch.empty(blob.nbytes, dtype=torch.uint8)
        blob.read_into(0, blob.nbytes, expect)
        assert torch.equal(gathered[: blob.nbytes], expect)
        assert not gathered[blob.nbytes :].any()  # padding written as zeros
    assert rows.nbytes * n == layout.padded_bytes


def test_digest_is_stable_and_names_the_structure():
    a, b = Model(), Model()
    da = collect_dense_layout(a, specs(a), world_size=4, min_bytes=0).digest
    assert da == collect_dense_layout(b, specs(b), world_size=4, min_bytes=0).digest
    assert da != collect_dense_layout(b, specs(b), world_size=2, min_bytes=0).digest
    c = Model()
    c.layers[1].self_attn.o = nn.Linear(8, 9, bias=False)
    c.layers[1].self_attn.o_alias = c.layers[1].self_attn.o.weight
    assert da != collect_dense_layout(c, specs(c), world_size=4, min_bytes=0).digest


def test_checksums_follow_the_weights():
    a, b = Model(), Model()
    la = collect_dense_layout(a, specs(a), world_size=4, min_bytes=0)
    with torch.no_grad():
        b.layers[1].self_attn.qkv[3, 3] += 1
    lb = collect_dense_layout(b, specs(b), world_size=4, min_bytes=0)
    assert la.digest == lb.digest
    differ = [k for k, v in la.checksums.items() if lb.checksums[k] != v]
    assert differ == ["layers.1/attention"]


@pytest.mark.parametrize(
    "mutation, message",
    [
        (
            lambda m: (
                setattr(m.layers[0].self_attn, "o_alias", None)
                or m.layers[0].self_attn.o.register_parameter(
                    "weight", nn.Parameter(torch.randn(8, 8).t())
                )
            ),
            "not contiguous",
        ),
        (
            lambda m: m.layers[0].self_attn.register_buffer(
                "q_view", torch.empty(4, 8, device="meta")
            ),
            "meta device",
        ),
    ],
)
def test_tensors_not_in_final_form_are_refused(mutation, message):
    model = Model()
    mutation(model)
    with pytest.raises(LayoutError, match=message):
        collect_dense_layout(model, specs(model), world_size=4, min_bytes=0)


def test_a_tensor_that_needs_a_dtype_cast_is_refused():
    model = Model()
    model.layers[0].self_attn.scale_copy = torch.randn(3, dtype=torch.float64)
    with pytest.raises(LayoutError, match="cast it before"):
        collect_dense_layout(model, specs(model), world_size=4, min_bytes=0, dtype=torch.float32)
    model.layers[0].self_attn.scale_copy = torch.randn(3)
    collect_dense_layout(model, specs(model), world_size=4, min_bytes=0, dtype=torch.float32)


def test_drop_sources_forgets_the_originals():
    model = Model()
    layout = collect_dense_layout(model, specs(model), world_size=2, min_bytes=0)
    assert layout.sources()
    layout.drop_sources()
    assert layout.sources() == []
    with pytest.raises(LayoutError, match="dropped"):
        layout.blobs[0].read_into(0, 8, torch.empty(8, dtype=torch.uint8))


def test_storages_under_one_mib_stay_replicated():
    """Seed 000: dense DWDP moves only storages of at least 1 MiB; smaller ones stay
    replicated with the reason named. The default is the threshold setup uses."""
    from dwdp.worker.settings import DENSE_MIN_BYTES
    from dwdp.worker.setup.dense import DenseSetupOptions

    assert DENSE_MIN_BYTES == 1 << 20 == DenseSetupOptions().min_bytes
    model = Model()
    big = model.layers[0].self_attn
    big.qkv = nn.Parameter(torch.randn(DENSE_MIN_BYTES // 4 // 8, 8))  # exactly 1 MiB
    big.o = nn.Linear(8, DENSE_MIN_BYTES // 4 // 8 - 1, bias=False)  # 32 bytes under
    big.o_alias = big.o.weight
    layout = collect_dense_layout(model, specs(model), world_size=2)
    assert names(layout) == {"layers.0.self_attn.qkv"}
    small = {r.name: r.reason for r in layout.replicated}
    assert "layers.0.self_attn.o.weight" in small
    assert small["layers.0.self_attn.o.weight"] == f"its storage is under {DENSE_MIN_BYTES} bytes"
    assert names(layout, layer=1) == set()
