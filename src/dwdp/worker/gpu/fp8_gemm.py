"""Block-scaled FP8 GEMMs on a GPU: the experts' grouped GEMMs and the linear layers of an FP8
checkpoint (``dwdp.worker.quant.fp8``), in FP8 on the tensor cores, with no dequantized copy
of a weight.

As DeepSeek-V3's reference inference does, the activations are quantized at run time per token
group: each row's every 128 columns get one float32 scale (their largest magnitude over 448,
``quantize_rows``) and become float8_e4m3fn. The GEMM then accumulates, per 128-wide step
along K, ``dot(a, w) * a_scale[row] * w_scale[block]`` in float32 and writes the activations'
dtype. One Triton kernel serves both cases:

- ``grouped_mm(x, weight, scale, offsets)``: ``x`` [S, K] rows sorted by expert (expert ``e``
  owns rows ``[offsets[e-1], offsets[e])``), ``weight`` [E, N, K] FP8, ``scale`` [E,
  ceil(N/128), K/128]; returns [S, N]. Row tiles never straddle two experts: tile ``t``'s
  expert is found in the kernel from the cumulative tile counts (no host sync, so a decode
  step stays capturable in a CUDA graph).
- ``linear(x, weight, scale, bias)``: one expert.

The experts' path (``dwdp.worker.gpu.cuda_path``) quantizes before it routes: a layer's
hidden rows [T, H] are quantized once (``quantize_rows``) and the FP8 rows and their scales
gathered into expert order (``QuantizedRows.index_select``), rather than gathering the
``top_k`` times larger [T x K, H] in bf16 and quantizing that; and the gate's SiLU(gate) x up
x routing weight is quantized in the same kernel that computes it (``gated_quantize``), so
the down GEMM's input is written once, in FP8.

The grid's fastest axis is the column tile: the programs that run together share one row
tile, so a row tile's activations come from memory about once, not once per column tile.
At 8K tokens (top-8 of 128 experts, H100) that order took the experts' two GEMMs from 0.90 and
0.58 ms to 0.62 and 0.43 ms, as fast as torch's bf16 grouped GEMM (0.65 and 0.38 ms).

K must be a multiple of 128 (``supports``); otherwise the caller dequantizes. Imported only on
a CUDA device (it imports triton). Source: written for this project.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

GROUP = 128
"""Columns per activation scale and per weight block (the format's 128x128 block)."""
FP8_MAX = 448.0
QUANT_ROWS = 32
"""Rows per program of the activations' quantization."""
BLOCK_N = GROUP  # one weight scale per tile and K step


def block_m(rows: int, experts: int) -> int:
    """Rows per tile: 16, 64 or 128 as the experts' average rows grow (a decode step routes
    a few rows to each expert; a prefill hundreds)."""
    average = rows // max(experts, 1)
    return 16 if average <= 16 else 64 if average <= 64 else 128


def supports(k: int) -> bool:
    """Whether a GEMM over ``k`` input columns runs here (whole 128-column groups)."""
    return k > 0 and k % GROUP == 0


@triton.jit
def _store_quantized(x, q_at, s_at, ok, q_dtype: tl.constexpr, fp8_max: tl.constexpr):
    """One [rows, 128] float32 tile ``x`` stored as FP8 at ``q_at`` with its per-row scale
    (largest magnitude / 448) at ``s_at``; rows where ``ok`` is false are skipped."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / fp8_max
    q = (x / scale[:, None]).to(q_dtype, fp_downcast_rounding="rtne")
    tl.store(q_at, q, mask=ok[:, None])
    tl.store(s_at, scale, mask=ok)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, rows, cols, groups, block_r: tl.constexpr,
                     group: tl.constexpr, fp8_max: tl.constexpr):
    r = tl.program_id(0) * block_r + tl.arange(0, block_r)
    g = tl.program_id(1)
    ok = r < rows
    at = r.to(tl.int64)[:, None] * cols + g * group + tl.arange(0, group)[None, :]
    x = tl.load(x_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    _store_quantized(x, q_ptr + at, s_ptr + r.to(tl.int64) * groups + g, ok,
                     q_ptr.dtype.element_ty, fp8_max)


class QuantizedRows(NamedTuple):
    """Activations quantized per row and 128-column group: ``values`` float8_e4m3fn [M, K],
    ``scales`` float32 [M, K/128] (``values[m, k] * scales[m, k // 128]`` is the row's value)
    and ``dtype``, the dtype they were quantized from (the GEMMs' output dtype)."""

    values: Any
    scales: Any
    dtype: Any

    def index_select(self, index: Any) -> QuantizedRows:
        """Rows ``index`` [S] (int64) of both tensors: [S, K] and [S, K/128]."""
        values = self.values.view(torch.uint8).index_select(0, index).view(self.values.dtype)
        return QuantizedRows(values, self.scales.index_select(0, index), self.dtype)


def quantize_rows(x: Any) -> QuantizedRows:
    """``x`` [M, K] (contiguous, K a multiple of 128) as float8_e4m3fn [M, K] and float32
    [M, K/128] scales, one per row and 128-column group."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, QUANT_ROWS), k // GROUP)
        _quantize_kernel[grid](x, q, scale, m, k, k // GROUP, block_r=QUANT_ROWS, group=GROUP,
                               fp8_max=FP8_MAX, num_warps=4)
    return QuantizedRows(q, scale, x.dtype)


@triton.jit
def _gated_quantize_kernel(gu_ptr, w_ptr, q_ptr, s_ptr, rows, width, groups,
                           block_r: tl.constexpr, group: tl.constexpr, fp8_max: tl.constexpr):
    r = tl.program_id(0) * block_r + tl.arange(0, block_r)
    g = tl.program_id(1)
    ok = r < rows
    cols = g * group + tl.arange(0, group)
    at = r.to(tl.int64)[:, None] * (2 * width) + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + width, mask=ok[:, None], other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + r, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up * weight[:, None]
    _store_quantized(y, q_ptr + r.to(tl.int64)[:, None] * width + cols[None, :],
                     s_ptr + r.to(tl.int64) * groups + g, ok, q_ptr.dtype.element_ty, fp8_max)


def gated_quantize(gate_up: Any, weights: Any) -> QuantizedRows:
    """SiLU(gate) x up x routing weight, computed in float32 and quantized per row and
    128-column group: ``gate_up`` [S, 2I] (gate columns first; I a multiple of 128, contiguous)
    and ``weights`` [S] -> [S, I] FP8 with [S, I/128] scales, in one pass over ``gate_up``."""
    s, two_width = gate_up.shape
    width = two_width // 2
    if not supports(width) or two_width != 2 * width:
        raise ValueError(f"fp8 gated_quantize: gate_up {tuple(gate_up.shape)} (the expert "
                         f"width a multiple of {GROUP})")
    q = torch.empty((s, width), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty((s, width // GROUP), dtype=torch.float32, device=gate_up.device)
    if s:
        grid = (triton.cdiv(s, QUANT_ROWS), width // GROUP)
        _gated_quantize_kernel[grid](gate_up, weights, q, scale, s, width, width // GROUP,
                                     block_r=QUANT_ROWS, group=GROUP, fp8_max=FP8_MAX,
                                     num_warps=4)
    return QuantizedRows(q, scale, gate_up.dtype)


@triton.jit
def _grouped_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, row_end_ptr, tile_end_ptr,
                    experts, n, k, ws_rows, total_rows, block_m: tl.constexpr,
                    block_n: tl.constexpr, group: tl.constexpr, experts_pow2: tl.constexpr,
                    one_expert: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: a row tile's column tiles run together (L2 reuse)
    tile = tl.program_id(1)
    if one_expert:  # a linear layer: every row is expert 0's, no tables to read
        expert = 0
        first_tile = 0
        row_start = 0
        row_end = total_rows
    else:
        e_offs = tl.arange(0, experts_pow2)
        tile_ends = tl.load(tile_end_ptr + e_offs, mask=e_offs < experts, other=2**30)
        expert = tl.sum((tile_ends <= tile).to(tl.int32))
        if expert >= experts:
            return
        before = tl.maximum(expert - 1, 0)  # the previous expert's ends (0 for expert 0)
        first_tile = tl.where(expert > 0, tl.load(tile_end_ptr + before), 0)
        row_start = tl.where(expert > 0, tl.load(row_end_ptr + before), 0)
        row_end = tl.load(row_end_ptr + expert)
    rows = row_start + (tile - first_tile) * block_m + tl.arange(0, block_m)
    cols = pid_n * block_n + tl.arange(0, block_n)
    row_ok = rows < row_end
    col_ok = cols < n
    kk = tl.arange(0, group)
    groups = k // group
    e64 = tl.cast(expert, tl.int64)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * k + kk[None, :]
    w_cols = w_ptr + e64 * n * k + cols.to(tl.int64)[None, :] * k + kk[:, None]
    acc = tl.zeros((block_m, block_n), dtype=tl.float32)
    for g in range(0, groups):
        a = tl.load(a_rows + g * group, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_cols + g * group, mask=col_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rows.to(tl.int64) * groups + g, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + (e64 * ws_rows + pid_n) * groups + g)
        acc += tl.dot(a, w) * a_s[:, None] * w_s
    out = c_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_mm(x: Any, weight: Any, scale: Any, offsets: Any) -> Any:
    """[S, N] in ``x``'s dtype: each expert's rows of ``x`` [S, K] times its weight [N, K]
    transposed (module docstring); ``x`` is quantized here unless it is
    :class:`QuantizedRows` already. ``offsets`` int32 [E]: cumulative rows per expert;
    ``None`` for one expert owning every row (``linear``).
    Raises ``ValueError`` for K not a multiple of 128 or mismatched shapes."""
    s, k = x.shape if not isinstance(x, QuantizedRows) else x.values.shape
    experts, n, wk = weight.shape
    if not supports(k) or wk != k or tuple(scale.shape) != (experts, -(-n // GROUP), k // GROUP):
        raise ValueError(f"fp8 grouped_mm: x {(s, k)}, weight {tuple(weight.shape)}, "
                         f"scale {tuple(scale.shape)} (K a multiple of {GROUP})")
    rows = x if isinstance(x, QuantizedRows) else quantize_rows(x.contiguous())
    tile = block_m(s, experts)
    one_expert = offsets is None
    if one_expert:
        offsets = tile_end = scale  # unread: the kernel's one_expert branch reads no table
    else:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        tile_end = torch.cumsum((counts + tile - 1) // tile, 0, dtype=torch.int32)
    out = torch.empty((s, n), dtype=rows.dtype, device=rows.values.device)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(s, tile) + (0 if one_expert else experts))
    _grouped_kernel[grid](rows.values, rows.scales, weight, scale, out, offsets, tile_end,
                          experts, n, k, scale.shape[1], s, block_m=tile, block_n=BLOCK_N,
                          group=GROUP, experts_pow2=triton.next_power_of_2(experts),
                          one_expert=one_expert, num_warps=8 if tile == 128 else 4,
                          num_stages=4)
    return out


def linear(x: Any, weight: Any, scale: Any, bias: Any = None) -> Any:
    """``x`` [..., K] times the FP8 ``weight`` [N, K] (block scales ``scale``) transposed, plus
    ``bias``: [..., N] in ``x``'s dtype. Two kernel launches: the quantization and the GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    out = grouped_mm(rows, weight.unsqueeze(0), scale.unsqueeze(0), None)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
