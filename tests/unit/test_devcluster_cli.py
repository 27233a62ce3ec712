"""``dwdp dev env`` and ``dwdp dev kubeconfig`` of a state folder that holds no cluster fail
(exit 1) with one line naming the folder, and print no exports a shell would trust."""

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
