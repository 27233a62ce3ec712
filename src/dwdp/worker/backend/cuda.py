"""The CUDA backend: VMM stores shared by POSIX fd or FABRIC handle, torch streams and
events, and the three copy modes (docs/design.md §6.2 and §6.6).

- Stores: ``cuMemCreate`` at the recommended granularity, mapped read-write here;
  ``map_peers`` exports them (a POSIX fd handed to each same-host peer over an abstract
  Unix socket with SCM_RIGHTS, or the 64-byte FABRIC handle through the group
  transport), imports every peer's, and maps it read-only where the driver allows.
  Every driver object is counted (``live_handles``) and released exactly once.
- Streams and events are ``torch.cuda.Stream`` / ``torch.cuda.Event``; a copy stream per
  manager comes from ``new_stream``.
- Copies: ``per_slice`` (one ``cuMemcpyAsync`` per descriptor), ``batched`` (one
  ``cuMemcpyBatchAsync`` per plan, CUDA 13 binding form: CUdeviceptr lists, no
  failIdx) and ``gather`` (one gather-kernel launch per plan, ``dwdp.kernels``).
  ``plan.local`` never rides the copy engines: it is copied by the gather kernel.
  ``contention_opt`` (batched) interleaves the peers in sub-slices (``interleave_peers``).

Invariant: between setup and teardown nothing here blocks the host on the device.
Per-plan state (gather tables, pointer lists) is built once, by ``prepare`` at setup or
at a plan's first launch; a table upload is an asynchronous copy from pinned memory,
ordered before its first gather by an event.

The group transport is duck-typed: ``rank``, ``world_size`` and either
``allgather_object(obj) -> list`` or ``allgather(obj, label=...) -> list`` (one entry per
rank, in rank order; ``dwdp.worker.transport.GroupTransport`` has the latter).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from cuda.bindings import driver

from dwdp.api.enums import CopyMode, GatherKernel, HandleType
from dwdp.kernels.loader import GatherModule, KernelError, load_gather
from dwdp.kernels.table import pack_table
from dwdp.worker.backend import cuda_vmm
from dwdp.worker.backend.base import (
    Backend,
    BackendError,
    Buffer,
    CopyPlan,
    Event,
    GatherHandle,
    PeerView,
    Store,
    Stream,
)
from dwdp.worker.backend.cuda_plan import (
    DEFAULT_SUB_SLICE_BYTES,
    FabricNotPermittedError,
    SmReserveError,
    check_sm_reserve,
    fabric_refused_message,
    gather_entries,
    interleave_peers,
)
from dwdp.worker.backend.cuda_vmm import LEDGER, CudaCallError, check, live_handles
from dwdp.worker.settings import CopySettings

__all__ = [
    "CudaBackend",
    "CudaBuffer",
    "CudaEvent",
    "CudaPeerView",
    "CudaStore",
    "CudaStream",
    "GatherLaunch",
    "host_check",
    "live_handles",
]

class _DeviceArray:
    """A device byte range as ``__cuda_array_interface__`` (v3), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _wrap(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` over device memory at ``ptr`` (no copy, not owned)."""
    return torch.as_tensor(_DeviceArray(ptr, nbytes), device=torch.device("cuda", device))


class CudaBuffer(Buffer):
    """Private device memory (prefetch slots) from torch's caching allocator."""

    def __init__(self, nbytes: int, *, device: int, tag: str) -> None:
        self.nbytes = nbytes
        self.tag = tag
        self._t: torch.Tensor | None = torch.empty(
            nbytes, dtype=torch.uint8, device=torch.device("cuda", device)
        )

    @property
    def device_ptr(self) -> int:
        """Device address of byte 0."""
        return self.tensor().data_ptr()

    def tensor(self) -> torch.Tensor:
        if self._t is None:
            raise BackendError(f"buffer {self.tag!r} is closed")
        return self._t

    def close(self) -> None:
        self._t = None


class _RegionBuffer:
    """Shared part of stores and peer views: one VMM region and its tensor."""

    _region: cuda_vmm.Region | None
    _tensor: torch.Tensor | None
    tag: str
    nbytes: int

    @property
    def device_ptr(self) -> int:
        """Device address of byte 0."""
        if self._region is None:
            raise BackendError(f"{self.tag!r} is closed")
        return self._region.ptr

    def tensor(self) -> torch.Tensor:
        """The whole region as a 1-D ``torch.uint8`` tensor (``nbytes`` elements)."""
        if self._region is None:
            raise BackendError(f"{self.tag!r} is closed")
        if self._tensor is None:
            self._tensor = _wrap(self._region.ptr, self.nbytes, self._region.device)
        return self._tensor

    def close(self) -> None:
        """Release the region's mapping, reservation and handle (once)."""
        region, self._region = self._region, None
        self._tensor = None
        if region is not None:
            region.release()


class CudaStore(_RegionBuffer, Store):
    """This rank's store: a cuMemCreate allocation of ``nbytes`` (granularity-rounded)."""

    def __init__(self, region: cuda_vmm.Region, *, tag: str, handle_type: HandleType) -> None:
        self._region = region
        self._tensor: torch.Tensor | None = None
        self.nbytes = region.size
        self.tag = tag
        self.handle_type = handle_type


class CudaPeerView(_RegionBuffer, PeerView):
    """Peer ``rank``'s store imported and mapped here (read-only where the driver allows;
    ``read_only`` says)."""

    def __init__(self, region: cuda_vmm.Region, *, rank: int, tag: str) -> None:
        self._region = region
        self._tensor: torch.Tensor | None = None
        self.nbytes = region.size
        self.rank = rank
        self.tag = tag
        self.read_only = region.read_only


class CudaStream(Stream):
    """A ``torch.cuda.Stream`` with the name of the overlap it enables."""

    def __init__(self, stream: torch.cuda.Stream, name: str) -> None:
        self.torch = stream
        self.name = name
        self.handle = int(stream.cuda_stream)
        self._cu = driver.CUstream(self.handle)

    def wait_event(self, event: Event) -> None:
        self.torch.wait_event(_torch_event(event))

    def synchronize(self) -> None:
        self.torch.synchronize()


class CudaEvent(Event):
    """A ``torch.cuda.Event`` (no timing)."""

    def __init__(self) -> None:
        self.torch = torch.cuda.Event()

    def record(self, stream: Stream) -> None:
        self.torch.record(_torch_stream(stream))

    def query(self) -> bool:
        return bool(self.torch.query())

    def synchronize(self) -> None:
        self.torch.synchronize()


def _torch_stream(stream: Stream) -> torch.cuda.Stream:
    if not isinstance(stream, CudaStream):
        raise BackendError(f"not a cuda stream: {stream!r}")
    return stream.torch


def _torch_event(event: Event) -> torch.cuda.Event:
    if not isinstance(event, CudaEvent):
        raise BackendError(f"not a cuda event: {event!r}")
    return event.torch


@dataclass(frozen=True, slots=True)
class GatherLaunch:
    """A resolved gather: the loaded kernel variant, its resident blocks (the persistent
    grid) and the SM reserve they make: ``ceil(blocks / blocks_per_sm)``, the SMs the gather
    holds while it runs (``blocks_per_sm``: the kernel's occupancy on this device).

    A manager gets one from ``CudaBackend.resolve_gather`` once and passes it to every
    ``launch_copies``.
    """

    kernel: GatherKernel
    module: GatherModule
    blocks: int
    sm_reserve: int


class _Table:
    """One uploaded gather table (device int8 tensor) and when it is ready."""

    def __init__(self, descs, ptr_of, chunk_bytes: int, stream: CudaStream, device: int) -> None:
        spec = gather_entries(descs, ptr_of)
        packed = pack_table(spec.entries, chunk_bytes=chunk_bytes)
        self.rows = packed.rows
        self.total_chunks = packed.total_chunks
        self.dst_base = spec.dst_base
        self.nbytes = packed.nbytes
        self.upload_stream = stream.handle
        self.ready = torch.cuda.Event()
        if packed.rows == 0:
            self.device = None
            return
        # Pinned host bytes kept alive with the table: the upload is asynchronous.
        self._host = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).pin_memory()
        with torch.cuda.stream(stream.torch):  # the table's memory belongs to this stream
            self.device = torch.empty(len(packed.data), dtype=torch.uint8, device=device)
            self.device.copy_(self._host, non_blocking=True)
        self.ready.record(stream.torch)
        self._users = {stream.handle}

    def launch(self, gather: GatherLaunch, stream: CudaStream) -> None:
        if self.device is None:
            return
        if stream.handle != self.upload_stream:
            stream.torch.wait_event(self.ready)  # read-after-write on the table
            if stream.handle not in self._users:  # keep it from reuse while this reads it
                self.device.record_stream(stream.torch)
                self._users.add(stream.handle)
        gather.module.launch(
            table_ptr=self.device.data_ptr(),
            rows=self.rows,
            total_chunks=self.total_chunks,
            dst_base=self.dst_base,
            blocks=gather.blocks,
            stream=stream.handle,
        )


class _Prepared:
    """Everything a plan's launches need, built once per (plan, mode, gather)."""

    def __init__(self, plan: CopyPlan) -> None:
        self.plan = plan  # kept alive so its id is not reused
        self.local: _Table | None = None
        self.remote: _Table | None = None
        self.batch: tuple | None = None
        self.slices: list[tuple[driver.CUdeviceptr, driver.CUdeviceptr, int]] = []


def _ptr_of(buffer: Buffer) -> int:
    ptr = getattr(buffer, "device_ptr", None)
    return int(ptr) if ptr is not None else int(buffer.tensor().data_ptr())


class CudaBackend(Backend):
    """The CUDA backend of one rank on CUDA device ``device``.

    ``handle_type``: how stores are shared (``posixFd`` or ``fabric``); ``settings``: the
    effective copy settings (``dwdp.worker.settings``): the default gather kernel and its
    resident blocks (``resolve_gather``), and ``contention_opt`` (batched copies interleave
    peers in ``sub_slice_bytes`` pieces);
    ``exchange_timeout_s``: how long ``map_peers`` waits for a peer's fd (seconds).
    Raises ``BackendError`` when CUDA is unavailable.
    """

    name = "cuda"

    def __init__(
        self,
        *,
        device: int | None = None,
        handle_type: HandleType = HandleType.POSIX_FD,
        settings: CopySettings | None = None,
        sub_slice_bytes: int = DEFAULT_SUB_SLICE_BYTES,
        exchange_timeout_s: float = 120.0,
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendError("the cuda backend needs a CUDA device; torch sees none")
        if handle_type not in cuda_vmm.HANDLE_TYPES:
            raise BackendError(
                f"the cuda backend shares stores as posixFd or fabric, not {handle_type}"
            )
        self.device = torch.cuda.current_device() if device is None else device
        self.handle_type = HandleType(handle_type)
        self.settings = settings if settings is not None else CopySettings()
        self.contention_opt = self.settings.contention_opt
        self.sub_slice_bytes = sub_slice_bytes
        self.exchange_timeout_s = exchange_timeout_s
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # the runtime makes the primary context
        check(driver.cuInit(0), "cuInit")
        self._cu_device = check(driver.cuDeviceGet(self.device), "cuDeviceGet")
        self._ctx = check(
            driver.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._bind()
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._modules: dict[str, GatherModule] = {}
        self._prepared: dict[tuple, _Prepared] = {}
        self._buffers: list[Buffer] = []
        self._closed = False
        self._default_gather: GatherLaunch | None = None
        self._memcpy_attr = self._batch_attributes()

    # -- context -------------------------------------------------------------------------
    def _bind(self) -> None:
        """Make this device's primary context current on the calling thread."""
        check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    # -- memory --------------------------------------------------------------------------
    def allocate_store(self, nbytes: int, *, tag: str) -> CudaStore:
        self._bind()
        try:
            region = cuda_vmm.create_region(
                nbytes, device=self.device, handle_type=self.handle_type
            )
        except CudaCallError as e:
            if self.handle_type is HandleType.FABRIC and e.code == "CUDA_ERROR_NOT_PERMITTED":
                raise FabricNotPermittedError(fabric_refused_message(self.device, str(e))) from e
            raise BackendError(f"store {tag!r} of {nbytes} bytes: {e}") from e
        store = CudaStore(region, tag=tag, handle_type=self.handle_type)
        self._buffers.append(store)
        return store

    def allocate(self, nbytes: int, *, tag: str) -> CudaBuffer:
        try:
            buf = CudaBuffer(nbytes, device=self.device, tag=tag)
        except torch.OutOfMemoryError as e:
            raise BackendError(f"buffer {tag!r} of {nbytes} bytes: {e}") from e
        self._buffers.append(buf)
        return buf

    def free_bytes(self) -> int:
        """Free device memory in bytes as the driver reports it (cuMemGetInfo)."""
        self._bind()
        free, _total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def granularity(self) -> int:
        """The recommended VMM granularity in bytes (stores are multiples of it)."""
        self._bind()
        return cuda_vmm.granularity(self.device, self.handle_type)

    # -- peers ---------------------------------------------------------------------------
    def map_peers(self, store: Store, transport: Any) -> list[PeerView | None]:
        """Collective over ``transport``: every rank exports its store, imports and maps
        every peer's. Two allgathers (handles, then a status) so a failure on any rank
        raises ``BackendError`` on every rank, with every view this rank mapped closed."""
        if not isinstance(store, CudaStore) or store._region is None:
            raise BackendError("map_peers needs an open CudaStore of this backend")
        self._bind()
        rank, world = int(transport.rank), int(transport.world_size)
        host = socket.gethostname()
        error: str | None = None
        fd: int | None = None
        server: cuda_vmm.FdServer | None = None
        handle: object = None
        try:
            shareable = cuda_vmm.export_handle(store._region, self.handle_type)
            if self.handle_type is HandleType.POSIX_FD:
                fd = int(shareable)
                handle = f"dwdp-vmm-{uuid.uuid4().hex}-r{rank}"
                server = cuda_vmm.FdServer(handle, fd, backlog=world)
            else:
                handle = shareable
        except BackendError as e:
            error = f"export: {e}"
        mine = {"rank": rank, "host": host, "size": store.nbytes, "handle": handle, "error": error}
        views: list[PeerView | None] = [None] * world
        try:
            infos = _allgather(transport, mine, label="cuda-map-peers/handles")
            failed = [f"rank {i['rank']}: {i['error']}" for i in infos if i["error"]]
            if not failed:
                try:
                    for info in infos:
                        if info["rank"] != rank:
                            views[info["rank"]] = self._map_peer(info, host)
                except Exception as e:
                    error = f"map: {type(e).__name__}: {e}"
            statuses = _allgather(transport, error, label="cuda-map-peers/status")
            failed += [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
            if failed:
                raise BackendError("map_peers failed; " + "; ".join(failed))
        except BaseException:
            for v in views:
                if v is not None:
                    v.close()
            raise
        finally:
            if server is not None:
                server.close()
            if fd is not None:
                cuda_vmm.close_exported_fd(fd)
        self._buffers.extend(v for v in views if v is not None)
        return views

    def _map_peer(self, info: dict, host: str) -> CudaPeerView:
        peer = info["rank"]
        if self.handle_type is HandleType.POSIX_FD:
            if info["host"] != host:
                raise BackendError(
                    f"rank {peer} is on host {info['host']}, this rank on {host}: posixFd "
                    f"handles work on one host only; use handleType: fabric"
                )
            fd = cuda_vmm.receive_fd(info["handle"], timeout_s=self.exchange_timeout_s)
            try:
                region = cuda_vmm.import_region(
                    fd, size=info["size"], device=self.device, handle_type=self.handle_type
                )
            finally:
                os.close(fd)
        else:
            region = cuda_vmm.import_region(
                info["handle"], size=info["size"], device=self.device, handle_type=self.handle_type
            )
        return CudaPeerView(region, rank=peer, tag=f"peer{peer}")

    # -- streams and events --------------------------------------------------------------
    def new_stream(self, name: str) -> CudaStream:
        return CudaStream(torch.cuda.Stream(device=self.device), name)

    def current_stream(self) -> CudaStream:
        return CudaStream(torch.cuda.current_stream(self.device), "compute")

    def new_event(self) -> CudaEvent:
        return CudaEvent()

    # -- gather kernels ------------------------------------------------------------------
    def resolve_gather(
        self, kernel: GatherKernel | None = None, blocks: int | None = None
    ) -> GatherLaunch:
        """Load (once per backend and variant) the ``kernel`` gather with a grid of
        ``blocks`` resident blocks and check the SM reserve they make (at least 1 SM and
        below the device's SM count). Defaults: the settings' kernel (else register) and
        blocks. Raises ``SmReserveError`` or ``BackendError`` (e.g. an NVRTC failure)."""
        kernel = kernel or self.settings.gather_kernel or GatherKernel.REGISTER
        blocks = self.settings.gather_blocks if blocks is None else blocks
        if blocks < 1:
            raise SmReserveError(f"gather grid of {blocks} blocks: at least 1 block is needed")
        self._bind()
        if kernel.value not in self._modules:
            try:
                self._modules[kernel.value] = load_gather(kernel.value, device=self.device)
            except KernelError as e:
                raise BackendError(f"gather kernel {kernel.value}: {e}") from e
        module = self._modules[kernel.value]
        per_sm = module.max_blocks_per_sm()
        if per_sm < 1:
            raise BackendError(f"gather kernel {kernel.value} cannot be resident on an SM")
        reserve = check_sm_reserve(-(-blocks // per_sm), self.sm_count)
        return GatherLaunch(kernel, module, blocks, reserve)

    def _default(self) -> GatherLaunch:
        if self._default_gather is None:
            self._default_gather = self.resolve_gather()
        return self._default_gather

    # -- copies --------------------------------------------------------------------------
    def _batch_attributes(self) -> driver.CUmemcpyAttributes:
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        for loc in (attr.srcLocHint, attr.dstLocHint):
            loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            loc.id = self.device
        attr.flags = 0
        return attr

    def prepare(
        self,
        plan: CopyPlan,
        *,
        mode: CopyMode,
        stream: Stream,
        gather: GatherHandle | None = None,
    ) -> None:
        """Build a plan's per-launch state once (setup, P3): gather tables uploaded on
        ``stream`` (asynchronously), CUdeviceptr lists. ``launch_copies`` calls it on a
        plan's first launch if setup did not."""
        self._prepare(plan, mode, _as_cuda(stream), _as_gather(gather))

    def _prepare(
        self, plan: CopyPlan, mode: CopyMode, stream: CudaStream, gather: GatherLaunch | None
    ) -> tuple[_Prepared, GatherLaunch | None]:
        local_gather = gather or (self._default() if plan.local else None)
        key = (id(plan), mode, None if gather is None else (gather.kernel, gather.blocks))
        prep = self._prepared.get(key)
        if prep is not None:
            return prep, local_gather
        self._bind()
        prep = _Prepared(plan)
        chunk = lambda g: g.module.config.chunk_bytes  # noqa: E731
        if plan.local:
            prep.local = _Table(plan.local, _ptr_of, chunk(local_gather), stream, self.device)
        remote = plan.remote
        if mode is CopyMode.GATHER:
            g = gather or self._default()
            local_gather = g
            descs = remote + plan.local  # one launch per plan: local rows ride along
            prep.local = None
            prep.remote = _Table(descs, _ptr_of, chunk(g), stream, self.device)
        else:
            if mode is CopyMode.BATCHED and self.contention_opt:
                remote = interleave_peers(CopyPlan(remote=remote), self.sub_slice_bytes).remote
            gather_entries(remote, _ptr_of)  # bounds check once
            triples = [
                (
                    driver.CUdeviceptr(_ptr_of(d.dst) + d.dst_offset),
                    driver.CUdeviceptr(_ptr_of(d.src) + d.src_offset),
                    d.nbytes,
                )
                for d in remote
                if d.nbytes
            ]
            if mode is CopyMode.BATCHED and triples:
                dsts, srcs, sizes = (list(x) for x in zip(*triples, strict=True))
                prep.batch = (dsts, srcs, sizes, len(sizes))
            else:
                prep.slices = triples
        self._prepared[key] = prep
        return prep, local_gather

    def launch_copies(
        self,
        plan: CopyPlan,
        stream: Stream,
        *,
        mode: CopyMode,
        gather: GatherHandle | None = None,
    ) -> None:
        """Enqueue ``plan`` on ``stream`` in ``mode`` without waiting.

        ``gather``: the manager's resolved kernel (``resolve_gather``), used for the whole
        plan in ``gather`` mode and for ``plan.local`` in the other modes; the backend's
        default when None. Raises ``BackendError`` (a refused launch or copy)."""
        cs = _as_cuda(stream)
        prep, local_gather = self._prepare(plan, mode, cs, _as_gather(gather))
        self._bind()
        try:
            if mode is CopyMode.GATHER:
                assert prep.remote is not None and local_gather is not None
                prep.remote.launch(local_gather, cs)
                return
            if prep.local is not None and local_gather is not None:
                prep.local.launch(local_gather, cs)
            if prep.batch is not None:
                if cs.handle in (0, 1):  # NULL / CU_STREAM_LEGACY
                    raise BackendError(
                        "batched copies need a created stream (new_stream): "
                        "cuMemcpyBatchAsync refuses the legacy NULL stream"
                    )
                dsts, srcs, sizes, count = prep.batch
                check(
                    driver.cuMemcpyBatchAsync(
                        dsts, srcs, sizes, count, [self._memcpy_attr], [0], 1, cs._cu
                    ),
                    "cuMemcpyBatchAsync",
                )
            for dst, src, n in prep.slices:
                check(driver.cuMemcpyAsync(dst, src, n, cs._cu), "cuMemcpyAsync")
        except KernelError as e:
            raise BackendError(str(e)) from e

    def reserve_sms(self, sms: int) -> int:
        """Backend.reserve_sms through torch's SM carveout (cuBLAS' SM count target and the
        grouped GEMM's ``hw_info.sm_count``: both read it at each launch). Raises
        ``SmReserveError`` for a reserve outside ``[0, SMs - 1]``."""
        if sms:
            check_sm_reserve(sms, self.sm_count)
        previous = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(sms or None)
        return int(previous or 0)

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Close every store, view and buffer of this backend, unload the kernels and
        release the primary context (teardown: after the device finished the copies)."""
        if self._closed:
            return
        self._closed = True
        self._prepared.clear()
        errors = []
        for buf in reversed(self._buffers):
            try:
                buf.close()
            except BackendError as e:
                errors.append(str(e))
        self._buffers.clear()
        for module in self._modules.values():
            module.close()
        self._modules.clear()
        self._default_gather = None
        driver.cuDevicePrimaryCtxRelease(self._cu_device)
        if errors:
            raise BackendError("close: " + "; ".join(errors))

    def live_handles(self) -> dict[str, int]:
        """Live driver objects of this process by kind (see ``cuda_vmm.LEDGER``)."""
        return LEDGER.snapshot()


def _allgather(transport: Any, obj: object, *, label: str) -> list:
    """Allgather ``obj`` over a group transport: ``allgather_object(obj)`` where the
    transport has it, else ``allgather(obj, label=...)`` (``dwdp.worker.transport``)."""
    if hasattr(transport, "allgather_object"):
        return list(transport.allgather_object(obj))
    return list(transport.allgather(obj, label=label))


def _as_gather(gather: GatherHandle | None) -> GatherLaunch | None:
    if gather is not None and not isinstance(gather, GatherLaunch):
        raise BackendError(f"not a cuda gather (resolve_gather): {gather!r}")
    return gather


def _as_cuda(stream: Stream) -> CudaStream:
    if not isinstance(stream, CudaStream):
        raise BackendError(f"not a cuda stream: {stream!r}")
    return stream


def host_check(handle_type: HandleType, *, device: int = 0) -> dict[str, object]:
    """The host check run before the model loads: VMM support, the handle type's support
    and a trial allocation (one granule, exported then released).

    Returns facts for the log (``sms``, ``granularity``, ``free_bytes``). Raises
    ``FabricNotPermittedError`` when the driver refuses a FABRIC allocation (no IMEX
    channel; the message names handleType and the ComputeDomain remedy), else
    ``BackendError`` naming what is missing.
    """
    handle_type = HandleType(handle_type)
    if handle_type not in cuda_vmm.HANDLE_TYPES:
        raise BackendError(
            f"the cuda backend shares stores as posixFd or fabric, not {handle_type}"
        )
    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        a = driver.CUdevice_attribute
        attr = lambda x: int(check(driver.cuDeviceGetAttribute(x, dev), str(x)))  # noqa: E731
        if not attr(a.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
            raise BackendError(f"cuda:{device} does not support CUDA VMM (cuMemCreate)")
        supported = {
            HandleType.POSIX_FD: a.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            HandleType.FABRIC: a.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
        }[handle_type]
        if not attr(supported):
            raise BackendError(
                f"handleType: {handle_type.value} is not supported by cuda:{device} (driver "
                f"attribute {supported.name} is 0)"
            )
        try:
            region = cuda_vmm.create_region(1, device=device, handle_type=handle_type)
        except CudaCallError as e:
            if handle_type is HandleType.FABRIC and e.code == "CUDA_ERROR_NOT_PERMITTED":
                raise FabricNotPermittedError(fabric_refused_message(device, str(e))) from e
            raise BackendError(f"trial {handle_type.value} allocation on cuda:{device}: {e}") from e
        try:
            shareable = cuda_vmm.export_handle(region, handle_type)
            if handle_type is HandleType.POSIX_FD:
                cuda_vmm.close_exported_fd(int(shareable))
        finally:
            region.release()
        free, _ = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return {
            "device": device,
            "handle_type": handle_type.value,
            "sms": attr(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "granularity": region.size,
            "free_bytes": int(free),
        }
    finally:
        driver.cuDevicePrimaryCtxRelease(dev)
