"""The ``cpu`` backend: the DWDP backend protocol on host shared memory (what CI runs).

A rank's store is a shared-memory file ``/dev/shm/dwdp-<group>-<incarnation>-<rank>-<tag>``
mapped read-write by its owner; every peer maps it read-only (``HandleType.SHM``: all ranks
on one host). Buffers are ``torch.frombuffer`` views of those mappings, so copy plans move
real bytes with ``torch.Tensor.copy_``. Streams and events have CPU semantics: work runs
synchronously in issue order, so every event is complete once recorded.

Invariant: every store file is unlinked exactly once: by :meth:`CpuBackend.map_peers` as
soon as every peer mapped it, or by :meth:`ShmStore.close` (also after a failure half way);
no segment outlives its store.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from typing import Any

import torch

from dwdp.api.enums import CopyMode, HandleType
from dwdp.worker.backend.base import (
    Backend,
    BackendError,
    Buffer,
    CopyPlan,
    Event,
    PeerView,
    Store,
    Stream,
)
from dwdp.worker.backend.shm_names import (  # noqa: F401 - leftover_segments: re-exported
    SHM_DIR,
    leftover_segments,
    segment_name,
)
from dwdp.worker.host_memory import host_budget


def _round_up(nbytes: int, granularity: int) -> int:
    return max(granularity, -(-nbytes // granularity) * granularity)


def _view_of(mapping: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only peer mappings: torch warns, we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def _release_mapping(mapping: mmap.mmap) -> None:
    """Unmap now, or leave the unmap to the last tensor view that still exports it."""
    with contextlib.suppress(BufferError):  # a view outlives it: unmapped when that goes
        mapping.close()


class ShmStore(Store):
    """This rank's store: a shared-memory file, mapped read-write.

    ``path`` is the file; ``nbytes`` the mapped size in bytes (a multiple of the page size).
    """

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self._unlinked = False
        self._tensor: torch.Tensor | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise BackendError(
                f"allocate_store: {path} exists (a store of the same group, incarnation, "
                "rank and tag is alive, or a crashed run left it: remove it)"
            ) from None
        except OSError as exc:
            raise BackendError(f"allocate_store: cannot create {path}: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            self._mapping: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            self.unlink()
            raise BackendError(
                f"allocate_store: cannot size or map {path} to {nbytes} bytes: {exc}"
            ) from exc
        finally:
            os.close(fd)

    def tensor(self) -> torch.Tensor:
        if self._mapping is None:
            raise BackendError(f"store {self.path} is closed")
        if self._tensor is None:
            self._tensor = _view_of(self._mapping)
        return self._tensor

    @property
    def unlinked(self) -> bool:
        """True once the file name is gone (peers that mapped it keep their mapping)."""
        return self._unlinked

    def unlink(self) -> None:
        """Remove the file name; the first call does it, later calls do nothing."""
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(FileNotFoundError):  # removed from outside: gone either way
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self._tensor = None
        if self._mapping is not None:
            mapping, self._mapping = self._mapping, None
            _release_mapping(mapping)


class ShmPeerView(PeerView):
    """A peer's store file mapped read-only into this rank."""

    def __init__(self, rank: int, path: str, nbytes: int) -> None:
        self.rank = rank
        self.path = path
        self.nbytes = nbytes
        self._tensor: torch.Tensor | None = None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise BackendError(f"map_peers: cannot open rank {rank}'s store {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise BackendError(
                    f"map_peers: rank {rank}'s store {path} holds {size} bytes, "
                    f"expected {nbytes}"
                )
            self._mapping: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                                        prot=mmap.PROT_READ)
        except OSError as exc:
            raise BackendError(f"map_peers: cannot map rank {rank}'s store {path}: {exc}") from exc
        finally:
            os.close(fd)

    def tensor(self) -> torch.Tensor:
        if self._mapping is None:
            raise BackendError(f"peer view of rank {self.rank} ({self.path}) is closed")
        if self._tensor is None:
            self._tensor = _view_of(self._mapping)
        return self._tensor

    def close(self) -> None:
        self._tensor = None
        if self._mapping is not None:
            mapping, self._mapping = self._mapping, None
            _release_mapping(mapping)


class HostBuffer(Buffer):
    """Private host memory (prefetch slots): a plain ``torch.uint8`` tensor."""

    def __init__(self, nbytes: int, tag: str) -> None:
        self.nbytes = nbytes
        self.tag = tag
        try:
            self._tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise BackendError(f"allocate: {nbytes} bytes for {tag!r}: {exc}") from exc

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise BackendError(f"buffer {self.tag!r} is closed")
        return self._tensor

    def close(self) -> None:
        self._tensor = None


class CpuStream(Stream):
    """A CPU 'stream': work runs when it is enqueued, so it is ordered by construction."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Event) -> None:
        """Nothing to wait for: the event's work already ran when it was enqueued."""

    def synchronize(self) -> None:
        """Nothing is ever pending."""


class CpuEvent(Event):
    """A CPU event: complete as soon as it is recorded (work ran synchronously)."""

    def __init__(self) -> None:
        self.recorded_on: str | None = None

    def record(self, stream: Stream) -> None:
        self.recorded_on = stream.name

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing is ever pending."""


class CpuBackend(Backend):
    """The host shared-memory backend of one rank of group ``group``/``incarnation``.

    ``shm_dir`` is where store files go (``/dev/shm``). Store sizes are rounded up to the
    page size (``mmap.PAGESIZE`` bytes).
    """

    name = "cpu"
    handle_type = HandleType.SHM
    granularity = mmap.PAGESIZE

    def __init__(self, *, group: str, incarnation: str, rank: int,
                 shm_dir: str = SHM_DIR) -> None:
        self.group = group
        self.incarnation = incarnation
        self.rank = rank
        self.shm_dir = shm_dir
        self._compute = CpuStream("compute")

    def allocate_store(self, nbytes: int, *, tag: str) -> ShmStore:
        if nbytes < 0:
            raise BackendError(f"allocate_store: negative size {nbytes} for {tag!r}")
        name = segment_name(self.group, self.incarnation, self.rank, tag)
        return ShmStore(os.path.join(self.shm_dir, name), _round_up(nbytes, self.granularity))

    def allocate(self, nbytes: int, *, tag: str) -> HostBuffer:
        if nbytes < 0:
            raise BackendError(f"allocate: negative size {nbytes} for {tag!r}")
        return HostBuffer(nbytes, tag)

    def map_peers(self, store: Store, transport: Any) -> list[PeerView | None]:
        """Exchange store file names, map every peer's file read-only, then (after a second
        exchange that confirms every rank mapped every peer) unlink this rank's file name.

        Both exchanges carry the status, so a rank that cannot map makes every rank close
        its views and raise ``BackendError`` after the same collective.
        """
        if not isinstance(store, ShmStore):
            raise BackendError(f"map_peers: the cpu backend cannot share a {type(store).__name__}")
        handles = transport.exchange((store.path, store.nbytes), label="cpu.map_peers.handles")
        if not handles.ok:
            raise BackendError(f"map_peers: a rank has no store to share: {dict(handles.errors)}")
        views: list[PeerView | None] = []
        error: str | None = None
        try:
            for peer, (path, nbytes) in enumerate(handles.payloads):
                views.append(None if peer == self.rank else ShmPeerView(peer, path, nbytes))
        except Exception as exc:  # every rank must reach the second exchange
            error = str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"
        mapped = transport.exchange(None, label="cpu.map_peers.mapped", error=error)
        if not mapped.ok:
            for view in views:
                if view is not None:
                    view.close()
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(mapped.errors.items()))
            raise BackendError(f"map_peers failed on rank(s) {list(mapped.failed_ranks)}: {detail}")
        store.unlink()  # every peer holds its mapping: the name has done its job
        return views

    def new_stream(self, name: str) -> CpuStream:
        return CpuStream(name)

    def current_stream(self) -> CpuStream:
        return self._compute

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def launch_copies(
        self, plan: CopyPlan, stream: Stream, *, mode: CopyMode, gather: Any = None
    ) -> None:
        """Run every copy of ``plan`` now (local rows first), in ``per_slice`` or ``batched``
        mode (identical on CPU). ``gather`` needs a CUDA kernel: ``BackendError``."""
        if mode not in (CopyMode.PER_SLICE, CopyMode.BATCHED):
            raise BackendError(f"launch_copies: copy mode {mode!s} is not available on the "
                               "cpu backend (use per_slice or batched)")
        for d in (*plan.local, *plan.remote):
            dst = d.dst.tensor()[d.dst_offset : d.dst_offset + d.nbytes]
            dst.copy_(d.src.tensor()[d.src_offset : d.src_offset + d.nbytes])

    def free_bytes(self) -> int:
        """The smaller of the container's host memory budget (``host_memory.host_budget``:
        its cgroup's limit, not the node's free pages) and the free space of ``shm_dir``."""
        stat = os.statvfs(self.shm_dir)
        shm_free = stat.f_bavail * stat.f_frsize
        try:
            available = host_budget().available
        except OSError:
            available = shm_free
        return min(shm_free, available)
