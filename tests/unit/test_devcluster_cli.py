"""``dwdp dev env`` and ``dwdp dev kubeconfig`` of a state folder that holds no cluster fail
(exit 1) with one line naming the folder, and print no exports a shell would trust; ``dwdp
dev down`` of such a folder leaves it as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _dwdp_dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dwdp", "dev", *args], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("action", ["env", "kubeconfig"])
def test_a_missing_cluster_fails_naming_its_state_folder(tmp_path: Path, action: str) -> None:
    missing = tmp_path / "no-such-cluster"
    proc = _dwdp_dev(action, "--state-dir", str(missing))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert f"no cluster in {missing}; run `dwdp dev up`" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not missing.exists()  # asking created nothing


def test_down_of_a_folder_without_a_cluster_touches_nothing(tmp_path: Path) -> None:
    """``dwdp dev down [--purge]`` of a folder that holds no cluster (no cluster.json), such
    as a mistyped ``--state-dir /etc``: one line saying so, exit 0, and the folder as it was
    (no lock file written; --purge deletes nothing)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    for args in ([], ["--purge"]):
        proc = _dwdp_dev("down", "--state-dir", str(foreign), *args)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        said = f"no cluster in {foreign} (no cluster.json): nothing stopped or deleted\n"
        assert proc.stdout == said
        assert sorted(p.name for p in foreign.iterdir()) == ["keep"]
    missing = tmp_path / "missing"
    assert _dwdp_dev("down", "--state-dir", str(missing)).stdout.startswith("no cluster in ")
    assert not missing.exists()
