"""Helpers of the multi-process tests: fork real rank processes, collect their records.

Ranks are forked from the test process (torch is imported once; on 2 shared cores four
fresh interpreters would spend most of a test importing it). Every rank is a real process
with its own memory, talking over a real TCP store and sharing real /dev/shm files. After
each test: no rank process is left running and no store file of the test's group is left.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dwdp.worker.backend.cpu import leftover_segments

RENDEZVOUS_SECRET = os.urandom(32)
"""The rendezvous secret of the groups the tests fork (every forked rank holds it)."""


def write_secret(directory: Path, name: str = "rendezvous-secret") -> Path:
    """A private file (mode 0600) in ``directory`` holding :data:`RENDEZVOUS_SECRET`, as the
    operator mounts one; ``DWDP_RENDEZVOUS_SECRET_FILE`` names it."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(RENDEZVOUS_SECRET)
    return path


class RankProcesses:
    """Fork ``target(rank, out_dir)`` per rank; ``wait`` reaps them or kills stragglers."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}

    def start(self, ranks: list[int], target: Callable[[int, Path], None]) -> None:
        # Garbage of earlier tests (a NIXL agent in a reference cycle, say) is finalized here,
        # not in a rank: a rank's own gc.collect() would run its finalizer against UCX state
        # that is pytest's, and UCX aborts the rank ("unable to modify event set")
        gc.collect()
        for rank in ranks:
            pid = os.fork()
            if pid == 0:  # the rank process: never return into pytest
                code = 0
                try:
                    target(rank, self.out)
                except BaseException:
                    (self.out / f"crash.{rank}.txt").write_text(traceback.format_exc())
                    code = 1
                finally:
                    os._exit(code)
            self.pids[rank] = pid

    def wait(self, timeout_s: float) -> dict[int, int]:
        """Exit codes by rank; ranks still running after ``timeout_s`` are killed and
        reported as -9."""
        deadline = time.monotonic() + timeout_s
        codes = self.codes
        while len(codes) < len(self.pids) and time.monotonic() < deadline:
            for rank, pid in self.pids.items():
                if rank in codes:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        for rank, pid in self.pids.items():
            if rank not in codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[rank] = -9
        return dict(codes)

    def alive(self) -> list[int]:
        """Pids of rank processes not reaped yet that still exist."""
        alive = []
        for rank, pid in self.pids.items():
            if rank in self.codes:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            alive.append(pid)
        return alive


def run_worker_rank(rank: int, *, group: str, world: int, port: int, config: Path,
                    termination_log: Path, timeout_s: float = 120) -> int:
    """Run ``dwdp worker``'s ``run_worker`` in this (rank) process as rank ``rank`` of
    ``world`` (the operator's environment, the store on 127.0.0.1:``port``); returns its
    exit status."""
    from dwdp.worker.main import WorkerOptions, run_worker

    secret = write_secret(termination_log.parent, f"rendezvous-secret.{rank}")

    os.environ.update({
        "DWDP_GROUP": group,
        "DWDP_INCARNATION": "i0",
        "DWDP_RANK": str(rank),
        "DWDP_LOCAL_RANK": str(rank),
        "DWDP_WORLD_SIZE": str(world),
        "DWDP_RENDEZVOUS": f"127.0.0.1:{port}",
        "DWDP_RENDEZVOUS_TIMEOUT_S": str(timeout_s),
        "DWDP_RENDEZVOUS_SECRET_FILE": str(secret),
        "DWDP_TORCH_THREADS": "1",
    })
    return run_worker(WorkerOptions(config=str(config), termination_log=str(termination_log)))


def run_group(out: Path, group: str, world: int, target: Callable[[int, Path], None], *,
              timeout_s: float = 600) -> None:
    """Fork ``target(rank, out)`` for every rank of one group and wait: every rank must
    exit 0 without a crash file, and no store segment of ``group`` may be left."""
    procs = RankProcesses(out)
    procs.start(list(range(world)), target)
    codes = procs.wait(timeout_s=timeout_s)
    crashes = sorted(out.glob("crash.*.txt"))
    assert not crashes, "\n".join(p.read_text() for p in crashes)
    assert codes == dict.fromkeys(range(world), 0)
    assert not leftover_segments(group)


@pytest.fixture
def group() -> Iterator[str]:
    """A DWDP group name unique to the test; no store file of it may survive the test."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    left = leftover_segments(name)
    for leftover in left:  # clean up, then fail: a leftover is a bug
        os.unlink(os.path.join("/dev/shm", leftover))
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[RankProcesses]:
    procs = RankProcesses(tmp_path)
    yield procs
    procs.wait(timeout_s=5)
    assert not procs.alive(), "rank processes left behind"


def read_records(out: Path, prefix: str, world: int) -> list[dict]:
    """The JSON records ``<prefix>.<rank>.json`` of every rank (fails on a crash file)."""
    crashes = sorted(out.glob("crash.*.txt"))
    assert not crashes, "\n".join(p.read_text() for p in crashes)
    return [json.loads((out / f"{prefix}.{r}.json").read_text()) for r in range(world)]
