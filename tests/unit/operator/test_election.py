"""The Lease decisions of leader election (``dwdp.operator.election.claim``)."""

from __future__ import annotations

import datetime as dt

from dwdp.operator.election import LEASE_DURATION_S, claim

NOW = dt.datetime(2026, 1, 1, 0, 1, 0, tzinfo=dt.UTC)


def _at(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_free_or_missing_lease_is_taken() -> None:
    got = claim(None, "a", NOW)
    assert got is not None and got["holderIdentity"] == "a" and got["leaseTransitions"] == 0
    assert got["leaseDurationSeconds"] == LEASE_DURATION_S
    released = {"holderIdentity": "", "renewTime": _at(1), "leaseTransitions": 3}
    taken = claim(released, "b", NOW)
    assert taken is not None and taken["leaseTransitions"] == 3


def test_a_lease_renewed_in_time_stays_with_its_holder() -> None:
    held = {"holderIdentity": "a", "renewTime": _at(14), "leaseDurationSeconds": 15}
    assert claim(held, "b", NOW) is None


def test_an_expired_lease_is_taken_over_and_counted() -> None:
    held = {
        "holderIdentity": "a",
        "acquireTime": _at(100),
        "renewTime": _at(16),
        "leaseDurationSeconds": 15,
        "leaseTransitions": 1,
    }
    got = claim(held, "b", NOW)
    assert got is not None
    assert (got["holderIdentity"], got["leaseTransitions"]) == ("b", 2)
    assert got["acquireTime"] == got["renewTime"]


def test_the_holder_renews_and_keeps_its_acquire_time() -> None:
    held = {"holderIdentity": "a", "acquireTime": _at(100), "renewTime": _at(2)}
    got = claim(held, "a", NOW)
    assert got is not None and got["acquireTime"] == _at(100) and got["renewTime"] == _at(0)
    assert got["leaseTransitions"] == 0
