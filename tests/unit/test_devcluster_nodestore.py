"""The real nodes' image stores kept in the cache (``dwdp_dev.devcluster.nodestore``): a store
is claimed by one node at a time (a containerd holding its database's ``flock`` marks it in
use, as containerd's bbolt does), a node past the last store gets a root of its own, and a
store whose last node did not go down cleanly is emptied before it is used again."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dwdp_dev.devcluster import nodestore


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path / "cache"))


@contextmanager
def _containerd_holds(store: Path) -> Iterator[None]:
    """What containerd does while it runs on ``store``: an exclusive flock on its metadata
    database (a file description of its own, as another process's would be)."""
    db = store / "io.containerd.metadata.v1.bolt" / "meta.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(db, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_a_store_in_use_goes_to_no_second_node(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "containerd", tmp_path / "b" / "containerd"
    with nodestore.claimed(a) as store_a:
        assert a.is_symlink() and a.resolve() == store_a == nodestore.store_dir() / "0"
    with _containerd_holds(store_a):  # the claim ends once containerd has the store
        assert nodestore.in_use(store_a)
        with nodestore.claimed(b) as store_b:
            assert store_b == nodestore.store_dir() / "1"
    assert not nodestore.in_use(store_a)  # its containerd stopped


def test_past_the_last_store_a_node_gets_a_root_of_its_own(tmp_path: Path) -> None:
    top = nodestore.store_dir()
    with _containerd_holds(top / "0"), _containerd_holds(top / "1"):
        root = tmp_path / "c" / "containerd"
        root.parent.mkdir()
        root.symlink_to(top / "1")  # where this cluster's node ran last time
        with nodestore.claimed(root) as got:
            assert got == root and root.is_dir() and not root.is_symlink()
    assert (top / "1" / "io.containerd.metadata.v1.bolt" / "meta.db").exists()


def test_only_a_store_left_cleanly_keeps_its_images(tmp_path: Path) -> None:
    root = tmp_path / "a" / "containerd"
    with nodestore.claimed(root) as store:
        (store / "image-blob").write_text("kept")
    # the node ran and went down cleanly: its images serve the next node
    nodestore.mark_clean(root)
    with nodestore.claimed(tmp_path / "b" / "containerd") as again:
        assert again == store and (store / "image-blob").read_text() == "kept"
        assert not (store / nodestore.CLEAN).exists()  # claimed: unmarked until its down
    # that node was killed (no clean down): the next claim empties the store
    with nodestore.claimed(tmp_path / "c" / "containerd") as third:
        assert third == store and not (store / "image-blob").exists()


def test_a_store_claimed_meanwhile_is_not_marked_clean(tmp_path: Path) -> None:
    """A node's down marks its store clean after its containerd stopped; if another node
    claimed the store in between (its claim emptied it), the mark would let a third node
    reuse what that one leaves when it is killed."""
    root = tmp_path / "a" / "containerd"
    with nodestore.claimed(root) as store:
        pass
    with _containerd_holds(store):  # another node's containerd runs on it now
        nodestore.mark_clean(root)
    assert not (store / nodestore.CLEAN).exists()


def test_a_store_left_cleanly_goes_before_one_a_killed_node_left(tmp_path: Path) -> None:
    top = nodestore.store_dir()
    with nodestore.claimed(tmp_path / "a" / "containerd") as first:
        (first / "image-blob").write_text("a killed node's")
    with _containerd_holds(first), nodestore.claimed(tmp_path / "b" / "containerd") as second:
        (second / "image-blob").write_text("kept")
    nodestore.mark_clean(tmp_path / "b" / "containerd")  # only the second went down cleanly
    with nodestore.claimed(tmp_path / "c" / "containerd") as got:
        assert got == second == top / "1" and (got / "image-blob").read_text() == "kept"
    assert (first / "image-blob").exists()  # not emptied: nobody needed it
