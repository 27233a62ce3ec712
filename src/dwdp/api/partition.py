"""The expert partition: which routed experts each rank of a DWDP group stores.

One function, :func:`expert_partition`, turns (experts, dwdp_size, experts_per_worker,
prefetch_experts) into the table of every rank's ``[start, end)`` range and its kind. Every
rank computes the same table from the same numbers; it is the only source of ranges in the
project. Four kinds are accepted (docs/design.md §3.1); every other combination is a
:class:`PartitionError` raised before any weight exists.

Invariant of an accepted table: ranges are non-empty, contiguous within a rank, sorted by
start, and together cover ``[0, num_experts)`` exactly (overlapping only for ``redundant``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACCEPTED_KINDS_TEXT",
    "ExpertPartition",
    "PartitionError",
    "PartitionKind",
    "classify_partition",
    "expert_partition",
]


class PartitionKind(enum.StrEnum):
    """The four accepted shapes of an expert partition."""

    BALANCED = "balanced"
    """Both fields 0: ``divmod(N, D)``; the first ``N % D`` ranks hold one expert more."""
    UNIFORM = "uniform"
    """size == stride and D * size == N: equal, disjoint ranges."""
    REDUNDANT = "redundant"
    """stride < size and (D - 1) * stride + size == N: ranges overlap by size - stride."""
    CAPPED = "capped"
    """size == stride and (D - 1) * size < N < D * size: the last rank holds what is left."""


# Integer codes of the kinds, as :func:`classify_partition` returns them (0: not a kind).
_CODES: dict[int, PartitionKind] = {
    1: PartitionKind.BALANCED,
    2: PartitionKind.UNIFORM,
    3: PartitionKind.REDUNDANT,
    4: PartitionKind.CAPPED,
}

ACCEPTED_KINDS_TEXT = (
    "the accepted kinds are balanced (experts_per_worker = prefetch_experts = 0, "
    "experts >= dwdp_size), uniform (size = stride, dwdp_size * size = experts), "
    "redundant (0 < stride < size, (dwdp_size - 1) * stride + size = experts) and "
    "capped (size = stride, (dwdp_size - 1) * size < experts < dwdp_size * size)"
)
"""One sentence naming the four accepted kinds and their conditions, for error messages."""


class PartitionError(ValueError):
    """A combination of expert counts that is none of the four accepted kinds.

    The message names the numbers that failed and the four accepted kinds. The numbers are
    also kept as attributes (``num_experts``, ``dwdp_size``, ``experts_per_worker``,
    ``prefetch_experts``) for callers that build their own message.
    """

    def __init__(
        self,
        reason: str,
        *,
        num_experts: int,
        dwdp_size: int,
        experts_per_worker: int,
        prefetch_experts: int,
    ) -> None:
        self.reason = reason
        self.num_experts = num_experts
        self.dwdp_size = dwdp_size
        self.experts_per_worker = experts_per_worker
        self.prefetch_experts = prefetch_experts
        super().__init__(
            f"no expert partition for experts={num_experts}, dwdp_size={dwdp_size}, "
            f"experts_per_worker (size)={experts_per_worker}, "
            f"prefetch_experts (stride)={prefetch_experts}: {reason}; {ACCEPTED_KINDS_TEXT}"
        )


@dataclass(frozen=True)
class ExpertPartition:
    """Every rank's expert range of one DWDP group; rank r stores ``ranges[r]``.

    ``ranges[r] == (start, end)`` means experts ``start, start + 1, ..., end - 1``
    (half-open, counted in routed experts).
    """

    kind: PartitionKind
    num_experts: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def dwdp_size(self) -> int:
        """The number of ranks in the group (the length of ``ranges``)."""
        return len(self.ranges)

    def owner(self, expert: int) -> int:
        """The rank that serves ``expert``: the lowest rank storing it.

        Raises ``IndexError`` for an expert outside ``[0, num_experts)``.
        """
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} is outside [0, {self.num_experts})")
        for rank, (start, end) in enumerate(self.ranges):
            if start <= expert < end:
                return rank
        raise AssertionError(f"expert {expert} is stored by no rank of {self.ranges}")

    def local_count(self, rank: int) -> int:
        """How many experts ``rank`` stores (its range length). ``IndexError`` if no such rank."""
        if not 0 <= rank < len(self.ranges):
            raise IndexError(f"rank {rank} is outside [0, {len(self.ranges)})")
        start, end = self.ranges[rank]
        return end - start

    def describe(self) -> str:
        """A one-line summary such as ``balanced, 8 x 75 + 4 x 74 of 896``."""
        groups: list[tuple[int, int]] = []  # (count of ranks, experts each), in rank order
        for rank in range(len(self.ranges)):
            size = self.local_count(rank)
            if groups and groups[-1][1] == size:
                groups[-1] = (groups[-1][0] + 1, size)
            else:
                groups.append((1, size))
        sizes = " + ".join(f"{count} x {size}" for count, size in groups)
        return f"{self.kind.value}, {sizes} of {self.num_experts}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view: kind, experts, dwdp_size and one row per rank."""
        return {
            "kind": self.kind.value,
            "num_experts": self.num_experts,
            "dwdp_size": self.dwdp_size,
            "ranks": [
                {"rank": r, "start": s, "end": e, "count": e - s}
                for r, (s, e) in enumerate(self.ranges)
            ],
        }


def classify_partition(
    num_experts: Any, dwdp_size: Any, experts_per_worker: Any, prefetch_experts: Any
) -> Any:
    """The kind code of one combination: 0 none, 1 balanced, 2 uniform, 3 redundant, 4 capped.

    This is the acceptance rule of :func:`expert_partition` and nothing else. It is written
    with elementwise operators only (``&``, ``*``, comparisons), so it also classifies
    numpy arrays of candidates at once; the exhaustive property test relies on that. The
    kinds exclude each other, so the sum below is one code. Arguments are expected to be
    non-negative integers with ``num_experts >= 1`` and ``dwdp_size >= 1``.
    """
    n, d, size, stride = num_experts, dwdp_size, experts_per_worker, prefetch_experts
    both_positive = (size > 0) & (stride > 0)
    balanced = (size == 0) & (stride == 0) & (n >= d)
    uniform = both_positive & (size == stride) & (d * size == n)
    redundant = both_positive & (stride < size) & ((d - 1) * stride + size == n)
    capped = both_positive & (size == stride) & ((d - 1) * size < n) & (n < d * size)
    return balanced * 1 + uniform * 2 + redundant * 3 + capped * 4


def _why_not(n: int, d: int, size: int, stride: int) -> str:
    """A short reason why a combination that classified as none is refused."""
    if size == 0 and stride == 0:
        return f"balanced needs experts >= dwdp_size, but {n} < {d}"
    if (size == 0) != (stride == 0):
        return "experts_per_worker and prefetch_experts must be both 0 or both > 0"
    if stride > size:
        return f"the stride {stride} is larger than the size {size}, which leaves gaps"
    if stride < size:
        covered = (d - 1) * stride + size
        return f"redundant needs (dwdp_size - 1) * stride + size = experts, but it is {covered}"
    if n <= (d - 1) * size:
        return (
            f"{d} ranks of {size} experts leave rank {d - 1} with nothing "
            f"((dwdp_size - 1) * size = {(d - 1) * size} >= experts)"
        )
    return f"{d} ranks of {size} experts hold only {d * size} < {n} experts"


def expert_partition(
    num_experts: int,
    dwdp_size: int,
    *,
    experts_per_worker: int = 0,
    prefetch_experts: int = 0,
) -> ExpertPartition:
    """Compute every rank's expert range for one DWDP group.

    Args:
        num_experts: routed experts per MoE layer (N), >= 1.
        dwdp_size: ranks in the DWDP group (D), >= 1.
        experts_per_worker: experts stored per rank (the range size); 0 with
            ``prefetch_experts`` 0 selects the balanced partition.
        prefetch_experts: the stride between consecutive ranks' range starts.

    Returns:
        The :class:`ExpertPartition` of kind balanced, uniform, redundant or capped.

    Raises:
        PartitionError: for a non-integer or out-of-range number, or any combination that
            is none of the four kinds; the message names the numbers and the four kinds.
    """
    numbers = {
        "num_experts": num_experts,
        "dwdp_size": dwdp_size,
        "experts_per_worker": experts_per_worker,
        "prefetch_experts": prefetch_experts,
    }

    def fail(reason: str) -> PartitionError:
        return PartitionError(reason, **numbers)

    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(f"{name} must be an integer, got {value!r}")
    if num_experts < 1:
        raise fail("experts must be at least 1")
    if dwdp_size < 1:
        raise fail("dwdp_size must be at least 1")
    if experts_per_worker < 0 or prefetch_experts < 0:
        raise fail("experts_per_worker and prefetch_experts must not be negative")

    n, d, size, stride = num_experts, dwdp_size, experts_per_worker, prefetch_experts
    code = int(classify_partition(n, d, size, stride))
    if code == 0:
        raise fail(_why_not(n, d, size, stride))
    kind = _CODES[code]
    if kind is PartitionKind.BALANCED:
        base, rem = divmod(n, d)
        ranges = []
        start = 0
        for rank in range(d):
            end = start + base + (1 if rank < rem else 0)
            ranges.append((start, end))
            start = end
    else:
        # uniform, redundant and capped share one formula; only capped ever clips.
        ranges = [(r * stride, min(r * stride + size, n)) for r in range(d)]
    return ExpertPartition(kind=kind, num_experts=n, ranges=tuple(ranges))
