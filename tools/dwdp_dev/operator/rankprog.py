"""A test-only rank program: the worker's pod contract without the model.

Run as the container command of a worker pod (``python -m dwdp_dev.operator.rankprog``).
It reads the rendezvous environment (docs/design.md §5.1), runs ``DWDP_LOCAL_WORLD_SIZE`` ranks as
threads, meets the group's other ranks at a tiny TCP store that rank 0 hosts on
``DWDP_RENDEZVOUS`` (keys namespaced by group and incarnation), walks the real worker's
steps (``load``, the dense setup phases ``P1``..``P6``), meets again to ``commit``, and
serves on ``DWDP_POD_IP``, port ``DWDP_PORT + k``: ``/health``, ``/ready`` (200 only after
the commit) and ``/dwdp/status`` (``phase``, ``rank``, ``group``, ``incarnation``,
``revision``, ``layout_digest``). It speaks only the words of the rank contract
(:mod:`dwdp.api.contract`): like the worker, it answers ``/dwdp/status`` only once committed
(503 before), and its termination messages start with the worker's stage and phase words.

Controls (environment, e.g. from the DwdpDeployment's ``spec.env``):
- ``RANKPROG_FAIL_PHASE``: a step of :data:`STEPS` (``rendezvous``, ``load``, ``P1``..``P6``,
  ``commit``, ``serve``) at which a rank fails: it writes ``"<step>: ..."`` to the
  termination message path and the process exits 1 (every local rank with it:
  fail-together within the pod); ``serve`` fails right after the commit.
- ``RANKPROG_FAIL_RANK``: the global rank that fails (default: every rank).
- ``RANKPROG_FAIL_INCARNATION``: fail only in this incarnation (default: every one).
- ``RANKPROG_FAIL_GROUP``: fail only in this group (``DWDP_GROUP``; default: every one).
- ``RANKPROG_COMMIT=0``: never commit (stay in P6).
- ``RANKPROG_PHASE_S``: seconds spent in each setup phase (default 0.05).
- ``RANKPROG_REEXEC_AFTER_S``: that many seconds after every local rank committed, the
  process re-executes itself once (same pod, same pid, new start id: ranks restarted in
  place behind an open gate, as a runtime that restarts a container without telling would).
  Only in incarnation 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dwdp.api.contract import (
    DENSE_SETUP_PHASES,
    EXPERT_SETUP_PHASES,
    Env,
    RankStatus,
    Stage,
    StatusPhase,
    new_start_id,
)
from dwdp.api.defaults import SERVER_PORT

COMMIT = EXPERT_SETUP_PHASES[-1]
"""The final vote (the worker's expert ``commit`` phase)."""
SETUP_STEPS: tuple[str, ...] = (Stage.LOAD, *DENSE_SETUP_PHASES)
"""The steps between the rendezvous and the commit (model load, dense setup phases)."""
STEPS: tuple[str, ...] = (Stage.RENDEZVOUS, *SETUP_STEPS, COMMIT, Stage.SERVE)
"""The steps a rank walks, in order; each is the word of its termination message."""
TERMINATION_LOG = os.environ.get(Env.TERMINATION_LOG, "/dev/termination-log")
START_ID = new_start_id()
"""This rank program's start id (a real worker draws one per rank process too)."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class Fail(Exception):
    """A rank was told to fail (or could not go on) at step ``phase``."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase


# ----------------------------------------------------------------------------- store
class _Store(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _StoreHandler)
        self.cond = threading.Condition()
        self.arrived: dict[str, set[int]] = {}


class _StoreHandler(socketserver.StreamRequestHandler):
    """One line ``BARRIER <key> <rank> <world>``; answers ``OK`` once ``world`` ranks
    arrived at ``key``."""

    def handle(self) -> None:
        parts = self.rfile.readline().decode().split()
        if len(parts) != 4 or parts[0] != "BARRIER":
            self.wfile.write(b"ERR\n")
            return
        key, rank, world = parts[1], int(parts[2]), int(parts[3])
        store: _Store = self.server  # type: ignore[assignment]
        with store.cond:
            store.arrived.setdefault(key, set()).add(rank)
            store.cond.notify_all()
            store.cond.wait_for(lambda: len(store.arrived[key]) >= world, timeout=3600)
        self.wfile.write(b"OK\n")


def barrier(address: str, key: str, rank: int, world: int, timeout: float) -> None:
    """Wait at the store for ``world`` ranks at ``key``; raises TimeoutError/OSError."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.sendall(f"BARRIER {key} {rank} {world}\n".encode())
                answer = sock.makefile().readline().strip()
            if answer == "OK":
                return
            raise OSError(f"store answered {answer!r}")
        except (ConnectionRefusedError, socket.gaierror, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no store at {address} within {timeout:.0f} s") from None
            time.sleep(0.1)


# ----------------------------------------------------------------------------- ranks
class Rank:
    """One rank: its state, its HTTP server, its walk through the phases."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.first = _env_int(Env.RANK, 0)
        self.rank = self.first + local_rank
        self.world = _env_int(Env.WORLD_SIZE, 1)
        self.group = os.environ.get(Env.GROUP, "group")
        self.incarnation = _env_int(Env.INCARNATION, 0)
        self.revision = os.environ.get(Env.REVISION, "")
        self.step: str = Stage.CONFIG
        """The step the rank is in (the word of its termination message)."""
        self.walked: list[str] = []
        """Every step entered, in order."""
        self.phase: StatusPhase | None = None
        """The ``/dwdp/status`` phase; None before the commit (no answer yet)."""
        self.digest: str | None = None
        self.lock = threading.Lock()

    def status(self) -> dict | None:
        """The ``/dwdp/status`` body, None before the commit."""
        with self.lock:
            if self.phase is None:
                return None
            return RankStatus.build(
                phase=self.phase.value,
                rank=self.rank,
                dwdp_size=self.world,
                group=self.group,
                incarnation=self.incarnation,
                revision=self.revision,
                layout_digest=self.digest,
                leaks=0,
                start_id=START_ID,
            ).wire()

    def _enter(self, phase: str) -> None:
        with self.lock:
            self.step = phase
            self.walked.append(phase)
        told = os.environ.get("RANKPROG_FAIL_PHASE")
        who = os.environ.get("RANKPROG_FAIL_RANK")
        inc = os.environ.get("RANKPROG_FAIL_INCARNATION")
        group = os.environ.get("RANKPROG_FAIL_GROUP")
        if group not in (None, "") and group != self.group:
            return
        if (
            told == phase
            and (who in (None, "") or int(who) == self.rank)
            and (inc in (None, "") or int(inc) == self.incarnation)
        ):
            raise Fail(
                phase,
                f"rank {self.rank} of {self.group} incarnation "
                f"{self.incarnation} failed (RANKPROG_FAIL_PHASE)",
            )

    def run(self) -> None:
        """Rendezvous, setup phases, commit; raises Fail."""
        address = os.environ.get(Env.RENDEZVOUS, "127.0.0.1:29500")
        timeout = float(os.environ.get(Env.RENDEZVOUS_TIMEOUT_S, "60"))
        ns = f"dwdp/{self.group}/{self.incarnation}"
        self._enter(Stage.RENDEZVOUS)
        try:
            barrier(address, f"{ns}/join", self.rank, self.world, timeout)
        except (OSError, TimeoutError) as exc:
            raise Fail(Stage.RENDEZVOUS, str(exc)) from exc
        step = float(os.environ.get("RANKPROG_PHASE_S", "0.05"))
        for phase in SETUP_STEPS:
            self._enter(phase)
            time.sleep(step)
        if os.environ.get("RANKPROG_COMMIT", "1") == "0":
            while True:
                time.sleep(3600)
        self._enter(COMMIT)
        try:
            barrier(address, f"{ns}/commit", self.rank, self.world, timeout)
        except (OSError, TimeoutError) as exc:
            raise Fail(COMMIT, str(exc)) from exc
        text = f"{self.group}/{self.incarnation}/{self.world}/{self.revision}"
        with self.lock:
            self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            self.phase = StatusPhase.COMMITTED
        self._enter(Stage.SERVE)  # a rank told to fail at "serve" dies while serving


def _handler(rank: Rank) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/ready":
                status = rank.status()
                if status is None:
                    self._send(503, {"status": rank.step})
                else:
                    self._send(200, {"status": "ready"})
            elif self.path == "/dwdp/status":
                status = rank.status()
                if status is None:  # the worker does not answer before its commit
                    self._send(503, {"error": f"not committed ({rank.step})"})
                else:
                    self._send(200, status)
            else:
                self._send(404, {"error": "not found"})

    return Handler


def _die(line: str) -> None:
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(line + "\n")
    except OSError:
        pass
    print(line, file=sys.stderr, flush=True)
    os._exit(1)


def main() -> int:
    """Run the pod's ranks until SIGTERM (exit 0) or a failure (exit 1)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = os.environ.get(Env.CONFIG)
    if config:
        try:
            from pathlib import Path

            import yaml

            from dwdp.api.launch import LaunchConfig

            LaunchConfig.model_validate(yaml.safe_load(Path(config).read_text()))
        except Exception as exc:
            _die(f"{Stage.CONFIG}: cannot read the launch config {config}: {exc}")
    host = os.environ.get(Env.POD_IP) or "127.0.0.1"
    port = _env_int(Env.PORT, SERVER_PORT)
    local = _env_int(Env.LOCAL_WORLD_SIZE, 1)
    ranks = [Rank(k) for k in range(local)]
    if ranks[0].rank == 0:
        rdv_port = int(os.environ.get(Env.RENDEZVOUS, ":29500").rpartition(":")[2])
        store = _Store((host, rdv_port))
        threading.Thread(target=store.serve_forever, daemon=True).start()
    for r in ranks:
        server = ThreadingHTTPServer((host, port + r.local_rank), _handler(r))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def run(r: Rank) -> None:
        try:
            r.run()
        except Fail as exc:
            _die(str(exc))
        except Exception as exc:
            _die(f"{r.step}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    _reexec_later(ranks)
    while True:
        time.sleep(3600)


def _reexec_later(ranks: list[Rank]) -> None:
    """``RANKPROG_REEXEC_AFTER_S``: re-execute this process once, that long after every
    local rank committed (incarnation 0 only)."""
    after = os.environ.get("RANKPROG_REEXEC_AFTER_S")
    if not after or os.environ.get("RANKPROG_REEXECUTED") or ranks[0].incarnation != 0:
        return
    while any(r.phase is not StatusPhase.COMMITTED for r in ranks):
        time.sleep(0.1)
    time.sleep(float(after))
    os.environ["RANKPROG_REEXECUTED"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "dwdp_dev.operator.rankprog"])


if __name__ == "__main__":
    sys.exit(main())
