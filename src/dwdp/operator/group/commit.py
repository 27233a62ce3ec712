"""The commit gate: open the ``dwdp.io/group-ready`` gates of an incarnation once every rank
committed, close them when it no longer is, and remember which processes committed (their
start ids) so that a rank restarted in place is seen."""

from __future__ import annotations

from collections.abc import Sequence

from dwdp.operator.actions import Actions, Event, GateChange
from dwdp.operator.constants import Reason
from dwdp.operator.group.state import GroupState, RoleContext
from dwdp.operator.group.verdict import GroupView
from dwdp.operator.observe import ObservedPod, RankReport

__all__ = [
    "answers_by_rank",
    "gates",
    "rank_starts",
    "restarted_rank",
]


def answers_by_rank(
    ctx: RoleContext, current: Sequence[ObservedPod]
) -> dict[int, RankReport] | None:
    """Every rank's ``/dwdp/status`` answer of this cycle by rank; None unless each rank of
    ``current`` was asked and answered (a committed group is asked every
    ``VERIFY_INTERVAL_S``, see :mod:`dwdp.operator.probe`)."""
    out: dict[int, RankReport] = {}
    for p in current:
        got = ctx.observed.ranks.get(p.name)
        if got is None or len(got) != p.ranks:
            return None
        for k, report in enumerate(got):
            if report is None:
                return None
            first = p.pod_index * ctx.shape.ranks_per_pod
            out[report.rank if report.rank is not None else first + k] = report
    return out


def restarted_rank(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> str | None:
    """Why a committed group (every gate open) no longer runs the processes that committed:
    a rank answering with another start id than the recorded one, or not committed; None
    when every rank is the one that committed, or not every rank answered this cycle."""
    if not view.committed or not all(p.gate for p in current):
        return None
    answers = answers_by_rank(ctx, current)
    if answers is None:
        return None
    recorded = g.recorded_starts if g.recorded_incarnation == view.incarnation else ()
    for rank, report in sorted(answers.items()):
        was = recorded[rank] if 0 <= rank < len(recorded) else None
        if was is not None and report.start_id is not None and report.start_id != was:
            return (
                f"rank {rank} is no longer the process that committed (start id "
                f"{report.start_id}, committed as {was}): it was restarted in place"
            )
        if not report.committed:
            return f"rank {rank} of the committed group reports {report.phase.value}"
    return None


def rank_starts(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> tuple[str, ...]:
    """The start ids to record for a committed incarnation: the recorded ones while it is
    the same incarnation, else those its ranks answered with (every rank, in rank order)."""
    if not view.committed:
        return ()
    if g.recorded_starts and g.recorded_incarnation == view.incarnation:
        return g.recorded_starts
    answers = answers_by_rank(ctx, current)
    if answers is None or any(r.start_id is None for r in answers.values()):
        return ()
    return tuple(str(answers[k].start_id) for k in sorted(answers))


def gates(
    ctx: RoleContext, g: GroupState, view: GroupView, current: Sequence[ObservedPod]
) -> Actions:
    """Open the gates of a committed incarnation, close them on one that is no longer."""
    running = [p for p in current if not p.failed]
    changes = [
        GateChange(p.name, True, f"{g.name} committed")
        if view.committed
        else GateChange(p.name, False, f"{g.name} is {view.phase.value}")
        for p in running
        if p.gate != view.committed
    ]
    events: list[Event] = []
    if view.committed and not all(p.gate for p in current):
        events.append(
            Event(
                Reason.GATE_OPENED,
                f"{ctx.role.value} group {g.name} incarnation {view.incarnation}: every rank "
                f"committed (revision {view.revision}, layout digest {view.layout_digest}); "
                "gate opened",
            )
        )
    elif not view.committed and any(p.gate for p in running):
        events.append(
            Event(
                Reason.GATE_CLOSED,
                f"{ctx.role.value} group {g.name}: {view.phase.value}; gate closed",
                "Warning",
            )
        )
    return Actions(gates=tuple(changes), events=tuple(events))
