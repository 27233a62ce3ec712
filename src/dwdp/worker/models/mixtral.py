"""Mixtral: grouped-query attention, softmax top-k router, every decoder layer MoE.

Original Mixtral checkpoints name the MoE block ``block_sparse_moe`` and one expert's
matrices ``w1`` (gate), ``w3`` (up) and ``w2`` (down); transformers 5 fuses them on load.
"""

from __future__ import annotations

from dwdp.worker.models.base import ArchitectureAdapter


class MixtralAdapter(ArchitectureAdapter):
    """``MixtralForCausalLM``."""

    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    attention_roots = ("self_attn",)
    moe_dense_roots = ("input_layernorm", "post_attention_layernorm", "mlp.gate")
    checkpoint_expert_suffixes = ("w1.weight", "w3.weight", "w2.weight")
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)
