"""The KV cache pool of one rank: its size in tokens, from the memory left after the commit.

A rank sizes its pool once, after the DWDP setup committed and before the engine starts
(docs/design.md §6.1), so whatever DWDP freed (the experts of the other ranks, with dense DWDP the
row shards of the dense weights) is free memory the pool takes. The rules follow the
``kvCache`` settings of the launch (``dwdp.api.launch.KvCacheConfig``), in the manner of
TensorRT-LLM's ``free_gpu_memory_fraction``/``max_tokens``:

- ``capacity = floor(freeMemoryFraction x free_bytes / bytes_per_token)``, where
  ``free_bytes`` is the memory left after the rank's weights, its DWDP buffers and the
  activation headroom of one full forward (``dwdp.worker.memory.free_for_kv_bytes``);
- ``maxTokens``, when set, bounds the capacity (the smaller of the two);
- a pool smaller than one request of the longest context (``max_model_len`` tokens) is
  refused (``KvPoolError``): such a rank could not serve a request it accepts.

``bytes_per_token`` is what transformers' ``DynamicCache`` stores per token over all layers
(``kv_bytes_per_token``). How the engine uses the pool (paged blocks or not) is the engine's
business; the pool here is the budget the engine admits requests against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dwdp.api.launch import KvCacheConfig


class KvPoolError(ValueError):
    """The KV cache pool cannot hold one request of the longest context (one line)."""


def kv_bytes_per_token(config: Any, dtype_bytes: int, extra_layers: int = 0) -> int:
    """Bytes the KV cache stores per token, over every decoder layer and ``extra_layers``
    more of the same shape (a draft MTP layer's cache beside the model's).

    ``config``: a transformers text config. Multi-head latent attention (DeepSeek-V3: the
    config has ``kv_lora_rank``) caches the compressed latent and the rotary key, one head:
    ``kv_lora_rank + qk_rope_head_dim`` values per layer. Other attention caches a key and a
    value per KV head: ``2 x num_key_value_heads x head_dim`` values per layer. ``dtype_bytes``:
    bytes per value (2 for bf16/fp16). Raises ``ValueError`` for a config without the fields.
    """
    layers = int(config.num_hidden_layers) + extra_layers
    lora = getattr(config, "kv_lora_rank", None)
    if lora:
        per_layer = int(lora) + int(config.qk_rope_head_dim)
    else:
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        per_layer = 2 * kv_heads * int(head_dim)
    if layers <= 0 or per_layer <= 0 or dtype_bytes <= 0:
        raise ValueError(
            f"KV cache: {layers} layers x {per_layer} values x {dtype_bytes} bytes per token"
        )
    return layers * per_layer * dtype_bytes


@dataclass(frozen=True, slots=True)
class KvPool:
    """The pool's budget: ``capacity_tokens`` tokens of ``bytes_per_token`` bytes on
    ``where`` (``device`` or ``host``); ``limited_by``: ``freeMemoryFraction`` or
    ``maxTokens``, the setting that set the capacity; ``free_bytes``: the memory left after
    weights, DWDP buffers and activations when the pool was sized (bytes)."""

    capacity_tokens: int
    bytes_per_token: int
    where: str
    limited_by: str
    free_bytes: int

    @property
    def nbytes(self) -> int:
        """The pool's size in bytes."""
        return self.capacity_tokens * self.bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields, ``bytes`` included."""
        return {**asdict(self), "bytes": self.nbytes}


def check_max_tokens(kv: KvCacheConfig, max_model_len: int) -> None:
    """Refuse a ``maxTokens`` below one request of the longest context before anything
    loads. Raises ``KvPoolError`` naming both values."""
    if kv.max_tokens is not None and kv.max_tokens < max_model_len:
        raise KvPoolError(
            f"kvCache.maxTokens: {kv.max_tokens} tokens is less than one request of "
            f"maxModelLen {max_model_len} tokens; raise maxTokens or lower maxModelLen"
        )


def size_kv_pool(
    kv: KvCacheConfig,
    *,
    free_bytes: int,
    bytes_per_token: int,
    max_model_len: int,
    where: str,
    note: str = "",
) -> KvPool:
    """The pool of a rank with ``free_bytes`` left (module docstring gives the rules).

    Raises ``KvPoolError`` (one line: the capacity, what sized it, the bytes one
    ``max_model_len`` request needs, the memory it was sized from, ``note`` on where that
    came from, and the settings to change) when the pool would hold fewer than
    ``max_model_len`` tokens.
    """
    by_memory = int(kv.free_memory_fraction * max(free_bytes, 0)) // bytes_per_token
    capacity, limited_by = by_memory, "freeMemoryFraction"
    if kv.max_tokens is not None and kv.max_tokens < by_memory:
        capacity, limited_by = kv.max_tokens, "maxTokens"
    if capacity < max_model_len:
        gib = free_bytes / 2**30
        need = max_model_len * bytes_per_token / 2**30
        raise KvPoolError(
            f"kvCache: the KV cache pool holds {capacity} tokens ({limited_by}; "
            f"freeMemoryFraction {kv.free_memory_fraction} of {gib:.2f} GiB left on the "
            f"{where} after weights, DWDP buffers and activations, {bytes_per_token} bytes "
            f"per token), less than one request of maxModelLen {max_model_len} tokens "
            f"({need:.2f} GiB){f' [{note}]' if note else ''}; lower maxModelLen, raise "
            f"freeMemoryFraction or give the rank more memory"
        )
    return KvPool(capacity, bytes_per_token, where, limited_by, int(free_bytes))
