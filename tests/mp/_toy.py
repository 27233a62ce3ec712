"""A tiny synthetic MoE causal LM shaped like the transformers 5 MoE models, for setup tests.

Layer 0 has a dense MLP (stays replicated); layers 1.. are MoE layers with attention, a
router with a routing bias (never moves), fused experts, a shared expert and two norms.
Every attention module also holds one ``inv_freq`` buffer object shared by all layers
(must stay replicated). Deterministic from the seed, so every rank builds the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from dwdp.worker.dense.architecture import DenseArchitecture

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 32, 16, 8, 2

TOY_ARCH = DenseArchitecture(
    name="toy",
    attention_roots=("self_attn",),
    moe_dense_roots=("input_layernorm", "post_attention_layernorm", "mlp.gate",
                     "mlp.shared_experts"),
    never_move=("mlp.gate.e_score_correction_bias", "self_attn.scratch"),
)


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.01 * torch.randn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self, h: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=True)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("scratch", torch.zeros(4, h), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.o_proj(scores.softmax(-1) @ v) + self.inv_freq.sum() * 0


class Router(nn.Module):
    def __init__(self, h: int, e: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, h) * 0.1)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()).sigmoid() + self.e_score_correction_bias


class Experts(nn.Module):
    def __init__(self, h: int, i: int, e: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.1)


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


class MoeBlock(nn.Module):
    def __init__(self, h: int, i: int, e: int) -> None:
        super().__init__()
        self.gate = Router(h, e)
        self.experts = Experts(h, i, e)
        self.shared_experts = MLP(h, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).topk(TOP_K, dim=-1)
        out = self.shared_experts(x)
        for k in range(TOP_K):
            gate_up = self.experts.gate_up_proj[chosen[..., k]]  # [..., 2I, H]
            down = self.experts.down_proj[chosen[..., k]]  # [..., H, I]
            hidden = (gate_up @ x.unsqueeze(-1)).squeeze(-1)
            g, u = hidden.chunk(2, dim=-1)
            y = (down @ (torch.nn.functional.silu(g) * u).unsqueeze(-1)).squeeze(-1)
            out = out + weights[..., k : k + 1] * y
        return out


class DecoderLayer(nn.Module):
    def __init__(self, h: int, i: int, e: int, moe: bool, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.self_attn = Attention(h, inv_freq)
        self.mlp = MoeBlock(h, i, e) if moe else MLP(h, i)
        self.input_layernorm = RMSNorm(h)
        self.post_attention_layernorm = RMSNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, HIDDEN)
        inv_freq = torch.arange(HIDDEN // 2, dtype=torch.float32)
        self.layers = nn.ModuleList(
            DecoderLayer(HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, index > 0, inv_freq)
            for index in range(layers)
        )
        self.norm = RMSNorm(HIDDEN)


class ToyMoeForCausalLM(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.model = Inner(layers)
        self.lm_head = nn.Linear(HIDDEN, 64, bias=False)

    def forward(self, ids: torch.Tensor, before_layer=None, after_attention=None,
                after_mlp=None) -> torch.Tensor:
        """``before_layer(i)``, ``after_attention(i)``, ``after_mlp(i)``: hook points H1,
        H2 and H3 of decoder layer i (optional)."""
        x = self.model.embed_tokens(ids)
        for index, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(index)
            x = x + layer.self_attn(layer.input_layernorm(x))
            if after_attention is not None:
                after_attention(index)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if after_mlp is not None:
                after_mlp(index)
        return self.lm_head(self.model.norm(x))


def build_toy(*, seed: int = 0, layers: int = 4, perturb: bool = False) -> ToyMoeForCausalLM:
    """The toy model; ``perturb`` changes one attention weight (a rank with other weights)."""
    torch.manual_seed(seed)
    model = ToyMoeForCausalLM(layers).eval().requires_grad_(False)
    if perturb:
        with torch.no_grad():
            model.model.layers[1].self_attn.q_proj.weight[0, 0] += 1.0
    return model


def snapshot(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Every parameter and buffer: (data pointer, a byte copy)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t.data_ptr(), t.detach().clone())
    return out


def intact(model: nn.Module, before: dict[str, tuple[int, torch.Tensor]]) -> list[str]:
    """Names whose tensor moved or whose bytes changed since ``snapshot``."""
    now = dict([*model.named_parameters(), *model.named_buffers()])
    bad = []
    for name, (ptr, data) in before.items():
        t = now[name]
        same = t.data_ptr() == ptr and torch.equal(
            t.detach().reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8))
        if not same:
            bad.append(name)
    return bad
