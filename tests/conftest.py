"""Test-suite wide settings: every test gets the marker of the folder it lives in, and the
modules that run the worker image's pods run last (``_LAST``).

tests/unit -> unit, tests/mp -> mp, tests/cluster -> cluster, tests/gpu -> gpu, so
``pytest -m "not gpu"`` (the README test command) and ``pytest -m gpu`` select by folder
without each module repeating its marker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_FOLDER_MARKERS = ("unit", "mp", "cluster", "gpu")
_TESTS = Path(__file__).parent


_LAST = ("cluster/test_e2e_demo.py", "cluster/test_router_pd.py", "cluster/test_worker_image.py")
"""Modules whose pods run the worker image (torch in up to nine containers at once): run after
every other test of the session. scripts/test.sh runs the unit tests beside the cluster and
multi-process ones, and these would share the 2 cores with them; by the end they are done."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    where = {item: _in_tests(item) for item in items}
    for item, path in where.items():
        if path is not None and path.parts[0] in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, path.parts[0]))
    # stable: the others keep their order
    items.sort(key=lambda item: (p := where[item]) is not None and p.as_posix() in _LAST)


def _in_tests(item: pytest.Item) -> Path | None:
    """The item's module relative to tests/ (None outside it)."""
    try:
        return Path(item.fspath).relative_to(_TESTS)
    except ValueError:
        return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """NIXL 1.5.1 crashes (SIGSEGV) in its native teardown at process exit once a UCX backend
    was created, after Python has finished (``python -c`` creating one agent exits 139); the
    disaggregation tests create agents in this process. When NIXL was loaded, leave without
    that teardown, with pytest's own exit status. (The worker already leaves with
    ``os._exit``.)"""
    if any(name in sys.modules for name in ("nixl_cu12", "nixl_cu13")):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash.get(_EXIT, 0))


_EXIT = pytest.StashKey[int]()
