"""The experts' combine on a GPU: each token's top-k expert output rows gathered and summed,
one Triton kernel reading every row once.

``combine(down, back, tokens, top_k)``: ``down`` [S, H] (S = tokens x top_k, the down
projection's rows in expert order, routing weights already applied), ``back`` [S] int64 (row
of ``down`` holding token ``t``'s ``k``-th choice at ``t * top_k + k``); returns [tokens, H]
in ``down``'s dtype, summed in fp32 in ``k`` order. The compiled reference (``index_select``,
a view and a sum through ``torch.compile``) took 2.25 ms for 4 layers at 8192 tokens on an
H200 (hidden 2048, top-8: 268 MB read per layer, 2.5 times the HBM time) and wrote fp32 for a
separate cast; this kernel reads each row once and writes the hidden dtype. Imported only on
a CUDA device (it imports triton). Source: written for this project; the layout is that of
``cuda_path.grouped_experts_forward``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_H = 1024
"""Hidden columns per program: 2 KB of bf16 per row read, 8 rows in flight at top-8."""


@triton.jit
def _combine_kernel(down_ptr, back_ptr, out_ptr, hidden, top_k: tl.constexpr,
                    block: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * block + tl.arange(0, block)
    mask = cols < hidden
    acc = tl.zeros([block], dtype=tl.float32)
    for k in tl.static_range(top_k):
        row = tl.load(back_ptr + token * top_k + k).to(tl.int64)
        acc += tl.load(down_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(down: Any, back: Any, tokens: int, top_k: int) -> Any:
    """[tokens, H] sums of each token's ``top_k`` rows of ``down`` (module docstring).
    Raises ``ValueError`` for a ``down`` that is not [tokens x top_k, H] contiguous or a
    ``back`` of another length."""
    if down.dim() != 2 or down.shape[0] != tokens * top_k or not down.is_contiguous():
        raise ValueError(f"combine: down must be contiguous [{tokens * top_k}, H], got "
                         f"{tuple(down.shape)}")
    if back.numel() != tokens * top_k:
        raise ValueError(f"combine: back must have {tokens * top_k} rows, got {back.numel()}")
    hidden = down.shape[1]
    out = torch.empty((tokens, hidden), dtype=down.dtype, device=down.device)
    if tokens:
        grid = (tokens, triton.cdiv(hidden, BLOCK_H))
        _combine_kernel[grid](down, back, out, hidden, top_k=top_k, block=BLOCK_H,
                              num_warps=4)
    return out
