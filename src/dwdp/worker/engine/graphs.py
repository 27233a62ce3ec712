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


def is_decode_only(chunks: Sequence[Chunk]) -> bool:
    """Every chunk adds one token to a context already cached and samples the next (a decode
    step). A one-token piece of a prompt that does not end the prompt (``sample`` false: the
    budget's last token went to a prefill) is not decode: its step keeps no logits row for it."""
    return all(len(c.token_ids) == 1 and c.start > 0 and c.sample for c in chunks)


class DecodeGraphs:
    """The captured decode steps of one ``PagedKVCache`` (kernel mode) and their static inputs.

    Static device tensors, shared by every bucket (bucket ``b`` uses their first ``b`` rows):
    ``longs`` [3, B] int64 (token ids, positions, slots) and ``ints`` int32
    ``[q_start B | q_len B | seq_len B | block table B x W]`` (each part from its
    ``index_offsets``), W = the blocks of one ``max_model_len`` request; pinned host twins are
    filled per step and copied in. Build with ``DecodeGraphs.capture``.
    """

    def __init__(self, cache: PagedKVCache, *, max_batch_size: int, max_model_len: int) -> None:
        import torch

        from dwdp.worker.gpu.paged_attention import index_offsets

        self.cache = cache
        self.buckets = bucket_sizes(max_batch_size)
        size, device = self.buckets[-1], cache.device
        self.width = -(-max_model_len // cache.block_size)
        self.scratch_slot = cache.scratch_block * cache.block_size
        self.longs = torch.zeros((3, size), dtype=torch.long, device=device)
        self.offsets = index_offsets(size)
        q_start, q_len, seq_len, table = self.offsets
        self.ints = torch.zeros(table + size * self.width, dtype=torch.int32, device=device)
        self.ints[q_start : q_start + size] = torch.arange(size, dtype=torch.int32,
                                                           device=device)
        self.ints[q_len : q_len + size] = 1
        self.ints[seq_len : seq_len + size] = 1  # a padding row's
        self.table = self.ints[table:].view(size, self.width)
        self.table[:, 0] = cache.scratch_block
        pin = self.longs.is_cuda  # pinned host memory: the copies in run asynchronously
        self.host_longs = torch.zeros((3, size), dtype=torch.long, pin_memory=pin)
        self.host_seq = torch.ones(size, dtype=torch.int32, pin_memory=pin)
        self.host_table = torch.zeros((size, self.width), dtype=torch.int32, pin_memory=pin)
        self.host_table[:, 0] = cache.scratch_block
        self._row_blocks: list[Any] = [None] * size  # the block list each host row holds
        self._row_filled = [1] * size
        self.graphs: dict[int, Any] = {}
        self.logits: dict[int, Any] = {}
        self.layouts: dict[int, KernelLayout] = {}
        """Each bucket's layout: a graph reads its tensors by address, so they live as long."""
        self.replays = 0

    def layout(self, batch: int) -> KernelLayout:
        """The static layout of bucket ``batch``: views of the shared static tensors."""
        import torch

        from dwdp.worker.gpu.paged_attention import PagedRequests

        q_start, q_len, seq_len, _ = self.offsets
        requests = PagedRequests(
            self.ints[q_start : q_start + batch], self.ints[q_len : q_len + batch],
            self.ints[seq_len : seq_len + batch], self.table[:batch], 1,
            self.width * self.cache.block_size,
        )
        return KernelLayout(
            input_ids=self.longs[0:1, :batch],
            position_ids=self.longs[1:2, :batch],
            slots=self.longs[2, :batch],
            logits_index=torch.arange(batch, device=self.cache.device),
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
    ) -> DecodeGraphs:
        """Capture one graph per bucket, largest first, into the memory pool ``pool``
        (``torch.cuda.graph_pool_handle()``). ``forward(layout)`` runs the model over a layout
        and returns its logits [rows, vocab]. Raises ``CudaGraphError`` naming the bucket and
        the first line of the failure."""
        import torch

        self = cls(cache, max_batch_size=max_batch_size, max_model_len=max_model_len)
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
                    self.logits[batch] = forward(layout)
            except Exception as exc:
                raise CudaGraphError.capturing(f"the decode step of batch {batch}", exc) from exc
            self.graphs[batch] = graph
        torch.cuda.synchronize(cache.device)
        return self

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the step of ``chunks`` replays a graph: decode-only, within the buckets."""
        return 0 < len(chunks) <= self.buckets[-1] and is_decode_only(chunks)

    def replay(self, chunks: Sequence[Chunk]) -> Any:
        """Copy the step's inputs into the smallest bucket holding it and replay; returns the
        logits [len(chunks), vocab] (a view of the graph's output, valid until the next
        replay)."""
        import torch

        n = len(chunks)
        batch = next(b for b in self.buckets if b >= n)
        bs = self.cache.block_size
        pad = batch - n
        ids = [c.token_ids[0] for c in chunks] + [0] * pad
        pos = [c.start for c in chunks] + [0] * pad
        slots = [c.blocks[c.start // bs] * bs + c.start % bs for c in chunks]
        self.host_longs[:, :batch] = torch.tensor(
            [ids, pos, slots + [self.scratch_slot] * pad], dtype=torch.long)
        self.host_seq[:batch] = torch.tensor([c.start + 1 for c in chunks] + [1] * pad,
                                             dtype=torch.int32)
        width = max(self._fill_table(row, c.blocks, c.start // bs + 1)
                    for row, c in enumerate(chunks))
        for row in range(n, batch):
            self._fill_table(row, None, 1)
        seq_len = self.offsets[2]
        self.longs[:, :batch].copy_(self.host_longs[:, :batch], non_blocking=True)
        self.ints[seq_len : seq_len + batch].copy_(self.host_seq[:batch], non_blocking=True)
        self.table[:batch, :width].copy_(self.host_table[:batch, :width], non_blocking=True)
        self.graphs[batch].replay()
        self.replays += 1
        return self.logits[batch][:n]

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
