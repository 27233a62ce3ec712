"""The worker side of the operator contract: ``/dwdp/status`` names the rank's group,
incarnation and revision (and ``failed`` once the engine died), and every termination line
starts with the phase the operator classifies the failure by."""

from __future__ import annotations

import pytest

from dwdp.api.contract import Stage
from dwdp.worker.engine.stats import EngineSnapshot, EngineStats
from dwdp.worker.launcher import launcher_line
from dwdp.worker.main import phased
from dwdp.worker.server.status import (
    START_ID,
    engine_failure,
    rank_identity,
    server_identity,
    with_identity,
)
from dwdp.worker.status_source import NoDwdp

pytestmark = pytest.mark.unit


def test_identity_from_the_operator_environment() -> None:
    env = {"DWDP_GROUP": "demo-g0", "DWDP_INCARNATION": "3", "DWDP_REVISION": "abc123"}
    start = {"start_id": START_ID}
    assert rank_identity(env) == {
        **start,
        "group": "demo-g0",
        "incarnation": 3,
        "revision": "abc123",
    }
    assert rank_identity({"DWDP_INCARNATION": "i2"}) == {**start, "incarnation": 2}
    assert rank_identity({}) == start


def test_server_identity_names_the_role_group_rank_and_pod() -> None:
    """What the ``dwdp`` response field and the KV side channel say about a server."""
    env = {
        "DWDP_ROLE": "context",
        "DWDP_GROUP": "demo-g1",
        "DWDP_RANK": "3",
        "DWDP_INCARNATION": "i2",
        "HOSTNAME": "demo-g1-i2-p0",
    }
    assert server_identity(environ=env) == {
        "role": "context",
        "group": "demo-g1",
        "rank": 3,
        "incarnation": 2,
        "pod": "demo-g1-i2-p0",
    }
    assert server_identity("generation", {"HOSTNAME": "laptop"}) == {"role": "generation"}
    assert server_identity(environ={}) == {}


def test_every_rank_process_draws_its_own_start_id() -> None:
    import subprocess
    import sys

    code = "from dwdp.worker.server.status import START_ID; print(START_ID)"
    ids = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(ids) == 2 and START_ID not in ids and all(len(i) == 16 for i in ids)


def test_status_carries_the_identity_and_failed_when_the_engine_died() -> None:
    ident = {"group": "g", "incarnation": 0, "revision": "r"}
    st = with_identity(NoDwdp().status(), ident)
    assert st["phase"] == "disabled" and st["revision"] == "r" and st["group"] == "g"

    dead = EngineSnapshot(EngineStats(), prefix_caching=True, failure="RuntimeError: boom")
    st = with_identity(NoDwdp().status(), ident, engine_failure(dead))
    assert st["phase"] == "failed" and st["error"] == "RuntimeError: boom"
    assert engine_failure(EngineSnapshot(EngineStats(), prefix_caching=True)) is None
    assert engine_failure(None) is None  # an engine that publishes nothing


def test_app_status_route_reports_identity() -> None:
    from fastapi.testclient import TestClient

    from dwdp.worker.server.app import build_app

    class Engine:
        model_name = "m"
        kv = None

        def snapshot(self):
            return None

    app = build_app(Engine(), identity={"group": "g1", "incarnation": 1, "revision": "rv"})
    body = TestClient(app).get("/dwdp/status").json()
    assert (body["group"], body["incarnation"], body["revision"]) == ("g1", 1, "rv")


class _SetupError(RuntimeError):
    phase = "P3"


class RendezvousTimeout(RuntimeError):
    pass


def test_termination_lines_lead_with_the_phase() -> None:
    assert phased(Stage.SETUP, _SetupError("map failed")) == "P3: _SetupError: map failed"
    assert phased("load", ValueError("bad")) == "load: ValueError: bad"
    assert phased(Stage.RENDEZVOUS, RendezvousTimeout("late")).startswith("rendezvous: ")
    line = launcher_line(2, 6, 1, "P3: SetupError: map failed")
    assert line == "P3: local rank 2 (rank 6) exited with status 1: SetupError: map failed"
    assert launcher_line(1, 1, -9, "") == "local rank 1 (rank 1) killed by signal 9"
    assert launcher_line(0, 0, 1, "no phase here") == (
        "local rank 0 (rank 0) exited with status 1: no phase here"
    )
