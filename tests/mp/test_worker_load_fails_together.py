"""A rank whose model load fails after the rendezvous fails its group together: 2 real worker
ranks (``run_worker``, forked), expert DWDP over the cpu backend and the TCP store.

How only one rank fails, honestly: each rank has its own copy of a checkpoint split over
several shard files with an index. Rank 0 starts alone; it checks its copy's headers and
then hosts the rendezvous store (``join_group``). Once its store listens (the same probe a
peer's join makes), its header check is behind it, so the test removes one shard file of
rank 0's copy (a shard file removed after the header check), and only then starts rank 1
on its intact copy. The group meets, rank 0's load finds the shard file gone, rank 1's
loads. Every rank must then exit 1 with a termination message starting ``load:`` that
names rank 0, the shard file and a tensor it holds, long before the rendezvous timeout,
and leave no shared-memory segment.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from conftest import RankProcesses, run_worker_rank
from ports import free_port

from dwdp.worker.backend.cpu import leftover_segments
from dwdp.worker.loading.validate import INDEX_FILE
from dwdp_dev.worker.checkpoint import make_checkpoint

WORLD = 2
FAIL_RANK = 0  # hosts the store: its store listening shows its header check is done
NUM_EXPERTS = 4
RENDEZVOUS_TIMEOUT_S = 600
WAIT_S = 240  # well under the rendezvous timeout: a hang until it would be killed (-9)


def _rank(rank: int, out: Path, group: str, port: int, config: Path) -> None:
    code = run_worker_rank(rank, group=group, world=WORLD, port=port, config=config,
                           termination_log=out / f"term.{rank}",
                           timeout_s=RENDEZVOUS_TIMEOUT_S)
    (out / f"code.{rank}").write_text(str(code))


def _store_listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


def test_one_rank_fails_to_load_every_rank_fails_with_its_cause(tmp_path, group):
    source = make_checkpoint("qwen3_moe", tmp_path / "ck", num_experts=NUM_EXPERTS,
                             hidden_size=64, moe_width=64, max_shard_size="50KB")
    weight_map = json.loads((source / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    port = free_port()
    configs = []
    for rank in range(WORLD):
        copy = shutil.copytree(source, tmp_path / f"ck.{rank}")
        config = tmp_path / f"launch.{rank}.yaml"
        config.write_text(yaml.safe_dump({
            "model": {"path": str(copy)},
            "handleType": "shm",
            "transport": "tcpStore",
            "dwdp": {"dwdpSize": WORLD, "numPrefetchSlots": 2},
            "serverPort": free_port(),
        }))
        configs.append(config)
    out = tmp_path / "out"
    out.mkdir()
    procs = RankProcesses(out)
    try:
        procs.start([FAIL_RANK], lambda r, o: _rank(r, o, group, port, configs[r]))
        deadline = time.monotonic() + WAIT_S
        while not _store_listens(port):
            assert procs.alive(), (out / f"term.{FAIL_RANK}").read_text()
            assert time.monotonic() < deadline, "rank 0 never hosted the rendezvous store"
            time.sleep(0.1)
        gone = sorted(set(weight_map.values()))[-1]
        (tmp_path / f"ck.{FAIL_RANK}" / gone).unlink()
        others = [r for r in range(WORLD) if r != FAIL_RANK]
        procs.start(others, lambda r, o: _rank(r, o, group, port, configs[r]))
        codes = procs.wait(timeout_s=WAIT_S)
    finally:
        procs.wait(timeout_s=5)
    crashes = sorted(out.glob("crash.*.txt"))
    assert not crashes, "\n".join(p.read_text() for p in crashes)
    assert codes == dict.fromkeys(range(WORLD), 0), codes  # run_worker returned
    messages = [(out / f"term.{r}").read_text() for r in range(WORLD)]
    assert [int((out / f"code.{r}").read_text()) for r in range(WORLD)] == [1] * WORLD, messages
    verdict = (
        f"load: LoadError: the model load failed on rank(s) [{FAIL_RANK}]: "
        f"rank {FAIL_RANK}: CheckpointError: checkpoint {tmp_path / f'ck.{FAIL_RANK}'}: "
        f"shard file {gone} named by {INDEX_FILE} (tensor "
    )
    assert all(m.startswith(verdict) for m in messages), messages
    for message in messages:
        tensor = message.split("(tensor ")[1].split(")")[0]
        assert weight_map[tensor] == gone, message
    # the same verdict on every rank, then each rank's own memory measured so far
    assert len({m.split("; memory GiB")[0] for m in messages}) == 1
    assert all("; memory GiB (host/device): runtime " in m and ", peak_load " in m
               for m in messages), messages
    assert not leftover_segments(group)
