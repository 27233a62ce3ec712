"""What the server reads about this rank's DWDP state (``/ready``, ``/dwdp/status``, metrics).

The server depends on the ``DwdpStatusSource`` protocol only; the attachment of DWDP to the
model (``dwdp.worker.attach``) implements it, and ``NoDwdp`` stands for a rank without DWDP.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

PHASE_DISABLED = "disabled"
PHASE_COMMITTED = "committed"


@runtime_checkable
class DwdpStatusSource(Protocol):
    """A view of the DWDP state of this rank."""

    @property
    def committed(self) -> bool:
        """True once the DWDP setup committed on every rank (or when DWDP is off)."""

    def status(self) -> dict[str, Any]:
        """JSON-able state: ``phase``, ``rank``, ``dwdp_size``, ``layout_digest``,
        ``partition`` (every rank's expert range), ``bytes_stored``, ``bytes_moved``,
        ``bytes_freed``, ``leaks``, ``slots`` and ``slot_waits`` (bytes as integers)."""


class NoDwdp:
    """The status of a rank that serves with replicated weights."""

    committed = True

    def __init__(self, reason: str = "DWDP is off (dwdp_size 1 and enable_dense false)") -> None:
        self.reason = reason

    def status(self) -> dict[str, Any]:
        """Phase ``disabled`` with zero counters."""
        return {
            "phase": PHASE_DISABLED,
            "reason": self.reason,
            "rank": 0,
            "dwdp_size": 1,
            "layout_digest": None,
            "partition": None,
            "bytes_stored": 0,
            "bytes_moved": 0,
            "bytes_freed": 0,
            "leaks": 0,
            "slots": {},
            "slot_waits": 0,
        }
