"""The paged attention kernel (``dwdp.worker.gpu.paged_attention``) against SDPA over the same
context packed: decode rows, prefill chunks after earlier chunks, grouped-query heads, a
sliding window, a value head dim unlike the key's, MLA's split key (latent + rotary) with
the latent as value, and decode rows whose contexts are split over several programs and
combined (the interpreter counts 8 SMs, so a few rows split). Blocks are scattered through
the cache in a random order and the cache's page size differs between cases. Triton's
interpreter runs the kernel on the CPU (``TRITON_INTERPRET=1``, set before triton is
imported, hence a child process); its ``tl.dot`` is wrong for bf16 operands (a plain 16x16
bf16 dot is off by 1e10 there), so the cases run in fp32 and fp16; bf16 runs on the GPU
(tests/gpu)."""

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
    import math
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from dwdp.worker.gpu.paged_attention import paged_attention, requests_on

    g = torch.Generator().manual_seed(0)

    def case(hq, hkv, d1, d2, dv, page, reqs, window, dtype, mla):
        nblocks = sum(-(-s // page) for s, _ in reqs) + 3
        k1 = torch.randn(nblocks * page, hkv, d1, generator=g).to(dtype)
        k2 = torch.randn(nblocks * page, hkv, d2, generator=g).to(dtype) if d2 else None
        v = k1 if mla else torch.randn(nblocks * page, hkv, dv, generator=g).to(dtype)
        perm = torch.randperm(nblocks, generator=g).tolist()
        total = sum(n for _, n in reqs)
        q = torch.randn(total, hq, d1 + d2, generator=g).to(dtype)
        out = torch.full((total, hq, v.shape[2]), 7.0, dtype=dtype)
        tables, starts, t0 = [], [], 0
        for s, n in reqs:
            tables.append([perm.pop() for _ in range(-(-s // page))])
            starts.append(t0)
            t0 += n
        req = requests_on("cpu", starts, [n for _, n in reqs], [s for s, _ in reqs], tables)
        scale = 1 / math.sqrt(d1 + d2)
        keys = (k1,) if k2 is None else (k1, k2)
        paged_attention(q, keys, v, out, req, block_size=page, scale=scale, window=window)
        for (s, n), table, start in zip(reqs, tables, starts):
            slot = torch.tensor([table[t // page] * page + t % page for t in range(s)])
            key = torch.cat([k[slot] for k in keys], -1).transpose(0, 1)[None].float()
            val = v[slot].transpose(0, 1)[None].float()
            i = torch.arange(n)[:, None] + (s - n)
            j = torch.arange(s)[None]
            mask = j <= i
            if window:
                mask &= j > i - window
            want = sdpa(q[start:start + n].transpose(0, 1)[None].float(), key, val,
                        attn_mask=mask, scale=scale, enable_gqa=hq != hkv)[0].transpose(0, 1)
            tol = 1e-4 if dtype == torch.float32 else 5e-3
            torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)

    for dtype in (torch.float32, torch.float16):
        case(8, 2, 64, 0, 64, 16, [(5, 1), (37, 1), (100, 1)], None, dtype, False)  # decode
        case(8, 2, 64, 0, 64, 16, [(300, 1), (2, 1)], None, dtype, False)  # split in 5
        case(8, 2, 64, 0, 64, 16, [(300, 1)], 100, dtype, False)  # splits outside the window
        case(8, 2, 64, 0, 64, 16, [(40, 40), (70, 23), (9, 1)], None, dtype, False)  # chunks
        case(4, 4, 48, 0, 32, 4, [(33, 1), (20, 7)], 8, dtype, False)  # window, dv != dk
        case(16, 1, 64, 16, 64, 16, [(30, 1), (50, 5)], None, dtype, True)  # MLA
    try:
        paged_attention(torch.zeros(1, 3, 8), (torch.zeros(4, 2, 8),), torch.zeros(4, 2, 8),
                        torch.zeros(1, 3, 8), requests_on("cpu", [0], [1], [1], [[0]]),
                        block_size=4, scale=1.0)
    except ValueError as exc:
        assert "do not match" in str(exc), exc
    else:
        raise AssertionError("no ValueError for 3 query heads over 2 KV heads")
    print("ok")
    """
)


def test_paged_attention_equals_sdpa_over_the_packed_context():
    run_interpreted(CHILD)


def _variant(pa, q_lens, seq_lens, group, kv_heads, dim):
    """What Triton compiles a call of these rows as: (query tile, splits' combine tile or 0)."""
    req = pa.requests_on("cpu", [0] * len(q_lens), q_lens, seq_lens,
                         [[0] * -(-s // 16) for s in seq_lens])
    width = pa._pow2(dim)
    heads, block_q, _ = pa._tiling(group, req.max_q_len, width)
    tiles = -(-req.max_q_len // block_q)
    programs = len(q_lens) * tiles * kv_heads * (group // heads)
    splits, _ = pa._splits(req, programs, group * kv_heads, width, "cpu")
    return block_q, (max(2, pa.triton.next_power_of_2(splits)) if splits > 1 else 0)


@pytest.mark.parametrize(("group", "kv_heads", "dim"), [(8, 4, 128), (1, 1, 64), (16, 1, 576)])
def test_the_warm_up_shapes_compile_every_variant_a_step_can_need(group, kv_heads, dim):
    """Random steps (several rows, prompt chunks beside decode rows, contexts up to the model's
    length) never need a kernel variant the warm-up's one-row calls did not compile."""
    import random

    from dwdp.worker.gpu import paged_attention as pa

    max_len, budget = 4096, 512
    warmed = {_variant(pa, [q], [s], group, kv_heads, dim)
              for q, s in pa.warm_up_shapes(max_len, "cpu") if q <= budget}
    rng = random.Random(0)
    for _ in range(400):
        rows = rng.randint(1, 64)
        q_lens = [1 if rng.random() < 0.7 else rng.randint(2, budget // rows + 1)
                  for _ in range(rows)]
        seq_lens = [rng.randint(q + 1, max_len) for q in q_lens]
        got = _variant(pa, q_lens, seq_lens, group, kv_heads, dim)
        assert got in warmed, (got, sorted(warmed), q_lens[:4], seq_lens[:4])


def test_every_part_of_the_packed_index_tensor_starts_on_16_bytes():
    """Triton specialises a pointer on 16-byte alignment: an unaligned part would compile a
    variant of its own while serving."""
    from dwdp.worker.gpu.paged_attention import requests_on

    for rows in range(1, 9):
        req = requests_on("cpu", list(range(rows)), [1] * rows, [5] * rows, [[3]] * rows)
        for part in (req.q_start, req.q_len, req.seq_len, req.block_table):
            assert part.data_ptr() % 16 == 0, (rows, part)
        assert req.q_len.tolist() == [1] * rows and req.seq_len.tolist() == [5] * rows
