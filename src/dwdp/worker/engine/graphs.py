"""CUDA graphs of decode-only steps: captured once per batch-size bucket, replayed per step.

A decode-only step (every scheduled request adds one token to a context already in the paged
cache) has the same kernels, shapes and addresses at every step of the same batch size; only
the values of a few small index tensors change. ``DecodeGraphs.capture`` records the model's
forward once per bucket (1, 2, 4, 8, 16, 32, ... up to ``max_batch_size``, largest first, all
in one memory pool) over static input tensors; ``DecodeGraphs.run`` copies a step's inputs into
the smallest bucket that holds it (padding rows write to a scratch block no request owns and
read only it) and replays. Steps with a prefill chunk, and batches above the largest bucket, run
eagerly.

Errors: ``CudaGraphError`` (the capture failed, or graphs were asked for off CUDA), one line
naming the reason; the worker stops the rank with it before serving.
"""

from __future__ import annotations

from dataclasses import dataclass


class CudaGraphError(RuntimeError):
    """CUDA graphs were asked for (``engine.cudaGraphs``) and cannot be captured here."""


@dataclass(frozen=True, slots=True)
class GraphStats:
    """What a capture made: the batch-size ``buckets`` (ascending) and ``pool_bytes``, the
    device memory the graphs' pool holds (bytes, part of the memory ledger)."""

    buckets: tuple[int, ...]
    pool_bytes: int


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
