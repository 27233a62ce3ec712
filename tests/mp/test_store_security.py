"""The rendezvous store against outsiders, with real rank processes and real sockets.

A 2-rank group joins over rank 0's store; while it waits between two collectives, the test
process attacks the store: a client with a wrong secret, one with none, and an
authenticated client sending an oversized frame, a malformed frame and an unknown op. Each
bad connection is dropped with one line in rank 0's log; the group then finishes its
collectives. A planted pickle under a collective key is refused and never runs.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import RENDEZVOUS_SECRET
from ports import free_port

from dwdp.worker.transport.base import RendezvousConfig
from dwdp.worker.transport.store import (
    MAX_FRAME_BYTES,
    SecretRefused,
    StoreClient,
)
from dwdp.worker.transport.tcp_store import TcpStoreTransport

WORLD = 2
WAIT_S = 120.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def _rank(group: str, port: int):
    def run(rank: int, out: Path) -> None:
        handler = logging.FileHandler(out / f"store.{rank}.log")
        logging.getLogger("dwdp.worker.transport.store").addHandler(handler)
        config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                                  secret=RENDEZVOUS_SECRET, address=("127.0.0.1", port),
                                  timeout_s=WAIT_S)
        with TcpStoreTransport(config) as transport:
            (out / f"joined.{rank}").touch()
            _wait_for(out / "go")
            first = transport.allgather(rank * 10, label="after-attacks")
            second = transport.allgather({"rank": rank}, label="again")
        (out / f"rec.{rank}.json").write_text(json.dumps({"first": first, "second": second}))
    return run


def _drain(conn) -> list[bytes]:
    """Every frame the server sends on ``conn`` until it closes it (fails if it does not
    close it within a few frames)."""
    frames = []
    for _ in range(4):
        assert conn.poll(30), f"the server neither answered nor closed: {frames}"
        try:
            frames.append(conn.recv_bytes(1024))
        except (EOFError, OSError):
            return frames
    raise AssertionError(f"the server kept the connection open: {frames}")


def test_outsiders_cannot_use_the_store_and_the_group_finishes(ranks, group):
    port = free_port()
    out = ranks.out
    ranks.start([0, 1], _rank(group, port))
    for r in range(WORLD):
        _wait_for(out / f"joined.{r}")
    address = ("127.0.0.1", port)
    deadline = time.monotonic() + 10
    planted = f"dwdp/{group}/i0/c1/1"

    # A wrong secret: the handshake is refused both ways; no request can be sent.
    with pytest.raises(SecretRefused, match="different secrets"):
        StoreClient.connect(*address, os.urandom(32), deadline=deadline, timeout_s=10)
    # No secret: whatever it sends is taken as the handshake's answer and refused.
    bare = Client(address, family="AF_INET")
    bare.send_bytes(msgpack.packb(["set", planted, b"evil"]))
    assert not [f for f in _drain(bare) if f.startswith(msgpack.packb(["ok", None])[:4])]
    bare.close()

    insider = StoreClient.connect(*address, RENDEZVOUS_SECRET, deadline=deadline, timeout_s=10)
    assert insider.get(planted) is None and not insider.check([planted])
    # Authenticated but out of protocol: an oversized frame (only its length header is
    # sent), a malformed frame, an unknown op. Each drops its own connection only.
    for frame in (None, b"\xc1", msgpack.packb(["shutdown"])):
        conn = Client(address, family="AF_INET", authkey=RENDEZVOUS_SECRET)
        if frame is None:
            os.write(conn.fileno(), struct.pack("!i", MAX_FRAME_BYTES + 1))
        else:
            conn.send_bytes(frame)
        assert _drain(conn) == []
        conn.close()
    assert insider.check([f"dwdp/{group}/i0/c0/0"])  # the store still serves
    insider.close()

    (out / "go").touch()
    assert ranks.wait(WAIT_S) == {0: 0, 1: 0}
    assert not sorted(out.glob("crash.*.txt")), [p.read_text() for p in out.glob("crash.*")]
    for r in range(WORLD):
        rec = json.loads((out / f"rec.{r}.json").read_text())
        assert rec == {"first": [0, 10], "second": [{"rank": 0}, {"rank": 1}]}
    lines = (out / "store.0.log").read_text().splitlines()
    assert len(lines) == 5, lines
    assert all(line.startswith("rendezvous store: connection from 127.0.0.1:")
               for line in lines)
    assert sum("authentication failed" in line for line in lines) == 2
    assert sum(f"frames are at most {MAX_FRAME_BYTES} bytes" in line for line in lines) == 1
    assert sum("malformed frame" in line for line in lines) == 1
    assert sum("unknown op 'shutdown'" in line for line in lines) == 1
    assert (out / "store.1.log").read_text() == ""


class _Planted:
    """A pickle whose loading creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_is_refused_and_never_runs(ranks, group):
    """Rank 0 of 2 waits for rank 1's join; a client holding the secret (an insider gone
    wrong) writes a pickle as rank 1's join message: rank 0 refuses it, naming the
    collective and the rank, and the file the pickle would create never appears."""
    port = free_port()
    out = ranks.out
    target = out / "pwned"

    def rank0(rank: int, out: Path) -> None:
        config = RendezvousConfig(group=group, incarnation="i0", rank=0, world_size=WORLD,
                                  secret=RENDEZVOUS_SECRET, address=("127.0.0.1", port),
                                  timeout_s=WAIT_S)
        try:
            TcpStoreTransport(config)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        (out / "rec.0.json").write_text(json.dumps({"error": error}))

    ranks.start([0], rank0)
    client = StoreClient.connect("127.0.0.1", port, RENDEZVOUS_SECRET,
                                 deadline=time.monotonic() + WAIT_S, timeout_s=WAIT_S)
    client.set(f"dwdp/{group}/i0/c0/1", pickle.dumps(_Planted(str(target))))
    client.set(f"dwdp/{group}/i0/left/1", b"1")  # rank 0 need not wait for rank 1 to leave
    client.close()
    assert ranks.wait(WAIT_S) == {0: 0}
    error = json.loads((out / "rec.0.json").read_text())["error"]
    assert error.startswith("TransportError: collective 'join': the message of rank 1 was "
                            "refused: not a well-formed message")
    assert not target.exists()
