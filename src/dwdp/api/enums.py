"""Enumerations shared by the API, the operator and the worker.

The string values are the spellings users write in YAML and the CRD accepts.
"""

from __future__ import annotations

import enum


class CopyMode(enum.StrEnum):
    """How the copies of one layer are issued, for every DWDP copy (docs/design.md §6.6)."""

    PER_SLICE = "per_slice"
    """One asynchronous copy per descriptor."""
    BATCHED = "batched"
    """One batched copy call per layer (cuMemcpyBatchAsync on CUDA, copy engines)."""
    GATHER = "gather"
    """One gather-kernel launch per layer that reads every peer's rows (SM copies)."""


class GatherKernel(enum.StrEnum):
    """The gather-kernel variant used with ``copy_mode: gather``."""

    REGISTER = "register"
    """16-byte vector loads and stores through registers."""
    TMA = "tma"
    """Hopper bulk copies global -> shared -> global completing on an mbarrier."""


class HandleType(enum.StrEnum):
    """How a rank's store is shared with the peers of its DWDP group."""

    FABRIC = "fabric"
    """CUDA fabric handle (multi-node NVLink domains; needs an IMEX channel)."""
    POSIX_FD = "posixFd"
    """CUDA POSIX file descriptor, sent to peers on the same host over a Unix socket."""
    SHM = "shm"
    """Host shared-memory file (the cpu backend; all ranks on one host)."""


class Role(enum.StrEnum):
    """The serving role of a worker (disaggregated serving)."""

    CONTEXT = "context"
    """Prefill server; the only role that may run dense DWDP."""
    GENERATION = "generation"
    """Decode server; refuses dense DWDP before the model loads."""
    AGGREGATED = "aggregated"
    """Prefill and decode in one server."""


class Transport(enum.StrEnum):
    """How the ranks of a DWDP group meet and run their setup collectives."""

    TCP_STORE = "tcpStore"
    """A TCP key-value store hosted by rank 0 (``DWDP_RENDEZVOUS``)."""
    MPI = "mpi"
    """An MPI sub-communicator (mpi4py), for ranks started under an MPI launcher."""


class DenseMode(enum.StrEnum):
    """The ways dense DWDP runs (docs/design.md §3.2) that this worker has: attached only (the
    reference's standalone mode needs an attention-DP instance)."""

    ATTACHED = "attached"
    """With expert DWDP: the DWDP group and the expert copy stream."""
