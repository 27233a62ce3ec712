"""A pod in a memory cgroup (what ``resources.limits.memory`` gives a container): ``dwdp launch``
of 2 ranks, expert + dense DWDP on the cpu backend, inside a real memory cgroup of this host
limited to :data:`LIMIT`. Each rank sizes its KV pool from the cgroup's limit, not from the
host's free memory; under a load of concurrent requests the cgroup's peak stays below the
limit and nothing is OOM-killed; each rank's ledger accounts for its resident set, and for its
API server process's."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from _pods import launched_pod  # noqa: E402

from dwdp.worker.host_memory import mem_available  # noqa: E402
from dwdp.worker.memory import HOST_MARGIN_MIN  # noqa: E402
from dwdp_dev.worker.cgroups import memory_cgroup  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

GIB = 2**30
LIMIT = 4 * GIB
WORLD = 2
REQUESTS = 48


def _rank_pids(group: Path) -> dict[int, int]:
    """``{local rank: pid}`` of the rank processes in ``group`` (not the launcher, not the
    API server processes)."""
    ranks = {}
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" not in cmdline or b"api_process" in b" ".join(cmdline):
            continue
        for var in environ:
            if var.startswith(b"DWDP_LOCAL_RANK="):
                ranks[int(var.split(b"=", 1)[1])] = int(pid)
    return ranks


def _api_process_of(rank_pid: int) -> int:
    """The pid of a rank's API server process (its child running ``api_process``)."""
    for task in Path(f"/proc/{rank_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"api_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"rank {rank_pid} has no API server process")


def _rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (``Rss``, ``Pss``, ``Shared_Clean``, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        out[name] = int(value.split()[0]) * 1024
    return out


@pytest.fixture(scope="module")
def limited_pod(tmp_path_factory):
    root = tmp_path_factory.mktemp("pod")
    ckpt = make_checkpoint("qwen3_moe", root / "ck", num_experts=4, seed=5)
    launch = {
        "model": {"path": str(ckpt), "servedName": "tiny-qwen"},
        "handleType": "shm",
        "transport": "tcpStore",
        "dwdp": {"dwdpSize": WORLD, "enableDense": True},
        "gracefulShutdownTimeoutSeconds": 5,
    }
    if os.geteuid() != 0:
        pytest.fail("a memory cgroup needs root (the test command runs as root)")
    with memory_cgroup(LIMIT) as group, launched_pod(
            root, launch, WORLD, cgroup=group) as (proc, urls, _g, term):
        yield group, proc, urls, term


def test_each_rank_sizes_its_pool_from_the_cgroups_limit(limited_pod) -> None:
    _group, _proc, urls, _term = limited_pod
    share = (LIMIT - HOST_MARGIN_MIN) // WORLD  # the margin is 256 MiB at this limit
    host_share = mem_available() // WORLD
    for url in urls:
        pool = httpx.get(url + "/dwdp/status", timeout=10).json()["kv_cache"]
        assert pool["where"] == "host" and pool["limited_by"] == "freeMemoryFraction"
        # what the cgroup leaves a rank: its share of the limit less the pod's working set
        assert 0 < pool["free_bytes"] < share, (pool, share)
        assert pool["bytes"] <= 0.9 * pool["free_bytes"] + pool["bytes_per_token"]
        if host_share > 2 * LIMIT:  # on this host the node's free memory would be far more
            assert pool["free_bytes"] < host_share / 2


def test_under_load_the_pod_stays_below_its_limit_and_loses_no_rank(limited_pod) -> None:
    """Concurrent requests on every rank; the pool's pages are touched as they fill. The
    cgroup's peak stays below the limit, no process is OOM-killed, every rank still serves."""
    group, proc, urls, _term = limited_pod

    def ask(i: int) -> int:
        body = {"model": "tiny-qwen", "prompt": f"{i} " * (40 + i % 200), "max_tokens": 24,
                "ignore_eos": True}
        return httpx.post(urls[i % WORLD] + "/v1/completions", json=body, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(ask, range(REQUESTS)))
    assert codes == [200] * REQUESTS
    peak, kills = group.peak(), group.oom_kills()
    assert peak < LIMIT and kills == 0, (peak, kills)
    assert proc.poll() is None
    assert all(httpx.get(u + "/ready", timeout=5).status_code == 200 for u in urls)


def test_the_ledger_accounts_for_each_ranks_memory(limited_pod) -> None:
    """After the load, each rank's ledger parts (but the KV pool's budget, whose pages become
    resident only as requests fill them, and the API process, another process) sum to the
    rank's resident set within 10%; the API process's part is its resident set, measured once it
    loaded (within 10% of it now)."""
    group, _proc, urls, _term = limited_pod
    pids = _rank_pids(group.path)
    assert sorted(pids) == list(range(WORLD)), pids
    for rank, url in enumerate(urls):
        memory = httpx.get(url + "/dwdp/status", timeout=10).json()["memory"]
        parts = ("runtime", "replicated_weights", "expert_store", "dense_store", "slot_rings",
                 "kv_staging")
        ledger = sum(memory[p]["host"] for p in parts)
        rollup = _rollup(pids[rank])
        rss = rollup["Rss"]
        assert abs(ledger - rss) <= 0.1 * rss, (rank, ledger, rss, memory)
        # measured once the API process loaded (tokenizer, transformers, torch): its RSS now
        api = _api_process_of(pids[rank])
        rss = _rollup(api)["Rss"]
        assert abs(memory["api_process"]["host"] - rss) <= 0.1 * rss, (rank, memory, rss)
