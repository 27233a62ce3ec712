"""RFC 3339 times of the API, read as :class:`datetime.datetime` (no clock read here: ``now``
is always an argument)."""

from __future__ import annotations

import datetime as dt

__all__ = [
    "parse_time",
    "seconds_since",
]


def parse_time(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time of the API (``2026-01-02T03:04:05Z``); None when absent or bad."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def seconds_since(then: str | None, now: str) -> float | None:
    """Seconds from ``then`` to ``now`` (both RFC 3339); None when ``then`` is unknown."""
    a, b = parse_time(then), parse_time(now)
    if a is None or b is None:
        return None
    return (b - a).total_seconds()
