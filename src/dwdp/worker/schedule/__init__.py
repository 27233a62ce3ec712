"""When each prefetch slot is filled and which stream waits for what (docs/design.md §6.4, §6.5).

``expert``: the cyclic expert prefetch schedule over a slot ring of ``num_prefetch_slots``
prefetch slots (``start_forward``, ``bind``, ``finish``, ``invalidate_prefetch``).
``dense``: the dense slot schedule, slot rings for blobs A(l) and D(l) driven by hooks
H0-H3, standalone or in attached mode. The schedules know streams, events and a ``launch``
callback, never stores or copy plans. Invariant: every dependency is an event on a
stream; between setup and teardown no schedule blocks the host.
"""

from dwdp.worker.schedule.dense import DensePassPhase, DenseSlotSchedule, WindowState
from dwdp.worker.schedule.errors import ScheduleStateError
from dwdp.worker.schedule.expert import ExpertPrefetchSchedule, PassPhase, SlotState

__all__ = [
    "DensePassPhase",
    "DenseSlotSchedule",
    "ExpertPrefetchSchedule",
    "PassPhase",
    "ScheduleStateError",
    "SlotState",
    "WindowState",
]
