"""vLLM interop on a GPU (issue 33): a context rank whose KV cache is on cuda:0 stages it in
vLLM 0.32.0's FLASH_ATTN layout in VRAM, byte for byte what ``staged_blocks`` gives on the host
for a copy of the cache (the layout the CPU unit tests check against vLLM's definitions,
tests/unit/worker/test_vllm_layout.py), and advertises FLASH_ATTN, 16-token blocks, LBHNC,
VRAM and its device in the agent metadata and the compatibility hash (real NIXL, real ZMQ)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytest.importorskip("zmq")

LAYERS, HEADS, DIM, BLOCK = 2, 2, 128, 16


def _caches():
    from dwdp.worker.engine.paged import PagedKVCache

    gen = torch.Generator().manual_seed(7)
    host = PagedKVCache(12, BLOCK, dtype=torch.bfloat16, device="cpu", kernel=False)
    gpu = PagedKVCache(12, BLOCK, dtype=torch.bfloat16, device=torch.device("cuda:0"),
                       kernel=False)
    for i in range(LAYERS):
        host.layers[i] = tuple(torch.randn(12 * BLOCK, HEADS, DIM, generator=gen)
                               .to(torch.bfloat16) for _ in range(2))
        gpu.layers[i] = tuple(t.to("cuda:0") for t in host.layers[i])
    return host, gpu


def test_a_cuda_cache_is_staged_in_flash_attn_layout_in_vram():
    from dwdp.worker.disagg.vllm_layout import LAYOUTS
    from dwdp.worker.disagg.vllm_nixl import (
        VllmInterop,
        VllmProducer,
        compatibility_hash,
        staged_blocks,
    )
    from dwdp_dev.worker.servers import free_port

    host, gpu = _caches()
    producer = VllmProducer(gpu, VllmInterop(model="/m", port=free_port()), num_layers=LAYERS,
                            host="127.0.0.1", lease_s=30, staging_blocks=10)
    try:
        assert producer.layout is LAYOUTS["flash"]
        blocks = [11, 2, 7, 0, 5, 1, 3, 4, 6, 8]
        staged = producer.stage("r", blocks, 150)
        assert len(staged) == 10  # 150 tokens in 16-token blocks
        for layer in range(LAYERS):
            assert producer.staging[layer].device == torch.device("cuda:0")
            ours = producer.staging[layer][staged].cpu().contiguous().view(torch.uint8)
            want = staged_blocks(host, layer, blocks, 150, LAYOUTS["flash"])
            assert torch.equal(ours, want.contiguous().view(torch.uint8)), layer
        meta = producer.agent_metadata()
        assert (meta["attn_backend_name"], meta["block_size"], meta["kv_cache_layout"]) == (
            "FLASH_ATTN", 16, "LBHNC")
        assert meta["region_mem_types"] == ["VRAM"] * LAYERS and meta["device_id"] == 0
        assert meta["block_lens"] == [HEADS * BLOCK * 2 * DIM * 2] * LAYERS
        assert meta["kv_caches_base_addr"] == [t.data_ptr() for t in producer.staging]
        assert producer.hash == compatibility_hash(
            model="/m", dtype="torch.bfloat16", num_kv_heads=HEADS, head_size=DIM,
            num_layers=LAYERS, attn_backend="FLASH_ATTN")
    finally:
        producer.close()
