"""The gather kernels copy every byte: poisoned destinations, random sources, odd sizes,
16-byte offsets that are not multiples of the chunk (tile) size, unaligned sources."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

POISON = 0xA5


def _table(entries, chunk_bytes):
    from dwdp.kernels.table import pack_table

    packed = pack_table(entries, chunk_bytes=chunk_bytes)
    dev = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).cuda()
    return packed, dev


def _case(sizes, src_misalign=0, gap=48):
    """Random sources, one poisoned destination; returns (entries, sources, dst, spans)."""
    from dwdp.kernels.table import GatherEntry

    g = torch.Generator(device="cuda").manual_seed(sum(sizes) + src_misalign)
    sources, entries, spans = [], [], []
    off = 16 * 3  # a 16-byte offset that no chunk size divides
    for n in sizes:
        buf = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, device="cuda", generator=g)
        sources.append(buf)
        entries.append(GatherEntry(buf.data_ptr() + 16 + src_misalign, off, n))
        spans.append((off, n, buf, 16 + src_misalign))
        off += ((n + 15) // 16) * 16 + gap
    dst = torch.full((off + 256,), POISON, dtype=torch.uint8, device="cuda")
    return entries, sources, dst, spans


def _check(dst, spans):
    expected = torch.full_like(dst, POISON)
    for off, n, buf, s in spans:
        expected[off : off + n] = buf[s : s + n]
    torch.cuda.synchronize()
    mismatch = (dst != expected).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} bytes differ, first at {mismatch[:4].tolist()}"
    )


@pytest.fixture(scope="module", params=["register", "tma"])
def module(request):
    from dwdp.kernels.loader import load_gather

    torch.cuda.init()
    torch.empty(1, device="cuda")
    m = load_gather(request.param, device=0)
    yield m
    m.close()


SIZES = {
    "tiny": [1, 15, 16, 17, 31],
    "odd": [4096 + 16, 49152 + 48, 65536 + 7, 3 * 49152 + 16 * 7, 5 * (1 << 20) + 13],
    "layer": [8 << 20, 8 << 20, (8 << 20) + 16 * 5, 123457],
}


@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("blocks", [1, 7, 132])
def test_gather_copies_every_byte(module, sizes, blocks):
    entries, _src, dst, spans = _case(SIZES[sizes])
    packed, table = _table(entries, module.config.chunk_bytes)
    stream = torch.cuda.current_stream()
    module.launch(
        table_ptr=table.data_ptr(),
        rows=packed.rows,
        total_chunks=packed.total_chunks,
        dst_base=dst.data_ptr(),
        blocks=blocks,
        stream=stream.cuda_stream,
    )
    _check(dst, spans)


@pytest.mark.parametrize("misalign", [1, 8])
def test_gather_unaligned_sources_fall_back_to_bytes(module, misalign):
    entries, _src, dst, spans = _case([100_003, 70_000, 33], src_misalign=misalign)
    packed, table = _table(entries, module.config.chunk_bytes)
    module.launch(
        table_ptr=table.data_ptr(),
        rows=packed.rows,
        total_chunks=packed.total_chunks,
        dst_base=dst.data_ptr(),
        blocks=16,
        stream=torch.cuda.current_stream().cuda_stream,
    )
    _check(dst, spans)


def test_gather_absolute_destinations(module):
    """dst_base 0: table rows carry absolute destination addresses (several slots)."""
    from dwdp.kernels.table import GatherEntry

    a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device="cuda")
    da = torch.full((1 << 20,), POISON, dtype=torch.uint8, device="cuda")
    db = torch.full((300_016,), POISON, dtype=torch.uint8, device="cuda")
    entries = [
        GatherEntry(a.data_ptr(), da.data_ptr(), a.numel()),
        GatherEntry(b.data_ptr(), db.data_ptr() + 16, b.numel()),
    ]
    packed, table = _table(entries, module.config.chunk_bytes)
    module.launch(
        table_ptr=table.data_ptr(),
        rows=packed.rows,
        total_chunks=packed.total_chunks,
        dst_base=0,
        blocks=33,
        stream=torch.cuda.current_stream().cuda_stream,
    )
    torch.cuda.synchronize()
    assert torch.equal(da, a)
    assert torch.equal(db[16:], b) and bool((db[:16] == POISON).all())


def test_tma_kernel_runs_the_named_variant(module):
    """The module reports the variant it was built from (cubin symbol names differ)."""
    assert module.config.entry == f"dwdp_gather_{module.config.variant}"
    assert module.arch == "sm_90" or int(module.arch[3:]) >= 90
    assert module.max_blocks_per_sm() >= 1
