"""Where an HTTP server of a rank listens: the bound socket and uvicorn's settings.

Shared by the rank's API server process (``dwdp.worker.server.api_process``), the router gate
(``dwdp.worker.gate.run``) and the test servers, below all of them.
"""

from __future__ import annotations

import socket
from typing import Any


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


class ListenError(Exception):
    """An HTTP server's address cannot be bound (the port in use, an address not of this
    host, a privileged port); the message names the address and the cause."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), for
    ``uvicorn.Server.serve(sockets=[...])``, which listens on it: binding first lets a
    failure name its cause in one line, where uvicorn logs it and exits. Raises
    :class:`ListenError`."""
    sock = None
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
