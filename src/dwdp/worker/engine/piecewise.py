"""Piecewise CUDA graphs: steps that hold prompt chunks replay graphs too, with attention eager.

A step with a prompt chunk cannot be one graph: its attention depends on how the step's tokens
split into requests (a prompt's first chunk through SDPA, later chunks and decode tokens through
the paged kernel, each with its own grid). Everything else in the forward (embedding, norms,
projections, rotary embedding, the cache write, the experts, the output head) depends only on
the number of tokens. So, as vLLM's piecewise graphs do, the forward is captured once per
token-count bucket (``token_buckets``) in pieces cut at every attention call: piece 0 runs up to
layer 0's attention, piece ``i`` from layer ``i - 1``'s attention output to layer ``i``'s
attention inputs, the last one to the logits. A step copies its token data into the static
inputs of the smallest bucket holding it (padding rows: token 0 at position 0, written to the
cache's scratch block), then replays piece 0, runs layer 0's attention eagerly over the step's
own layout (reading the queries the piece left and writing the static output the next piece
reads), replays piece 1, and so on. An eager step of the 4-layer benchmark model spends 9 to 14
ms of host time launching its kernels whatever its size; this step launches the pieces and one
attention call per layer.

Steps of more tokens than the largest bucket run eagerly (their launches then take about as long
as their GPU work: about 15 ms at 8K tokens on that model).
Captured beside the decode graphs (``dwdp.worker.engine.graphs``), in the same memory pool, by
``ContinuousEngine.capture_cuda_graphs``; the same setting turns both on (``engine.cudaGraphs``).

Errors: ``CudaGraphError`` (one line: the bucket and the first line of the failure).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dwdp.worker.engine.graphs import CudaGraphError
from dwdp.worker.engine.paged import Chunk, KernelLayout, PagedKVCache, StepRows, kernel_attention

MAX_CAPTURE_TOKENS = 4096
"""The largest bucket (tokens of a step); at most the engine's ``max_num_tokens``. An eager step
of the 4-layer benchmark model launches for 9 to 14 ms; its GPU time reaches that near 8K
tokens."""
FINE_TOKENS = 256
"""Buckets are powers of two up to this many tokens, then multiples of it."""


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts captured for steps of at most ``max_tokens`` tokens (at most
    ``MAX_CAPTURE_TOKENS``): powers of two up to ``FINE_TOKENS``, then its multiples, then
    the bound itself (``300 -> (1, 2, ..., 256, 300)``). Raises ``ValueError`` below 1."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens}, must be at least 1")
    top = min(max_tokens, MAX_CAPTURE_TOKENS)
    sizes = []
    size = 1
    while size < top:
        sizes.append(size)
        size = size * 2 if size < FINE_TOKENS else size + FINE_TOKENS
    sizes.append(top)
    return tuple(sizes)


@dataclass(slots=True)
class _Site:
    """One attention call of a captured forward: its module and arguments as the piece before
    it left them (static tensors of the bucket), and ``out``, the static rows [T, Hq, Dv]
    the piece after it reads."""

    module: Any
    query: Any
    key: Any
    value: Any
    scaling: float | None
    window: int | None
    out: Any

    def attend(self, layout: KernelLayout) -> None:
        """This layer's attention for the step of ``layout``, into ``out``."""
        kernel_attention(self.module, layout, self.query, self.key, self.value, self.scaling,
                         self.window, out=self.out)


@dataclass(slots=True)
class _Bucket:
    """The pieces of one bucket's forward: ``graphs[i]`` runs before ``sites[i]`` (one more
    graph than sites: the last runs to the logits [rows, vocab], ``logits``)."""

    graphs: list[Any] = field(default_factory=list)
    sites: list[_Site] = field(default_factory=list)
    logits: Any = None

    def run(self, layout: KernelLayout) -> Any:
        """Replay the pieces with each attention, eager, over ``layout``; returns ``logits``."""
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.sites):
                self.sites[i].attend(layout)
        return self.logits


class PiecewiseGraphs:
    """The piecewise graphs of one ``PagedKVCache`` (kernel mode) and their static tensors.

    - ``longs`` [4, B] int64 on the device (token ids, sampled rows, positions, slots, as
      ``StepRows.tokens``), B the largest bucket, with a pinned host twin;
    - ``statics``: per shape (without the token dimension), one static tensor of B tokens for
      each attention argument (query, key, value: a piece copies them in last) and output,
      and one for the logits; a bucket of T tokens uses their first T rows. Every layer and
      bucket shares them (a piece reads them before the next attention writes them), so the
      graphs' pool holds only the largest bucket's transient activations.

    Build with ``PiecewiseGraphs.capture``."""

    def __init__(self, cache: PagedKVCache, *, max_num_tokens: int, max_rows: int) -> None:
        import torch

        self.cache = cache
        self.buckets = token_buckets(max_num_tokens)
        self.max_rows = max_rows
        """The most logits rows a step keeps: one per request (``max_batch_size``), and with
        speculative decoding one per draft position too."""
        size = self.buckets[-1]
        self.scratch_slot = cache.scratch_block * cache.block_size
        self.longs = torch.zeros((4, size), dtype=torch.long, device=cache.device)
        self.longs[3].fill_(self.scratch_slot)
        self.host = torch.zeros((4, size), dtype=torch.long, pin_memory=self.longs.is_cuda)
        self.statics: dict[tuple[Any, ...], Any] = {}
        self.steps: dict[int, Any] = {}
        """Each bucket's pieces (a ``_Bucket``: ``run(layout)`` returns its logits)."""
        self.replays = 0

    def layout(self, tokens: int) -> KernelLayout:
        """The static layout of bucket ``tokens``: views of ``longs``; the sampled rows are
        the bucket's first ``min(tokens, max_rows)``."""
        rows = min(tokens, self.max_rows)
        return KernelLayout(
            input_ids=self.longs[0:1, :tokens],
            position_ids=self.longs[2:3, :tokens],
            slots=self.longs[3, :tokens],
            logits_index=self.longs[1, :rows],
            fresh=[],
            paged=None,
            cache=self.cache,
        )

    def static(self, name: str, like: Any, dim: int, rows: int | None = None) -> Any:
        """The static tensor ``name`` for tensors like ``like`` (same dtype, sizes and order of
        strides; ``like`` may be a meta tensor), ``like.shape[dim]`` rows along ``dim`` (the
        tokens): a view of a tensor of ``rows`` rows (default: the largest bucket's tokens) on
        the cache's device, allocated at its first use (the warm-up, outside any capture)."""
        import torch

        order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
        sizes = list(like.shape)
        sizes[dim] = self.buckets[-1] if rows is None else rows
        key = (name, like.dtype, tuple(order), tuple(sizes))
        full = self.statics.get(key)
        if full is None:
            base = torch.zeros([sizes[d] for d in order], dtype=like.dtype,
                               device=self.cache.device)
            full = self.statics[key] = base.permute([order.index(d) for d in range(like.dim())])
        return full.narrow(dim, 0, like.shape[dim])

    @classmethod
    def capture(
        cls,
        cache: PagedKVCache,
        forward: Callable[[KernelLayout], Any],
        *,
        max_num_tokens: int,
        max_rows: int,
        pool: Any,
    ) -> PiecewiseGraphs:
        """Capture every bucket, largest first, into the memory pool ``pool``.
        ``forward(layout)`` runs the model over a layout and returns its logits. Raises
        ``CudaGraphError`` naming the bucket and the first line of the failure."""
        import torch

        self = cls(cache, max_num_tokens=max_num_tokens, max_rows=max_rows)
        side = torch.cuda.Stream(device=cache.device)
        for tokens in reversed(self.buckets):
            layout = self.layout(tokens)
            try:
                side.wait_stream(torch.cuda.current_stream(cache.device))
                with torch.cuda.stream(side), torch.inference_mode():
                    # warm-up: lazy initialisations and the static tensors, outside capture
                    for _ in range(2):
                        self._logits(forward(replace(layout, split=self._prepare)))
                    self.steps[tokens] = self._capture(layout, forward, pool)
                torch.cuda.current_stream(cache.device).wait_stream(side)
            except Exception as exc:
                raise CudaGraphError.capturing(f"the pieces of a {tokens}-token step",
                                               exc) from exc
        torch.cuda.synchronize(cache.device)
        return self

    def _prepare(self, module: Any, query: Any, key: Any, value: Any, scaling: float | None,
                 window: int | None) -> Any:
        """``KernelLayout.split`` in the warm-up: allocate the static tensors of this call;
        returns its static output [1, T, Hq, Dv] (no attention runs)."""
        for name, arg in (("query", query), ("key", key), ("value", value)):
            self.static(name, arg, 2)
        return self._out(query, value)[None]

    def _out(self, query: Any, value: Any) -> Any:
        """The static attention output [T, Hq, Dv] of ``query`` [1, Hq, T, D] and ``value``
        [1, Hkv, T, Dv]."""
        import torch

        like = torch.empty((query.shape[2], query.shape[1], value.shape[3]), dtype=query.dtype,
                           device="meta")
        return self.static("out", like, 0)

    def _logits(self, logits: Any) -> Any:
        """The static logits [rows, vocab] of ``logits``, sized for the most rows a step
        samples."""
        return self.static("logits", logits, 0, min(self.buckets[-1], self.max_rows))

    def _capture(self, layout: KernelLayout, forward: Callable[[KernelLayout], Any],
                 pool: Any) -> _Bucket:
        """One bucket's pieces (on the capture stream): a graph is begun, each attention call
        ends it and begins the next (``_split``), the forward's end (its logits copied to the
        static logits) ends the last."""
        import torch

        bucket = _Bucket()
        bucket.graphs.append(torch.cuda.CUDAGraph())
        bucket.graphs[-1].capture_begin(pool=pool)
        try:
            logits = forward(replace(layout, split=functools.partial(self._split, bucket, pool)))
            bucket.logits = self._logits(logits)
            bucket.logits.copy_(logits)
        finally:
            bucket.graphs[-1].capture_end()
        return bucket

    def _split(self, bucket: _Bucket, pool: Any, module: Any, query: Any, key: Any,
               value: Any, scaling: float | None, window: int | None) -> Any:
        """``KernelLayout.split`` while capturing: copy the attention's arguments into their
        static tensors (the running piece's last work), end the piece, keep the call, begin
        the next piece; returns the static output [1, T, Hq, Dv] the next piece reads."""
        import torch

        q, k, v = (self.static(name, arg, 2) for name, arg in
                   (("query", query), ("key", key), ("value", value)))
        for static, arg in ((q, query), (k, key), (v, value)):
            static.copy_(arg)
        bucket.graphs[-1].capture_end()
        out = self._out(query, value)
        bucket.sites.append(_Site(module, q, k, v, scaling, window, out))
        bucket.graphs.append(torch.cuda.CUDAGraph())
        bucket.graphs[-1].capture_begin(pool=pool)
        return out[None]

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the step of ``chunks`` replays a bucket: at most the largest's tokens and
        ``max_rows`` logits rows."""
        return (0 < sum(len(c.token_ids) for c in chunks) <= self.buckets[-1]
                and sum(c.rows for c in chunks) <= self.max_rows)

    def replay(self, chunks: Sequence[Chunk]) -> Any:
        """Copy the step's token data into the smallest bucket holding it and run its pieces;
        returns the logits of the sampling chunks [samples, vocab] (a view of the bucket's
        output, valid until the next replay)."""
        rows = StepRows.of(chunks, self.cache.block_size, pin=self.longs.is_cuda)
        n = rows.tokens.shape[1]
        tokens = next(b for b in self.buckets if b >= n)
        self.host[:, :n] = rows.tokens
        self.host[:3, n:tokens] = 0  # padding: token 0 at position 0, sampled row 0
        self.host[3, n:tokens] = self.scratch_slot
        self.longs[:, :tokens].copy_(self.host[:, :tokens], non_blocking=True)
        layout = replace(self.layout(tokens), fresh=rows.fresh,
                         paged=rows.requests(self.cache.device))
        logits = self.steps[tokens].run(layout)
        self.replays += 1
        return logits[: rows.samples]
