"""Attention that reads the paged KV cache where it lies: one Triton kernel for decode tokens and
prefill chunks that follow earlier chunks, for multi-head/grouped-query attention and for
DeepSeek's multi-head latent attention (MLA) over the compressed latent cache.

``paged_attention(query, key_caches, value_cache, out, requests, ...)`` computes, for each
request ``r`` of ``requests`` (a ``PagedRequests``: device tensors of ``R`` rows), the
attention of its ``q_len[r]`` query rows (rows ``q_start[r]`` .. of ``query``) to the first
``seq_len[r]`` tokens of its context, read through its block table: token ``t`` lives in slot
``block_table[r, t // block_size] * block_size + t % block_size`` of each cache. The queries are
the last ``q_len[r]`` positions of the context (query ``i`` sits at position
``seq_len[r] - q_len[r] + i`` and sees keys up to it; with ``window`` only the ``window``
latest of them), so no mask tensor exists.

Shapes (``T`` query rows, ``Hq`` query heads, ``Hkv`` KV heads, ``Hq % Hkv == 0``):
- ``query`` [T, Hq, D1 + D2] (any strides, last dim contiguous);
- ``key_caches``: one or two caches [slots, Hkv, D1] and [slots, Hkv, D2]; the score of a key is
  the dot product of the query's first ``D1`` dims with the first cache plus its last ``D2``
  dims with the second (MLA: the absorbed query against the latent, plus the rotary part
  against the rotary key cache);
- ``value_cache`` [slots, Hkv, DV] (MLA: the latent cache itself);
- ``out`` [T, Hq, DV], written at the rows the requests name; other rows are left as they are.

Every index the kernel reads is a device tensor; the grid depends only on host integers: ``R``,
the longest ``q_len``, and for a decode call the number of splits (from ``max_seq_len`` and the
device's SM count, ``_splits``). A decode step's launch is therefore the same at every step of a
batch size when ``max_seq_len`` is held fixed: the CUDA graphs pass the model's maximum length
(programs past a context's end find no keys and write an empty partial), so one capture serves
every context length. Softmax in fp32 (online, flash-attention style); the output
in ``out``'s dtype.

Compiled variants: Triton compiles a kernel per set of ``tl.constexpr`` values and per
specialisation of its other arguments (an integer equal to 1 or divisible by 16, a pointer
aligned to 16 bytes). The integers that can change from step to step (``num_splits``,
``split_keys``, ``window``, the block table's row stride, and the query's and output's strides,
which follow the step's token count) are not specialised; the caches' strides, fixed for a
model, are (they let the loads of cache rows vectorise). Every part of a packed index tensor
starts on a 16-byte boundary (``index_offsets``). So the variants a server can need are few and
known: ``warm_up_shapes`` lists one call per variant, which the engine runs
before it serves (a compile takes about half a second: in a step it stalls every request).

On the CPU, Triton's interpreter runs it (tests); the engine's CPU path does not use it.
Source: written for this project.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_N = 32
"""Keys per inner iteration (gathered slot by slot, so any page size works)."""
MAX_TILE_ELEMENTS = 128 * 128
"""Bound on a program's query rows x padded head dim: the fp32 accumulator stays in registers."""
PROGRAMS_PER_SM = 4
"""Decode splits each context until the grid has about this many programs per SM."""
MIN_SPLIT_KEYS = 64
"""Keys of one split at least (a split shorter than this costs more to combine than it saves)."""
PARTIAL_BYTES = 1 << 26
"""Bound on the fp32 partial outputs of one split call (bytes): fewer splits beyond it."""
INDEX_ALIGN = 4
"""int32 elements in 16 bytes: each part of a packed index tensor starts at a multiple of it."""


@dataclass(frozen=True, slots=True)
class PagedRequests:
    """The requests of one call, on the cache's device: ``q_start``, ``q_len``, ``seq_len``
    [R] int32 and ``block_table`` [R, W] int32 (W blocks of ``block_size`` tokens at least
    cover the longest ``seq_len``); ``max_q_len`` and ``max_seq_len``: bounds of ``q_len``
    and ``seq_len`` (host ints; a captured graph passes the bounds of any step it replays)."""

    q_start: Any
    q_len: Any
    seq_len: Any
    block_table: Any
    max_q_len: int
    max_seq_len: int


@triton.jit(do_not_specialize=["window", "num_splits", "split_keys", "stride_qt", "stride_qh",
                               "stride_ot", "stride_oh", "stride_table"])
def _paged_attention_kernel(
    q_ptr, k1_ptr, k2_ptr, v_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    q_start_ptr, q_len_ptr, seq_len_ptr, table_ptr,
    scale, window, num_splits, split_keys, heads_q,
    stride_qt, stride_qh, stride_k1s, stride_k1h, stride_k2s, stride_k2h,
    stride_vs, stride_vh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    D1: tl.constexpr, D1P: tl.constexpr, D2: tl.constexpr, D2P: tl.constexpr,
    DV: tl.constexpr, DVP: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    tile = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    head_tiles: tl.constexpr = GROUP // HEADS
    kv_head = tl.program_id(2) // head_tiles
    first_head = kv_head * GROUP + (tl.program_id(2) % head_tiles) * HEADS
    q_len = tl.load(q_len_ptr + r)
    if tile * BLOCK_Q >= q_len:
        return
    q_begin = tl.load(q_start_ptr + r)
    seq_len = tl.load(seq_len_ptr + r)

    rows = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + rows // HEADS  # query index within the request
    head = first_head + rows % HEADS
    row_ok = (rows < BLOCK_Q * HEADS) & (qi < q_len)
    qpos = seq_len - q_len + qi  # its position in the context
    q_row = (q_begin + qi).to(tl.int64) * stride_qt + head * stride_qh

    d1 = tl.arange(0, D1P)
    q1 = tl.load(q_ptr + q_row[:, None] + d1[None, :],
                 mask=row_ok[:, None] & (d1[None, :] < D1), other=0.0)
    if D2 > 0:
        d2 = tl.arange(0, D2P)
        q2 = tl.load(q_ptr + q_row[:, None] + D1 + d2[None, :],
                     mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)
    dv = tl.arange(0, DVP)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], dtype=tl.float32)

    last = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    hi = seq_len - q_len + last + 1  # keys this tile can see: [lo, hi)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if SPLIT:  # this program's share of the keys (split_keys is a multiple of BLOCK_N)
        lo = tl.maximum(lo, split * split_keys)
        hi = tl.minimum(hi, (split + 1) * split_keys)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        key_ok = kpos < hi
        page = tl.load(table_ptr + r.to(tl.int64) * stride_table + kpos // PAGE,
                       mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE + kpos % PAGE
        k1 = tl.load(k1_ptr + slot[:, None] * stride_k1s + kv_head * stride_k1h + d1[None, :],
                     mask=key_ok[:, None] & (d1[None, :] < D1), other=0.0)
        s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        if D2 > 0:
            k2 = tl.load(k2_ptr + slot[:, None] * stride_k2s + kv_head * stride_k2h
                         + d2[None, :], mask=key_ok[:, None] & (d2[None, :] < D2), other=0.0)
            s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        s = s * scale
        ok = key_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                    mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:  # partials of row (r, head, split): o normalised by its own sum, m and that sum
        part = (r.to(tl.int64) * heads_q + head) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * DVP + dv[None, :], o, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        o_row = (q_begin + qi).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_row[:, None] + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit(do_not_specialize=["num_splits", "stride_ot", "stride_oh"])
def _combine_splits_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, q_start_ptr, num_splits, heads_q,
    stride_ot, stride_oh, DV: tl.constexpr, DVP: tl.constexpr, SP: tl.constexpr,
):
    r = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SP)
    ok = splits < num_splits
    part = (r.to(tl.int64) * heads_q + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l_s > 0.0, l_s * tl.exp(m - m_safe), 0.0)
    total = tl.sum(w, 0)
    dv = tl.arange(0, DVP)
    o = tl.load(part_o_ptr + part[:, None] * DVP + dv[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(tl.where(w[:, None] > 0.0, o * w[:, None], 0.0), 0) / tl.where(
        total == 0.0, 1.0, total)
    row = tl.load(q_start_ptr + r).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty),
             mask=dv < DV)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _tiling(group: int, max_q_len: int, width: int) -> tuple[int, int, int]:
    """(heads per program, query tokens per program, padded rows): the largest tile whose
    rows x ``width`` stays within ``MAX_TILE_ELEMENTS``."""
    heads = group
    while heads > 1 and heads * width > MAX_TILE_ELEMENTS and heads % 2 == 0:
        heads //= 2
    block_q = 1
    while (block_q * 2 <= max_q_len and _pow2(block_q * 2 * heads) * width
           <= MAX_TILE_ELEMENTS):
        block_q *= 2
    return heads, block_q, _pow2(block_q * heads)


@functools.cache
def _sm_count(device: Any) -> int:
    if torch.device(device).type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _splits(requests: PagedRequests, programs: int, heads_q: int, dvp: int,
            device: Any) -> tuple[int, int]:
    """(splits, keys per split) of a decode call (every ``q_len`` 1): enough splits that the
    grid fills the SMs, none shorter than ``MIN_SPLIT_KEYS``, the partials within
    ``PARTIAL_BYTES``; (1, 0) when one program per row already fills the device."""
    if requests.max_q_len != 1:
        return 1, 0
    want = -(-PROGRAMS_PER_SM * _sm_count(device) // max(1, programs))
    cap_len = -(-requests.max_seq_len // MIN_SPLIT_KEYS)
    cap_mem = PARTIAL_BYTES // max(1, requests.q_len.shape[0] * heads_q * dvp * 4)
    splits = max(1, min(want, cap_len, cap_mem))
    if splits == 1:
        return 1, 0
    keys = -(-requests.max_seq_len // splits)
    return splits, -(-keys // BLOCK_N) * BLOCK_N


def paged_attention(
    query: Any,
    key_caches: tuple[Any, ...],
    value_cache: Any,
    out: Any,
    requests: PagedRequests,
    *,
    block_size: int,
    scale: float,
    window: int | None = None,
) -> Any:
    """Attention of ``requests``' query rows to their paged contexts, written into ``out``
    (module docstring for shapes). A decode call (every ``q_len`` 1) on a device its rows
    do not fill splits each context over several programs and combines their softmax
    partials in a second kernel (flash-decoding). Returns ``out``. Raises ``ValueError`` for
    caches or a query whose head counts or dims do not match."""
    k1 = key_caches[0]
    k2 = key_caches[1] if len(key_caches) > 1 else None
    heads_q, kv_heads = query.shape[1], k1.shape[1]
    d1, d2 = k1.shape[2], (k2.shape[2] if k2 is not None else 0)
    dv = value_cache.shape[2]
    if heads_q % kv_heads or query.shape[2] != d1 + d2 or out.shape[1:] != (heads_q, dv):
        raise ValueError(
            f"paged_attention: query {tuple(query.shape)}, key caches "
            f"{[tuple(k.shape) for k in key_caches]}, value cache {tuple(value_cache.shape)}, "
            f"out {tuple(out.shape)} do not match"
        )
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention: query and out need a contiguous last dimension")
    num = requests.q_len.shape[0]
    if num == 0:
        return out
    group = heads_q // kv_heads
    width = max(_pow2(d1), _pow2(dv))
    heads, block_q, block_m = _tiling(group, max(1, requests.max_q_len), width)
    tiles = triton.cdiv(max(1, requests.max_q_len), block_q)
    head_programs = kv_heads * (group // heads)
    dvp = _pow2(dv)
    splits, split_keys = _splits(requests, num * tiles * head_programs, heads_q, dvp,
                                 query.device)
    part_o = part_ml = out  # unused without splits
    if splits > 1:
        part_o = torch.empty((num, heads_q, splits, dvp), dtype=torch.float32,
                             device=query.device)
        part_ml = torch.empty((num, heads_q, splits, 2), dtype=torch.float32,
                              device=query.device)
    k2_arg = k2 if k2 is not None else k1
    exact = query.dtype == torch.float32  # fp32 models: no TF32 rounding in the dots
    _paged_attention_kernel[(num, tiles * splits, head_programs)](
        query, k1, k2_arg, value_cache, out, part_o, part_ml,
        requests.q_start, requests.q_len, requests.seq_len, requests.block_table,
        float(scale), int(window or 0), splits, split_keys, heads_q,
        query.stride(0), query.stride(1), k1.stride(0), k1.stride(1),
        k2_arg.stride(0), k2_arg.stride(1), value_cache.stride(0), value_cache.stride(1),
        out.stride(0), out.stride(1), requests.block_table.stride(0),
        GROUP=group, HEADS=heads, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        PAGE=block_size, D1=d1, D1P=_pow2(d1), D2=d2, D2P=_pow2(d2) if d2 else 16,
        DV=dv, DVP=dvp, SPLIT=splits > 1, PRECISION="ieee" if exact else "tf32",
        num_warps=4 if block_m * width <= 64 * 128 else 8,
    )
    if splits > 1:
        _combine_splits_kernel[(num, heads_q)](
            part_o, part_ml, out, requests.q_start, splits, heads_q,
            out.stride(0), out.stride(1), DV=dv, DVP=dvp,
            SP=max(2, triton.next_power_of_2(splits)),
        )
    return out


def index_offsets(rows: int) -> tuple[int, int, int, int]:
    """Where ``q_start``, ``q_len``, ``seq_len`` and the block table start (int32 elements) in
    a packed index tensor of ``rows`` requests: each part on a 16-byte boundary."""
    part = -(-rows // INDEX_ALIGN) * INDEX_ALIGN
    return 0, part, 2 * part, 3 * part


def requests_on(device: Any, q_start: list[int], q_len: list[int], seq_len: list[int],
                tables: Sequence[Sequence[int]]) -> PagedRequests:
    """``PagedRequests`` from host lists, through one copy of one packed int32 tensor
    (``[q_start | q_len | seq_len | tables]``, each part contiguous from its
    ``index_offsets``; pinned for a CUDA device, so that the copy does not wait for the
    stream); tables are padded with 0 to the longest."""
    num = len(q_len)
    width = max((len(t) for t in tables), default=1) or 1
    starts = index_offsets(num)
    pinned = torch.device(device).type == "cuda"  # then the copy runs asynchronously
    host = torch.zeros(starts[3] + num * width, dtype=torch.int32, pin_memory=pinned)
    for start, part in zip(starts, (q_start, q_len, seq_len), strict=False):
        host[start : start + num] = torch.tensor(part, dtype=torch.int32)
    table = host[starts[3] :].view(num, width)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    q_start_at, q_len_at, seq_len_at, table_at = starts
    return PagedRequests(dev[q_start_at : q_start_at + num], dev[q_len_at : q_len_at + num],
                         dev[seq_len_at : seq_len_at + num], dev[table_at:].view(num, width),
                         max(q_len, default=0), max(seq_len, default=0))


def warm_up_shapes(max_seq_len: int, device: Any) -> list[tuple[int, int]]:
    """(q_len, seq_len) of one-request calls that, between them, compile every kernel variant a
    step can need on ``device`` for contexts up to ``max_seq_len`` tokens: decode without
    splits, decode at each power of two of splits up to the most a call can make (one KV head,
    the most programs per head; the combine kernel's tile), and each query tile of a prefill
    chunk that follows earlier chunks (``q_len`` at powers of two up to the tallest tile
    ``_tiling`` can make, at a padded width of 16). A call of several requests tiles by its
    longest ``q_len`` and splits no more than one request does, so these cover every step
    (a few of them may compile a variant this model never uses)."""
    shapes = [(1, 2)]
    most = min(PROGRAMS_PER_SM * _sm_count(device), -(-max_seq_len // MIN_SPLIT_KEYS))
    splits = 2
    while splits <= triton.next_power_of_2(most):
        shapes.append((1, min(max_seq_len, splits * MIN_SPLIT_KEYS)))
        splits *= 2
    q_len = 2
    while q_len <= min(MAX_TILE_ELEMENTS // 16, max_seq_len - 1):
        shapes.append((q_len, q_len + 1))
        q_len *= 2
    return shapes
