"""Group transports: how the ranks of one DWDP group exchange small messages at setup.

Every exchange carries each rank's status, so a rank that failed reports its error at the
same collective where the others look for its payload: every rank reaches the same verdict
after the same collective (fail-together). ``base`` fixes the interface; ``tcp_store`` is
the TCP store rendezvous (rank 0 hosts the authenticated ``store``) and ``mpi`` the mpi4py
sub-communicator; ``codec`` is the wire format of every collective (msgpack, never pickle).
"""

from dwdp.worker.transport.base import (
    CollectiveMismatch,
    Exchange,
    GroupFailure,
    GroupTransport,
    RendezvousConfig,
    RendezvousSecretError,
    RendezvousTimeout,
    TransportError,
)

__all__ = [
    "CollectiveMismatch",
    "Exchange",
    "GroupFailure",
    "GroupTransport",
    "RendezvousConfig",
    "RendezvousSecretError",
    "RendezvousTimeout",
    "TransportError",
]
