"""The group's vote: the one collective each setup phase ends with (the load's vote and a
weight update's use it too): every rank's status (and payload).

A free function over the group transport, returning the transport's small named result
(:class:`~dwdp.worker.transport.base.Exchange`): ``ok``, ``errors`` by rank, ``payloads``.
"""

from __future__ import annotations

from dwdp.worker.transport.base import Exchange, GroupTransport
from dwdp.worker.transport.codec import Payload


def vote(transport: GroupTransport, label: str, error: str | None,
         payload: Payload = None) -> Exchange:
    """Send this rank's ``error`` (``None``: success) and ``payload``; return every rank's.

    Every rank gets the same :class:`Exchange`, so a verdict computed from it is the same
    on every rank after this collective (see [Note: fail-together] in ``phases``).
    """
    return transport.exchange(payload, label=label, error=error)
