"""The verdict on one group incarnation: its phase (gang scheduling, rendezvous wait, set-up,
commit) and whether its commit gate may open, from its pods and its ranks' reports.

Invariant: the same inputs give the same verdict (no clock, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dwdp.api.deployment import FailureRecord, GroupStatus
from dwdp.operator.constants import GroupPhase
from dwdp.operator.observe import ObservedPod, RankReport

__all__ = [
    "GroupView",
    "evaluate_group",
    "failure_record",
]


@dataclass(frozen=True, slots=True)
class GroupView:
    """The verdict on one group incarnation."""

    name: str
    index: int
    incarnation: int
    revision: str
    phase: GroupPhase
    ranks_ready: int
    ranks_total: int
    layout_digest: str | None = None
    committed: bool = False
    """Every rank committed with one revision and layout digest: the gate may be open."""
    failure: dict[str, Any] | None = None

    def to_model(self, *, restarts: int = 0) -> GroupStatus:
        """The ``status.groups[]`` entry."""
        return GroupStatus(
            name=self.name,
            revision=self.revision,
            incarnation=self.incarnation,
            phase=self.phase.value,
            ranks_ready=self.ranks_ready,
            ranks_total=self.ranks_total,
            layout_digest=self.layout_digest,
            leaks=0,
            restarts=restarts,
            last_failure=(
                FailureRecord.model_validate(self.failure) if self.failure is not None else None
            ),
        )


def failure_record(pod: ObservedPod, reports: Sequence[RankReport | None]) -> dict[str, Any]:
    """The ``lastFailure`` of a group whose pod ``pod`` failed: the phase a rank reported
    last (else ``exit``) and the termination message (else the exit code)."""
    phase: str | None = next((r.phase for r in reports if r is not None and r.failed), None)
    message = pod.termination_message or (
        f"pod {pod.name} exited with code {pod.exit_code}"
        if pod.exit_code is not None
        else f"pod {pod.name} is {pod.phase}"
    )
    if phase is None and pod.termination_message and ":" in pod.termination_message:
        head = pod.termination_message.split(":", 1)[0].strip()
        phase = head if head and " " not in head else None
    return {"phase": phase or "exit", "message": f"{pod.name}: {message}", "reason": "PodFailed"}


def _agree(reports: Sequence[RankReport], revision: str, incarnation: int) -> bool:
    """All reports committed, for this revision and incarnation (where a rank says), with
    one layout digest."""
    if not all(r.committed for r in reports):
        return False
    if any(r.revision is not None and r.revision != revision for r in reports):
        return False
    if any(r.incarnation is not None and r.incarnation != incarnation for r in reports):
        return False
    return len({r.layout_digest for r in reports}) == 1


def evaluate_group(
    *,
    name: str,
    index: int,
    incarnation: int,
    revision: str,
    pods: Sequence[ObservedPod],
    pods_expected: int,
    ranks_expected: int,
    reports: Mapping[str, Sequence[RankReport | None]],
    previous_digest: str | None = None,
) -> GroupView:
    """The phase of one group incarnation.

    ``pods`` are the incarnation's live pods; ``reports`` the ranks' answers by pod name
    (pods that were not asked are absent). Order of the rules: a failed pod or rank wins
    (Failed), then missing pods (Pending), unscheduled pods (Scheduling), unstarted pods
    (Pending), an open gate on every pod (Serving, committed), every rank committed in
    agreement (Serving, committed: the gate opens now), any rank that answered (a worker
    answers only after its setup; SettingUp), else Rendezvous.
    """

    def verdict(
        phase: GroupPhase,
        ready: int = 0,
        *,
        digest: str | None = None,
        failure: dict[str, Any] | None = None,
    ) -> GroupView:
        committed = phase is GroupPhase.SERVING
        return GroupView(
            name=name,
            index=index,
            incarnation=incarnation,
            revision=revision,
            phase=phase,
            ranks_ready=ready,
            ranks_total=ranks_expected,
            layout_digest=digest,
            committed=committed,
            failure=failure,
        )

    all_reports = [r for p in pods for r in reports.get(p.name, ())]
    for pod in pods:
        pod_reports = reports.get(pod.name, ())
        if pod.failed or any(r is not None and r.failed for r in pod_reports):
            return verdict(GroupPhase.FAILED, failure=failure_record(pod, pod_reports))
    if len(pods) < pods_expected:
        return verdict(GroupPhase.PENDING)
    if not all(p.scheduled for p in pods):
        return verdict(GroupPhase.SCHEDULING)
    if not all(p.started and p.phase == "Running" for p in pods):
        return verdict(GroupPhase.PENDING)
    if all(p.gate for p in pods):
        digests = {r.layout_digest for r in all_reports if r is not None}
        digest = digests.pop() if len(digests) == 1 else previous_digest
        return verdict(GroupPhase.SERVING, ranks_expected, digest=digest)
    answered = [r for r in all_reports if r is not None]
    ready = sum(1 for r in answered if r.committed)
    if len(answered) == ranks_expected and _agree(answered, revision, incarnation):
        return verdict(GroupPhase.SERVING, ranks_expected, digest=answered[0].layout_digest)
    if any(not r.committed for r in answered) or ready:
        return verdict(GroupPhase.SETTING_UP, ready)
    return verdict(GroupPhase.RENDEZVOUS, ready)
