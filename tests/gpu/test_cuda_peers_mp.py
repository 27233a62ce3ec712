"""POSIX-fd store export and import across 4 real processes on one GPU: bytes checked
through every peer view and every copy mode; handles released, also when one rank's
mapping fails half way (every rank raises)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

CHILD = Path(__file__).with_name("cuda_peer_child.py")
WORLD = 4


def _run(scenario: str) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(r), str(WORLD), str(port), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for r in range(WORLD)
    ]
    results = []
    for r, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} timed out")
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{stderr[-4000:]}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def test_posix_fd_stores_mapped_across_four_processes():
    results = _run("ok")
    for res in results:
        r = res["rank"]
        assert res["self_entry_none"]
        assert res["bytes_ok"] == {str(p): True for p in range(WORLD) if p != r}, res
        assert all(res["modes_ok"].values()), res
        assert set(res["modes_ok"]) == {"per_slice", "batched", "gather-register", "gather-tma"}
        assert res["handles_store"] == res["handles_start"] + 3
        assert res["handles_mapped"] == res["handles_store"] + 3 * (WORLD - 1)
        assert res["handles_views_closed"] == res["handles_store"]
        assert res["handles_end"] == res["handles_start"]


def test_failure_half_way_through_mapping_raises_everywhere_and_releases():
    results = _run("fail")
    for res in results:
        assert "error" in res, f"rank {res['rank']} did not raise"
        assert "rank 2" in res["error"] and "injected" in res["error"], res["error"]
        # Only the rank's own store is left after map_peers raised; then nothing.
        assert res["handles_after_error"] == res["handles_store"], res
        assert res["handles_end"] == res["handles_start"], res
