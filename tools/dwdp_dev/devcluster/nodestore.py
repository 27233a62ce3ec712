"""The real nodes' image stores, kept between clusters (``<cache>/node-store/<N>``).

A real node's containerd keeps its images (their blobs, and the unpacked snapshots its
containers run on) under its ``root``. A root in the cluster's state folder dies with the
cluster, so every new cluster imported and unpacked every image again: the worker image's
3.4 GB of layers took about two minutes on two cores, in every test session and every demo.
The process kubelet keeps its unpacked roots in the image cache; this is the real node's
equivalent: :data:`SLOTS` containerd roots in the cache, each used by one node at a time.

- A node's root is ``<state>/containerd``, a link to the store it claimed
  (:func:`claimed`), or a plain folder there when every store is in use (then it dies with
  the cluster, as before).
- A store is in use while a containerd holds the lock of its metadata database (bbolt's
  ``flock`` on ``io.containerd.metadata.v1.bolt/meta.db``); claims are serialized by
  ``<cache>/node-store/.lock``, held until the claimant's containerd has opened the database.
- A store is reused only if its last node went down cleanly (its containers removed:
  :func:`mark_clean` writes ``clean``); one left by a killed node is emptied when claimed,
  so no container, sandbox or snapshot of an earlier cluster is ever seen by a new kubelet.
- What a store holds is pruned on import: an image name keeps one digest
  (``realnode.RealNode.import_images``). Deleting ``<cache>/node-store`` while no real node
  runs reclaims the space (up to 10 GB a store with the worker image).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from dwdp_dev.devcluster import paths

SLOTS = 2
"""How many stores the cache keeps: the tests' session cluster and one more (the demo, or a
test's own cluster) reuse their images; any further node at the same time gets a root of its
own that goes with its cluster."""
CLEAN = "clean"
"""The marker file of a store whose last node went down cleanly."""
_DB = Path("io.containerd.metadata.v1.bolt") / "meta.db"
_CRI = "io.containerd.grpc.v1.cri"
"""The CRI plugin's per-sandbox and per-container folders (hostname, resolv.conf, ...)."""


def store_dir() -> Path:
    """The stores' folder, ``<cache>/node-store``."""
    return paths.cache_dir() / "node-store"


def in_use(store: Path) -> bool:
    """Whether a containerd holds ``store``'s metadata database open now (its ``flock``)."""
    try:
        fd = os.open(store / _DB, os.O_RDONLY)
    except OSError:
        return False  # no database yet: never opened
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


@contextlib.contextmanager
def claimed(root: Path) -> Iterator[Path]:
    """Make ``root`` (a node's ``<state>/containerd``) a link to a free store and yield the
    store; or, with every store in use, a plain folder, yielded as it is. The claim is
    exclusive until the block ends: start containerd inside it, so that its lock is held
    before another node looks for a free store. A free store left cleanly is taken before one
    a killed node left, which is emptied first. Raises OSError if the folders cannot be
    made."""
    top = store_dir()
    top.mkdir(parents=True, exist_ok=True)
    with open(top / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        free_stores = [s for s in (top / str(n) for n in range(SLOTS)) if not in_use(s)]
        # a store left cleanly first: one a killed node left is emptied (its images imported
        # again)
        free = min(free_stores, key=lambda s: not (s / CLEAN).exists(), default=None)
        if root.is_symlink() or (free is not None and root.exists()):
            _remove(root)
        if free is None:
            root.mkdir(parents=True, exist_ok=True)
            yield root
            return
        if not (free / CLEAN).exists():
            shutil.rmtree(free, ignore_errors=True)
        free.mkdir(parents=True, exist_ok=True)
        (free / CLEAN).unlink(missing_ok=True)  # until this node goes down cleanly
        root.parent.mkdir(parents=True, exist_ok=True)
        root.symlink_to(free, target_is_directory=True)
        yield free


def mark_clean(root: Path) -> None:
    """After a node's down removed every container and stopped its containerd: drop the
    CRI plugin's leftover folders and mark the store behind ``root`` reusable. Nothing to
    do for a root of the node's own, or if another node claimed the store meanwhile (its
    claim emptied the store, unmarked)."""
    if not root.is_symlink():
        return
    store = root.resolve()
    with open(store_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if in_use(store):
            return
        shutil.rmtree(store / _CRI, ignore_errors=True)
        (store / CLEAN).write_text("")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
