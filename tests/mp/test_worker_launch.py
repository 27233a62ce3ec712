"""``dwdp launch`` end to end: one pod of 4 local ranks, expert + dense DWDP over the cpu
backend and the TCP store, each rank serving HTTP on base port + local rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from _pods import launched_pod  # noqa: E402

from dwdp.worker.backend.cpu import leftover_segments  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

WORLD = 4
PROMPT = "Hello world, the"


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    root = tmp_path_factory.mktemp("pod")
    ckpt = make_checkpoint("qwen3_moe", root / "ck", num_experts=6, seed=4)
    launch = {
        "model": {"path": str(ckpt), "servedName": "tiny-qwen"},
        "handleType": "shm",
        "transport": "tcpStore",
        "dwdp": {"dwdpSize": WORLD, "enableDense": True, "numPrefetchSlots": 2},
        "gracefulShutdownTimeoutSeconds": 5,
    }
    with launched_pod(root, launch, WORLD) as (proc, urls, group, term):
        yield proc, urls, ckpt, group, term


def test_every_rank_committed_the_same_layout(pod):
    _proc, urls, *_ = pod
    statuses = [httpx.get(u + "/dwdp/status", timeout=10).json() for u in urls]
    assert [s["rank"] for s in statuses] == list(range(WORLD))
    assert {s["phase"] for s in statuses} == {"committed"}
    assert len({s["layout_digest"] for s in statuses}) == 1
    counts = [s["partition"]["ranks"][s["rank"]]["count"] for s in statuses]
    assert counts == [2, 2, 1, 1]
    stores = [s["resident"]["expert"]["store_bytes"] for s in statuses]
    assert stores[0] == stores[1] > stores[2] == stores[3]
    # each rank loaded only its expert rows (sharded loading): what the repoint freed is those
    # rows, at most its store (the rows, 64-byte aligned), never a replicated expert table
    assert all(s["leaks"] == 0 and 0 < s["bytes_freed"] <= s["bytes_stored"] for s in statuses)


def _mem_total() -> int:
    lines = Path("/proc/meminfo").read_text().splitlines()
    line = next(x for x in lines if x.startswith("MemTotal"))
    return int(line.split()[1]) * 1024


def test_every_rank_reports_its_memory_ledger_and_kv_pool(pod):
    """/dwdp/status and /metrics carry the rank's memory ledger and its KV cache pool; on
    the cpu backend every part lives on the host, and the replicated weights are the whole
    model's minus every managed expert table and the dense shards DWDP took."""
    _proc, urls, ckpt, *_ = pod
    model, _tok = load_checkpoint(ckpt)
    whole = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    for url in urls:
        status = httpx.get(url + "/dwdp/status", timeout=10).json()
        memory, pool, resident = status["memory"], status["kv_cache"], status["resident"]
        assert all(part["device"] in (0, None) for part in memory.values()), memory
        assert memory["expert_store"]["host"] == resident["expert"]["store_allocated_bytes"]
        assert memory["dense_store"]["host"] == resident["dense"]["store_allocated_bytes"] > 0
        assert memory["slot_rings"]["host"] == status["bytes_slots"] > 0
        taken = resident["expert"]["sharded_bytes"] + resident["dense"]["sharded_bytes"]
        assert memory["replicated_weights"]["host"] == whole - taken
        assert memory["peak_load"]["host"] > memory["replicated_weights"]["host"]
        assert memory["activations_headroom"]["host"] is None  # not measured on the host
        assert pool["where"] == "host" and pool["limited_by"] == "freeMemoryFraction"
        # the pod's 4 ranks share the host: each pool takes at most a quarter of it
        assert pool["free_bytes"] <= _mem_total() // WORLD
        assert pool["capacity_tokens"] >= model.config.max_position_embeddings
        assert memory["kv_pool"]["host"] == pool["bytes"] == (
            pool["capacity_tokens"] * pool["bytes_per_token"]
        )
        metrics = httpx.get(url + "/metrics", timeout=10).text
        shown = {
            m.rsplit(" ", 1)[0]: float(m.rsplit(" ", 1)[1])
            for m in metrics.splitlines()
            if m and not m.startswith("#")
        }
        part = 'dwdp_memory_bytes{part="expert_store",where="host"}'
        assert shown[part] == memory["expert_store"]["host"]
        assert shown["dwdp_kv_cache_capacity_tokens"] == pool["capacity_tokens"]
        assert shown["dwdp_kv_cache_usage_perc"] == 0.0  # nothing running


def test_every_rank_serves_the_replicated_greedy_tokens(pod):
    _proc, urls, ckpt, *_ = pod
    torch.set_num_threads(1)
    model, tok = load_checkpoint(ckpt)
    want = ContinuousEngine(model, tok, model_name="ref").run_batch(
        [tok(PROMPT)["input_ids"]], SamplingParams(max_tokens=6, ignore_eos=True)
    )[0]
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    for url in urls:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
        assert r.json()["model"] == "tiny-qwen"
    metrics = httpx.get(urls[1] + "/metrics", timeout=10).text
    moved = next(line for line in metrics.splitlines() if line.startswith("dwdp_bytes_moved_total"))
    assert float(moved.split()[-1]) > 0


def _secret_files(launcher: int) -> list[str]:
    """``DWDP_RENDEZVOUS_SECRET_FILE`` in the environment of each child of ``launcher``."""
    paths = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        paths += [e.split(b"=", 1)[1].decode() for e in environ
                  if e.startswith(b"DWDP_RENDEZVOUS_SECRET_FILE=")]
    return paths


def test_the_launch_made_one_private_secret_for_its_ranks(pod):
    """The environment had no DWDP_RENDEZVOUS_SECRET_FILE: the launcher made one private
    secret file and gave it to every rank (the group above committed over it)."""
    proc, *_ = pod
    paths = _secret_files(proc.pid)
    assert len(paths) == WORLD and len(set(paths)) == 1
    info = os.stat(paths[0])
    assert info.st_mode & 0o777 == 0o600 and info.st_size == 32


def test_sigterm_stops_the_pod_cleanly(pod):
    proc, _urls, _ckpt, group, _term = pod
    secret = _secret_files(proc.pid)[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert not leftover_segments(group)
    assert not os.path.exists(secret)  # the launcher removed its secret at exit
