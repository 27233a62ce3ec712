"""Run by vLLM 0.32.0's interpreter for tests/unit/worker/test_vllm_layout.py (no dwdp import):
writes K/V into a KV cache laid out by vLLM's own definitions and writes back its bytes.

argv: a JSON file of cases and an output folder. Each case: ``kind`` (``flash``: FLASH_ATTN,
written with ``reshape_and_cache_flash``'s index semantics, its CUDA op does not run here;
``vec``/``amx``: CPU_ATTN, written by the wheel's ``cpu_attn_reshape_and_cache`` with that
ISA), ``dtype``, ``heads``, ``head_dim``, ``blocks``, ``layers``, ``slots`` (one per token) and
``kv`` (a file of float32 [layers, 2, tokens, heads, head_dim]). For each case ``<i>.bin`` is
the cache's bytes, every layer's region in turn; stdout is one JSON line of what vLLM
declares. ``hash_model``: also vLLM's compatibility hashes of that checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch


def _views(case: dict, block_size: int) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """vLLM's per-layer [B, H, N, 2 x head_dim] views of one int8 allocation, LBHNC as the NIXL
    connector resolves it (``create_kv_cache_views``), and what vLLM declares about them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    non_mla = SimpleNamespace(model_config=SimpleNamespace(use_mla=False))
    layout = KVCacheLayout[NixlConnector.get_required_kvcache_layout(non_mla)]
    dtype = getattr(torch, case["dtype"])
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=case["heads"],
                             head_size=case["head_dim"], dtype=dtype)
    page, blocks, layers = spec.page_size_bytes, case["blocks"], case["layers"]
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=[f"l{i}" for i in range(layers)],
                           layer_stride=page * blocks, block_stride=page)
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor)
    declared = {
        "layout": layout.name,
        "block_size": block_size,
        "page_size_bytes": page,
        "view_shape": list(views[0].shape),
        "view_stride": list(views[0].stride()),
        "layer_offsets": [v.data_ptr() - raw.data_ptr() for v in views],
    }
    return raw, views, declared


def _kv(case: dict) -> torch.Tensor:
    dtype = getattr(torch, case["dtype"])
    shape = (case["layers"], 2, len(case["slots"]), case["heads"], case["head_dim"])
    data = Path(case["kv"]).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape).to(dtype)


def flash(case: dict) -> tuple[torch.Tensor, dict]:
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as Backend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    block_size = Backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
    raw, views, declared = _views(case, block_size)
    candidates = [m.name for m in get_supported_kv_cache_layouts([Backend])]
    kv, slots, d = _kv(case), torch.tensor(case["slots"]), case["head_dim"]
    for layer, view in enumerate(views):
        # FlashAttentionImpl.do_kv_cache_update's split: (B, H, N, 2D) -> (B, N, H, D) twice
        key_cache, value_cache = view.transpose(1, 2).split(d, dim=-1)
        # reshape_and_cache_flash: token i to block slots[i] // N, row slots[i] % N
        key_cache[slots // block_size, slots % block_size] = kv[layer, 0]
        value_cache[slots // block_size, slots % block_size] = kv[layer, 1]
    return raw, {**declared, "backend": Backend.get_name(), "candidates": candidates,
                 "dtypes": [str(t) for t in Backend.supported_dtypes]}


def cpu(case: dict) -> tuple[torch.Tensor, dict]:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as Backend
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block_size = 128  # vLLM's CPU default --block-size
    amx = bool(torch.cpu._is_amx_tile_supported())
    dtype = getattr(torch, case["dtype"])
    out = {"backend": Backend.get_name(), "amx": amx,
           "isa": _get_attn_isa(dtype, block_size, case["head_dim"]),
           "candidates": [m.name for m in Backend.supported_kv_cache_layouts()],
           "dtypes": [str(t) for t in Backend.supported_dtypes]}
    if case["kind"] == "amx" and not amx:
        return torch.zeros(0, dtype=torch.int8), {**out, "skipped": "no AMX tiles here"}
    raw, views, declared = _views(case, block_size)
    kv, slots = _kv(case), torch.tensor(case["slots"])
    for layer, view in enumerate(views):
        # CPUAttentionBackendImpl.do_kv_cache_update's views of one layer
        b, h, n, _ = view.shape
        key_cache, value_cache = view.view(b, h, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(kv[layer, 0], kv[layer, 1], key_cache, value_cache,
                                       slots, case["kind"])
    return raw, {**declared, **out}


def hashes(model: str, dtype: str) -> dict[str, str]:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        compute_nixl_compatibility_hash,
    )

    config = VllmConfig(model_config=ModelConfig(model=model, dtype=dtype))
    return {name: compute_nixl_compatibility_hash(config, name)
            for name in ("FLASH_ATTN", "CPU_ATTN")}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results = []
    for i, case in enumerate(spec["cases"]):
        raw, declared = flash(case) if case["kind"] == "flash" else cpu(case)
        (out_dir / f"{i}.bin").write_bytes(raw.numpy().tobytes())
        results.append(declared)
    answer = {"cases": results}
    if spec.get("hash_model"):
        answer["hashes"] = hashes(spec["hash_model"], spec["hash_dtype"])
    print("PROBE " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
