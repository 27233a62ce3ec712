"""Qwen3-MoE: grouped-query attention with q/k norms, softmax top-k router, no shared expert.

Layers listed in ``mlp_only_layers`` (or skipped by ``decoder_sparse_step``) have a plain MLP
and stay replicated.
"""

from __future__ import annotations

from dwdp.worker.models.base import ArchitectureAdapter


class Qwen3MoeAdapter(ArchitectureAdapter):
    """``Qwen3MoeForCausalLM``."""

    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    attention_roots = ("self_attn",)
    moe_dense_roots = ("input_layernorm", "post_attention_layernorm", "mlp.gate")
