"""vLLM 0.32.0's KV block layouts, as data: what a dwdp rank stages so that vLLM's NIXL
connector reads its blocks as if a vLLM prefill server had written them.

In 0.32.0 every attention backend's per-layer cache is the logical ``[B, H, N, C]`` of
``vllm.v1.kv_cache_interface`` (blocks, KV heads, tokens of a block, content ``C`` = K then V of
one token and head), placed in memory by a ``KVCacheLayout`` stride order. A decode server with
the NIXL connector resolves ``LBHNC`` (``NixlConnector.get_required_kvcache_layout``; CPU_ATTN
supports nothing else, FLASH_ATTN declares no preference): one NIXL region per layer, block
``b`` at ``b * block_len``, and inside a block every head's ``N x C`` bytes in a row. What those
bytes are depends on the kernel that writes them (``reshape_and_cache``):

- ``FLASH_ATTN`` (CUDA; vLLM's default backend on Hopper, ``flash_attn.py``): per head and
  token K then V, ``[N][2 x head_dim]`` (the backend splits ``C`` at ``head_dim``;
  ``reshape_and_cache_flash`` puts token ``t`` of slot ``s`` at block ``s // N``, row
  ``s % N``). 16-token blocks (``CacheConfig.DEFAULT_BLOCK_SIZE``, kept by FLASH_ATTN's
  ``MultipleOf(16)`` kernel sizes), float16/bfloat16 only, VRAM.
- ``CPU_ATTN`` with the ``vec`` kernels (float32, float16, or bfloat16 on a host without AMX):
  per head K transposed ``[head_dim][N]`` then V ``[N][head_dim]``; 128-token blocks, DRAM.
- ``CPU_ATTN`` with the ``amx`` kernels (bfloat16 where ``torch.cpu._is_amx_tile_supported()``;
  vLLM's ``_get_attn_isa``, no setting turns it off but another dtype): per head K in 16-token
  tiles of dimension pairs ``[N/16][head_dim/2][16][2]`` then V in 16-wide dimension tiles of
  token pairs ``[head_dim/16][N/2][16][2]`` (found by running the wheel's
  ``cpu_attn_reshape_and_cache`` with ``isa="amx"``; ``tests/unit/worker/test_vllm_layout.py``
  compares every byte with it).

The decode side's handshake carries the backend name, block size and layout but not the CPU
kernel, so the CPU kernel of the decode hosts is a setting (``cpu_kernel``): ``auto`` takes the
one vLLM would pick on this host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LBHNC = "LBHNC"
"""The ``KVCacheLayout`` vLLM 0.32.0 resolves with its NIXL connector (non-MLA models)."""
CPU_KERNELS = ("auto", "vec", "amx")
"""``cpu_kernel`` values: the CPU attention kernels of the decode hosts (``auto``: vLLM's choice
on this host)."""


def to_cpu_attn_blocks(keys: Any, values: Any, block_size: int = 128) -> Any:
    """``keys``/``values`` [tokens, heads, dim] (tokens a multiple of ``block_size``) in vLLM's
    CPU attention ``vec`` layout: [blocks, heads, 2 x block_size x dim], per head K transposed
    [dim][block_size] then V [block_size][dim]."""
    import torch

    tokens, heads, dim = keys.shape
    n = tokens // block_size
    k = keys.reshape(n, block_size, heads, dim).permute(0, 2, 3, 1)  # [n, heads, dim, bs]
    v = values.reshape(n, block_size, heads, dim).permute(0, 2, 1, 3)  # [n, heads, bs, dim]
    return torch.cat(
        [k.reshape(n, heads, dim * block_size), v.reshape(n, heads, block_size * dim)], dim=2
    )


def to_cpu_amx_blocks(keys: Any, values: Any, block_size: int = 128) -> Any:
    """``keys``/``values`` [tokens, heads, dim] (tokens a multiple of ``block_size``, itself a
    multiple of 16; dim a multiple of 16) in vLLM's CPU attention ``amx`` layout: [blocks,
    heads, 2 x block_size x dim], per head K [bs/16][dim/2][16 tokens][2 dims] then V
    [dim/16][bs/2][16 dims][2 tokens]."""
    import torch

    tokens, heads, dim = keys.shape
    n = tokens // block_size
    k = keys.reshape(n, block_size // 16, 16, heads, dim // 2, 2).permute(0, 3, 1, 4, 2, 5)
    v = values.reshape(n, block_size // 2, 2, heads, dim // 16, 16).permute(0, 3, 4, 1, 5, 2)
    return torch.cat(
        [k.reshape(n, heads, block_size * dim), v.reshape(n, heads, block_size * dim)], dim=2
    )


def to_flash_attn_blocks(keys: Any, values: Any, block_size: int = 16) -> Any:
    """``keys``/``values`` [tokens, heads, dim] (tokens a multiple of ``block_size``) in vLLM's
    FLASH_ATTN page under ``LBHNC``: [blocks, heads, block_size x 2 x dim], per head and token
    K then V. Device-agnostic (the result is on the inputs' device)."""
    import torch

    tokens, heads, dim = keys.shape
    n = tokens // block_size
    kv = torch.cat([keys, values], dim=2).reshape(n, block_size, heads, 2 * dim)
    return kv.permute(0, 2, 1, 3).reshape(n, heads, block_size * 2 * dim)


def from_cpu_attn_blocks(blocks: Any, dim: int, block_size: int = 128) -> tuple[Any, Any]:
    """The inverse of ``to_cpu_attn_blocks``: ``blocks`` [n, heads, 2 x block_size x dim] as
    (keys, values), each [n x block_size, heads, dim] (contiguous)."""
    n, heads, _ = blocks.shape
    half = block_size * dim
    k = blocks[:, :, :half].reshape(n, heads, dim, block_size).permute(0, 3, 1, 2)
    v = blocks[:, :, half:].reshape(n, heads, block_size, dim).permute(0, 2, 1, 3)
    return k.reshape(n * block_size, heads, dim), v.reshape(n * block_size, heads, dim)


def from_cpu_amx_blocks(blocks: Any, dim: int, block_size: int = 128) -> tuple[Any, Any]:
    """The inverse of ``to_cpu_amx_blocks`` (shapes as ``from_cpu_attn_blocks``)."""
    n, heads, _ = blocks.shape
    half = block_size * dim
    k = blocks[:, :, :half].reshape(n, heads, block_size // 16, dim // 2, 16, 2)
    v = blocks[:, :, half:].reshape(n, heads, dim // 16, block_size // 2, 16, 2)
    k = k.permute(0, 2, 4, 1, 3, 5)  # [n, bs/16, 16, heads, dim/2, 2]
    v = v.permute(0, 3, 5, 1, 2, 4)  # [n, bs/2, 2, heads, dim/16, 16]
    return k.reshape(n * block_size, heads, dim), v.reshape(n * block_size, heads, dim)


def from_flash_attn_blocks(blocks: Any, dim: int, block_size: int = 16) -> tuple[Any, Any]:
    """The inverse of ``to_flash_attn_blocks`` (shapes as ``from_cpu_attn_blocks``)."""
    n, heads, _ = blocks.shape
    kv = blocks.reshape(n, heads, block_size, 2 * dim).permute(0, 2, 1, 3)
    kv = kv.reshape(n * block_size, heads, 2 * dim)
    return kv[:, :, :dim].contiguous(), kv[:, :, dim:].contiguous()


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """One vLLM attention backend's KV blocks as a decode server reads them.

    ``backend``: vLLM's ``attn_backend_name`` (hashed and in the agent metadata); ``kernel``:
    the kernel family whose bytes these are; ``block_size``: tokens per block;
    ``mem_type``: NIXL's memory type of the region; ``dtypes``: the ``str(torch.dtype)`` the
    backend serves; ``head_dim_multiple``: head sizes it takes; ``to_blocks``: [tokens, heads,
    dim] K and V to [blocks, heads, 2 x block_size x dim] (the bytes of each head's part of a
    block, in order); ``from_blocks``: its inverse (blocks, head_dim, block_size) to K and V
    [tokens, heads, dim], as a dwdp server reading a vLLM prefill server's blocks needs."""

    backend: str
    kernel: str
    block_size: int
    mem_type: str
    dtypes: tuple[str, ...]
    head_dim_multiple: int
    to_blocks: Callable[[Any, Any, int], Any]
    from_blocks: Callable[[Any, int, int], tuple[Any, Any]]
    kv_layout: str = LBHNC

    head_sizes: tuple[int, ...] | None = None
    """The head sizes these kernels take, when not every multiple of ``head_dim_multiple``."""

    def problem(self, dtype: str, head_dim: int) -> str | None:
        """One line naming what a cache of ``dtype``/``head_dim`` lacks for this layout, or
        None when the decode side can read it."""
        if dtype not in self.dtypes:
            return (f"vLLM interop: KV cache dtype {dtype}; vLLM's {self.backend} "
                    f"({self.kernel}) serves {', '.join(self.dtypes)} only")
        if self.head_sizes is not None and head_dim not in self.head_sizes:
            return (f"vLLM interop: head_dim {head_dim}; vLLM's {self.backend} ({self.kernel}) "
                    f"blocks are staged for head sizes {', '.join(map(str, self.head_sizes))} "
                    "only")
        if head_dim % self.head_dim_multiple:
            return (f"vLLM interop: head_dim {head_dim}; vLLM's {self.backend} ({self.kernel}) "
                    f"blocks need a multiple of {self.head_dim_multiple}")
        return None

    def block_bytes(self, heads: int, head_dim: int, element_size: int) -> int:
        """Bytes of one block of one layer (vLLM's ``block_len`` and ``block_stride``)."""
        return heads * 2 * self.block_size * head_dim * element_size


HALF = ("torch.float16", "torch.bfloat16")
CPU_ATTN_HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM 0.32.0's CPU attention (``get_supported_head_sizes``) that its ``vec`` and
``amx`` kernels take (80 and 112 run its ``vec16`` kernels, a layout not staged here)."""
LAYOUTS = {
    "flash": VllmLayout("FLASH_ATTN", "flash", 16, "VRAM", HALF, 8, to_flash_attn_blocks,
                         from_flash_attn_blocks),
    "vec": VllmLayout("CPU_ATTN", "vec", 128, "DRAM", ("torch.float32", *HALF), 32,
                      to_cpu_attn_blocks, from_cpu_attn_blocks,
                      head_sizes=CPU_ATTN_HEAD_SIZES),
    "amx": VllmLayout("CPU_ATTN", "amx", 128, "DRAM", ("torch.bfloat16",), 32,
                      to_cpu_amx_blocks, from_cpu_amx_blocks, head_sizes=CPU_ATTN_HEAD_SIZES),
}
"""The layouts a dwdp rank stages, by kernel family."""


def amx_supported() -> bool:
    """Whether this host has AMX tiles as vLLM 0.32.0 asks (``torch.cpu``)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def check_cpu_kernel(setting: str) -> str:
    """``setting`` when it is one of ``CPU_KERNELS``; ``ValueError`` (one line) otherwise."""
    if setting not in CPU_KERNELS:
        raise ValueError(f"vLLM interop: cpu_kernel {setting!r}; one of {', '.join(CPU_KERNELS)}")
    return setting


def cpu_kernel_for(dtype: str, setting: str, amx: bool | None = None) -> str:
    """The CPU attention kernel a vLLM 0.32.0 decode host runs for ``dtype``: ``setting``
    (``CPU_KERNELS``) when it names one, else vLLM's ``_get_attn_isa`` on x86 with head sizes
    that are multiples of 32: ``amx`` for bfloat16 where ``amx`` (default: this host has AMX
    tiles), ``vec`` otherwise. ``ValueError`` (one line) for an unknown setting or ``amx``
    with another dtype (vLLM runs AMX for bfloat16 only)."""
    if check_cpu_kernel(setting) == "amx" and dtype != "torch.bfloat16":
        raise ValueError(f"vLLM interop: cpu_kernel 'amx' with KV cache dtype {dtype}; vLLM "
                         "runs its AMX attention for torch.bfloat16 only (use 'vec')")
    if setting != "auto":
        return setting
    if dtype != "torch.bfloat16":
        return "vec"
    return "amx" if (amx_supported() if amx is None else amx) else "vec"


def block_size_for(device_type: str) -> int:
    """Tokens per block of the layout staged from a ``device_type`` KV cache (both CPU
    kernels' blocks hold 128 tokens, FLASH_ATTN's 16)."""
    return LAYOUTS["flash" if device_type == "cuda" else "vec"].block_size


def layout_for(device_type: str, dtype: str, cpu_kernel: str = "auto") -> VllmLayout:
    """The layout a vLLM 0.32.0 decode server reads from a prefill rank whose KV cache is on a
    ``device_type`` device (``cuda``: FLASH_ATTN in VRAM; ``cpu``: CPU_ATTN with the kernel of
    ``cpu_kernel_for``). ``ValueError`` (one line) for another device."""
    if device_type == "cuda":
        return LAYOUTS["flash"]
    if device_type == "cpu":
        return LAYOUTS[cpu_kernel_for(dtype, cpu_kernel)]
    raise ValueError(f"vLLM interop: the KV cache is on a {device_type} device; vLLM's layouts "
                     "are implemented for cpu (CPU_ATTN) and cuda (FLASH_ATTN)")
