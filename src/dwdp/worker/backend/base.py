"""The device backend interface of the DWDP runtime (docs/design.md §6.2).

A backend gives the runtime four things and nothing else: shareable *stores* (a rank's
slice of the weights, readable by every peer of the DWDP group), *peer views* (a peer's
store mapped read-only into this rank), *streams* and *events* (ordering of device work
without host synchronization), and *copies* described by copy plans. The runtime never
touches a device API directly, so the same schedule and setup code runs on CUDA, on host
shared memory (CI) and on a recording fake (protocol tests).

Invariant: between DWDP setup and teardown, no backend call made by the runtime blocks the
host on device work; only ``Event.synchronize`` and ``Stream.synchronize`` do, and the
runtime calls them only during setup and teardown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dwdp.api.enums import CopyMode, GatherKernel, HandleType

if TYPE_CHECKING:  # the interface itself needs no torch
    import torch

    from dwdp.worker.transport.base import GroupTransport


class BackendError(RuntimeError):
    """A backend operation failed; the message names the operation and the cause."""


@dataclass(frozen=True, slots=True)
class CopyDescriptor:
    """One contiguous copy of ``nbytes`` bytes.

    ``src`` and ``dst`` are byte buffers of the backend (a ``Store``, a ``PeerView`` or a
    buffer from ``Backend.allocate``); offsets and sizes are in bytes.
    """

    src: Buffer
    src_offset: int
    dst: Buffer
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Every copy that fills one prefetch slot for one layer, built once at setup (P3).

    ``local`` holds the descriptors whose source is this rank's own store (they never ride
    the copy engines on CUDA); ``remote`` those whose source is a peer view.
    """

    remote: tuple[CopyDescriptor, ...]
    local: tuple[CopyDescriptor, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves (remote and local)."""
        return sum(d.nbytes for d in self.remote) + sum(d.nbytes for d in self.local)


class Buffer(ABC):
    """A byte buffer of the backend's device: a store, a peer view or a plain allocation."""

    nbytes: int

    @abstractmethod
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a 1-D ``torch.uint8`` tensor of ``nbytes`` elements.

        Raises ``BackendError`` where the backend has no tensors (the recording fake).
        """

    @abstractmethod
    def close(self) -> None:
        """Release the buffer; safe to call twice. Views of it must not be used after."""


class Store(Buffer):
    """This rank's shareable memory: its slice of the DWDP weights (expert or row store)."""


class PeerView(Buffer):
    """A peer's store mapped read-only into this rank's address space."""

    rank: int


class Stream(ABC):
    """An ordered queue of device work. Work enqueued on one stream runs in order."""

    name: str

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host wait)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until this stream's work is done (setup and teardown only)."""


class Event(ABC):
    """A point in a stream's work that other streams can wait on."""

    @abstractmethod
    def record(self, stream: Stream) -> None:
        """Capture the current end of ``stream``'s work; re-recording moves the event."""

    @abstractmethod
    def query(self) -> bool:
        """True when the captured work is complete (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the captured work is done (setup and teardown only)."""


class GatherHandle(Protocol):
    """A gather kernel resolved once for one manager (``Backend.resolve_gather``)."""

    @property
    def sm_reserve(self) -> int:
        """SMs the gather holds while it runs (its resident blocks over the blocks one SM
        can hold)."""
        ...


class Backend(ABC):
    """A device backend: stores, peer views, streams, events and copies of one rank."""

    name: str
    handle_type: HandleType

    @abstractmethod
    def allocate_store(self, nbytes: int, *, tag: str) -> Store:
        """Allocate a shareable store of at least ``nbytes`` bytes (rounded up to the
        backend's granularity). ``tag`` names it in errors and, where the backend has
        names (shared-memory files), in the name. Raises ``BackendError``."""

    @abstractmethod
    def allocate(self, nbytes: int, *, tag: str) -> Buffer:
        """Allocate private device memory (prefetch slots). Raises ``BackendError``."""

    @abstractmethod
    def map_peers(self, store: Store, transport: GroupTransport) -> list[PeerView | None]:
        """Exchange store handles over the group ``transport`` (a collective: every rank
        calls it) and map every peer's store read-only. Returns one entry per rank; the
        entry of this rank is ``None``. Raises ``BackendError``; views mapped before a
        failure are closed before it raises."""

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A new stream; ``name`` says which overlap it enables (e.g. ``"expert-copy"``)."""

    @abstractmethod
    def current_stream(self) -> Stream:
        """The compute stream the model runs on."""

    @abstractmethod
    def new_event(self) -> Event:
        """A new, never-recorded event (``query()`` is True)."""

    def resolve_gather(
        self, kernel: GatherKernel | None = None, blocks: int | None = None
    ) -> GatherHandle | None:
        """Resolve the gather kernel once per manager (docs/design.md §6.6) from the copy
        settings (``kernel``: ``None`` for the default variant; ``blocks``: resident blocks
        of its grid); the result is passed to every ``launch_copies`` of that manager as
        ``gather``. Backends without a gather kernel return ``None``."""
        return None

    def prepare(  # noqa: B027 - optional hook
        self,
        plan: CopyPlan,
        *,
        mode: CopyMode,
        stream: Stream,
        gather: GatherHandle | None = None,
    ) -> None:
        """Set up per-plan device state (e.g. the gather kernel's descriptor table) at
        setup time (P3), so that ``launch_copies`` does no allocation while serving."""

    @abstractmethod
    def launch_copies(
        self,
        plan: CopyPlan,
        stream: Stream,
        *,
        mode: CopyMode,
        gather: GatherHandle | None = None,
    ) -> None:
        """Enqueue every copy of ``plan`` on ``stream`` in ``mode``; returns without
        waiting. ``gather`` is the value of ``resolve_gather`` for ``mode`` gather. Raises
        ``BackendError`` if the mode is not available on this backend.

        The peer views a plan reads must stay mapped until every rank passed a barrier
        after its last read (teardown), since a peer unmapping early would fault readers.
        """

    def reserve_sms(self, sms: int) -> int:
        """Size the model's persistent GEMM grids (cuBLAS, the grouped GEMMs) to leave
        ``sms`` SMs to a concurrent gather kernel (0: all SMs to the GEMMs); returns the
        previous reserve, for the teardown to restore. The seed's ``set_sm_reserve``: a
        persistent grid wider than the free SMs makes its last blocks wait behind the whole
        first wave. Backends without a gather kernel keep no reserve and return 0."""
        return 0

    def free_bytes(self) -> int:
        """Free device memory in bytes, for the setup's fit checks (P1)."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend-wide resources (streams, kernel caches)."""


def total_bytes(descriptors: Sequence[CopyDescriptor]) -> int:
    """Sum of ``nbytes`` over ``descriptors``."""
    return sum(d.nbytes for d in descriptors)
