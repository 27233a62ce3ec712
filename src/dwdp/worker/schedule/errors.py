"""Errors of the DWDP schedules."""

from __future__ import annotations


class ScheduleStateError(RuntimeError):
    """A schedule call that the protocol does not allow in the current state (a caller
    bug, e.g. ``finish`` of a layer that is not bound, or H2 before H1). The message names
    the call, the state and the fix."""
