"""The expert partition against an independent, constructive formulation of its four kinds.

The code under test decides acceptance with a predicate (``classify_partition``); the
test enumerates, per (N experts, D ranks), the pairs each kind admits by construction and
builds their tables directly. The two must agree on every (N 1..256, D 1..16,
S 0..N, T 0..N): the predicate is evaluated over whole numpy grids of (S, T) at once,
and ``expert_partition`` itself on every accepted pair, on every neighbour of one, on
every pair for small N, and on random pairs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.api.config import DwdpConfig
from dwdp.api.partition import (
    ExpertPartition,
    PartitionError,
    PartitionKind,
    classify_partition,
    expert_partition,
)

MAX_EXPERTS, MAX_RANKS = 256, 16
CODE = {
    PartitionKind.BALANCED: 1,
    PartitionKind.UNIFORM: 2,
    PartitionKind.REDUNDANT: 3,
    PartitionKind.CAPPED: 4,
}


# --------------------------------------------------------------- independent formulation


def admitted(n: int, d: int) -> dict[tuple[int, int], tuple[PartitionKind, list[tuple[int, int]]]]:
    """Every (size, stride) with 0 <= size, stride <= n that a kind admits, and its table.

    Built kind by kind from the definitions in docs/design.md §3.1, not from the predicate.
    """
    out: dict[tuple[int, int], tuple[PartitionKind, list[tuple[int, int]]]] = {}
    # balanced: 0/0; the first n % d ranks get one expert more; needs n >= d.
    if n >= d:
        counts = [n // d + (1 if r < n % d else 0) for r in range(d)]
        starts = [sum(counts[:r]) for r in range(d)]
        ranges = [(s, s + c) for s, c in zip(starts, counts, strict=True)]
        out[(0, 0)] = (PartitionKind.BALANCED, ranges)
    # uniform: equal disjoint ranges that tile n exactly.
    if n % d == 0:
        size = n // d
        out[(size, size)] = (
            PartitionKind.UNIFORM,
            [(r * size, (r + 1) * size) for r in range(d)],
        )
    # redundant: stride t in 1.., size = n - (d - 1) * t, which must exceed t.
    t = 1
    while n - (d - 1) * t > t:
        size = n - (d - 1) * t
        out[(size, t)] = (PartitionKind.REDUNDANT, [(r * t, r * t + size) for r in range(d)])
        t += 1
    # capped: size == stride, the last rank non-empty but short: (d-1)*s < n < d*s.
    for size in range(1, n + 1):
        if (d - 1) * size < n < d * size:
            out[(size, size)] = (
                PartitionKind.CAPPED,
                [(r * size, min((r + 1) * size, n)) for r in range(d)],
            )
    return out


ALL_ADMITTED = {
    (n, d): admitted(n, d)
    for n in range(1, MAX_EXPERTS + 1)
    for d in range(1, MAX_RANKS + 1)
}


# --------------------------------------------------------------- exhaustive checks


def test_predicate_accepts_exactly_the_four_kinds_everywhere() -> None:
    """Every (N 1..256, D 1..16, S 0..N, T 0..N): accepted iff admitted, with its kind."""
    checked = 0
    for (n, d), table in ALL_ADMITTED.items():
        grid = np.arange(n + 1, dtype=np.int64)
        sizes, strides = grid[:, None], grid[None, :]
        got = np.broadcast_to(classify_partition(n, d, sizes, strides), (n + 1, n + 1))
        want = np.zeros((n + 1, n + 1), dtype=np.int64)
        for (s, t), (kind, _) in table.items():
            want[s, t] = CODE[kind]
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:5].tolist()
            pytest.fail(f"N={n} D={d}: (S, T) {bad} got {got[tuple(np.array(bad).T)]}")
        checked += got.size
    assert checked == sum(16 * (n + 1) ** 2 for n in range(1, MAX_EXPERTS + 1))


def test_every_admitted_pair_builds_the_independent_table() -> None:
    for (n, d), table in ALL_ADMITTED.items():
        for (s, t), (kind, ranges) in table.items():
            part = expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)
            assert part.kind is kind, (n, d, s, t)
            assert part.num_experts == n
            assert list(part.ranges) == ranges, (n, d, s, t)


def _neighbours(n: int, table) -> set[tuple[int, int]]:
    near = set()
    for s, t in table:
        for ds in (-1, 0, 1):
            for dt in (-1, 0, 1):
                if 0 <= s + ds <= n and 0 <= t + dt <= n:
                    near.add((s + ds, t + dt))
    return near


SPREAD = {*range(1, 33), *range(40, MAX_EXPERTS, 13), *range(MAX_EXPERTS - 4, MAX_EXPERTS + 1)}
"""Expert counts for the checks that call expert_partition pair by pair (the predicate
itself is checked on every N above)."""


def test_function_refuses_the_neighbours_of_admitted_pairs() -> None:
    """expert_partition (not only its predicate) refuses the near misses of every kind."""
    for (n, d), table in ALL_ADMITTED.items():
        if n not in SPREAD:
            continue
        for s, t in _neighbours(n, table) - set(table):
            with pytest.raises(PartitionError):
                expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)


def test_function_matches_on_every_pair_for_small_expert_counts() -> None:
    for n in range(1, 21):
        for d in range(1, MAX_RANKS + 1):
            table = ALL_ADMITTED[(n, d)]
            for s in range(n + 1):
                for t in range(n + 1):
                    try:
                        part = expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)
                    except PartitionError:
                        assert (s, t) not in table, (n, d, s, t)
                    else:
                        assert (s, t) in table and part.kind is table[(s, t)][0], (n, d, s, t)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, MAX_EXPERTS),
    d=st.integers(1, MAX_RANKS),
    s_frac=st.floats(0, 1),
    t_frac=st.floats(0, 1),
)
def test_function_matches_on_random_pairs(n: int, d: int, s_frac: float, t_frac: float) -> None:
    s, t = round(s_frac * n), round(t_frac * n)
    table = ALL_ADMITTED[(n, d)]
    if (s, t) in table:
        part = expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)
        assert part.kind is table[(s, t)][0]
    else:
        with pytest.raises(PartitionError):
            expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)


def test_balanced_equals_divmod_rule() -> None:
    for n in range(1, MAX_EXPERTS + 1):
        for d in range(1, min(n, MAX_RANKS) + 1):
            base, rem = divmod(n, d)
            part = expert_partition(n, d)
            assert part.kind is PartitionKind.BALANCED
            assert [part.local_count(r) for r in range(d)] == [base + 1] * rem + [base] * (
                d - rem
            )


def test_tables_cover_every_expert_once_with_the_lowest_owner() -> None:
    for (n, d), table in ALL_ADMITTED.items():
        if n not in (1, 2, 7, 64, 200, 256):
            continue  # the exhaustive tests above already compared every table
        for s, t in table:
            part = expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)
            assert all(end > start for start, end in part.ranges)
            assert part.ranges[0][0] == 0 and max(e for _, e in part.ranges) == n
            first_holder = [-1] * n
            for rank in reversed(range(d)):
                start, end = part.ranges[rank]
                first_holder[start:end] = [rank] * (end - start)
            assert -1 not in first_holder
            for expert in range(0, n, max(1, n // 16)):
                assert part.owner(expert) == first_holder[expert]


# --------------------------------------------------------------- concrete cases


def test_896_experts_on_12_ranks() -> None:
    part = expert_partition(896, 12)
    assert part.kind is PartitionKind.BALANCED
    assert [part.local_count(r) for r in range(12)] == [75] * 8 + [74] * 4
    assert part.ranges[0] == (0, 75) and part.ranges[8] == (600, 674)
    assert part.ranges[-1] == (822, 896)
    assert part.describe() == "balanced, 8 x 75 + 4 x 74 of 896"


def test_capped_last_rank_holds_fewer() -> None:
    part = expert_partition(10, 4, experts_per_worker=3, prefetch_experts=3)
    assert part.kind is PartitionKind.CAPPED
    assert part.ranges == ((0, 3), (3, 6), (6, 9), (9, 10))
    assert part.local_count(3) == 1 < part.local_count(0)
    # Kimi-K3 sized: 896 experts, 12 ranks of 75: the last rank keeps 71.
    big = expert_partition(896, 12, experts_per_worker=75, prefetch_experts=75)
    assert big.kind is PartitionKind.CAPPED and big.local_count(11) == 71


def test_uniform_and_redundant() -> None:
    uni = expert_partition(64, 8, experts_per_worker=8, prefetch_experts=8)
    assert uni.kind is PartitionKind.UNIFORM and uni.ranges[7] == (56, 64)
    red = expert_partition(896, 12, experts_per_worker=82, prefetch_experts=74)
    assert red.kind is PartitionKind.REDUNDANT
    assert red.ranges[1] == (74, 156) and red.local_count(5) == 82
    assert red.owner(80) == 0 and red.owner(156) == 2 and red.owner(895) == 11


def test_owner_and_local_count_bounds() -> None:
    part = expert_partition(8, 2)
    with pytest.raises(IndexError):
        part.owner(8)
    with pytest.raises(IndexError):
        part.owner(-1)
    with pytest.raises(IndexError):
        part.local_count(2)
    assert isinstance(part, ExpertPartition) and part.dwdp_size == 2


def test_error_names_the_kinds_and_the_numbers() -> None:
    with pytest.raises(PartitionError) as info:
        expert_partition(10, 4, experts_per_worker=3, prefetch_experts=2)
    text = str(info.value)
    for word in ("balanced", "uniform", "redundant", "capped"):
        assert word in text
    assert "experts=10" in text and "dwdp_size=4" in text
    assert "(size)=3" in text and "(stride)=2" in text
    assert isinstance(info.value, ValueError)
    assert (info.value.num_experts, info.value.dwdp_size) == (10, 4)


@pytest.mark.parametrize(
    "args",
    [
        (0, 1, 0, 0),
        (4, 0, 0, 0),
        (4, 2, -1, 2),
        (4, 2, 2, -1),
        (3, 4, 0, 0),  # balanced needs experts >= ranks
        (8, 2, 4, 0),  # one field alone
        (8, 2, 0, 4),
        (8, 2, 3, 5),  # stride above size
        (4.0, 2, 0, 0),
        (True, 1, 0, 0),
    ],
)
def test_refusals(args) -> None:
    n, d, s, t = args
    with pytest.raises(PartitionError):
        expert_partition(n, d, experts_per_worker=s, prefetch_experts=t)


def test_config_partition_delegates() -> None:
    cfg = DwdpConfig(dwdp_size=12)
    assert cfg.balanced and cfg.partition(896).describe().startswith("balanced, 8 x 75")
    cfg = DwdpConfig(dwdp_size=4, num_experts_per_worker=3, num_prefetch_experts=3)
    assert cfg.partition(10).kind is PartitionKind.CAPPED
    with pytest.raises(PartitionError):
        cfg.partition(20)


# --------------------------------------------------------------- the CLI


DWDP = Path(sys.executable).with_name("dwdp")


def _dwdp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DWDP), "partition", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_partition_table_json_and_error() -> None:
    proc = _dwdp("--experts", "896", "--dwdp-size", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "balanced, 8 x 75 + 4 x 74 of 896"

    proc = _dwdp(
        "--experts", "10", "--dwdp-size", "4", "--experts-per-worker", "3",
        "--prefetch-experts", "3", "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "capped" and data["ranks"][-1] == {
        "rank": 3, "start": 9, "end": 10, "count": 1
    }

    proc = _dwdp("--experts", "10", "--dwdp-size", "4", "--experts-per-worker", "3")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "capped" in proc.stderr and "experts=10" in proc.stderr


def test_cli_output_into_a_closed_pipe_ends_quietly() -> None:
    # `dwdp partition ... | head`: the reader is gone before the table is written
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [str(DWDP), "partition", "--experts", "896", "--dwdp-size", "12"], stdout=write,
            stderr=subprocess.PIPE, text=True, timeout=120, check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_cli_partition_serves_column_follows_the_owner_rule() -> None:
    # Redundant: ranges [0,16) [8,24) [16,32) [24,40); each expert is served by the lowest
    # rank storing it, so rank r > 0 serves only the tail its predecessor does not store.
    proc = _dwdp(
        "--experts", "40", "--dwdp-size", "4", "--experts-per-worker", "16",
        "--prefetch-experts", "8",
    )
    assert proc.returncode == 0, proc.stderr
    serves = [line.split()[-2:] for line in proc.stdout.splitlines()[1:5]]
    assert serves == [["[0,", "16)"], ["[16,", "24)"], ["[24,", "32)"], ["[32,", "40)"]]


def test_cli_partition_of_many_experts_answers_at_once() -> None:
    # The table is computed per rank, not per expert: a per-expert walk over 10^8 experts
    # takes minutes and runs into _dwdp's timeout.
    proc = _dwdp("--experts", "100000000", "--dwdp-size", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        "balanced, 1 x 33333334 + 2 x 33333333 of 100000000"
    )
