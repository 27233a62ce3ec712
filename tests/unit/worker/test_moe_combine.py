"""The experts' combine kernel (``dwdp.worker.gpu.moe_combine``): each token's top-k rows
summed, what the eager combine computes, for any hidden size (masked tail) and an unsorted
row map. Triton's interpreter runs the kernel on the CPU (``TRITON_INTERPRET=1``, set before
triton is imported, hence a child process); the interpreter rounds fp32 to bf16 by truncation
where the GPU rounds to nearest, so the comparison allows one bf16 ULP."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
from _triton import run_interpreted

CHILD = textwrap.dedent(
    """
    import torch
    from dwdp.worker.gpu.cuda_path import _combine
    from dwdp.worker.gpu.moe_combine import combine

    g = torch.Generator().manual_seed(0)
    for tokens, k, hidden in [(37, 8, 1300), (5, 2, 64), (1, 4, 2048)]:
        down = torch.randn(tokens * k, hidden, generator=g).to(torch.bfloat16)
        back = torch.randperm(tokens * k, generator=g)
        got = combine(down, back, tokens, k)
        want = _combine(down, back, tokens, k).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden), got.shape
        torch.testing.assert_close(got, want)
    for bad, needle in [((torch.zeros(6, 8), torch.arange(6), 2, 2), "contiguous [4, H]"),
                        ((torch.zeros(4, 8), torch.arange(3), 2, 2), "4 rows, got 3")]:
        try:
            combine(*bad)
        except ValueError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError("no ValueError")
    print("ok")
    """
)


def test_combine_sums_each_tokens_rows_like_the_eager_combine():
    run_interpreted(CHILD)
