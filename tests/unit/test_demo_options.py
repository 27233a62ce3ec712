"""scripts/demo.sh checks its options before any set-up: a bad one fails at once with
argparse's message naming it (on a fresh machine the set-up it skips takes minutes), and
``--help`` prints and stops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), *args], capture_output=True,
                          text=True, timeout=60, check=False, env=env)


@pytest.mark.parametrize(("args", "words"), [
    (("--requests", "0"), "argument --requests: must be at least 1 (got 0)"),
    (("--requests", "-1"), "argument --requests: must be at least 1 (got -1)"),
    (("--requests", "many"), "argument --requests: must be a whole number (got 'many')"),
    (("--nosuchflag",), "unrecognized arguments: --nosuchflag"),
])
def test_a_bad_option_fails_before_any_set_up(args: tuple[str, ...], words: str) -> None:
    proc = _demo(*args)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert "==" not in proc.stdout  # no set-up step began (each announces itself with ==)


def test_help_prints_and_stops() -> None:
    proc = _demo("--help")
    assert proc.returncode == 0 and "--requests" in proc.stdout
    assert "==" not in proc.stdout


@pytest.mark.parametrize(("args", "status"), [(("--requests", "3"), 0), (("--help",), 10)])
def test_options_are_checked_with_the_standard_library_alone(
    args: tuple[str, ...], status: int
) -> None:
    # demo.sh runs this before .venv exists, with the system's Python (no PyYAML, no
    # dwdp): -S -I leaves out every site-packages folder and the environment
    proc = subprocess.run([sys.executable, "-S", "-I", str(REPO / "scripts" / "demo.py"),
                           "--parse-only", *args], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
