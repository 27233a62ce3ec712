"""What DWDP holds resident on one rank, in bytes (``/dwdp/status`` reports it).

After dense setup on N ranks, ``store_bytes`` is 1/N of the padded blobs
(``sharded_bytes + padding_bytes`` over N), the slots hold ``slot_bytes``, and the tensors
that stayed replicated under the dense roots hold ``replicated_bytes``: the replicated copy
of ``sharded_bytes`` each rank held before is gone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ResidentBytes:
    """Per-rank resident bytes of one DWDP kind (``"dense"`` or ``"expert"``).

    ``store_bytes``: this rank's rows (or expert chunks) in its store, in bytes, padding
    included; ``store_allocated_bytes``: the store as allocated (rounded up to the
    backend's granularity); ``slot_bytes``: all prefetch slots; ``replicated_bytes``: tensors
    under the roots that stayed replicated; ``sharded_bytes``: the bytes every rank held
    before setup and now holds 1/N of; ``padding_bytes``: this rank's share of the row
    padding; ``world_size``: N; ``leaks``: originals still alive after the commit.
    """

    kind: str
    rank: int
    world_size: int
    store_bytes: int
    store_allocated_bytes: int
    slot_bytes: int
    replicated_bytes: int
    sharded_bytes: int
    padding_bytes: int
    leaks: int = 0

    @property
    def resident_bytes(self) -> int:
        """Store plus slots plus replicated tensors."""
        return self.store_bytes + self.slot_bytes + self.replicated_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "resident_bytes": self.resident_bytes}
