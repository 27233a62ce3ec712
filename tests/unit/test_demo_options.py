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


def _parse_only(*args: str) -> subprocess.CompletedProcess[str]:
    """``scripts/demo.py --parse-only ARGS`` with the standard library alone (-S -I: no
    site-packages, no environment), as demo.sh runs it before .venv exists."""
    return subprocess.run([sys.executable, "-S", "-I", str(REPO / "scripts" / "demo.py"),
                           "--parse-only", *args], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize(("args", "status"), [(("--requests", "3"), 0), (("--help",), 10)])
def test_options_are_checked_with_the_standard_library_alone(
    args: tuple[str, ...], status: int
) -> None:
    # demo.sh runs this before .venv exists, with the system's Python (no PyYAML, no dwdp)
    proc = _parse_only(*args)
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "node"), [((), "real"), (("--node", "process"), "process"),
                                           (("--node=process",), "process")])
def test_the_options_name_the_node_demo_sh_installs_packages_for(
    args: tuple[str, ...], node: str
) -> None:
    # demo.sh installs the real node's system packages only when the demo runs one
    proc = _parse_only(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{node}\n"


def test_a_state_dir_the_demo_did_not_make_is_refused_and_kept(tmp_path: Path) -> None:
    # the demo deletes its state folder when it ends: a folder of the user's must never be it
    (tmp_path / "notes.txt").write_text("mine")
    for path, words in [
        (str(tmp_path), f"'{tmp_path}' holds files the demo did not make"),
        ("", "must be a folder path (got an empty one)"),
        (str(tmp_path / "notes.txt"), f"'{tmp_path / 'notes.txt'}' exists and is not a folder"),
    ]:
        proc = _parse_only("--state-dir", path)
        assert proc.returncode == 2, proc.stderr
        assert f"argument --state-dir: {words}" in proc.stderr, proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("made", ["new", "empty", "by-a-demo"])
def test_a_new_empty_or_demo_made_state_dir_is_taken(tmp_path: Path, made: str) -> None:
    state = tmp_path / "state"
    if made != "new":
        state.mkdir()
    if made == "by-a-demo":
        (state / ".dwdp-demo-state").write_text("")
        (state / "models").mkdir()
    proc = _parse_only("--state-dir", str(state))
    assert proc.returncode == 0, proc.stderr
