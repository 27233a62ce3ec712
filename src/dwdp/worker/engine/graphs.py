"""CUDA graphs of decode-only steps: captured once per batch-size bucket, replayed per step.

A decode-only step (every scheduled request adds one token to a context already in the paged
cache) has the same kernels, shapes and addresses at every step of the same batch size; only
the values of a few small index tensors change. ``DecodeGraphs.capture`` records the model's
forward once per bucket (1, 2, 4, 8, 16, 32, ... up to ``max_batch_size``, largest first, all
in one memory pool) over static input tensors; ``DecodeGraphs.run`` copies a step's inputs into
the smallest bucket that holds it (padding rows write to a scratch block no request owns and
read only it) and replays. Steps with a prefill chunk replay the piecewise graphs
(``dwdp.worker.engine.piecewise``) or run eagerly.

Errors: ``CudaGraphError`` (the capture failed, or graphs were asked for off CUDA), one line
naming the reason; the worker stops the rank with it before serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dwdp.worker.engine.paged import Chunk, KernelLayout, PagedKVCache


class CudaGraphError(RuntimeError):
    """CUDA graphs were asked for (``engine.cudaGraphs``) and cannot be captured here."""

    @classmethod
    def capturing(cls, what: str, exc: BaseException) -> CudaGraphError:
        """The one-line error of a failed capture of ``what`` (``the decode step of batch
        8``): the failure's type and first line."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return cls(f"engine.cudaGraphs: capturing {what} failed: {type(exc).__name__}: {first}")


@dataclass(frozen=True, slots=True)
class GraphStats:
    """What a capture made: the decode graphs' batch-size ``buckets`` (ascending),
    ``pool_bytes``, the device memory the graphs' pool holds (bytes, part of the memory
    ledger), and the piecewise graphs' ``token_buckets`` (``dwdp.worker.engine.piecewise``)."""

    buckets: tuple[int, ...]
    pool_bytes: int
    token_buckets: tuple[int, ...] = ()


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two from 1 below ``max_batch_size``, then ``max_batch_size`` itself
    (``8 -> (1, 2, 4, 8)``, ``48 -> (1, 2, 4, 8, 16, 32, 48)``). Raises ``ValueError`` for a
    size below 1."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size: {max_batch_size}, must be at least 1")
    sizes = []
    b = 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def is_decode_only(chunks: Sequence[Chunk], q: int = 1) -> bool:
    """Every chunk adds its pending token, and at most ``q - 1`` draft tokens after it, to a
    context already cached, and samples from each (a decode step; with drafts a verify step).
    A one-token piece of a prompt that does not end the prompt (``sample`` false: the budget's
    last token went to a prefill) is not decode: its step keeps no logits row for it."""
    return all(0 < len(c.token_ids) <= q and c.start > 0 and c.sample
               and c.draft == len(c.token_ids) - 1 for c in chunks)


class DecodeGraphs:
    """The captured steps of one ``PagedKVCache`` (kernel mode) whose requests each add 1 to
    ``q`` tokens to a cached context, and their static inputs. Request ``i`` of a bucket owns
    token rows ``i * q`` to ``i * q + q - 1`` (its slab); rows past its tokens, and the slabs
    past the step's requests, are padding: they write the scratch block and attend nothing
    of a request's. ``q`` is 1 for decode steps, ``1 + numSpeculativeTokens`` for verify
    steps, and ``dwdp.worker.engine.mtp_drafts`` captures its layer's pass the same way.

    Static device tensors, shared by every bucket (bucket ``b`` uses their first ``b`` slabs):
    ``longs`` [3, B * q] int64 (token ids, positions, slots) and ``ints`` int32
    ``[q_start B | q_len B | seq_len B | block table B x W]`` (each part from its
    ``index_offsets``), W = the blocks of one ``max_model_len`` request; pinned host twins are
    filled per step and copied in. Build with ``DecodeGraphs.capture``.
    """

    def __init__(self, cache: PagedKVCache, *, max_batch_size: int, max_model_len: int,
                 q: int = 1) -> None:
        import torch

        from dwdp.worker.gpu.paged_attention import index_offsets

        self.cache, self.q = cache, q
        self.buckets = bucket_sizes(max_batch_size)
        size, device = self.buckets[-1], cache.device
        self.width = -(-max_model_len // cache.block_size)
        self.scratch_slot = cache.scratch_block * cache.block_size
        self.longs = torch.zeros((3, size * q), dtype=torch.long, device=device)
        self.offsets = index_offsets(size)
        q_start, q_len, _, table = self.offsets
        self.ints = torch.zeros(table + size * self.width, dtype=torch.int32, device=device)
        self.ints[q_start : q_start + size] = torch.arange(0, size * q, q, dtype=torch.int32,
                                                           device=device)
        self.ints[q_len:table] = 1  # a padding row's q_len and seq_len
        self.table = self.ints[table:].view(size, self.width)
        self.table[:, 0] = cache.scratch_block
        pin = self.longs.is_cuda  # pinned host memory: the copies in run asynchronously
        self.host_longs = torch.zeros((3, size * q), dtype=torch.long, pin_memory=pin)
        self.host_lens = torch.ones(table - q_len, dtype=torch.int32, pin_memory=pin)
        """q_len then seq_len of each row, as ``ints`` holds them from ``q_len`` on."""
        self.host_rows = torch.zeros(size * q, dtype=torch.long, pin_memory=pin)
        self.rows_index = torch.zeros(size * q, dtype=torch.long, device=device)
        self.host_table = torch.zeros((size, self.width), dtype=torch.int32, pin_memory=pin)
        self.host_table[:, 0] = cache.scratch_block
        self._row_blocks: list[Any] = [None] * size  # the block list each host row holds
        self._row_filled = [1] * size
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.layouts: dict[int, KernelLayout] = {}
        """Each bucket's layout: a graph reads its tensors by address, so they live as long."""
        self.replays = 0

    def layout(self, batch: int) -> KernelLayout:
        """The static layout of bucket ``batch``: views of the shared static tensors."""
        import torch

        from dwdp.worker.gpu.paged_attention import PagedRequests

        q_start, q_len, seq_len, _ = self.offsets
        tokens = batch * self.q
        requests = PagedRequests(
            self.ints[q_start : q_start + batch], self.ints[q_len : q_len + batch],
            self.ints[seq_len : seq_len + batch], self.table[:batch], self.q,
            self.width * self.cache.block_size,
        )
        return KernelLayout(
            input_ids=self.longs[0:1, :tokens],
            position_ids=self.longs[1:2, :tokens],
            slots=self.longs[2, :tokens],
            logits_index=torch.arange(tokens, device=self.cache.device),
            fresh=[],
            paged=requests,
            cache=self.cache,
        )

    @classmethod
    def capture(
        cls,
        cache: PagedKVCache,
        forward: Callable[[KernelLayout], Any],
        *,
        max_batch_size: int,
        max_model_len: int,
        pool: Any,
        q: int = 1,
        what: str = "the decode step",
    ) -> DecodeGraphs:
        """Capture one graph per bucket, largest first, into the memory pool ``pool``
        (``torch.cuda.graph_pool_handle()``). ``forward(layout)`` runs the model over a layout
        and returns a row per token [rows, ...] (the logits), or a tuple of such. Raises
        ``CudaGraphError`` naming ``what`` and the bucket and the first line of the failure."""
        import torch

        self = cls(cache, max_batch_size=max_batch_size, max_model_len=max_model_len, q=q)
        self.longs[2].fill_(self.scratch_slot)  # capture writes and reads the scratch block only
        side = torch.cuda.Stream(device=cache.device)
        for batch in reversed(self.buckets):
            layout = self.layouts[batch] = self.layout(batch)
            try:
                side.wait_stream(torch.cuda.current_stream(cache.device))
                with torch.cuda.stream(side), torch.inference_mode():
                    for _ in range(2):  # warm-up: lazy initialisations happen outside capture
                        forward(layout)
                torch.cuda.current_stream(cache.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch] = forward(layout)
            except Exception as exc:
                raise CudaGraphError.capturing(f"{what} of batch {batch}", exc) from exc
            self.graphs[batch] = graph
        torch.cuda.synchronize(cache.device)
        return self

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the step of ``chunks`` replays a graph: a decode (or verify) step of at most
        ``q`` tokens a request, within the buckets."""
        return 0 < len(chunks) <= self.buckets[-1] and is_decode_only(chunks, self.q)

    def bucket(self, n: int) -> int:
        """The smallest bucket holding a step of ``n`` requests."""
        return next(b for b in self.buckets if b >= n)

    def slabs(self, batch: int) -> tuple[Any, Any, Any]:
        """Bucket ``batch``'s static inputs, slab by slab: ``longs`` as [3, batch, q] (token
        ids, positions, slots) and the rows' ``q_len`` and ``seq_len`` [batch] (int32); what a
        replay reads, to change on the device between ``run``'s fill and its replay."""
        q_len, seq_len = self.offsets[1], self.offsets[2]
        return (self.longs[:, : batch * self.q].view(3, batch, self.q),
                self.ints[q_len : q_len + batch], self.ints[seq_len : seq_len + batch])

    def run(self, chunks: Sequence[Chunk | None],
            prepare: Callable[[int], None] | None = None) -> tuple[int, Any]:
        """Copy the step's inputs into the smallest bucket holding it, call ``prepare(batch)``
        (device work that edits the inputs, ``slabs``), and replay; returns the bucket and its
        whole output (every slab row; valid until the next replay). A ``None`` chunk is a
        padding slab (its request's place kept)."""
        batch = self.bucket(len(chunks))
        self._fill(chunks, batch)
        if prepare is not None:
            prepare(batch)
        self.graphs[batch].replay()
        self.replays += 1
        return batch, self.outputs[batch]

    def replay(self, chunks: Sequence[Chunk | None]) -> Any:
        """``run`` the step; returns each chunk's last ``Chunk.rows`` output rows, in order
        ([sum of rows, ...]; a view of the graph's output when every chunk keeps its whole
        slab, valid until the next replay; of each tensor when the forward returned a tuple).
        A ``None`` chunk is a padding slab (nothing of it kept)."""
        n, q = len(chunks), self.q
        _, out = self.run(chunks)
        if all(c is not None and c.rows == q for c in chunks):
            return _rows(out, slice(0, n * q))
        kept = [i * q + r for i, c in enumerate(chunks) if c is not None
                for r in range(len(c.token_ids) - c.rows, len(c.token_ids))]
        self.host_rows[: len(kept)] = self.host_rows.new_tensor(kept)
        index = self.rows_index[: len(kept)]
        index.copy_(self.host_rows[: len(kept)], non_blocking=True)
        return _rows(out, index)

    def _fill(self, chunks: Sequence[Chunk | None], batch: int) -> None:
        """The static inputs of bucket ``batch`` from ``chunks``: every slab's token ids,
        positions and slots (padding on the scratch block), the rows' lengths and tables."""
        import torch

        bs, q, scratch = self.cache.block_size, self.q, self.scratch_slot
        ids, pos, slots = [0] * (batch * q), [0] * (batch * q), [scratch] * (batch * q)
        q_lens, seq_lens = [1] * batch, [1] * batch
        width = 1
        for row, c in enumerate(chunks):
            if c is None:
                self._fill_table(row, None, 1)
                continue
            at, n = row * q, len(c.token_ids)
            ids[at : at + n] = c.token_ids
            pos[at : at + n] = range(c.start, c.start + n)
            slots[at : at + n] = [c.blocks[p // bs] * bs + p % bs
                                  for p in range(c.start, c.start + n)]
            q_lens[row], seq_lens[row] = n, c.start + n
            width = max(width, self._fill_table(row, c.blocks, (c.start + n - 1) // bs + 1))
        for row in range(len(chunks), batch):
            self._fill_table(row, None, 1)
        self.host_longs[:, : batch * q] = torch.tensor([ids, pos, slots], dtype=torch.long)
        part = self.offsets[2] - self.offsets[1]
        self.host_lens[:batch] = torch.tensor(q_lens, dtype=torch.int32)
        self.host_lens[part : part + batch] = torch.tensor(seq_lens, dtype=torch.int32)
        self.longs[:, : batch * q].copy_(self.host_longs[:, : batch * q], non_blocking=True)
        self.ints[self.offsets[1] : self.offsets[3]].copy_(self.host_lens, non_blocking=True)
        self.table[:batch, :width].copy_(self.host_table[:batch, :width], non_blocking=True)

    def _fill_table(self, row: int, blocks: Any, count: int) -> int:
        """Make host row ``row`` hold the first ``count`` blocks of ``blocks`` (``None``: the
        scratch block), writing only what changed since the row's last step; returns
        ``count``."""
        import torch

        if blocks is None:
            if self._row_blocks[row] is not None:
                self.host_table[row, 0] = self.cache.scratch_block
                self._row_blocks[row], self._row_filled[row] = None, 1
            return count
        start = self._row_filled[row] if self._row_blocks[row] is blocks else 0
        if start < count:
            self.host_table[row, start:count] = torch.tensor(blocks[start:count],
                                                             dtype=torch.int32)
        self._row_blocks[row], self._row_filled[row] = blocks, count
        return count


def _rows(out: Any, rows: Any) -> Any:
    """Rows ``rows`` (a slice or an index tensor) of ``out``, a tensor or a tuple of them."""
    if isinstance(out, tuple):
        return tuple(_rows(o, rows) for o in out)
    return out[rows] if isinstance(rows, slice) else out.index_select(0, rows)
