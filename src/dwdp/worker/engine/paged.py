"""The paged KV cache and the attention that reads it, plugged into transformers' models.

One forward of the continuous engine packs every scheduled request into one row: ``T`` new
tokens (prefill chunks and single decode tokens side by side) with their own positions. The
model runs unchanged; two of transformers' extension points carry the packing:

- the cache: ``PagedKVCache.update(key, value, layer_idx)`` is what every attention layer calls
  with the new tokens' cache entries ([1, heads, T, dim]: K and V, or for DeepSeek-V3's MLA the
  compressed latent and the rotary key). It writes them to their slots (``StepLayout.slots``)
  and returns the whole context of every request, packed in request order ([1, heads, S, dim],
  ``S`` = the sum of the requests' lengths after this step);
- the attention: ``dwdp_paged`` (registered with ``AttentionInterface``) attends each request's
  queries to its own slice of that packing: the decode tokens in one batched SDPA call with a key
  mask, each prefill chunk in its own SDPA call (causal; a chunk after earlier chunks gets the
  bottom-right causal mask). On a GPU ``dwdp.worker.gpu.cuda_path.sdpa_backends`` picks the
  kernels per call.

On CUDA the cache is read where it lies instead (``KernelLayout``): ``update`` only writes the
new entries and returns them, and ``dwdp_paged`` runs the step's decode tokens and the chunks
that follow earlier chunks through one call of ``dwdp.worker.gpu.paged_attention`` (block
tables and context lengths, no packing copy; DeepSeek's MLA attends to the latent cache through
the absorbed query), while chunks that start a prompt attend to their new entries through SDPA.
Every index of a decode-only step is a device tensor, so ``dwdp.worker.engine.graphs`` can
capture it. The cache then holds one more block, ``scratch_block``, that no request owns: the
padding rows of a captured batch write and read only it.

Outside an engine step (no layout active: a plain forward, ``generate``, the wave engine)
``dwdp_paged`` is transformers' SDPA attention with SDPA's masks, so a model switched to it
still serves every other caller unchanged.

Slots: a layer's cache is a tensor [num_blocks x block_size, heads, dim]; token ``t`` of a
request with block table ``b`` lives in slot ``b[t // block_size] * block_size + t % block_size``
(``dwdp.worker.engine.blocks``). Tensors are allocated at a layer's first write, with the shape
that layer writes, so the cache holds exactly what transformers' own cache would per token.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dwdp.worker.gpu.paged_attention import PagedRequests

ATTENTION_NAME = "dwdp_paged"

_STEP: contextvars.ContextVar[StepLayout | KernelLayout | None] = contextvars.ContextVar(
    "dwdp_paged_step", default=None
)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's part of a step: tokens ``[start, start + len(token_ids))`` of the request,
    ``blocks`` its block table, ``sample``: the step ends at the request's last known token, so
    its logits choose the next one. ``draft``: the last ``draft`` of ``token_ids`` are draft
    tokens after the last known one (speculative decoding, ``sample`` true): the step keeps the
    logits of the chunk's last ``draft + 1`` positions (``rows``)."""

    token_ids: Sequence[int]
    start: int
    blocks: Sequence[int]
    sample: bool
    draft: int = 0

    @property
    def rows(self) -> int:
        """Logits rows the step keeps for this chunk: 0, 1, or ``draft + 1``."""
        return self.draft + 1 if self.sample else 0


class _Masks:
    """Causal masks of a step's prefill chunks, built once per shape and reused by every layer."""

    __slots__ = ()
    _masks: dict[Any, Any]

    def chunk_mask(self, n: int, total: int, window: int | None, device: Any) -> Any:
        """[n, total] bool, bottom-right causal: query ``i`` (position ``total - n + i``) sees
        keys up to its own position (and inside its sliding window); ``None`` when plain
        top-left causal attention is the same (``n == total``, no window in reach)."""
        if n == total and (window is None or total <= window):
            return None
        key = (n, total, window)
        if key not in self._masks:
            import torch

            i = torch.arange(n, device=device)[:, None] + (total - n)
            j = torch.arange(total, device=device)[None, :]
            ok = j <= i
            if window is not None:
                ok &= j > i - window
            self._masks[key] = ok
        return self._masks[key]


@dataclass(slots=True)
class StepLayout(_Masks):
    """Where one step's tokens go and what each query attends to, the context packed (the CPU
    path; all index tensors on the model's device). Built by ``StepLayout.build``."""

    input_ids: Any  # [1, T]
    position_ids: Any  # [1, T]
    slots: Any  # [T] cache slot of each new token
    context_slots: Any | None  # [S] slots of every request's context; None: the new tokens
    logits_index: Any  # [R] position in T of each kept logits row (``Chunk.rows``)
    prefills: list[tuple[int, int, int, int]]  # (q0, q1, k0, k1) of each multi-token chunk
    decode_q: Any | None  # [B] positions in T of the single-token chunks
    decode_k: Any | None  # [B, Kmax] positions in S of their contexts (padded with 0)
    decode_len: list[int]  # context length of each decode chunk
    cache: PagedKVCache
    _masks: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], cache: PagedKVCache, device: Any) -> StepLayout:
        """The layout of ``chunks`` (at least one), in their order."""
        import torch

        bs = cache.block_size
        ids: list[int] = []
        pos: list[Any] = []
        slots: list[Any] = []
        ctx: list[Any] = []
        sample_at: list[int] = []
        prefills: list[tuple[int, int, int, int]] = []
        decode_q: list[int] = []
        decode_k: list[tuple[int, int]] = []
        decode_len: list[int] = []
        q = k = 0
        fresh = True
        for c in chunks:
            n = len(c.token_ids)
            end = c.start + n
            table = torch.tensor(list(c.blocks), dtype=torch.long)
            every = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[:end]
            ids.extend(c.token_ids)
            pos.append(torch.arange(c.start, end))
            slots.append(every[c.start :])
            ctx.append(every)
            fresh = fresh and c.start == 0
            if n == 1 and c.start > 0:
                decode_q.append(q)
                decode_k.append((k, k + end))
                decode_len.append(end)
            else:
                prefills.append((q, q + n, k, k + end))
            q += n
            k += end
            sample_at.extend(range(q - c.rows, q))
        dq = dk = None
        if decode_q:
            width = max(decode_len)
            dk_host = torch.zeros((len(decode_q), width), dtype=torch.long)
            for row, (k0, k1) in enumerate(decode_k):
                dk_host[row, : k1 - k0] = torch.arange(k0, k1)
            dq = torch.tensor(decode_q, dtype=torch.long).to(device)
            dk = dk_host.to(device)
        return cls(
            input_ids=torch.tensor([ids], dtype=torch.long).to(device),
            position_ids=torch.cat(pos).unsqueeze(0).to(device),
            slots=torch.cat(slots).to(device),
            context_slots=None if fresh else torch.cat(ctx).to(device),
            logits_index=torch.tensor(sample_at, dtype=torch.long).to(device),
            prefills=prefills,
            decode_q=dq,
            decode_k=dk,
            decode_len=decode_len,
            cache=cache,
        )

    def decode_mask(self, window: int | None) -> Any:
        """[B, 1, 1, Kmax] bool: key ``j`` of decode row ``b`` is inside its context (and its
        sliding window)."""
        key = ("decode", window)
        if key not in self._masks:
            import torch

            assert self.decode_k is not None
            lens = torch.tensor(self.decode_len, device=self.decode_k.device)[:, None]
            j = torch.arange(self.decode_k.shape[1], device=self.decode_k.device)[None, :]
            ok = j < lens
            if window is not None:
                ok &= j >= lens - window
            self._masks[key] = ok[:, None, None, :]
        return self._masks[key]


@dataclass(slots=True)
class KernelLayout(_Masks):
    """One step's layout for the paged kernel (CUDA): where the new tokens go, the chunks that
    start a prompt (``fresh``: (q0, q1) row ranges, attended over their new entries), and every
    other chunk as ``paged`` rows of the kernel (``None``: none this step). Built by
    ``KernelLayout.build``, or over static tensors by ``dwdp.worker.engine.graphs``."""

    input_ids: Any  # [1, T]
    position_ids: Any  # [1, T]
    slots: Any  # [T] int64 cache slot of each new token
    logits_index: Any  # [R] position in T of each kept logits row (``Chunk.rows``)
    fresh: list[tuple[int, int]]
    paged: PagedRequests | None
    cache: PagedKVCache
    _masks: dict[Any, Any] = field(default_factory=dict)

    split: Callable[..., Any] | None = None
    """While ``dwdp.worker.engine.piecewise`` captures: the attention call's stand-in, which
    ends one graph at each layer's attention and returns the static output rows."""

    @classmethod
    def build(cls, chunks: Sequence[Chunk], cache: PagedKVCache, device: Any) -> KernelLayout:
        """The layout of ``chunks`` (at least one), in their order: one copy to the device for
        the token data, one for the kernel's request rows."""
        rows = StepRows.of(chunks, cache.block_size, pin=str(device).startswith("cuda"))
        dev = rows.tokens.to(device, non_blocking=True)
        return cls(
            input_ids=dev[0:1],
            position_ids=dev[2:3],
            slots=dev[3],
            logits_index=dev[1, : rows.samples],
            fresh=rows.fresh,
            paged=rows.requests(device),
            cache=cache,
        )


@dataclass(frozen=True, slots=True)
class StepRows:
    """The host data of one kernel step of ``T`` tokens: ``tokens`` [4, T] int64 (token ids,
    the rows whose logits the step keeps (``Chunk.rows``) padded with 0, positions, cache
    slots; pinned for a CUDA device, so that its copy runs asynchronously), ``samples`` (those
    rows), ``fresh`` (the (q0, q1) rows of chunks that start a prompt) and the paged kernel's
    request rows of every other chunk (``q_start``, ``q_len``, ``seq_len``, block ``tables``)."""

    tokens: Any
    samples: int
    fresh: list[tuple[int, int]]
    q_start: list[int]
    q_len: list[int]
    seq_len: list[int]
    tables: list[Sequence[int]]

    @classmethod
    def of(cls, chunks: Sequence[Chunk], block_size: int, *, pin: bool) -> StepRows:
        """The rows of ``chunks`` (at least one), in their order; ``pin``: the tokens in pinned
        host memory (for a copy to a CUDA device)."""
        import torch

        bs = block_size
        ids: list[int] = []
        small: list[int] = []  # positions then slots of single-token chunks, flushed in order
        parts: list[Any] = []
        fresh: list[tuple[int, int]] = []
        q_start: list[int] = []
        q_len: list[int] = []
        seq_len: list[int] = []
        tables: list[Sequence[int]] = []
        sample_at: list[int] = []
        q = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start + n
            ids.extend(c.token_ids)
            if n == 1:
                small.append(c.start)
                small.append(c.blocks[c.start // bs] * bs + c.start % bs)
            else:
                if small:
                    parts.append(torch.tensor(small, dtype=torch.long).view(-1, 2).T)
                    small = []
                pos = torch.arange(c.start, end)
                table = torch.tensor(list(c.blocks[: -(-end // bs)]), dtype=torch.long)
                parts.append(torch.stack([pos, table[pos // bs] * bs + pos % bs]))
            if c.start == 0:
                fresh.append((q, q + n))
            else:
                q_start.append(q)
                q_len.append(n)
                seq_len.append(end)
                tables.append(c.blocks[: -(-end // bs)])
            q += n
            sample_at.extend(range(q - c.rows, q))
        if small:
            parts.append(torch.tensor(small, dtype=torch.long).view(-1, 2).T)
        tokens = torch.empty((4, len(ids)), dtype=torch.long, pin_memory=pin)
        torch.cat([torch.tensor([ids, sample_at + [0] * (len(ids) - len(sample_at))],
                                dtype=torch.long), torch.cat(parts, dim=1)], out=tokens)
        return cls(tokens, len(sample_at), fresh, q_start, q_len, seq_len, tables)

    def requests(self, device: Any) -> PagedRequests | None:
        """The paged kernel's rows on ``device``; None when every chunk starts a prompt."""
        from dwdp.worker.gpu.paged_attention import requests_on

        if not self.q_len:
            return None
        return requests_on(device, self.q_start, self.q_len, self.seq_len, self.tables)


class PagedKVCache:
    """The KV cache of every layer in ``num_blocks`` blocks of ``block_size`` tokens.

    transformers calls ``update`` (the ``Cache`` protocol's write-and-read); ``layers`` holds,
    per layer, the pair of slot tensors ([slots, heads, dim] each) once the layer first wrote.
    ``step`` (a context manager) makes a layout the active one for the forward it wraps.
    ``kernel``: read the cache in place through the paged kernel (default: on a CUDA device);
    the tensors then hold ``num_blocks + 1`` blocks, the last one ``scratch_block``.
    """

    is_compileable = False

    def __init__(
        self, num_blocks: int, block_size: int, *, dtype: Any, device: Any,
        kernel: bool | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kernel = kernel_for(device) if kernel is None else kernel
        self.scratch_block = num_blocks
        """A block no request owns (kernel mode): padding rows of a captured batch use it."""
        self.layers: dict[int, tuple[Any, Any]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the allocated layers hold."""
        return sum(t.numel() * t.element_size() for pair in self.layers.values() for t in pair)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed step has no single sequence length (positions come in explicitly)."""
        return 0

    def layout(self, chunks: Sequence[Chunk]) -> StepLayout | KernelLayout:
        """The layout of one step of ``chunks`` for this cache's attention path."""
        kind = KernelLayout if self.kernel else StepLayout
        return kind.build(chunks, self, self.device)

    @contextlib.contextmanager
    def step(self, layout: StepLayout | KernelLayout) -> Iterator[StepLayout | KernelLayout]:
        """Make ``layout`` the active step of this thread while the forward runs."""
        token = _STEP.set(layout)
        try:
            yield layout
        finally:
            _STEP.reset(token)

    def update(
        self, first: Any, second: Any, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[Any, Any]:
        """Write the step's new entries ([1, heads, T, dim] each) and return, on the packed
        path, every request's context packed ([1, heads, S, dim] each); on the kernel path
        the new entries themselves. Raises ``RuntimeError`` outside a step."""
        layout = _STEP.get()
        if layout is None or layout.cache is not self:
            raise RuntimeError("PagedKVCache.update outside an engine step")
        pair = self.layers.get(layer_idx)
        if pair is None:
            pair = tuple(self._allocate(t) for t in (first, second))
            self.layers[layer_idx] = pair
        out = []
        for store, new in zip(pair, (first, second), strict=True):
            rows = new[0].transpose(0, 1)  # [T, heads, dim]
            store.index_copy_(0, layout.slots, rows.to(store.dtype))
            if isinstance(layout, KernelLayout) or layout.context_slots is None:
                out.append(new)  # the kernel reads the cache; or every request starts here
            else:
                out.append(store.index_select(0, layout.context_slots).transpose(0, 1)[None])
        return out[0], out[1]

    def copy_slots(self, src_block: int, dst_block: int, n: int) -> None:
        """Copy the first ``n`` slots (tokens) of block ``src_block`` into block ``dst_block``,
        in every allocated layer (a sequence that shares a prompt's full blocks takes its own
        copy of the partly filled one it goes on writing)."""
        import torch

        dst, src = dst_block * self.block_size, src_block * self.block_size
        with torch.inference_mode():  # the cache's tensors are inference tensors
            for pair in self.layers.values():
                for store in pair:
                    store[dst : dst + n] = store[src : src + n]

    def _allocate(self, like: Any) -> Any:
        import torch

        heads, dim = like.shape[1], like.shape[3]
        slots = (self.num_blocks + (1 if self.kernel else 0)) * self.block_size
        # empty, not zeros: a slot is always written before it is read, and on the host the
        # pages of blocks never used stay uncommitted (the pool is a budget there)
        return torch.empty((slots, heads, dim), dtype=self.dtype, device=self.device)


def kernel_for(device: Any) -> bool:
    """Whether a cache on ``device`` is read through the paged kernel: on CUDA."""
    return str(device).startswith("cuda")


def paged_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function signature: ``query`` [1, Hq, T, D], ``key``/``value``
    [1, Hkv, S, D] (the packing ``PagedKVCache.update`` returned); returns [1, T, Hq, Dv].
    Outside a step: transformers' SDPA attention."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from dwdp.worker.gpu.cuda_path import sdpa_backends

    layout = _STEP.get()
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        with sdpa_backends(query):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                **kwargs,
            )
    window = sliding_window
    if isinstance(layout, KernelLayout):
        if layout.split is not None:
            return layout.split(module, query, key, value, scaling, window), None
        return kernel_attention(module, layout, query, key, value, scaling, window), None
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty((query.shape[2], query.shape[1], value.shape[3]))  # [T, Hq, Dv]
    _attend_chunks(layout, layout.prefills, query, key, value, out, scaling, window)
    if layout.decode_q is not None:
        idx = layout.decode_k
        q = query[0].index_select(1, layout.decode_q).transpose(0, 1)[:, :, None]  # [B,Hq,1,D]
        k = key[0][:, idx].transpose(0, 1)  # [B, Hkv, Kmax, D]
        v = value[0][:, idx].transpose(0, 1)
        with sdpa_backends(q):
            o = sdpa(q, k, v, attn_mask=layout.decode_mask(window), scale=scaling,
                     enable_gqa=gqa)
        out.index_copy_(0, layout.decode_q, o[:, :, 0].to(out.dtype))
    return out[None], None


def kernel_attention(
    module: Any, layout: KernelLayout, query: Any, key: Any, value: Any,
    scaling: float | None, window: int | None, out: Any = None,
) -> Any:
    """The kernel path of ``paged_attention``: ``query`` [1, Hq, T, D], ``key``/``value`` the
    step's new entries [1, Hkv, T, D]; returns [1, T, Hq, Dv] (``out`` [T, Hq, Dv] when given,
    else a new tensor; rows no chunk names are left as they are). Paged rows read the layer's
    cache through the kernel; fresh chunks attend to their new entries through SDPA."""
    tokens, heads = query.shape[2], query.shape[1]
    if out is None:
        out = query.new_empty((tokens, heads, value.shape[3]))  # [T, Hq, Dv]
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    if layout.paged is not None:
        first, second = layout.cache.layers[module.layer_idx]
        if _is_mla(module):
            _mla_paged(module, layout, query, (first, second), out, scale, window)
        else:
            from dwdp.worker.gpu.paged_attention import paged_attention as kernel

            kernel(query[0].transpose(0, 1), (first,), second, out, layout.paged,
                   block_size=layout.cache.block_size, scale=scale, window=window)
    fresh = [(q0, q1, q0, q1) for q0, q1 in layout.fresh]
    _attend_chunks(layout, fresh, query, key, value, out, scaling, window)
    return out[None]


def _attend_chunks(
    layout: StepLayout | KernelLayout, chunks: list[tuple[int, int, int, int]], query: Any,
    key: Any, value: Any, out: Any, scaling: float | None, window: int | None,
) -> None:
    """SDPA of each prefill chunk ``(q0, q1, k0, k1)``: queries ``[q0, q1)`` of ``query``
    [1, Hq, T, D] to keys ``[k0, k1)`` of ``key``/``value`` [1, Hkv, S, D] (bottom-right
    causal), written into ``out`` [T, Hq, Dv]."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from dwdp.worker.gpu.cuda_path import sdpa_backends

    gqa = query.shape[1] != key.shape[1]
    for q0, q1, k0, k1 in chunks:
        mask = layout.chunk_mask(q1 - q0, k1 - k0, window, query.device)
        q = query[:, :, q0:q1]
        with sdpa_backends(q):
            o = sdpa(q, key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=mask,
                     is_causal=mask is None, scale=scaling, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)


def _is_mla(module: Any) -> bool:
    """DeepSeek's multi-head latent attention: the cache holds the latent and the rotary key."""
    return hasattr(module, "kv_b_proj") and hasattr(module, "kv_lora_rank")


def _mla_paged(
    module: Any, layout: KernelLayout, query: Any, caches: tuple[Any, Any], out: Any,
    scale: float, window: int | None,
) -> None:
    """MLA's paged rows over the latent cache, absorbed (DeepSeek-V2's inference form): the
    no-rope query goes through the key half of ``kv_b_proj`` ([H, nope, rank]) into the latent
    space, the kernel attends to the latent [slots, 1, rank] (also the value) plus the rotary
    key [slots, 1, rope], and the latent output goes through the value half ([H, v, rank]).
    Writes ``out`` [T, H, v] at the paged rows (the others get garbage, overwritten after)."""
    import torch

    from dwdp.worker.gpu.paged_attention import paged_attention as kernel
    from dwdp.worker.quant.fp8 import linear_weight

    latent, rotary = caches
    assert layout.paged is not None
    heads, nope = query.shape[1], module.qk_nope_head_dim
    rank, v_dim = latent.shape[2], out.shape[2]
    # an FP8 checkpoint's kv_b_proj is dequantized for the step (vLLM and SGLang keep a bf16
    # copy instead; a dense-DWDP rank holds only its shard of the layer, so nothing is kept)
    w = linear_weight(module.kv_b_proj, query.dtype).view(heads, nope + v_dim, rank)
    q = query[0]  # [H, T, nope + rope]
    q_latent = torch.matmul(q[..., :nope], w[:, :nope])  # [H, T, rank]
    q_all = torch.cat([q_latent, q[..., nope:]], dim=-1).transpose(0, 1)  # [T, H, rank+rope]
    o_latent = q_all.new_empty((q_all.shape[0], heads, rank))
    kernel(q_all, (latent, rotary), latent, o_latent, layout.paged,
           block_size=layout.cache.block_size, scale=scale, window=window)
    o = torch.matmul(o_latent.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, T, v]
    out.copy_(o.transpose(0, 1))


def use_paged_attention(model: Any) -> None:
    """Register ``dwdp_paged`` with transformers (attention and, for the fallback, SDPA's mask)
    and switch ``model`` to it. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
