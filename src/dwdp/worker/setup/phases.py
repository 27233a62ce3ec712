"""Setup phases, the failure-injection hook, the errors every rank raises alike, and the
runner of a phase that ends in a status-only vote.

[Note: fail-together] Each phase ends with one collective that carries every rank's status
(``None`` or its error). Every rank computes its verdict from that one exchange, so after
the same collective either every rank goes on or every rank raises the same
:class:`SetupError`, naming the phase and the failing ranks. A rank that fails keeps
taking part in the collectives up to the verdict; it never leaves its peers blocked.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dwdp.worker.setup.group_vote import vote
from dwdp.worker.transport.base import GroupTransport

log = logging.getLogger(__name__)


class DensePhase(enum.StrEnum):
    """The six phases of dense setup (docs/design.md §6.3), each ending in one collective."""

    P1 = "P1"
    """Collect the layout, its digest and checksums; compare across ranks; fit check."""
    P2 = "P2"
    """Allocate the row store and the slots; write this rank's rows."""
    P3 = "P3"
    """Map every peer's row store; build the copy plans."""
    P4 = "P4"
    """Gather every layer into its slot and compare the bytes with the originals."""
    P5 = "P5"
    """Repoint the module tensors into the slots; check every layer again."""
    P6 = "P6"
    """Drop the originals, count leaks; the last collective agrees on the commit."""

    @property
    def what(self) -> str:
        return _DENSE_WHAT[self]


_DENSE_WHAT = {
    DensePhase.P1: "collect the layout and compare it across ranks",
    DensePhase.P2: "allocate the row store and the slots, write the rows",
    DensePhase.P3: "map the peers' row stores, build the copy plans",
    DensePhase.P4: "gather every layer and check the bytes",
    DensePhase.P5: "repoint the module tensors and check every layer again",
    DensePhase.P6: "drop the originals and commit",
}


class ExpertPhase(enum.StrEnum):
    """The phases of expert setup, each ending in one collective."""

    HANDSHAKE = "handshake"
    """Every rank's expert range and chunk shapes, checked against the partition."""
    ALLOCATE = "allocate"
    """The expert store and the prefetch slots: every rank agrees before any maps a peer."""
    MAP = "map"
    """Map every peer's expert store; build the copy plans."""
    COMMIT = "commit"
    """The final vote."""

    @property
    def what(self) -> str:
        return f"expert {self.value}"


class SetupError(RuntimeError):
    """DWDP setup failed; raised on every rank after the same collective.

    ``phase`` is the phase whose collective reported the failure, ``errors`` maps each
    failing rank to its message, ``restored`` says whether the original tensors are back
    (P1-P5) or DWDP state was released without them (a failed commit: exit the process).
    """

    def __init__(self, phase: str, what: str, errors: Mapping[int, str], *,
                 restored: bool) -> None:
        self.phase = phase
        self.errors = dict(sorted(errors.items()))
        self.restored = restored
        detail = "; ".join(f"rank {r}: {m}" for r, m in self.errors.items())
        after = ("every rank restored its original tensors" if restored else
                 "every rank released its DWDP state; restart the process (no fallback to "
                 "replicated weights)")
        super().__init__(
            f"DWDP setup failed in {phase} ({what}) on rank(s) {list(self.failed_ranks)}: "
            f"{detail}; "
            f"{after}"
        )

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(self.errors)


class InjectedFailure(RuntimeError):
    """A failure the failure-injection hook raised on purpose (tests)."""


FailHook = Callable[[str, int], None]
"""``hook(phase, rank)`` runs at the end of each phase's local work; raising fails it."""


@dataclass(frozen=True, slots=True)
class FailAt:
    """Fail phase ``phase`` on rank ``rank`` (``None``: every rank)."""

    phase: str
    rank: int | None


class FailureInjector:
    """Raises :class:`InjectedFailure` at the chosen (phase, rank) points.

    Built from explicit points or around a callable hook, and handed to setup only by tests
    (``attach(..., injector=...)``): a worker never builds one from its environment or
    configuration, so nothing outside the test suite can make setup fail on purpose; setup's
    default has no points. ``check(phase, rank)`` is called by setup at the end of each
    phase's local work, just before the phase's collective.
    """

    def __init__(self, points: tuple[FailAt, ...] = (), hook: FailHook | None = None) -> None:
        self.points = points
        self.hook = hook

    def check(self, phase: str, rank: int) -> None:
        for point in self.points:
            if point.phase == phase and point.rank in (None, rank):
                raise InjectedFailure(f"injected failure at {phase} on rank {rank}")
        if self.hook is not None:
            self.hook(phase, rank)


def run_phase(phase: DensePhase | ExpertPhase, transport: GroupTransport,
              injector: FailureInjector, work: Callable[[], object],
              undo: Callable[[], object]) -> None:
    """Run one phase's local work, then its collective (label ``dense.<phase>`` or
    ``expert.<phase>``); on a failure any rank reported, call ``undo`` and raise
    :class:`SetupError` (``restored=True``) on every rank alike (see [Note: fail-together]).

    For the phases whose collective carries only the status; a phase that exchanges a
    payload or ends in the commit computes its own verdict.
    """
    kind = "dense" if isinstance(phase, DensePhase) else "expert"
    error: str | None = None
    try:
        work()
        injector.check(phase, transport.rank)
    except Exception as exc:
        error = describe(exc)
        log.warning("%s DWDP %s failed on rank %d: %s", kind, phase, transport.rank, error)
    verdict = vote(transport, f"{kind}.{phase}", error)
    if not verdict.ok:
        undo()
        raise SetupError(phase, phase.what, verdict.errors, restored=True)


def setup_stream(backend: Any, name: str) -> Any:
    """A created stream for setup's gathers (P4/P5 and the expert check), ordered after the
    work enqueued so far on the compute stream (the weights and stores written there).

    [Note: setup stream] Setup gathers every layer once and checks the bytes on the host.
    It never uses ``backend.current_stream()`` for the copies: on CUDA that is the legacy
    NULL stream outside any stream context, which batched copies (cuMemcpyBatchAsync)
    refuse. The caller synchronizes this stream before reading the slots on the host.
    """
    stream = backend.new_stream(name)
    ready = backend.new_event()
    ready.record(backend.current_stream())
    stream.wait_event(ready)
    return stream


def describe(exc: BaseException) -> str:
    """A one-line status for an exchange: the exception type and its message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
