"""Group transport pieces that need no processes: env contract, envelopes, loopback rule."""

from __future__ import annotations

import threading

import msgpack
import pytest

from dwdp.worker.transport import codec
from dwdp.worker.transport.base import (
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    CollectiveMismatch,
    GroupFailure,
    GroupTransport,
    RendezvousConfig,
    RendezvousSecretError,
    TransportError,
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
SECRET = bytes(range(32))


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The rendezvous contract with a secret file, as the operator mounts it."""
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return {**ENV, "DWDP_RENDEZVOUS_SECRET_FILE": str(path)}


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


def test_config_from_env_reads_the_contract(env):
    cfg = RendezvousConfig.from_env(env)
    assert (cfg.group, cfg.incarnation, cfg.rank, cfg.world_size) == ("g", "3", 1, 4)
    assert cfg.secret == SECRET and SECRET.hex() not in repr(cfg)
    assert cfg.address == ("pod-0.svc", 29500)
    assert cfg.timeout_s == DEFAULT_RENDEZVOUS_TIMEOUT_S == 1800
    assert cfg.namespace == "dwdp/g/3"
    assert RendezvousConfig.from_env({**env, "DWDP_RENDEZVOUS_TIMEOUT_S": "2.5"}).timeout_s == 2.5


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
def test_config_from_env_names_the_bad_variable(env, change, message):
    env = {k: v for k, v in {**env, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        RendezvousConfig.from_env(env)


def test_the_secret_file_errors_are_one_line_naming_the_variable_and_the_path(env, tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    cases = [
        (None, "environment variable DWDP_RENDEZVOUS_SECRET_FILE is not set"),
        (str(tmp_path / "absent"),
         f"DWDP_RENDEZVOUS_SECRET_FILE='{tmp_path}/absent' cannot be read: No such file"),
        (str(short), f"DWDP_RENDEZVOUS_SECRET_FILE='{short}' holds 31 bytes; a rendezvous "
                     "secret is at least 32"),
    ]
    for path, message in cases:
        bad = {k: v for k, v in env.items() if k != "DWDP_RENDEZVOUS_SECRET_FILE"}
        if path is not None:
            bad["DWDP_RENDEZVOUS_SECRET_FILE"] = path
        with pytest.raises(RendezvousSecretError) as info:
            RendezvousConfig.from_env(bad)
        assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_short_secret_is_refused_in_the_config():
    with pytest.raises(ValueError, match="the rendezvous secret is 8 bytes; it must be at "
                                         "least 32"):
        RendezvousConfig(group="g", incarnation="i", rank=0, world_size=1, secret=b"12345678")


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


class _Planted:
    """A pickle whose loading creates ``path`` (what an outsider wrote to the store)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _PlantedPeer(GroupTransport):
    """Rank 0 of two whose peer's message is ``blob`` (bytes as read from the store)."""

    def __init__(self, blob: bytes) -> None:
        super().__init__(rank=0, world_size=2, timeout_s=1)
        self.blob = blob

    def _allgather_bytes(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
        return [data, self.blob]


def test_a_pickle_from_a_peer_is_refused_and_never_runs(tmp_path):
    import pickle

    planted = tmp_path / "pwned"
    blob = pickle.dumps(_Planted(str(planted)))
    with pytest.raises(TransportError, match=r"collective 'join': the message of rank 1 was "
                                             r"refused"):
        _PlantedPeer(blob).allgather("hostA", label="join")
    assert not planted.exists()


@pytest.mark.parametrize("blob, why", [
    (b"\xc1", "not a well-formed message"),                       # msgpack's reserved byte
    (b"\x94\x00\xa1x\xc0", "not a well-formed message"),           # truncated array
    (b"\x93\x00\xa1x\xc0", "not an envelope"),                     # three items, not four
    (b"\x94\x00\xa1x\xc0\xc7\x01\x09x", "unknown ext type 9"),
    (b"\x94\x00\xa1x\xc0\xc7\x03\x02\x92\x01\x02", "a record that is not"),
    (b"\x91" * 200_000, "not a well-formed message"),              # nested past the stack
])
def test_a_malformed_message_names_the_collective_and_the_rank(blob, why):
    with pytest.raises(TransportError, match=rf"'join': the message of rank 1 .*{why}"):
        _PlantedPeer(blob).allgather("hostA", label="join")


def test_an_unregistered_record_is_refused():
    record = codec.encode([0, "join", None, None]).replace(b"\xc0", b"", 1)
    unknown = msgpack.ExtType(codec.EXT_RECORD, codec.encode(["os.system", ["id"]]))
    blob = record + msgpack.packb(unknown)
    with pytest.raises(TransportError, match=r"unknown record type 'os\.system'"):
        _PlantedPeer(blob).allgather("hostA", label="join")


def test_an_oversized_message_is_refused_before_decoding():
    blob = msgpack.packb([0, "join", None, b"x" * codec.MAX_BLOB_BYTES])
    with pytest.raises(TransportError, match="over the limit"):
        _PlantedPeer(blob).allgather("hostA", label="join")


def test_records_tuples_and_plain_values_round_trip():
    from dwdp.worker.expert.layout import ChunkSpec
    from dwdp.worker.setup.expert import Handshake

    shake = Handshake(((0, 2), (2, 4)), (2, 2), ((ChunkSpec("w1", (3, 4), "float32", 48),),),
                      ("model.layers.0.mlp",))
    value = {"a": [1, 2.5, None, True, b"\x00"], "b": ("x", (1,)), "h": shake}
    assert codec.decode(codec.encode(value)) == value
    assert isinstance(codec.decode(codec.encode(value))["b"], tuple)


def test_a_payload_that_cannot_travel_becomes_the_senders_error():
    results = run_threads(2, lambda t: t.exchange(object() if t.rank == 1 else 1, label="x"))
    for ex in results:
        assert ex.payloads == (1, None)
        assert "rank" not in ex.errors[1] and "cannot encode a object" in ex.errors[1]
