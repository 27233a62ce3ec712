"""Test-suite wide settings: every test gets the marker of the folder it lives in.

tests/unit -> unit, tests/mp -> mp, tests/cluster -> cluster, tests/gpu -> gpu, so
``pytest -m "not gpu"`` (the README test command) and ``pytest -m gpu`` select by folder
without each module repeating its marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_FOLDER_MARKERS = ("unit", "mp", "cluster", "gpu")
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(item.fspath).relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        if folder in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))
