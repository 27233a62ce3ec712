"""The type checker of the test command catches a wrong call across packages.

``scripts/test.sh`` runs mypy over the package ``dwdp`` (configuration in pyproject.toml).
This feeds it a checked-in negative example, ``tests/typecheck/wrong_cross_package_call.py``,
with the same configuration, and expects exactly the errors that file marks ``# expect:``:
if the package map stopped resolving (``dwdp.api`` unknown to the checker) or the API lost
its annotations, the expected errors would not appear and this test fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "typecheck" / "wrong_cross_package_call.py"


def _expected(path: Path) -> set[tuple[int, str]]:
    """(line, error code) of every ``# expect: CODE`` comment in ``path``."""
    out = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        m = re.search(r"#\s*expect:\s*([a-z-]+)", line)
        if m:
            out.add((number, m.group(1)))
    return out


def test_mypy_refuses_the_wrong_cross_package_call(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "mypy",
            "--config-file", str(REPO / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "cache"),
            "--show-error-codes", "--no-error-summary",
            str(EXAMPLE.relative_to(REPO)),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    found = {
        (int(m.group(1)), m.group(2))
        for m in re.finditer(r":(\d+): error: .*\[([a-z-]+)\]$", proc.stdout, re.MULTILINE)
    }
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert found == _expected(EXAMPLE), proc.stdout
