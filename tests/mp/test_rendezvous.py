"""The TCP store rendezvous with real processes: missing ranks, incarnations, loopback.

Each rank reads its contract from an environment (docs/design.md §5.1), with a short
``DWDP_RENDEZVOUS_TIMEOUT_S`` so the timeouts are fast.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import write_secret

from dwdp.worker.transport.base import RendezvousConfig
from dwdp.worker.transport.tcp_store import TcpStoreTransport

TIMEOUT_S = 2.0


def _target(group: str, port: int, *, world: int = 4, incarnation=lambda r: "i1",
            host_id=lambda r: "hostA"):
    def run(rank: int, out: Path) -> None:
        env = {"DWDP_GROUP": group, "DWDP_INCARNATION": incarnation(rank),
               "DWDP_RANK": str(rank), "DWDP_WORLD_SIZE": str(world),
               "DWDP_RENDEZVOUS": f"127.0.0.1:{port}",
               "DWDP_RENDEZVOUS_TIMEOUT_S": str(TIMEOUT_S),
               "DWDP_RENDEZVOUS_SECRET_FILE": str(write_secret(out, f"secret.{rank}"))}
        start = time.monotonic()
        record = {"rank": rank}
        try:
            with TcpStoreTransport(RendezvousConfig.from_env(env), host_id=host_id(rank)) as t:
                record["payloads"] = t.allgather(rank * 10, label="hello")
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["missing"] = list(getattr(exc, "missing", ()))
        record["elapsed_s"] = time.monotonic() - start
        (out / f"rdv.{rank}.json").write_text(json.dumps(record))
    return run


def _records(out: Path, ranks) -> dict[int, dict]:
    return {r: json.loads((out / f"rdv.{r}.json").read_text()) for r in ranks}


def test_all_ranks_arrive(ranks, group):
    from ports import free_port

    ranks.start([0, 1, 2, 3], _target(group, free_port()))
    assert ranks.wait(60) == dict.fromkeys(range(4), 0)
    recs = _records(ranks.out, range(4))
    assert all(r["payloads"] == [0, 10, 20, 30] for r in recs.values())


def test_a_rank_that_never_arrives_fails_the_others_at_the_timeout(ranks, group):
    from ports import free_port

    ranks.start([0, 1, 2], _target(group, free_port()))
    assert ranks.wait(60) == dict.fromkeys(range(3), 0)
    recs = _records(ranks.out, range(3)).values()
    for rec in recs:
        assert rec["error"].startswith("RendezvousTimeout")
        assert "rank(s) [3] did not arrive" in rec["error"]
        assert rec["missing"] == [3]
        assert rec["elapsed_s"] < TIMEOUT_S + 8
    # The first rank to time out waited the whole timeout and published the verdict; a rank
    # that started later receives that verdict, so its own wait can be shorter by its lag.
    assert max(rec["elapsed_s"] for rec in recs) >= TIMEOUT_S * 0.9


def test_a_missing_rank_zero_is_named(ranks, group):
    from ports import free_port

    ranks.start([1, 2, 3], _target(group, free_port()))
    assert ranks.wait(60) == {1: 0, 2: 0, 3: 0}
    for rec in _records(ranks.out, [1, 2, 3]).values():
        assert "hosted by rank 0" in rec["error"] and rec["missing"] == [0]


def test_a_rank_of_an_old_incarnation_never_joins_the_new_one(ranks, group):
    from ports import free_port

    old = _target(group, free_port(), incarnation=lambda r: "old" if r == 3 else "new")
    ranks.start([0, 1, 2, 3], old)
    assert ranks.wait(60) == dict.fromkeys(range(4), 0)
    recs = _records(ranks.out, range(4))
    assert all(recs[r]["missing"] == [3] for r in range(3))
    assert "payloads" not in recs[3]  # it never saw the new incarnation's keys


def test_a_loopback_rendezvous_across_hosts_is_refused_on_every_rank(ranks, group):
    from ports import free_port

    ranks.start([0, 1], _target(group, free_port(), world=2,
                                host_id=lambda r: f"host{r}"))
    assert ranks.wait(60) == {0: 0, 1: 0}
    for rec in _records(ranks.out, [0, 1]).values():
        assert rec["error"].startswith("LoopbackAcrossHosts")
        assert "loopback" in rec["error"] and "2 hosts" in rec["error"]


def test_after_serving_rank_0_leaves_without_waiting_for_a_killed_peer(ranks, group):
    """Rank 1 dies without leaving (as under SIGKILL); rank 0, done serving, closes with
    ``linger=False`` and exits at once instead of hosting the store for min(timeout, 60 s)
    (which held a context pod's rank 0, and the router's traffic to its group, for 15 s)."""
    import os

    from ports import free_port

    port = free_port()

    def run(rank: int, out: Path) -> None:
        env = {"DWDP_GROUP": group, "DWDP_INCARNATION": "i1", "DWDP_RANK": str(rank),
               "DWDP_WORLD_SIZE": "2", "DWDP_RENDEZVOUS": f"127.0.0.1:{port}",
               "DWDP_RENDEZVOUS_TIMEOUT_S": "300",
               "DWDP_RENDEZVOUS_SECRET_FILE": str(write_secret(out, f"secret.{rank}"))}
        t = TcpStoreTransport(RendezvousConfig.from_env(env))
        t.allgather(rank, label="served")
        if rank == 1:
            os._exit(0)  # killed: never says it left
        time.sleep(0.5)
        t.close(linger=False)
        (out / "closed.json").write_text("true")

    ranks.start([0, 1], run)
    assert ranks.wait(30) == {0: 0, 1: 0}  # a lingering rank 0 would wait out 60 s here
    assert json.loads((ranks.out / "closed.json").read_text())
