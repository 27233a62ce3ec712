"""DeepSeek-V3 family: MLA attention, sigmoid top-k router with a routing bias, shared experts.

The first ``first_k_dense_replace`` decoder layers have a plain MLP and stay replicated. The
routing bias ``mlp.gate.e_score_correction_bias`` never moves (the reference keeps it
replicated: it is tiny and read on every token).
"""

from __future__ import annotations

from dwdp.worker.models.base import ArchitectureAdapter


class DeepseekV3Adapter(ArchitectureAdapter):
    """``DeepseekV3ForCausalLM`` (and the same layout under Kimi-K2 style configs)."""

    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    attention_roots = ("self_attn",)
    moe_dense_roots = (
        "input_layernorm",
        "post_attention_layernorm",
        "mlp.gate",
        "mlp.shared_experts",
    )
    never_move = ("mlp.gate.e_score_correction_bias",)
