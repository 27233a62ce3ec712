"""Group transport pieces that need no processes: env contract, envelopes, loopback rule."""

from __future__ import annotations

import threading

import pytest

from dwdp.worker.transport.base import (
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    CollectiveMismatch,
    GroupFailure,
    GroupTransport,
    RendezvousConfig,
    parse_address,
)
from dwdp.worker.transport.tcp_store import LoopbackAcrossHosts, check_rendezvous_hosts, is_loopback

ENV = {
    "DWDP_GROUP": "g",
    "DWDP_INCARNATION": "3",
    "DWDP_RANK": "1",
    "DWDP_WORLD_SIZE": "4",
    "DWDP_RENDEZVOUS": "pod-0.svc:29500",
}


class ThreadGroup:
    """An in-process allgather for ``n`` threads (one shared board per collective)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n)
        self.board: dict[int, dict[int, bytes]] = {}
        self.lock = threading.Lock()

    def transport(self, rank: int) -> GroupTransport:
        group = self

        class _T(GroupTransport):
            def _allgather_bytes(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
                with group.lock:
                    group.board.setdefault(seq, {})[self.rank] = data
                group.barrier.wait(timeout=10)
                return [group.board[seq][r] for r in range(group.n)]

        return _T(rank=rank, world_size=self.n, timeout_s=10)


def run_threads(n: int, body):
    group = ThreadGroup(n)
    results: dict[int, object] = {}

    def main(rank: int) -> None:
        try:
            results[rank] = body(group.transport(rank))
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return [results[r] for r in range(n)]


def test_config_from_env_reads_the_contract():
    cfg = RendezvousConfig.from_env(ENV)
    assert (cfg.group, cfg.incarnation, cfg.rank, cfg.world_size) == ("g", "3", 1, 4)
    assert cfg.address == ("pod-0.svc", 29500)
    assert cfg.timeout_s == DEFAULT_RENDEZVOUS_TIMEOUT_S == 1800
    assert cfg.namespace == "dwdp/g/3"
    assert RendezvousConfig.from_env({**ENV, "DWDP_RENDEZVOUS_TIMEOUT_S": "2.5"}).timeout_s == 2.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"DWDP_RANK": None}, "DWDP_RANK is not set"),
        ({"DWDP_RANK": "4"}, "outside"),
        ({"DWDP_WORLD_SIZE": "x"}, "not an integer"),
        ({"DWDP_RENDEZVOUS": "nohostport"}, "host:port"),
        ({"DWDP_RENDEZVOUS_TIMEOUT_S": "0"}, "> 0"),
        ({"DWDP_INCARNATION": "a/b"}, "without '/'"),
    ],
)
def test_config_from_env_names_the_bad_variable(change, message):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        RendezvousConfig.from_env(env)


def test_parse_address_handles_ipv6():
    assert parse_address("[::1]:80") == ("::1", 80)


def test_loopback_is_refused_only_across_hosts():
    assert is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.1")
    check_rendezvous_hosts("127.0.0.1", ["a", "a", "a"])
    check_rendezvous_hosts("10.0.0.1", ["a", "b"])
    with pytest.raises(LoopbackAcrossHosts, match=r"a: ranks \[0, 2\], b: ranks \[1\]"):
        check_rendezvous_hosts("127.0.0.1", ["a", "b", "a"])


def test_every_rank_sees_every_error_in_one_exchange():
    def body(t: GroupTransport):
        ex = t.exchange({"r": t.rank}, label="x", error="boom" if t.rank == 1 else None)
        return ex

    results = run_threads(3, body)
    for ex in results:
        assert ex.payloads == ({"r": 0}, {"r": 1}, {"r": 2})
        assert dict(ex.errors) == {1: "boom"} and ex.failed_ranks == (1,)
        with pytest.raises(GroupFailure, match=r"'x' failed on rank\(s\) \[1\]: rank 1: boom"):
            ex.raise_if_failed()


def test_ranks_in_different_collectives_raise_a_mismatch():
    results = run_threads(2, lambda t: t.exchange(None, label=f"phase{t.rank}"))
    assert all(isinstance(r, CollectiveMismatch) for r in results)
