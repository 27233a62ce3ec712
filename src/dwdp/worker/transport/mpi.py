"""The MPI group transport: a sub-communicator of the DWDP group with its own tag.

The group's ranks are split off a parent communicator (``MPI.COMM_WORLD`` by default), so
DWDP traffic never matches a message of the engine's other MPI users; inside it every
message also carries the DWDP tag. The allgather is built from point-to-point sends and
polled receives instead of ``MPI_Allgather`` so that a rank that never arrives makes the
others fail at the timeout with the missing ranks named, instead of blocking forever.
MPI orders the messages of one (source, tag, communicator), so consecutive collectives
never mix. Messages travel as raw byte buffers (``Isend``/``Recv`` of ``MPI.BYTE``), never
through mpi4py's pickling ``send``/``recv``; the bytes are the collective's msgpack
envelope (``codec``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from dwdp.api.contract import Env
from dwdp.worker.transport.base import (
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    GroupTransport,
    RendezvousTimeout,
    TransportError,
)

DWDP_MPI_TAG = 0x4457
"""The message tag of every DWDP exchange ("DW")."""

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.02


class MpiTransport(GroupTransport):
    """A group transport over an mpi4py communicator that holds exactly the group's ranks.

    ``comm`` is owned by the transport (freed on :meth:`close`). ``timeout_s`` bounds each
    collective in seconds. Use :meth:`split` to make one from a parent communicator.
    """

    def __init__(self, comm: Any, *, tag: int = DWDP_MPI_TAG,
                 timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S) -> None:
        super().__init__(rank=comm.Get_rank(), world_size=comm.Get_size(), timeout_s=timeout_s)
        self.comm = comm
        self.tag = tag
        self._closed = False

    @classmethod
    def split(
        cls,
        ranks: Sequence[int] | None = None,
        *,
        parent: Any = None,
        tag: int = DWDP_MPI_TAG,
        timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    ) -> MpiTransport | None:
        """Split the group of parent ranks ``ranks`` (default: all) off ``parent``.

        A collective over ``parent`` (default ``MPI.COMM_WORLD``): every parent rank calls
        it; ranks outside ``ranks`` get ``None``. Group rank order follows ``ranks``.
        Raises ``ValueError`` for ranks outside the parent.
        """
        from mpi4py import MPI

        parent = MPI.COMM_WORLD if parent is None else parent
        size = parent.Get_size()
        members = list(range(size)) if ranks is None else list(ranks)
        if len(set(members)) != len(members) or any(not 0 <= r < size for r in members):
            raise ValueError(f"DWDP group ranks {members} are not distinct ranks of [0, {size})")
        me = parent.Get_rank()
        inside = me in members
        comm = parent.Split(0 if inside else MPI.UNDEFINED, members.index(me) if inside else 0)
        if not inside:
            return None
        return cls(comm, tag=tag, timeout_s=timeout_s)

    def _allgather_bytes(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
        if self._closed:
            raise TransportError("the MPI transport is closed")
        from mpi4py import MPI

        comm, tag = self.comm, self.tag
        peers = [r for r in range(self.world_size) if r != self.rank]
        sends = [comm.Isend([data, MPI.BYTE], dest=p, tag=tag) for p in peers]
        received: dict[int, bytes] = {self.rank: data}
        pending = list(peers)
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_MIN_S
        status = MPI.Status()
        while pending:
            progressed = False
            for peer in list(pending):
                if comm.Iprobe(source=peer, tag=tag, status=status):
                    buffer = bytearray(status.Get_count(MPI.BYTE))
                    comm.Recv([buffer, MPI.BYTE], source=peer, tag=tag)
                    received[peer] = bytes(buffer)
                    pending.remove(peer)
                    progressed = True
            if not pending:
                break
            if progressed:
                pause = _POLL_MIN_S
                continue
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(
                    f"MPI DWDP group (tag {tag}): rank(s) {pending} did not arrive at "
                    f"collective #{seq} {label!r} within {self.timeout_s:g} s "
                    f"({Env.RENDEZVOUS_TIMEOUT_S})",
                    missing=tuple(pending),
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        MPI.Request.waitall(sends)
        return [received[r] for r in range(self.world_size)]

    def close(self, *, linger: bool = True) -> None:
        """Free the sub-communicator; safe to call twice (``linger``: nothing to keep)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # MPI already finalized at interpreter exit
            self.comm.Free()
