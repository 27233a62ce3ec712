"""Dense and expert setup on 4 real rank processes: commit, fail-together, resident bytes.

Every scenario of ``_ranks.SCENARIOS`` runs once per transport (the TCP store, forked from
this process; MPI, under ``mpirun -np 4``), all scenarios in one group of 4 processes, one
incarnation each; each test reads the per-rank records of its scenario.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _ranks import FAIL_RANK, SCENARIOS, run_scenario
from conftest import RENDEZVOUS_SECRET, RankProcesses, read_records
from ports import free_port

from dwdp.worker.backend.cpu import leftover_segments
from dwdp.worker.transport.base import RendezvousConfig
from dwdp.worker.transport.tcp_store import TcpStoreTransport

WORLD = 4
MPIRUN = shutil.which("mpirun")


def _run_tcp(out: Path, group: str) -> dict[int, int]:
    port = free_port()

    def target(rank: int, out: Path) -> None:
        config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                                  secret=RENDEZVOUS_SECRET, address=("127.0.0.1", port),
                                  timeout_s=60)
        with TcpStoreTransport(config) as transport:
            for scenario in SCENARIOS:
                run_scenario(scenario, transport, rank, group, out)

    procs = RankProcesses(out)
    procs.start(list(range(WORLD)), target)
    return procs.wait(timeout_s=300)


def _run_mpi(out: Path, group: str) -> dict[int, int]:
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(WORLD),
           sys.executable, str(Path(__file__).parent / "_ranks.py"), str(out), group,
           ",".join(SCENARIOS)]
    env = {**os.environ, "DWDP_RENDEZVOUS_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict.fromkeys(range(WORLD), 0)


@pytest.fixture(scope="module", params=["tcp", "mpi"])
def run(request, tmp_path_factory):
    if request.param == "mpi" and MPIRUN is None:
        pytest.skip("mpirun is not installed (scripts/test.sh installs openmpi)")
    out = tmp_path_factory.mktemp(request.param)
    group = f"t{uuid.uuid4().hex[:10]}"
    codes = (_run_tcp if request.param == "tcp" else _run_mpi)(out, group)
    left = leftover_segments(group)
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    return out, codes, left


def records(run, scenario: str) -> list[dict]:
    out, _, _ = run
    recs = read_records(out, scenario, WORLD)
    for rec in recs:
        assert "crash" not in rec, rec.get("traceback")
        assert rec["leftover_segments"] == [], rec
    return recs


def test_every_rank_exits_and_no_segment_is_left(run):
    _, codes, left = run
    assert codes == dict.fromkeys(range(WORLD), 0)
    assert left == []


def test_four_ranks_commit_with_one_layout_digest(run):
    recs = records(run, "commit")
    assert all(r["ok"] for r in recs)
    assert len({r["digest"] for r in recs}) == 1
    assert all(r["forward_equal"] for r in recs), "the model reads other weights via the slots"
    assert all(r["scheduled_forward_equal"] for r in recs)
    moved, replicated = recs[0]["moved"], recs[0]["replicated"]
    assert "model.layers.1.self_attn.q_proj.weight" in moved
    assert "model.layers.3.mlp.shared_experts.up.weight" in moved
    assert "model.layers.1.mlp.gate.weight" in moved
    assert not any("e_score_correction_bias" in n or "scratch" in n or "experts.gate_up" in n
                   for n in moved)
    assert not any(n.startswith("model.layers.0.") for n in moved)
    assert "model.layers.1.self_attn.inv_freq" in replicated  # one buffer shared by all layers
    assert all(r["status"]["leaks"] == 0 for r in recs)


def test_resident_bytes_are_a_quarter_plus_padding_plus_slots(run):
    recs = records(run, "commit")
    for rec in recs:
        st = rec["status"]
        assert st["world_size"] == WORLD
        assert st["store_bytes"] * WORLD == rec["padded_bytes"]
        assert rec["padded_bytes"] == st["sharded_bytes"] + st["padding_bytes"] * WORLD
        assert st["padding_bytes"] < 6 * 64  # at most one alignment unit per blob (6 blobs)
        sizes = rec["slot_sizes"]
        assert len(sizes["attention"]) == 2 and len(sizes["moe_dense"]) == 3
        assert st["slot_bytes"] == sum(sizes["attention"]) + sum(sizes["moe_dense"])
        assert st["resident_bytes"] == st["store_bytes"] + st["slot_bytes"] + st["replicated_bytes"]
        assert st["store_bytes"] < st["sharded_bytes"] / WORLD + 6 * 64


@pytest.mark.parametrize("phase", [f"P{i}" for i in range(1, 7)])
def test_a_failure_in_any_phase_raises_on_every_rank(run, phase):
    recs = records(run, f"fail-{phase}")
    for rec in recs:
        assert rec["ok"] is False
        assert rec["phase"] == phase
        assert rec["failed"] == [FAIL_RANK]
        assert f"failed in {phase}" in rec["error"] and f"rank {FAIL_RANK}" in rec["error"]
        if phase != "P6":
            assert rec["restored"] is True
            assert rec["changed"] == [], "P1-P5 must leave every original tensor intact"
            assert rec["forward_equal"] is True
        else:
            assert rec["restored"] is False


def test_ranks_that_disagree_on_enable_dense_all_raise_at_p1(run):
    recs = records(run, "enable-dense-mismatch")
    assert all(not r["ok"] and r["phase"] == "P1" and r["failed"] == [1] for r in recs)
    assert all("enable_dense" in r["error"] for r in recs)
    assert all(r["changed"] == [] for r in recs)


def test_ranks_with_other_weights_all_raise_at_p1(run):
    recs = records(run, "weights-mismatch")
    assert all(not r["ok"] and r["phase"] == "P1" and r["failed"] == [3] for r in recs)
    assert all("model.layers.1/attention" in r["error"] for r in recs)


def test_a_leaked_original_is_counted_not_fatal(run):
    recs = records(run, "leak")
    assert all(r["ok"] for r in recs)
    assert [r["status"]["leaks"] for r in recs] == [1] * WORLD


def test_expert_setup_commits_and_fills_full_tables(run):
    recs = records(run, "expert-commit")
    assert all(r["ok"] and r["full_tables"] for r in recs)
    assert recs[0]["ranges"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    for rec in recs:
        st = rec["status"]
        assert st["store_bytes"] * WORLD == st["sharded_bytes"]  # 2 of 8 experts, aligned


@pytest.mark.parametrize("phase", ["handshake", "allocate", "map", "commit"])
def test_an_expert_setup_failure_raises_on_every_rank(run, phase):
    recs = records(run, f"expert-fail-{phase}")
    assert all(not r["ok"] and r["phase"] == phase and r["failed"] == [FAIL_RANK] for r in recs)


def test_expert_chunk_shapes_that_differ_raise_at_the_handshake(run):
    recs = records(run, "expert-shape-mismatch")
    assert all(not r["ok"] and r["phase"] == "handshake" and r["failed"] == [1] for r in recs)
