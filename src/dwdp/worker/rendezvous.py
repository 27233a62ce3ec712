"""The rendezvous of this rank's DWDP group, and the device backend its stores then live in.

``join_group`` is the rendezvous (a collective: TCP store or MPI, from the launch's
``transport``); ``make_backend`` picks, for the group joined, the backend the launch's
``handleType`` names (``shm``: the cpu backend over host shared memory, its files named after
the group; ``posixFd``/``fabric``: the CUDA backend).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dwdp.api.contract import Env
from dwdp.api.launch import LaunchConfig, dwdp_active
from dwdp.worker.backend.base import Backend
from dwdp.worker.settings import CopySettings
from dwdp.worker.transport.base import GroupTransport


class DwdpConfigError(ValueError):
    """A DWDP setting this worker cannot run; the message names the field and the fix."""


def join_group(
    cfg: LaunchConfig, environ: Mapping[str, str] | None = None
) -> GroupTransport | None:
    """Join this rank's DWDP group (a collective), or return ``None`` without DWDP.

    TCP store (``DWDP_RENDEZVOUS``, rank 0 hosts it) or MPI, from ``cfg.transport``. Raises
    ``DwdpConfigError`` when ``DWDP_WORLD_SIZE`` is not ``dwdp.dwdpSize``, and the transport's
    errors (rendezvous timeout naming the missing ranks).
    """
    if not dwdp_active(cfg):
        return None
    from dwdp.api.enums import Transport as TransportKind
    from dwdp.worker.transport.base import RendezvousConfig

    rendezvous = RendezvousConfig.from_env(environ)
    if rendezvous.world_size != cfg.dwdp.dwdp_size:
        raise DwdpConfigError(
            f"dwdp.dwdpSize is {cfg.dwdp.dwdp_size} but DWDP_WORLD_SIZE is "
            f"{rendezvous.world_size}: the group's rank count must equal dwdpSize"
        )
    if cfg.transport == TransportKind.MPI:
        from mpi4py import MPI

        from dwdp.worker.transport.mpi import MpiTransport

        world = MPI.COMM_WORLD
        if world.Get_size() != rendezvous.world_size or world.Get_rank() != rendezvous.rank:
            raise DwdpConfigError(
                f"transport mpi: this worker runs one DWDP group per MPI world; MPI rank "
                f"{world.Get_rank()} of {world.Get_size()} but DWDP_RANK={rendezvous.rank} of "
                f"DWDP_WORLD_SIZE={rendezvous.world_size}"
            )
        return MpiTransport.split(timeout_s=rendezvous.timeout_s)
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    return TcpStoreTransport(rendezvous)


def make_backend(
    cfg: LaunchConfig,
    transport: GroupTransport,
    settings: CopySettings,
    environ: Mapping[str, str] | None = None,
) -> Backend:
    """The device backend for ``cfg.handle_type``: ``shm`` -> the cpu backend (store files
    named after ``DWDP_GROUP``/``DWDP_INCARNATION``), ``posixFd``/``fabric`` -> cuda (with
    the effective copy ``settings``)."""
    from dwdp.api.enums import HandleType

    env = os.environ if environ is None else environ
    if cfg.handle_type == HandleType.SHM:
        from dwdp.worker.backend.cpu import CpuBackend

        return CpuBackend(
            group=env.get(Env.GROUP, "local"),
            incarnation=env.get(Env.INCARNATION, "0"),
            rank=transport.rank,
        )
    from dwdp.worker.backend.cuda import CudaBackend

    return CudaBackend(
        device=int(env.get(Env.LOCAL_RANK, "0")),
        handle_type=cfg.handle_type,
        settings=settings,
    )
