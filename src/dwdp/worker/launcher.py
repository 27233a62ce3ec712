"""``dwdp launch``: one worker process per local rank of a pod, started and stopped together.

The pod's environment carries the rank contract of docs/design.md §5.1 for its *first* local rank:
``DWDP_RANK`` is the rank of local rank 0 (pod index x ranks per pod), ``DWDP_WORLD_SIZE`` the
group's rank count. ``DWDP_LOCAL_WORLD_SIZE`` (or ``--nproc``) says how many local ranks to
start. Each child gets ``DWDP_RANK = first + k``, ``DWDP_LOCAL_RANK = k`` and
``DWDP_LOCAL_WORLD_SIZE``, and serves HTTP on port base + k.

Fail-together within the pod: when any child exits while the launcher is not stopping (a
crash, or even a clean exit, which leaves the group short of a rank), the launcher stops the
others (SIGTERM, then SIGKILL after a grace period), writes that child's termination line to
the pod's termination message path, and exits non-zero. SIGTERM or SIGINT to the launcher is
forwarded to every child; the launcher then exits 0 only if every child did.

The rendezvous secret: children inherit ``DWDP_RENDEZVOUS_SECRET_FILE`` (the operator mounts
the group incarnation's secret). When it is unset, the launcher writes 32 random bytes to a
private file (mode 0600, in its own 0700 work directory, removed at exit) and names it in
every child's environment, so a single-pod local run needs no setup. Only this launch's
ranks share that secret: a group spread over several pods without the operator must give
every pod the same secret file (at least 32 random bytes) in ``DWDP_RENDEZVOUS_SECRET_FILE``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dwdp.api.contract import Env
from dwdp.worker.host_memory import oom_cause
from dwdp.worker.termination import write_termination_message
from dwdp.worker.transport.base import make_secret_file

log = logging.getLogger(__name__)

DEFAULT_STOP_GRACE_S = 30.0
POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """Options of the launcher; ``None`` means: from the environment or the config."""

    config: str | None = None
    role: str | None = None
    host: str = "0.0.0.0"
    port: int | None = None
    nproc: int | None = None
    termination_log: str | None = None
    stop_grace_s: float | None = None


def child_env(
    base: dict[str, str], *, first_rank: int, local_rank: int, nproc: int, config: str, term: str
) -> dict[str, str]:
    """The environment of local rank ``local_rank`` (see the module docstring)."""
    env = dict(base)
    env[Env.RANK] = str(first_rank + local_rank)
    env[Env.LOCAL_RANK] = str(local_rank)
    env[Env.LOCAL_WORLD_SIZE] = str(nproc)
    env[Env.CONFIG] = config
    env[Env.TERMINATION_LOG] = term
    return env


def _stop_grace(opts: LaunchOptions, config: str) -> float:
    if opts.stop_grace_s is not None:
        return opts.stop_grace_s
    try:
        from dwdp.worker.main import load_launch_config

        bound = load_launch_config(config).graceful_shutdown_timeout_s
    except Exception:
        bound = None
    return DEFAULT_STOP_GRACE_S if bound is None else float(bound) + 10.0


def run_launcher(opts: LaunchOptions) -> int:
    """Start the local ranks, watch them, stop them together; returns the exit status."""
    config = opts.config or os.environ.get(Env.CONFIG)
    if not config:
        line = write_termination_message(
            f"launcher: no launch config: pass --config FILE or set {Env.CONFIG}",
            opts.termination_log,
        )
        log.error("%s", line)
        return 1
    config = str(Path(config).resolve())
    try:
        nproc = opts.nproc or int(os.environ.get(Env.LOCAL_WORLD_SIZE) or 1)
        first_rank = int(os.environ.get(Env.RANK) or 0)
    except ValueError as exc:
        line = (
            f"launcher: {Env.LOCAL_WORLD_SIZE} and {Env.RANK} must be whole numbers "
            f"(got {os.environ.get(Env.LOCAL_WORLD_SIZE)!r}, {os.environ.get(Env.RANK)!r}): {exc}"
        )
        write_termination_message(line, opts.termination_log)
        log.error("%s", line)
        return 1
    if nproc < 1:
        line = f"launcher: the number of local ranks must be at least 1 (got {nproc})"
        write_termination_message(line, opts.termination_log)
        log.error("%s", line)
        return 1
    grace = _stop_grace(opts, config)
    workdir = Path(tempfile.mkdtemp(prefix="dwdp-launch-"))
    base = dict(os.environ)
    if not base.get(Env.RENDEZVOUS_SECRET_FILE):
        base[Env.RENDEZVOUS_SECRET_FILE] = str(_local_secret(workdir, nproc))
    children: list[tuple[int, subprocess.Popen, Path]] = []
    stopping: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for k in range(nproc):
            term = workdir / f"rank-{k}.termination-log"
            cmd = [sys.executable, "-m", "dwdp", "worker", "--config", config, "--host", opts.host]
            if opts.role:
                cmd += ["--role", opts.role]
            if opts.port is not None:
                cmd += ["--port", str(opts.port)]
            env = child_env(
                base,
                first_rank=first_rank,
                local_rank=k,
                nproc=nproc,
                config=config,
                term=str(term),
            )
            children.append((k, subprocess.Popen(cmd, env=env), term))
            log.info(
                "started local rank %d (rank %d), pid %d", k, first_rank + k, children[-1][1].pid
            )
        return _watch(children, stopping, grace, first_rank, opts.termination_log)
    finally:
        _stop_all(children, grace)
        _sweep_stores(base, nproc)
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(workdir, ignore_errors=True)


def _sweep_stores(env: dict[str, str], nproc: int) -> None:
    """After every local rank exited: when this launcher ran the whole group (the cpu
    backend's shared-memory stores need that), unlink the store files its ranks left (a
    rank killed in setup cannot unlink its own; /dev/shm outlives the container)."""
    group, incarnation = env.get(Env.GROUP), env.get(Env.INCARNATION, "0")
    if not group or str(nproc) != env.get(Env.WORLD_SIZE, str(nproc)):
        return
    from dwdp.worker.backend.shm_names import remove_incarnation_segments

    removed = remove_incarnation_segments(group, incarnation)
    if removed:
        log.warning("removed %d store file(s) the ranks left: %s", len(removed), ", ".join(removed))


def _local_secret(workdir: Path, nproc: int) -> Path:
    """A fresh rendezvous secret for this launch's ranks (a private file in ``workdir``)."""
    world = os.environ.get(Env.WORLD_SIZE)
    if world and world.isdigit() and int(world) > nproc:
        log.warning(
            "launcher: %s is unset: a secret was made for the %d local rank(s) of this "
            "launch only, but %s=%s; ranks of other pods will be refused by the rendezvous "
            "store (give every pod the same secret file)",
            Env.RENDEZVOUS_SECRET_FILE, nproc, Env.WORLD_SIZE, world,
        )
    return make_secret_file(workdir)


def launcher_line(local_rank: int, rank: int, code: int, cause: str) -> str:
    """The pod's termination line for a child that ended: ``<phase>: local rank k (rank r)
    <how>: <cause>``. The phase leads, as the operator classifies by the first word: the
    child's own phase (its line starts ``<phase>: ``). A child that left no phased cause
    (killed by a signal, OOM) gets no phase word, so the operator infers it (``serve`` for a
    group that was serving, else ``exit``)."""
    how = f"exited with status {code}" if code >= 0 else f"killed by signal {-code}"
    phase, sep, rest = cause.partition(": ")
    line = f"local rank {local_rank} (rank {rank}) {how}"
    if sep and phase and " " not in phase:
        return f"{phase}: {line}: {rest}"
    return f"{line}: {cause}" if cause else line


def _watch(children, stopping, grace, first_rank, termination_log) -> int:
    while True:
        if stopping["signal"] is not None:
            log.info("launcher: signal %d, stopping every local rank", stopping["signal"])
            codes = _stop_all(children, grace)
            return 0 if all(c == 0 for c in codes) else 1
        for k, proc, term in children:
            code = proc.poll()
            if code is None:
                continue
            cause = term.read_text().strip() if term.is_file() else ""
            if code == -signal.SIGKILL and not cause:
                cause = oom_cause()
            line = launcher_line(k, first_rank + k, code, cause)
            log.error("launcher: %s; stopping the other local ranks", line)
            _stop_all(children, grace)
            write_termination_message(line, termination_log)
            return code if code > 0 else 1
        time.sleep(POLL_S)


def _stop_all(children, grace: float) -> list[int]:
    """SIGTERM every live child, SIGKILL those alive after ``grace`` seconds; returns the exit
    codes (by local rank). Safe to call twice."""
    for _k, proc, _term in children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    codes = []
    for _k, proc, _term in children:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            log.warning(
                "launcher: local rank %d (pid %d) still running %.0f s after SIGTERM; SIGKILL",
                _k, proc.pid, grace,
            )
            proc.kill()
            codes.append(proc.wait())
    return codes
