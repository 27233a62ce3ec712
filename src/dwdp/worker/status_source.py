"""The status protocol of this rank's DWDP state: what the server (``/ready``,
``/dwdp/status``, metrics) and the memory ledger read of it.

The attachment of DWDP to the model (``dwdp.worker.attachment``) implements
``DwdpStatusSource``; ``NoDwdp`` stands for a rank without DWDP. A leaf of ``dwdp.worker``:
its sub-packages (``server``) and its own modules (``memory``, ``bringup``) import it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dwdp.api.contract import RankStatus, StatusPhase


@runtime_checkable
class DwdpStatusSource(Protocol):
    """A view of the DWDP state of this rank."""

    @property
    def committed(self) -> bool:
        """True once the DWDP setup committed on every rank (or when DWDP is off)."""

    def status(self) -> dict[str, Any]:
        """JSON-able state: ``phase``, ``rank``, ``dwdp_size``, ``layout_digest``,
        ``partition`` (every rank's expert range), ``bytes_stored``, ``bytes_moved``,
        ``bytes_freed``, ``leaks``, ``slots``, ``slot_waits``, ``sm_reserve`` (the SMs
        the gather kernel holds) and ``sm_reserve_model`` (the SMs the model's GEMMs leave
        free, ``dwdp.smReserve``) (bytes as integers)."""

    def buffer_ranges(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of every DWDP store and slot this rank allocated."""


class NoDwdp:
    """The status of a rank that serves with replicated weights."""

    committed = True

    def __init__(self, reason: str = "DWDP is off (dwdp_size 1 and enable_dense false)") -> None:
        self.reason = reason

    def buffer_ranges(self) -> list[tuple[int, int]]:
        """No DWDP buffers."""
        return []

    def status(self) -> dict[str, Any]:
        """Phase ``disabled`` with zero counters."""
        return RankStatus.build(
            phase=StatusPhase.DISABLED,
            reason=self.reason,
            rank=0,
            dwdp_size=1,
            layout_digest=None,
            partition=None,
            bytes_stored=0,
            bytes_moved=0,
            bytes_freed=0,
            leaks=0,
            slots={},
            slot_waits=0,
            sm_reserve=0,
            sm_reserve_model=0,
        ).wire()
