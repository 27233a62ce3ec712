"""The FP8 grouped GEMM's tiling (``dwdp.worker.gpu.fp8_gemm``) under Triton's interpreter on
the CPU: with values the format holds exactly (every 128-column group's largest magnitude is
448, so every scale is 1, and sums bfloat16 holds) the result is the exact product, for experts
of 0 to 300 rows with tiles of 16, 64 and 128 rows (a tile never straddles two experts) and a
partial last block of output columns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
from _triton import run_interpreted

CODE = """
import torch
from dwdp.worker.gpu.fp8_gemm import block_m, grouped_mm, linear

torch.manual_seed(0)
n, k = 200, 256
for counts, tile in (([3, 0, 70, 1, 130], 64), ([1, 0, 2, 1], 16), ([300, 0, 260], 128)):
    assert block_m(sum(counts), len(counts)) == tile
    weight = torch.randint(-1, 2, (len(counts), n, k)).float()
    weight[..., ::128] = 0.0
    scale = torch.ones(len(counts), 2, 2)
    x = torch.randint(-1, 2, (sum(counts), k)).float()
    x[:, ::128] = 448.0  # each 128-column group's largest magnitude: its scale is 1
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = grouped_mm(x.to(torch.bfloat16), weight.to(torch.float8_e4m3fn), scale, offsets)
    ends = [0, *offsets.tolist()]
    want = torch.cat([x[ends[e]:ends[e + 1]] @ weight[e].T for e in range(len(counts))])
    assert torch.equal(got, want.to(torch.bfloat16)), (counts, (got.float() - want).abs().max())
one = linear(x[:5].to(torch.bfloat16), weight[0].to(torch.float8_e4m3fn), scale[0])
assert torch.equal(one, (x[:5] @ weight[0].T).to(torch.bfloat16))
print("ok")
"""


def test_grouped_gemm_tiles_every_expert_exactly():
    run_interpreted(CODE)
