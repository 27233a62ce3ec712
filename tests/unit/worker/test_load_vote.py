"""The group-wide vote on the model load (``dwdp.worker.loading.load_vote``), over a real TCP
store with two ranks in two threads: one rank's failed load fails both alike, naming it and
its cause, and what either rank had loaded is dropped."""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from ports import free_port

torch = pytest.importorskip("torch")

from dwdp.api.contract import Stage  # noqa: E402
from dwdp.worker.loading.load_vote import LoadError, load_together  # noqa: E402
from dwdp.worker.loading.validate import CheckpointError  # noqa: E402
from dwdp.worker.main import phased  # noqa: E402
from dwdp.worker.transport.base import RendezvousConfig  # noqa: E402
from dwdp.worker.transport.tcp_store import TcpStoreTransport  # noqa: E402

WORLD = 2
SECRET = os.urandom(32)  # the rendezvous secret of the group these threads form
CAUSE = "checkpoint /ck/model-00002-of-00003.safetensors: tensor w: reading failed (EIO)"


def _each_rank(body: Callable[[int, TcpStoreTransport], Any]) -> list[Any]:
    """``body(rank, transport)`` on every rank of one group, a thread each; its result or
    the exception it raised, by rank."""
    group, port = f"u{uuid.uuid4().hex[:8]}", free_port()
    results: list[Any] = [None] * WORLD

    def run(rank: int) -> None:
        config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                                  secret=SECRET, address=("127.0.0.1", port), timeout_s=60)
        try:
            with TcpStoreTransport(config) as transport:
                results[rank] = body(rank, transport)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_one_rank_fails_every_rank_raises_the_same_load_error_and_drops_its_tensors():
    loaded: dict[int, weakref.ref] = {}

    def load(rank: int) -> torch.Tensor:
        tensor = torch.ones(1 << 16)
        loaded[rank] = weakref.ref(tensor)
        if rank == 1:
            try:
                raise OSError("EIO")
            except OSError as exc:  # as the sharded reader wraps a failed read
                raise CheckpointError(CAUSE) from exc
        return tensor

    results = _each_rank(lambda r, t: load_together(t, lambda: load(r), device="cpu"))
    assert all(isinstance(e, LoadError) for e in results), results
    assert all(e.errors == {1: f"CheckpointError: {CAUSE}"} for e in results)
    lines = {phased(Stage.LOAD, e) for e in results}
    assert lines == {
        f"load: LoadError: the model load failed on rank(s) [1]: rank 1: CheckpointError: "
        f"{CAUSE}; every rank of the group stops"
    }
    # the failing rank's partial load and the healthy rank's whole load are both gone
    assert {r: ref() for r, ref in loaded.items()} == {0: None, 1: None}


def test_every_rank_loaded_each_gets_its_own_result():
    results = _each_rank(lambda r, t: load_together(t, lambda: f"model of rank {r}",
                                                    device="cpu"))
    assert results == ["model of rank 0", "model of rank 1"]


def test_without_a_group_the_load_error_itself_propagates():
    def load() -> None:
        raise CheckpointError(CAUSE)

    with pytest.raises(CheckpointError, match="reading failed"):
        load_together(None, load, device="cpu")
