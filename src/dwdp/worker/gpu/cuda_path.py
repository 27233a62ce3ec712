"""What a model is switched to before it serves on a GPU: experts through two grouped GEMMs with
nothing else of size [tokens x top-k, hidden] in between, fused normalisation and rotary
embedding, and SDPA kernels chosen per call.

``use_cuda_kernels(model)`` is called once per model on a CUDA device (the worker after its
load, the GPU benches likewise); it changes nothing on the CPU path. Measured on an H200 with
``bench/gpu_profile.py`` (Qwen3-MoE shape, 4 layers, one 8192-token prefill, replicated).

- **Experts**: ``dwdp_grouped_mm`` is registered with transformers' ``ExpertsInterface`` and
  selected when it can serve every experts module (gated experts, weights [E, 2I, H] and
  [E, H, I], no biases; FP8 tables with their block scales go through ``fp8_gemm``'s grouped
  FP8 GEMM instead of torch's ``grouped_mm``, when H and I are whole 128-column groups: the
  hidden rows are quantized before they are routed and the gate quantizes its output).
  Per MoE layer of ``T`` tokens and top-``K`` routing (``S = T x K`` rows): sort the routed
  (token, expert) pairs by expert, gather the hidden rows [S, H],
  ``grouped_mm`` with the gate/up weights [S, 2I], SiLU(gate) x up x routing weight [S, I] (one
  fused kernel), ``grouped_mm`` with the down weights [S, H], then each token's K rows gathered
  and summed in fp32 by ``moe_combine``'s Triton kernel, which reads each row once and writes
  the hidden dtype (``bench/gpu_forward.py``, 4 layers: the forward at 8K tokens 14.68 ms
  against 16.83 ms in ``bench/results/gpu_forward-sm-reserve.txt``, 15.01 against 17.20 ms in
  ``gpu_forward.txt``, with the ``torch.compile``-d ``index_select`` + sum, which took 2.25 ms,
  2.5 times its HBM time, and wrote fp32 for a separate cast; that one is kept with
  ``use_cuda_kernels(triton_combine=False)``).
  transformers' own ``grouped_mm`` path (5.17) also masks [S, H] rows for expert parallelism
  and multiplies the weights in a broadcast over [S, H]: those elementwise passes took 5.3 ms
  of a 27 ms forward. The weights
  are read from the module at each call (``gate_up_proj``, ``down_proj``), so DWDP's hooks,
  which repoint them to the prefetched slot before the layer runs, work unchanged.
- **RMSNorm and rotary embedding** (the decoder's, the attention's q/k norms): one
  ``torch.compile``-d function each (dynamic shapes, no CUDA graphs: DWDP's hooks run eagerly
  around them) instead of 6 to 8 elementwise kernels per call.
- **Attention**: cuDNN's SDPA builds an execution plan for every new shape, and in decode the
  key length changes at every step: each SDPA call then spent 11 ms on the host (a 4-layer
  decode step: 45 ms on the host for 1.7 ms of GPU work). ``sdpa_backends(tokens)`` lets
  cuDNN (twice PyTorch's flash kernel at 8K tokens: 3.5 against 6.9 ms) take only prefill
  chunks of ``CUDNN_MIN_TOKENS`` queries or more, where a plan build is repaid; decode and
  short chunks use PyTorch's flash and memory-efficient kernels.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any

EXPERTS_NAME = "dwdp_grouped_mm"
CUDNN_MIN_TOKENS = 4096
FUSE_MIN_TOKENS = 256
"""Calls of fewer tokens (decode steps) run the eager kernels: a compiled function's guards
cost more host time than its fusion saves there (a 4-layer decode step: 12.5 ms compiled,
8.5 ms eager, on an H200)."""
_NORMS = ("Qwen3MoeRMSNorm", "MixtralRMSNorm", "DeepseekV3RMSNorm")


def grouped_experts_forward(self: Any, hidden_states: Any, top_k_index: Any,
                            top_k_weights: Any) -> Any:
    """The experts of one MoE layer for ``hidden_states`` [T, H] routed to ``top_k_index``
    [T, K] (expert ids) with ``top_k_weights`` [T, K]; returns [T, H] in the hidden dtype.
    ``self`` is the experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], SiLU
    ``act_fn``; ``dwdp_fused``: the gate and the combine through ``torch.compile``;
    ``dwdp_triton_combine``: the combine through ``moe_combine`` instead). Raises what
    ``torch.nn.functional.grouped_mm`` raises (CUDA sm80+, bf16)."""
    import torch

    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [S] routed pairs, grouped by expert
    # counted with index_add_, not bincount: bincount reads its input's max on the host, a
    # device sync per layer that stalls the launches DWDP's prefetches overlap with
    counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert
    fp8 = getattr(self, "gate_up_proj_scale_inv", None) is not None
    if fp8:  # quantized once per token, then routed: FP8 rows [S, H] and their scales
        from dwdp.worker.gpu.fp8_gemm import gated_quantize, quantize_rows

        rows = quantize_rows(hidden_states.contiguous()).index_select(order // top_k)
    else:
        rows = hidden_states.index_select(0, order // top_k)  # [S, H]
    gate_up = _experts_mm(self, "gate_up_proj", rows, offsets)  # [S, 2I]
    weights = top_k_weights.reshape(-1).index_select(0, order).to(gate_up.dtype)
    fused = getattr(self, "dwdp_fused", False) and tokens >= FUSE_MIN_TOKENS
    if fp8:
        act = gated_quantize(gate_up, weights)  # [S, I] FP8 and its scales
    else:
        act = (_compiled("gate", _gate) if fused else _gate)(gate_up, weights)  # [S, I]
    down = _experts_mm(self, "down_proj", act, offsets)  # [S, H]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)  # (token, k) -> sorted row
    if fused and getattr(self, "dwdp_triton_combine", False):
        from dwdp.worker.gpu.moe_combine import combine

        return combine(down, back, tokens, top_k)  # [T, H] in the hidden dtype
    combine_fn = _compiled("combine", _combine) if fused else _combine
    return combine_fn(down, back, tokens, top_k).to(hidden_states.dtype)


def _experts_mm(self: Any, table: str, rows: Any, offsets: Any) -> Any:
    """``rows`` [S, K] (grouped by expert, ``offsets`` [E] their ends) times each expert's
    matrix of ``table`` ([E, N, K]) transposed: [S, N]. FP8 tables (a ``..._scale_inv``
    beside them) through ``fp8_gemm.grouped_mm`` (``rows`` may be its ``QuantizedRows``),
    others through torch's ``grouped_mm``."""
    weight = getattr(self, table)
    scale = getattr(self, table + "_scale_inv", None)
    if scale is not None:
        from dwdp.worker.gpu import fp8_gemm

        return fp8_gemm.grouped_mm(rows, weight, scale, offsets)
    return _grouped_mm(rows, weight.transpose(-2, -1), offsets)


def _grouped_mm(a: Any, b: Any, offsets: Any) -> Any:
    import torch

    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offsets)


def _gate(gate_up: Any, weights: Any) -> Any:
    """SiLU(gate) x up x routing weight: [S, 2I], [S] -> [S, I]."""
    from torch.nn.functional import silu

    width = gate_up.shape[-1] // 2
    return silu(gate_up[:, :width]) * gate_up[:, width:] * weights[:, None]


def _combine(down: Any, back: Any, tokens: int, top_k: int) -> Any:
    """Each token's ``top_k`` rows of ``down`` [S, H] (row ``back[t * top_k + k]``) summed in
    fp32: [T, H]."""
    import torch

    rows = down.index_select(0, back).view(tokens, top_k, down.shape[-1])
    return rows.sum(dim=1, dtype=torch.float32)


@functools.cache
def _compiled(name: str, fn: Any) -> Any:
    """``fn`` through ``torch.compile`` (dynamic shapes, default mode: no CUDA graphs), made
    once per process."""
    import torch

    return torch.compile(fn, dynamic=True)


def _rms_norm(weight: Any, eps: float, hidden_states: Any) -> Any:
    """Llama-style RMSNorm (what the norms of ``_NORMS`` compute): x / rms(x) in fp32, cast
    back, times ``weight``."""
    import torch

    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _fused_norm_forward(self: Any, hidden_states: Any) -> Any:
    fn = _compiled("rms_norm", _rms_norm) if _rows(hidden_states) >= FUSE_MIN_TOKENS else _rms_norm
    return fn(self.weight, self.variance_epsilon, hidden_states)


def _rows(x: Any) -> int:
    """Rows of a [..., features] activation: its tokens (times heads for per-head norms)."""
    return int(x.numel() // x.shape[-1])


def _fuse_norms(model: Any) -> int:
    count = 0
    for m in model.modules():
        if type(m).__name__ in _NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_fused_norm_forward, m)
            count += 1
    return count


def _fuse_rotary(model: Any) -> bool:
    """The model's modeling module's ``apply_rotary_pos_emb`` through ``torch.compile`` (the
    attention layers look it up there at each call)."""
    module: Any = sys.modules.get(type(model).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None or getattr(fn, "_dwdp_compiled", False):
        return fn is not None
    compiled = _compiled(f"rotary:{module.__name__}", fn)

    def rotary(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
        use = compiled if q.shape[-2] >= FUSE_MIN_TOKENS else fn  # [B, H, T, D]
        return use(q, k, *args, **kwargs)

    rotary._dwdp_compiled = True  # type: ignore[attr-defined]
    module.apply_rotary_pos_emb = rotary
    return True


def sdpa_backends(query: Any) -> Any:
    """A context manager choosing SDPA's kernels for an attention call of ``query``
    [B, H, T, D]: on a GPU cuDNN first for ``T >= CUDNN_MIN_TOKENS``, else flash and
    memory-efficient (then math); nothing changes on the CPU."""
    if not query.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tail = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if query.shape[-2] >= CUDNN_MIN_TOKENS:
        return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *tail], set_priority=True)
    return sdpa_kernel(tail, set_priority=True)


def _servable(module: Any) -> bool:
    """Whether ``dwdp_grouped_mm`` computes what this experts module computes."""
    if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
        return False
    if any(getattr(module, flag, False) for flag in
           ("has_bias", "is_transposed", "has_post_expert_norm")):
        return False
    if getattr(module, "has_gate", True) is False:
        return False
    if type(getattr(module, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    e, two_i, h = module.gate_up_proj.shape
    if hasattr(module, "gate_up_proj_scale_inv"):  # FP8: whole 128-column groups only
        from dwdp.worker.gpu.fp8_gemm import supports

        if not (supports(h) and supports(two_i // 2)):
            return False
    return tuple(module.down_proj.shape) == (e, h, two_i // 2)


def use_cuda_kernels(model: Any, *, fuse: bool = True, triton_combine: bool = True) -> list[str]:
    """Switch ``model`` (on a CUDA device) to the kernels above; ``fuse=False`` leaves out the
    ``torch.compile``-d ones (norms, rotary, the experts' gate and combine);
    ``triton_combine``: with ``fuse``, the experts' combine through ``moe_combine`` (else the
    compiled ``_combine``). Returns what
    changed, one phrase each (for the worker's log); a model on the CPU is left as it is."""
    if next(model.parameters()).device.type != "cuda":
        return []
    changed = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")
               and hasattr(m, "gate_up_proj")]
    if experts and all(_servable(m) for m in experts) and _register():
        model.set_experts_implementation(EXPERTS_NAME)
        for m in experts:
            m.dwdp_fused = fuse
            m.dwdp_triton_combine = fuse and triton_combine
            m.dwdp_fp8_native = True  # FP8 tables go to the FP8 GEMMs, not dequantized
        changed.append(f"experts: {EXPERTS_NAME} ({len(experts)} layers)")
    if fuse:
        changed.append(f"RMSNorm: torch.compile ({_fuse_norms(model)} modules)")
        if _fuse_rotary(model):
            changed.append("rotary embedding: torch.compile")
    return changed


def _register() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface: keep its experts
        return False
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, grouped_experts_forward)
    return True
