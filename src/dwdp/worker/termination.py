"""The termination message of a worker: one line naming the cause of a fatal error.

Kubernetes reads the container's termination message from ``terminationMessagePath``
(default ``/dev/termination-log``); the operator classifies a group failure from it. The path
is configurable (``--termination-log`` or ``DWDP_TERMINATION_LOG``) for local runs and tests.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dwdp.api.contract import Env

log = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/termination-log"
MAX_CHARS = 4000
"""Kubernetes keeps at most 4096 bytes of a termination message."""


def termination_path(flag: str | None = None) -> str:
    """The path to write: the flag, else ``DWDP_TERMINATION_LOG``, else the default."""
    return flag or os.environ.get(Env.TERMINATION_LOG) or DEFAULT_PATH


def one_line(exc: BaseException | str) -> str:
    """``"<ErrorType>: <first line>"`` for an exception (a string is kept), cut to fit."""
    if isinstance(exc, BaseException):
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    else:
        line = " ".join(exc.split())
    return line[:MAX_CHARS]


def write_termination_message(cause: BaseException | str, path: str | None = None) -> str:
    """Write the one-line cause to the termination message path; returns the line.

    Never raises: a path that cannot be written (no such directory, no permission, as on a
    developer machine) is logged and skipped.
    """
    line = one_line(cause)
    target = termination_path(path)
    try:
        Path(target).write_text(line + "\n")
    except OSError as exc:
        log.warning("cannot write the termination message to %s: %s", target, exc)
    return line
