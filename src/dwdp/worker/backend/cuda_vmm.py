"""CUDA VMM regions of the CUDA backend: create, export, import, map, release (docs/design.md §6.2).

A *region* is one physical allocation mapped at one virtual range of this process: this
rank's store (``create_region``, cuMemCreate) or a peer's store (``import_region``,
cuMemImportFromShareableHandle). Each driver object it holds -- the allocation handle,
the address reservation, the mapping -- is counted in ``LEDGER`` when made and uncounted
when released, and released exactly once (``Region.release`` is idempotent; a creation
that fails half way releases what it made before raising). Tests compare
``live_handles()`` before and after.

Invariant: every function here that fails raises ``BackendError`` and leaves the ledger
as it found it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

from cuda.bindings import driver

from dwdp.api.enums import HandleType
from dwdp.worker.backend.base import BackendError

_T = driver.CUmemAllocationHandleType
HANDLE_TYPES = {
    HandleType.POSIX_FD: _T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    HandleType.FABRIC: _T.CU_MEM_HANDLE_TYPE_FABRIC,
}
"""The driver's handle type of each ``HandleType`` the CUDA backend supports."""


class CudaCallError(BackendError):
    """A CUDA driver call failed; ``code`` is the driver's error name."""

    def __init__(self, what: str, code: str) -> None:
        super().__init__(f"{what} failed: {code}")
        self.code = code


def check(result, what: str):
    """Unwrap a cuda-python ``(CUresult, *values)`` result; raise ``CudaCallError``."""
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaCallError(what, name.decode() if name else str(err))
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class HandleLedger:
    """Live driver objects of this process by kind (allocation, import, reservation,
    mapping, exported_fd); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self._live[kind] += 1

    def remove(self, kind: str) -> None:
        with self._lock:
            if self._live[kind] <= 0:
                raise AssertionError(f"released a {kind} that was not live")
            self._live[kind] -= 1

    def snapshot(self) -> dict[str, int]:
        """Live count per kind (kinds with zero omitted)."""
        with self._lock:
            return {k: v for k, v in self._live.items() if v}

    def total(self) -> int:
        """All live driver objects."""
        with self._lock:
            return sum(self._live.values())


LEDGER = HandleLedger()


def live_handles() -> int:
    """Driver objects (allocations, imports, reservations, mappings, exported fds) made by
    the CUDA backend in this process and not yet released."""
    return LEDGER.total()


def allocation_prop(device: int, handle_type: HandleType) -> driver.CUmemAllocationProp:
    """Pinned device memory on ``device``, shareable as ``handle_type``."""
    if handle_type not in HANDLE_TYPES:
        raise BackendError(f"the cuda backend cannot share memory as {handle_type!r}")
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = HANDLE_TYPES[handle_type]
    return prop


def granularity(device: int, handle_type: HandleType) -> int:
    """The recommended VMM granularity in bytes (2 MiB on H200)."""
    return int(
        check(
            driver.cuMemGetAllocationGranularity(
                allocation_prop(device, handle_type),
                driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            ),
            "cuMemGetAllocationGranularity",
        )
    )


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass
class Region:
    """One physical allocation mapped at ``[ptr, ptr + size)`` of this process.

    ``kind`` is ``"allocation"`` (made here) or ``"import"`` (a peer's). ``read_only``
    says whether the mapping was granted read access only.
    """

    device: int
    size: int
    kind: str
    handle: object | None = None
    ptr: int = 0
    mapped: bool = False
    read_only: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def release(self) -> None:
        """Unmap, free the address range and release the handle, each once. Errors are
        collected and raised together after every step was tried."""
        with self._lock:
            errors = []
            if self.mapped:
                self.mapped = False
                LEDGER.remove("mapping")
                errors += _try(
                    driver.cuMemUnmap(driver.CUdeviceptr(self.ptr), self.size), "cuMemUnmap"
                )
            if self.ptr:
                ptr, self.ptr = self.ptr, 0
                LEDGER.remove("reservation")
                errors += _try(
                    driver.cuMemAddressFree(driver.CUdeviceptr(ptr), self.size), "cuMemAddressFree"
                )
            if self.handle is not None:
                handle, self.handle = self.handle, None
                LEDGER.remove(self.kind)
                errors += _try(driver.cuMemRelease(handle), "cuMemRelease")
            if errors:
                raise BackendError("; ".join(errors))


def _try(result, what: str) -> list[str]:
    try:
        check(result, what)
    except CudaCallError as e:
        return [str(e)]
    return []


def _map(region: Region, alignment: int, flags: driver.CUmemAccess_flags) -> None:
    """Reserve, map and set access for ``region.handle``; counted in the ledger."""
    ptr = check(
        driver.cuMemAddressReserve(region.size, alignment, driver.CUdeviceptr(0), 0),
        "cuMemAddressReserve",
    )
    region.ptr = int(ptr)
    LEDGER.add("reservation")
    check(driver.cuMemMap(ptr, region.size, 0, region.handle, 0), "cuMemMap")
    region.mapped = True
    LEDGER.add("mapping")
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = region.device
    desc.flags = flags
    check(driver.cuMemSetAccess(ptr, region.size, [desc], 1), "cuMemSetAccess")


def create_region(nbytes: int, *, device: int, handle_type: HandleType) -> Region:
    """cuMemCreate of ``nbytes`` rounded up to the recommended granularity, mapped
    read-write on ``device``. Raises ``CudaCallError`` (``code`` ``CUDA_ERROR_NOT_PERMITTED``
    for a FABRIC allocation without an IMEX channel)."""
    gran = granularity(device, handle_type)
    region = Region(device=device, size=round_up(max(nbytes, 1), gran), kind="allocation")
    try:
        region.handle = check(
            driver.cuMemCreate(region.size, allocation_prop(device, handle_type), 0), "cuMemCreate"
        )
        LEDGER.add("allocation")
        _map(region, gran, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    except BaseException:
        region.release()
        raise
    return region


def export_handle(region: Region, handle_type: HandleType) -> int | bytes:
    """This allocation as a shareable handle: a POSIX fd (an int the caller owns; close
    it with ``close_exported_fd``) or the 64 bytes of a FABRIC handle."""
    shareable = check(
        driver.cuMemExportToShareableHandle(region.handle, HANDLE_TYPES[handle_type], 0),
        "cuMemExportToShareableHandle",
    )
    if handle_type is HandleType.POSIX_FD:
        LEDGER.add("exported_fd")
        return int(shareable)
    return bytes(shareable.data)


def close_exported_fd(fd: int) -> None:
    """Close an fd from ``export_handle`` (once)."""
    LEDGER.remove("exported_fd")
    os.close(fd)


def import_region(
    shareable: int | bytes, *, size: int, device: int, handle_type: HandleType
) -> Region:
    """Import a peer's allocation of ``size`` bytes and map it on ``device``, read-only
    where the driver grants read-only access, else read-write (``Region.read_only`` says
    which). A POSIX fd stays the caller's to close. Raises ``CudaCallError``."""
    region = Region(device=device, size=size, kind="import")
    try:
        if handle_type is HandleType.POSIX_FD:
            os_handle: object = int(shareable)
        else:
            fabric = driver.CUmemFabricHandle()
            fabric.data = bytes(shareable)
            os_handle = fabric
        region.handle = check(
            driver.cuMemImportFromShareableHandle(os_handle, HANDLE_TYPES[handle_type]),
            "cuMemImportFromShareableHandle",
        )
        LEDGER.add("import")
        gran = granularity(device, handle_type)
        try:
            _map(region, gran, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
            region.read_only = True
        except CudaCallError:
            # Drivers that grant only read-write access to device mappings: map again.
            if region.mapped:
                region.mapped = False
                LEDGER.remove("mapping")
                check(driver.cuMemUnmap(driver.CUdeviceptr(region.ptr), size), "cuMemUnmap")
            if region.ptr:
                ptr, region.ptr = region.ptr, 0
                LEDGER.remove("reservation")
                check(driver.cuMemAddressFree(driver.CUdeviceptr(ptr), size), "cuMemAddressFree")
            _map(region, gran, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    except BaseException:
        region.release()
        raise
    return region


class FdServer:
    """Hands one exported POSIX fd to every same-host peer that connects (SCM_RIGHTS).

    Listens on the abstract Unix socket ``name`` (no file to clean up; one network
    namespace, i.e. one pod or host network) from construction; a daemon thread answers
    each connection with the fd until ``close``. The fd stays the caller's.
    """

    def __init__(self, name: str, fd: int, *, backlog: int) -> None:
        self.name = name
        self._fd = fd
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(max(backlog, 1))
        except OSError as e:
            self._sock.close()
            raise BackendError(f"cannot listen on unix socket @{name}: {e}") from e
        self._thread = threading.Thread(target=self._serve, name=f"dwdp-fd-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    socket.send_fds(conn, [b"F"], [self._fd])
                except OSError:
                    continue

    def close(self) -> None:
        """Stop serving (wakes the thread) and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=10.0)


def receive_fd(name: str, *, timeout_s: float) -> int:
    """Connect to the ``FdServer`` at ``name`` and return the fd it sends (the caller's
    to close). Raises ``BackendError`` on timeout or a refused connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect("\0" + name)
            msg, fds, _, _ = socket.recv_fds(s, 16, 1)
        except OSError as e:
            raise BackendError(f"no fd from unix socket @{name}: {e}") from e
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise BackendError(f"unix socket @{name} sent {msg!r} with {len(fds)} fds, expected one fd")
    return fds[0]
