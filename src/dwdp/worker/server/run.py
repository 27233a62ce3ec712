"""The serving lifecycle of one rank: its API server process, its own app and the engine core,
until a signal, with the graceful-shutdown bound.

``graceful_shutdown_timeout_s`` (docs/design.md §6.7), when set, reaches the API process's
uvicorn as ``timeout_graceful_shutdown``: handlers still running that many seconds after the
stop signal are cancelled. Unset, uvicorn's default applies (wait for every handler). Either
way the engine is stopped afterwards: in the rank app's lifespan shutdown and again,
idempotently, in ``finally``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


SOCKET_PATH_MAX = 107
"""The longest path a Unix socket can be bound at (``sun_path``'s 108 bytes, the NUL included);
ZMQ's ``ipc://`` addresses share the bound."""


def rank_dir_prefix() -> str:
    """The name a rank's private socket directory starts with (``tempfile.mkdtemp`` adds 8
    characters): named by the rank's pid, so its API process can find and remove it."""
    return f"dwdp-rank-{os.getpid()}-"


def check_socket_dir() -> None:
    """Check, before anything loads, that the rank's sockets fit under the temporary folder
    (``tempfile.gettempdir()``: ``TMPDIR``, ``TEMP``, ``TMP`` or /tmp).

    Raises ``ValueError`` naming the folder and the bound when
    ``<tmpdir>/dwdp-rank-<pid>-XXXXXXXX/control`` (the longer of its two sockets, ``core`` and
    ``control``) is longer than ``SOCKET_PATH_MAX`` bytes."""
    import tempfile

    folder = tempfile.gettempdir()
    longest = os.path.join(folder, rank_dir_prefix() + "x" * 8, "control")
    size = len(os.fsencode(longest))
    if size > SOCKET_PATH_MAX:
        raise ValueError(
            f"TMPDIR: the temporary folder {folder!r} is too long for the rank's Unix sockets "
            f"({longest!r} is {size} bytes, the bound is {SOCKET_PATH_MAX}); "
            "set TMPDIR to a shorter path")


def _take_stop_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """Install ``handler`` for SIGINT and SIGTERM and return the handlers it replaced (for
    :func:`_restore_handlers`); outside the main thread nothing changes (``{}``)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@contextlib.contextmanager
def returning_on_stop_signals(on_stop: Callable[[], None] | None = None) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM are logged and ``on_stop`` runs, instead of the
    default (main thread only).

    uvicorn re-raises the stop signal once it has shut down, to the handlers it found: this
    handler turns that into a normal return, so the engine stop and the caller's teardown run
    and a signalled stop exits 0."""
    previous = _take_stop_signals(functools.partial(_note_stop, on_stop))
    try:
        yield
    finally:
        _restore_handlers(previous)


class StopRequested(BaseException):
    """A stop signal (SIGTERM, SIGINT) reached a rank before it served. Raised where the rank
    was (the load, the rendezvous, ...) so that it unwinds through its cleanups and exits 0:
    a pod deleted while its model loads stops cleanly, not killed by the signal. A
    ``BaseException``, so no ``except Exception`` records it as a failure."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stop signal {signum}")
        self.signum = signum


class StopBeforeServing:
    """Stop signals of a rank before it serves: the first SIGTERM or SIGINT raises
    :class:`StopRequested` in the main thread. One that comes once serving began
    (``serving()`` true) but before ``serve_with_api_process`` took the signals over is kept
    (:attr:`pending`), for it to act on; later ones, and those once the rank is tearing down
    (:meth:`quiet`), are logged and ignored, so that its cleanups run to their end. Outside
    the main thread nothing changes."""

    def __init__(self, serving: Callable[[], bool]) -> None:
        self._serving = serving
        self._ignore = False
        self.pending: int | None = None
        """The stop signal that came after serving began, before it was handled."""
        self._previous = _take_stop_signals(self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._ignore:
            log.info("stop signal %d: already stopping", signum)
            return
        self._ignore = True
        if self._serving():
            log.info("stop signal %d: the rank stops as soon as it serves", signum)
            self.pending = signum
            return
        raise StopRequested(signum)

    def quiet(self) -> None:
        """From now on, log and ignore stop signals (the rank is tearing down)."""
        self._ignore = True

    def restore(self) -> None:
        """Put back the handlers found at the start."""
        _restore_handlers(self._previous)


def _note_stop(on_stop: Callable[[], None] | None, signum: int, _frame: Any) -> None:
    log.info("stop signal %d", signum)
    if on_stop is not None:
        on_stop()


class ApiProcess:
    """A rank's API server process (``dwdp.worker.server.api_process``) and its private socket
    directory (mode 0700: the link's trust boundary; ``rank_dir_prefix``).

    Made early (``dwdp worker`` makes it at the config stage), the process imports its modules
    and loads the tokenizer of ``tokenizer`` (a checkpoint directory) while the rank loads the
    model, then waits on its standard input; ``tell`` sends it the rest of its spec once the
    engine runs; ``close`` ends the process if it still runs and removes the directory. (A rank
    killed before ``tell`` closes the process's input by dying: the process then removes the
    directory itself and exits 0.) Raises ``ValueError`` when the temporary folder leaves
    no room for the sockets (``check_socket_dir``)."""

    def __init__(self, tokenizer: str) -> None:
        import subprocess
        import sys
        import tempfile

        check_socket_dir()
        self.workdir = tempfile.mkdtemp(prefix=rank_dir_prefix())
        self.core_address = f"ipc://{self.workdir}/core"
        self.control_socket = f"{self.workdir}/control"
        # a group of its own: a terminal's Ctrl-C reaches the rank, which stops it in order
        self.proc = subprocess.Popen([sys.executable, "-m", "dwdp.worker.server.api_process"],
                                     stdin=subprocess.PIPE, text=True, process_group=0)
        self._write(json.dumps({"tokenizer": tokenizer, "control_socket": self.control_socket})
                    + "\n")

    def _write(self, text: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # a process that failed keeps its exit status
            self.proc.stdin.write(text)
            self.proc.stdin.flush()

    def tell(self, spec: Any) -> None:
        """Send the rest of the spec (an ``ApiProcessSpec``): the process starts serving."""
        self._write(spec.to_json())
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]

    def exit_message(self) -> str | None:
        """``None`` while the process runs; else "the API server process exited with status N",
        plus the cause it left when it could not start (``failure_of``)."""
        from dwdp.worker.server.api_process import failure_of

        ended = self.proc.poll()
        if ended is None:
            return None
        cause = failure_of(self.control_socket)
        return f"the API server process exited with status {ended}" + (
            f": {cause}" if cause else "")

    def check(self) -> None:
        """Raise ``RuntimeError`` (``exit_message``) when the process has ended: a rank whose API
        process died while it loaded fails then, not after its setup."""
        message = self.exit_message()
        if message is not None:
            raise RuntimeError(message)

    def wait_loaded(self, poll_s: float = 0.05) -> None:
        """Wait until the process has loaded what it serves with (its modules and the
        tokenizer: with transformers, torch too, about half a GiB), so the memory the rank
        measures next includes it. Raises ``RuntimeError`` (``exit_message``) when the
        process ends first."""
        from dwdp.worker.server.api_process import LOADED_FILE

        loaded = os.path.join(self.workdir, LOADED_FILE)
        while not os.path.exists(loaded):
            self.check()
            time.sleep(poll_s)

    def stop(self, wait_s: float | None) -> None:
        """SIGTERM the process if it still runs (serving, it drains), wait ``wait_s`` seconds
        (``None``: until it exits), then SIGKILL."""
        import subprocess

        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.warning("the API server process did not stop in %s s: killed", wait_s)
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """End the process if it still runs (``stop``, 10 s) and remove the socket directory.
        Safe to call twice."""
        import shutil

        self.stop(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def serve_with_api_process(
    control_app: Any,
    engine: Any,
    api: dict[str, Any],
    *,
    stop_engine: Callable[[], None],
    server_holder: dict[str, Any] | None = None,
    process: ApiProcess,
    stop_pending: Callable[[], bool] = lambda: False,
) -> None:
    """Serve ``engine`` through an API server process until SIGINT/SIGTERM, the API process's
    end or ``server_holder["stop"]()``; then stop the API process (SIGTERM: it drains within
    its graceful bound), the rank's app and the engine.

    ``control_app``: the rank's own app (``build_app(..., openai=False)``), served on a Unix
    socket in the process's private directory, beside the engine core's ``ipc://`` socket;
    ``api``: the ``ApiProcessSpec`` fields the caller knows (host, port, names, limits,
    identity, graceful bound); ``process``: the ``ApiProcess`` the caller started (early, so
    that it loads the tokenizer meanwhile); it is closed here; ``stop_pending()``:
    whether a stop signal came before this took the signals over
    (``StopBeforeServing.pending``): then it stops at once, through the same teardown. Raises
    ``RuntimeError`` when the API process cannot listen or exits on its own with a failure.
    """
    import uvicorn

    from dwdp.worker.server.api_process import EXIT_CANNOT_LISTEN, ApiProcessSpec
    from dwdp.worker.server.engine_core import EngineCoreServer

    stop = threading.Event()
    if server_holder is not None:
        server_holder["stop"] = stop.set
    core = control = thread = None
    # the handlers stay until everything has stopped: a second signal (Ctrl-C reaches the
    # whole process group, and the launcher follows with SIGTERM) must not cut the drain
    with returning_on_stop_signals(on_stop=stop.set):
        if stop_pending():
            stop.set()
        try:
            core = EngineCoreServer(engine, process.core_address).start()
            control = uvicorn.Server(uvicorn.Config(
                control_app, uds=process.control_socket, lifespan="on", log_level="warning",
                access_log=False))
            thread = threading.Thread(target=control.run, name="dwdp-rank-app", daemon=True)
            thread.start()
            while not control.started and thread.is_alive():
                time.sleep(0.02)
            process.tell(ApiProcessSpec(**api, core_address=process.core_address,
                                        control_socket=process.control_socket,
                                        parent_pid=os.getpid()))
            proc = process.proc
            while not stop.wait(0.2) and proc.poll() is None:
                pass
            ended = proc.poll()
            if ended is None:  # drain: the graceful bound and 10 s, or without one, all of it
                bound = api.get("graceful_shutdown_timeout_s")
                process.stop(None if bound is None else bound + 10)
            elif ended == EXIT_CANNOT_LISTEN:
                raise RuntimeError(
                    f"the HTTP server could not start on {api['host']}:{api['port']}")
            elif ended != 0:
                process.check()
        finally:
            if process.proc.poll() is None:
                process.proc.kill()
            if control is not None and thread is not None:
                control.should_exit = True
                thread.join(30)
            if core is not None:
                core.stop()
            stop_engine()
            process.close()
