"""The FP8 GEMMs on the GPU (``dwdp.worker.gpu.fp8_gemm``): the activations' per-group quantization
is torch's float8_e4m3fn rounding bitwise; the experts' fused gate quantizes SiLU(gate) x up x
weight within e4m3's rounding, and the experts' FP8 path (hidden rows quantized before routing)
equals a float32 emulation of its steps; the grouped GEMM equals a float32 matmul
of the same quantized activations and dequantized weights (up to the output's bfloat16 rounding)
for every expert, empty ones included; it replays in a CUDA graph; a model loaded from an FP8
checkpoint serves through it and its logits follow those of the checkpoint dequantized to
bfloat16 (top-1 agreement is measured by ``bench/gpu_fp8.py``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.quant.fp8 import dequantize  # noqa: E402


def _emulated(x):
    """torch's own per-(row, 128 columns) quantization of ``x`` [M, K]: (fp8, scale)."""
    groups = x.float().view(x.shape[0], -1, 128)
    scale = groups.abs().amax(-1).clamp(min=1e-10) / 448.0
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


def _weights(experts, n, k):
    from dwdp_dev.worker.fp8_checkpoint import quantize_blocks

    pairs = [quantize_blocks(torch.randn(n, k, device="cuda")) for _ in range(experts)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def test_activation_quantization_is_torchs_rounding():
    from dwdp.worker.gpu.fp8_gemm import quantize_rows

    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16) * 3
    q, scale, _ = quantize_rows(x)
    want_q, want_scale = _emulated(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("counts", [[3, 0, 70, 1, 9], [0, 0, 128, 0], [1]])
def test_grouped_gemm_equals_the_dequantized_matmul(counts):
    from dwdp.worker.gpu.fp8_gemm import grouped_mm

    torch.manual_seed(0)
    n, k = 320, 384  # N not whole 128-row blocks: the last weight block is partial
    weight, scale = _weights(len(counts), n, k)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16)
    got = grouped_mm(x, weight, scale, offsets)
    q, q_scale = _emulated(x)
    xd = (q.float().view(x.shape[0], -1, 128) * q_scale[..., None]).view(x.shape)
    ends = [0, *offsets.tolist()]
    want = torch.cat([xd[ends[e]:ends[e + 1]] @ dequantize(weight[e], scale[e], torch.float32).T
                      for e in range(len(counts))])
    assert got.dtype == torch.bfloat16 and got.shape == (sum(counts), n)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2,
                               atol=1e-2 * float(want.abs().max()))


def test_grouped_gemm_replays_in_a_cuda_graph():
    from dwdp.worker.gpu.fp8_gemm import grouped_mm

    weight, scale = _weights(4, 256, 256)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([4, 4, 12, 16], device="cuda", dtype=torch.int32)
    eager = grouped_mm(x, weight, scale, offsets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_mm(x, weight, scale, offsets)
    offsets.copy_(torch.tensor([16, 16, 16, 16], device="cuda"))  # every row to expert 0
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    assert torch.equal(captured, grouped_mm(x, weight, scale, offsets))


def test_the_fused_gate_quantizes_silu_gate_times_up_times_weight():
    from torch.nn.functional import silu

    from dwdp.worker.gpu.fp8_gemm import gated_quantize

    gate_up = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16) * 2
    weights = torch.rand(37, device="cuda", dtype=torch.bfloat16)
    got = gated_quantize(gate_up, weights)
    g, u = gate_up.float().chunk(2, dim=-1)
    want = silu(g) * u * weights.float()[:, None]  # float32, before any rounding
    amax = want.view(37, 2, 128).abs().amax(-1)
    torch.testing.assert_close(got.scales, amax / 448.0, rtol=1e-5, atol=0)
    values = got.values.float().view(37, 2, 128) * got.scales[..., None]
    err = (values.view(37, 256) - want).abs().view(37, 2, 128).amax(-1)
    assert bool((err <= amax / 16 * 1.001).all())  # e4m3 rounds to 3 mantissa bits


def test_fp8_experts_equal_the_emulated_fp8_product():
    """The experts' FP8 path (hidden rows quantized once before routing and gathered into
    expert order as ``QuantizedRows``, the gate's output quantized where it is computed)
    equals a float32 emulation of the same steps: per-128-column quantization of the hidden
    rows, the gate/up product rounded to bfloat16, SiLU(gate) x up x routing weight quantized
    likewise, the down product rounded to bfloat16, summed per token."""
    import types

    from torch.nn.functional import silu

    from dwdp.worker.gpu.cuda_path import grouped_experts_forward

    def fp8_round(x):  # [M, K] float32 -> the values the kernels' FP8 rows stand for
        q, scale = _emulated(x)
        return (q.float().view(x.shape[0], -1, 128) * scale[..., None]).view(x.shape)

    experts, hidden_size, width, tokens, top_k = 4, 256, 128, 50, 2
    gu_w, gu_s = _weights(experts, 2 * width, hidden_size)
    dn_w, dn_s = _weights(experts, hidden_size, width)
    gu_s, dn_s = gu_s * 0.05, dn_s * 0.05  # activations of order 1
    module = types.SimpleNamespace(num_experts=experts, gate_up_proj=gu_w,
                                   gate_up_proj_scale_inv=gu_s, down_proj=dn_w,
                                   down_proj_scale_inv=dn_s)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, experts, (tokens, top_k), device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda")
    out = grouped_experts_forward(module, hidden, index, weights)

    gate_up = dequantize(gu_w, gu_s, torch.float32)
    down = dequantize(dn_w, dn_s, torch.float32)
    rows = fp8_round(hidden.float())
    want = torch.zeros(tokens, hidden_size, device="cuda")
    for t in range(tokens):
        for k in range(top_k):
            e = int(index[t, k])
            h = (gate_up[e] @ rows[t]).to(torch.bfloat16).float()
            act = silu(h[:width]) * h[width:] * weights[t, k].to(torch.bfloat16).float()
            want[t] += (down[e] @ fp8_round(act[None])[0]).to(torch.bfloat16).float()
    assert out.shape == (tokens, hidden_size) and out.dtype == torch.bfloat16
    assert float((out.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_fp8_model_serves_through_the_fp8_gemms(tmp_path, arch):
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint
    from dwdp_dev.worker.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint

    src = make_checkpoint(arch, tmp_path / "src", num_experts=8, seed=4, hidden_size=512,
                          moe_width=256, dtype="bfloat16")
    fp8 = quantize_checkpoint(src, tmp_path / "fp8")
    model, _ = load_checkpoint(fp8)
    reference, _ = load_checkpoint(dequantize_checkpoint(fp8, tmp_path / "bf16"))
    for m in (model, reference):
        m.to("cuda:0")
        use_cuda_kernels(m)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj_scale_inv"))
    assert experts.dwdp_fp8_native and model.config._experts_implementation == "dwdp_grouped_mm"
    ids = torch.randint(0, model.config.vocab_size, (4, 300), device="cuda")
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
    # per position the logits' cosine is mostly above 0.99 (H200: 0.995 to 0.999); a few
    # positions of this random tiny model, whose logits are nearly flat, fall to 0.7
    cosine = torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1))
    assert float(cosine.mean()) > 0.98
