"""The uvicorn lifecycle of one rank: serve until a signal, with the graceful-shutdown bound.

``graceful_shutdown_timeout_s`` (docs/design.md §6.7), when set, reaches uvicorn as
``timeout_graceful_shutdown``: handlers still running that many seconds after the stop signal
are cancelled. Unset, uvicorn's default applies (wait for every handler). Either way the engine
is stopped afterwards: in the app's lifespan shutdown and again, idempotently, in ``finally``.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def uvicorn_kwargs(
    *, host: str, port: int, graceful_shutdown_timeout_s: int | None
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``; the timeout only when set.

    Raises ``ValueError`` for a timeout that is not a positive integer.
    """
    kwargs: dict[str, Any] = {
        "host": host,
        "port": port,
        "lifespan": "on",
        "log_level": "info",
        "access_log": False,
    }
    if graceful_shutdown_timeout_s is not None:
        if (
            isinstance(graceful_shutdown_timeout_s, bool)
            or not isinstance(graceful_shutdown_timeout_s, int)
            or graceful_shutdown_timeout_s <= 0
        ):
            raise ValueError(
                "graceful_shutdown_timeout_s: must be a positive integer number of seconds, "
                f"got {graceful_shutdown_timeout_s!r}"
            )
        kwargs["timeout_graceful_shutdown"] = graceful_shutdown_timeout_s
    return kwargs


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    graceful_shutdown_timeout_s: int | None,
    stop_engine: Callable[[], None],
    on_started: Callable[[], None] | None = None,
    server_holder: dict[str, Any] | None = None,
) -> None:
    """Run ``app`` on uvicorn in this (main) thread until SIGINT/SIGTERM, then stop the
    engine, whatever happened; returns normally after a signalled stop. ``on_started`` runs
    once the socket listens; ``server_holder["server"]`` receives the ``uvicorn.Server``
    (set its ``should_exit`` to stop it from elsewhere)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        **uvicorn_kwargs(
            host=host, port=port, graceful_shutdown_timeout_s=graceful_shutdown_timeout_s
        ),
    )
    server = uvicorn.Server(config)
    if server_holder is not None:
        server_holder["server"] = server
    if on_started is not None:
        original = server.startup

        async def startup(sockets: Any = None) -> None:
            await original(sockets=sockets)
            if server.started:
                on_started()

        server.startup = startup  # type: ignore[method-assign]
    # uvicorn re-raises the stop signal once it has shut down, to the handlers it found: a
    # signal handler of ours turns that into a normal return, so the engine stop and the
    # caller's teardown run and a signalled stop exits 0.
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _note_stop)
    try:
        server.run()
    finally:
        stop_engine()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not server.started:
        raise RuntimeError(f"the HTTP server could not start on {host}:{port}")


def _note_stop(signum: int, _frame: Any) -> None:
    log.info("stop signal %d: the server has shut down", signum)
