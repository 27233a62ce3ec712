"""Names of the cpu backend's store files in ``/dev/shm``, without torch (the launcher
sweeps what killed ranks left; ``dwdp.worker.backend.cpu`` makes and maps the files)."""

from __future__ import annotations

import contextlib
import os
import re

SHM_DIR = "/dev/shm"
"""Where the store files live (a tmpfs on Linux)."""

SEGMENT_PREFIX = "dwdp-"
"""Every store file name starts with this (``dwdp-<group>-<incarnation>-<rank>-<tag>``)."""

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.]+")


def _safe(part: str) -> str:
    return _NAME_UNSAFE.sub("_", part) or "_"


def segment_name(group: str, incarnation: str, rank: int, tag: str) -> str:
    """The file name of rank ``rank``'s store ``tag`` (characters outside [A-Za-z0-9_.]
    become ``_``, so ``-`` separates the parts)."""
    return f"{SEGMENT_PREFIX}{_safe(group)}-{_safe(incarnation)}-{rank}-{_safe(tag)}"


def remove_incarnation_segments(group: str, incarnation: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every store file of ``group``'s ``incarnation`` left in ``shm_dir`` (ranks
    killed before they could unlink theirs); returns the names removed. Only for a caller
    that knows every rank of that incarnation has exited (``dwdp launch`` of a whole group)."""
    prefix = f"{SEGMENT_PREFIX}{_safe(group)}-{_safe(incarnation)}-"
    removed = []
    for name in leftover_segments(group, shm_dir):
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    return removed


def leftover_segments(group: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Store files of ``group`` still present in ``shm_dir`` (tests: must be empty)."""
    prefix = f"{SEGMENT_PREFIX}{_safe(group)}-"
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix))
    except FileNotFoundError:
        return []
