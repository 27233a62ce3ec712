"""The pid files of the local cluster's processes, and how those processes are stopped.

A pid file records the pid with its start time, so a reused pid is never mistaken for ours;
processes are stopped by process group, SIGTERM first and SIGKILL after a bound. Shared by
the cluster (cluster.py), its real node (realnode.py) and the process kubelet (kubelet.py),
below all three.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def write_pidfile(path: Path, pid: int) -> None:
    """Record ``pid`` with its start time (so a reused pid is never mistaken for ours)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {_proc_start_time(pid) or '-'}\n")


def read_pidfile(path: Path) -> int | None:
    """Return the pid recorded in ``path`` if that very process still runs, else None."""
    try:
        pid_s, start = path.read_text().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    if not alive(pid) or (start != "-" and _proc_start_time(pid) != start):
        return None
    return pid


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (and to ``pid``); ignore if gone."""
    for fn, target in ((os.killpg, pid), (os.kill, pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            fn(target, sig)


def stop_pids(pids: list[int], timeout_s: float) -> None:
    """SIGTERM each process group, wait up to ``timeout_s`` seconds, then SIGKILL what is left."""
    for pid in pids:
        kill_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        _reap()
        time.sleep(0.05)
    for pid in pids:
        kill_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        _reap()
        time.sleep(0.05)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
