"""Gather-kernel host side without a GPU: descriptor table packing, chunk ownership, the
kernel configs and the cubin cache key."""

from __future__ import annotations

import pytest

from dwdp.kernels.loader import (
    GatherConfig,
    KernelError,
    cache_dir,
    cache_key,
    cache_path,
    compile_options,
    read_sources,
)
from dwdp.kernels.table import (
    ROW_BYTES,
    GatherEntry,
    GatherTableError,
    chunk_owner,
    chunks_of,
    pack_table,
    unpack_table,
)


def test_pack_rows_and_chunk_prefix():
    entries = [
        GatherEntry(0x1000, 0, 100),
        GatherEntry(0x2000, 100, 0),  # dropped: owns no chunk
        GatherEntry(0x3000, 200, 64),
        GatherEntry(0x4000, 300, 33),
    ]
    t = pack_table(entries, chunk_bytes=32)
    assert t.rows == 3
    assert len(t.data) == 3 * ROW_BYTES
    assert t.nbytes == 197
    rows = unpack_table(t.data)
    assert rows == [(0x1000, 0, 100, 0), (0x3000, 200, 64, 4), (0x4000, 300, 33, 6)]
    assert t.total_chunks == 4 + 2 + 2


def test_chunk_owner_walks_like_the_kernel():
    t = pack_table(
        [GatherEntry(1, 0, 100), GatherEntry(2, 0, 64), GatherEntry(3, 0, 33)], chunk_bytes=32
    )
    rows = unpack_table(t.data)
    owners = [chunk_owner(rows, c) for c in range(t.total_chunks)]
    assert owners == [0, 0, 0, 0, 1, 1, 2, 2]
    # Every byte is covered once: chunk c of row r covers [k*32, min((k+1)*32, n)).
    covered = {}
    for c, r in enumerate(owners):
        src, _, n, begin = rows[r]
        k = c - begin
        for b in range(k * 32, min((k + 1) * 32, n)):
            assert (src, b) not in covered
            covered[(src, b)] = c
    assert len(covered) == 100 + 64 + 33


@pytest.mark.parametrize("chunk", [0, -16, 24])
def test_pack_refuses_bad_chunk(chunk):
    with pytest.raises(GatherTableError, match="multiple of 16"):
        pack_table([GatherEntry(0, 0, 1)], chunk_bytes=chunk)


def test_pack_refuses_non_uint64():
    with pytest.raises(GatherTableError, match="descriptor 0: nbytes"):
        pack_table([GatherEntry(0, 0, -1)], chunk_bytes=16)
    with pytest.raises(GatherTableError, match="src"):
        pack_table([GatherEntry(1 << 64, 0, 1)], chunk_bytes=16)


def test_unpack_refuses_partial_rows():
    with pytest.raises(GatherTableError):
        unpack_table(b"\0" * 31)


def test_chunks_of():
    assert chunks_of(0, 16) == 0
    assert chunks_of(1, 16) == 1
    assert chunks_of(32, 16) == 2
    assert chunks_of(33, 16) == 3


def test_default_configs_are_valid_and_differ():
    reg, tma = GatherConfig.default("register"), GatherConfig.default("tma")
    reg.validate()
    tma.validate()
    assert reg.dynamic_smem == 0
    assert tma.dynamic_smem == tma.stages * tma.chunk_bytes + 8 * tma.stages
    assert tma.dynamic_smem <= 227 * 1024  # Hopper's per-block limit
    assert reg.entry == "dwdp_gather_register" and tma.entry == "dwdp_gather_tma"
    with pytest.raises(KernelError, match="unknown gather kernel"):
        GatherConfig.default("dma")


@pytest.mark.parametrize(
    "bad",
    [
        GatherConfig("register", threads=512, chunk_bytes=24, unroll=4),
        GatherConfig("register", threads=500, chunk_bytes=4096, unroll=4),
        GatherConfig("register", threads=512, chunk_bytes=4096, unroll=0),
        GatherConfig("tma", threads=128, chunk_bytes=1 << 20, stages=2),
        GatherConfig("tma", threads=128, chunk_bytes=4096, stages=1),
        GatherConfig("tma", threads=128, chunk_bytes=4096, stages=17),
        GatherConfig("tma", threads=128, chunk_bytes=4096, stages=4, store_lag=4),
    ],
)
def test_bad_configs_refused(bad):
    with pytest.raises(KernelError):
        bad.validate()


def test_cache_key_changes_with_every_input():
    cfg = GatherConfig.default("register")
    main, headers = read_sources(cfg)
    opts = compile_options(cfg, "sm_90")
    base = cache_key(main, headers, opts, "sm_90", "nvrtc-13.0")
    assert base == cache_key(main, dict(headers), list(opts), "sm_90", "nvrtc-13.0")
    assert base != cache_key(main + " ", headers, opts, "sm_90", "nvrtc-13.0")
    changed = {k: v + "//" for k, v in headers.items()}
    assert base != cache_key(main, changed, opts, "sm_90", "nvrtc-13.0")
    assert base != cache_key(main, headers, opts, "sm_100", "nvrtc-13.0")
    assert base != cache_key(main, headers, opts, "sm_90", "nvrtc-13.2")
    other = compile_options(GatherConfig("register", 256, 256 * 16 * 8, unroll=8), "sm_90")
    assert base != cache_key(main, headers, other, "sm_90", "nvrtc-13.0")


def test_compile_options_name_arch_and_macros():
    opts = compile_options(GatherConfig.default("tma"), "sm_90")
    assert "--gpu-architecture=sm_90" in opts
    assert "-DDWDP_STAGES=4" in opts and "-DDWDP_CHUNK=49152" in opts


def test_cache_dir_and_path(monkeypatch, tmp_path):
    monkeypatch.setenv("DWDP_KERNEL_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    p = cache_path(GatherConfig.default("tma"), "sm_90", "abc")
    assert p == tmp_path / "dwdp_gather_tma-sm_90-abc.cubin"
    monkeypatch.delenv("DWDP_KERNEL_CACHE")
    assert cache_dir().parts[-3:] == (".cache", "dwdp", "kernels")


def test_nvrtc_compiles_both_variants_when_available(monkeypatch, tmp_path):
    """A syntax check of the sources where NVRTC is installed (no GPU needed)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # pragma: no cover - library missing
        pytest.skip(f"NVRTC not loadable: {e}")
    from dwdp.kernels.loader import compile_cubin

    monkeypatch.setenv("DWDP_KERNEL_CACHE", str(tmp_path))
    for variant in ("register", "tma"):
        cubin, path, cached = compile_cubin(GatherConfig.default(variant), "sm_90")
        assert cubin[:4] == b"\x7fELF" and not cached and path.is_file()
        again, _, cached = compile_cubin(GatherConfig.default(variant), "sm_90")
        assert cached and again == cubin


def test_kernel_cache_folder_follows_the_pod_environment(monkeypatch, tmp_path) -> None:
    """An operator-made pod has a read-only home and XDG_CACHE_HOME under its /tmp volume;
    DWDP_KERNEL_CACHE, when set, wins."""
    from pathlib import Path

    from dwdp.kernels.loader import cache_dir

    monkeypatch.delenv("DWDP_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "dwdp" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dwdp" / "kernels"
    monkeypatch.setenv("DWDP_KERNEL_CACHE", str(tmp_path / "k"))
    assert cache_dir() == tmp_path / "k"
