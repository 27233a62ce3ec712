"""Pure helpers of the CUDA backend: plan transforms, gather tables, the SM reserve check.

Nothing here touches a device, so every rule is unit-tested on a CPU-only machine
(tests/unit/worker/test_cuda_plan.py). The CUDA backend (``cuda.py``) calls these with
real device pointers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dwdp.api.enums import HandleType
from dwdp.kernels.table import GatherEntry
from dwdp.worker.backend.base import BackendError, Buffer, CopyDescriptor, CopyPlan

DEFAULT_SUB_SLICE_BYTES = 1 << 20
"""contention_opt's sub-slice: 1 MiB of one peer before the next peer's turn."""


class SmReserveError(BackendError):
    """The SMs the gather holds (SM reserve) are not in ``[1, SMs - 1]``."""


class FabricNotPermittedError(BackendError):
    """The driver refused a FABRIC allocation: no IMEX channel is granted to this process."""


def peer_key(buffer: Buffer) -> object:
    """The peer a source buffer belongs to: its ``rank`` when it has one (a peer view),
    else the buffer itself (by identity)."""
    rank = getattr(buffer, "rank", None)
    return ("rank", rank) if rank is not None else ("buffer", id(buffer))


def split_descriptor(desc: CopyDescriptor, sub_slice_bytes: int) -> list[CopyDescriptor]:
    """``desc`` cut into consecutive pieces of at most ``sub_slice_bytes`` bytes."""
    if sub_slice_bytes <= 0:
        raise ValueError(f"sub_slice_bytes must be > 0, got {sub_slice_bytes}")
    return [
        CopyDescriptor(
            desc.src,
            desc.src_offset + off,
            desc.dst,
            desc.dst_offset + off,
            min(sub_slice_bytes, desc.nbytes - off),
        )
        for off in range(0, desc.nbytes, sub_slice_bytes)
    ]


def interleave_peers(plan: CopyPlan, sub_slice_bytes: int = DEFAULT_SUB_SLICE_BYTES) -> CopyPlan:
    """contention_opt: the same copies with the remote ones cut into ``sub_slice_bytes``
    pieces and ordered round-robin over the source peers (peer order of first appearance;
    within a peer, the original order), so every peer's link is read at once instead of
    one peer after another. ``plan.local`` is kept as is. Bytes moved are unchanged.
    """
    queues: dict[object, list[CopyDescriptor]] = {}
    for desc in plan.remote:
        queues.setdefault(peer_key(desc.src), []).extend(split_descriptor(desc, sub_slice_bytes))
    out: list[CopyDescriptor] = []
    lists = list(queues.values())
    for i in range(max((len(q) for q in lists), default=0)):
        out.extend(q[i] for q in lists if i < len(q))
    return CopyPlan(remote=tuple(out), local=plan.local)


def check_bounds(desc: CopyDescriptor, index: int) -> None:
    """Raise ``BackendError`` if ``desc`` reads or writes past its buffers."""
    if desc.nbytes < 0 or desc.src_offset < 0 or desc.dst_offset < 0:
        raise BackendError(f"descriptor {index}: negative offset or size ({desc})")
    if desc.src_offset + desc.nbytes > desc.src.nbytes:
        raise BackendError(
            f"descriptor {index}: reads [{desc.src_offset}, {desc.src_offset + desc.nbytes}) "
            f"of a {desc.src.nbytes}-byte source"
        )
    if desc.dst_offset + desc.nbytes > desc.dst.nbytes:
        raise BackendError(
            f"descriptor {index}: writes [{desc.dst_offset}, {desc.dst_offset + desc.nbytes}) "
            f"of a {desc.dst.nbytes}-byte destination"
        )


@dataclass(frozen=True, slots=True)
class GatherTableSpec:
    """The gather entries of some descriptors and the ``dst_base`` their offsets start at."""

    entries: tuple[GatherEntry, ...]
    dst_base: int


def gather_entries(
    descs: Sequence[CopyDescriptor], ptr_of: Callable[[Buffer], int]
) -> GatherTableSpec:
    """Gather entries for ``descs``: absolute source pointers; destination offsets from
    the one destination buffer when all share it (``dst_base`` = its address), else
    absolute addresses (``dst_base`` = 0). Bounds are checked (``BackendError``)."""
    for i, d in enumerate(descs):
        check_bounds(d, i)
    dsts = {id(d.dst) for d in descs}
    if len(dsts) == 1:
        base = ptr_of(descs[0].dst)
        entries = tuple(
            GatherEntry(ptr_of(d.src) + d.src_offset, d.dst_offset, d.nbytes) for d in descs
        )
        return GatherTableSpec(entries, base)
    entries = tuple(
        GatherEntry(ptr_of(d.src) + d.src_offset, ptr_of(d.dst) + d.dst_offset, d.nbytes)
        for d in descs
    )
    return GatherTableSpec(entries, 0)


def check_sm_reserve(sms: int, sm_count: int) -> int:
    """``sms`` if it is a valid SM reserve on a device of ``sm_count`` SMs: at least 1
    and leaving at least one SM to the model (docs/design.md §6.6). Raises ``SmReserveError``."""
    if sms < 1:
        raise SmReserveError(f"gather SM reserve {sms} must be at least 1 SM")
    if sms >= sm_count:
        raise SmReserveError(
            f"gather SM reserve of {sms} SMs leaves no SM for the model "
            f"(the device has {sm_count}); use at most {sm_count - 1}"
        )
    return sms


def fabric_refused_message(device: int, detail: str) -> str:
    """The host check's message for a FABRIC allocation the driver refuses."""
    return (
        f"handleType: {HandleType.FABRIC.value} is not usable on cuda:{device}: the driver "
        f"refused a FABRIC allocation ({detail}), which means no IMEX channel is granted to "
        f"this process. Run the pods in a ComputeDomain (the NVIDIA DRA driver creates the "
        f"IMEX domain and mounts the channel, /dev/nvidia-caps-imex-channels/channelN), or "
        f"set handleType: {HandleType.POSIX_FD.value} when every rank of the DWDP group is "
        f"on one host."
    )
