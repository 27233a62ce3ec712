"""The worker's GPU path (``dwdp.worker.gpu.cuda_path``): its experts forward computes what
transformers' experts compute, for every MoE family we serve; it is chosen only where it can
serve; on the CPU nothing changes. (Its speed is measured in ``bench/gpu_profile.py``.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.gpu.cuda_path import (  # noqa: E402
    _servable,
    grouped_experts_forward,
    sdpa_backends,
    use_cuda_kernels,
)


def _experts(family: str):
    """A real transformers experts module of ``family`` (float32, seeded weights)."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8)
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as cls

        config = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8)
    config._experts_implementation = "eager"
    module = cls(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_grouped_experts_equal_transformers_eager_experts(family, tokens):
    module = _experts(family)
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 64, generator=gen)
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    with torch.no_grad():
        want = module(hidden, index, weights)
        got = grouped_experts_forward(module, hidden, index, weights)
    assert _servable(module)
    assert got.shape == want.shape == (tokens, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_it_cannot_compute_keep_their_implementation():
    module = _experts("qwen3_moe")
    module.has_bias = True  # e.g. GPT-OSS's experts: biased projections
    assert not _servable(module)
    module = _experts("qwen3_moe")
    module.act_fn = torch.nn.GELU()
    assert not _servable(module)


def test_cpu_model_is_left_as_it_is():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            vocab_size=50)
    model = Qwen3MoeForCausalLM(config)
    before = model.config._experts_implementation
    assert use_cuda_kernels(model) == []
    assert model.config._experts_implementation == before
    q = torch.zeros(1, 2, 4, 16)
    with sdpa_backends(q):  # a no-op on the CPU: every SDPA backend stays allowed
        assert torch.backends.cuda.math_sdp_enabled()
