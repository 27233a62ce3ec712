"""The package build is quiet and ships what the runtime reads from files.

The wheel and the editable wheel are built through setuptools' PEP 517 backend (what pip
runs) from a copy of the files the build reads. setuptools warns about every folder it finds
with files but no declaration ("Package 'dwdp.devcluster.go' is absent from the `packages`
configuration", about 50 lines each); the build must print no warning, and the wheel must
hold the Go sources of the local control plane and the CUDA kernels' sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

import dwdp

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("pyproject.toml", "README.md", "src", "api", "operator", "worker", "kernels")
"""What the build reads (src/dwdp links to the sub-package folders), plus tools/devcluster."""

_BUILD = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
out = sys.argv[1]
print("BUILT", build_meta.build_wheel(out))
print("BUILT", build_meta.build_editable(out))
"""


def _copy_inputs(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in BUILD_INPUTS:
        src = REPO / name
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(src, dest / name, follow_symlinks=False)
    shutil.copytree(REPO / "tools" / "devcluster", dest / "tools" / "devcluster", ignore=ignore)


def test_build_is_quiet_and_ships_the_data_files(tmp_path: Path) -> None:
    src = tmp_path / "src-copy"
    src.mkdir()
    _copy_inputs(src)
    out = tmp_path / "dist"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out)],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    warnings = [
        line
        for line in log.splitlines()
        if "Warning" in line or "absent from" in line or "warning: " in line.lower()
        if "byte-compiling is disabled" not in line  # PYTHONDONTWRITEBYTECODE, not ours
    ]
    assert warnings == [], "\n".join(warnings)
    (wheel,) = (p for p in out.glob("dwdp-*.whl") if "editable" not in p.name)
    assert wheel.name.startswith(f"dwdp-{dwdp.__version__}-"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "dwdp/py.typed",
        "dwdp/devcluster/go/main.go",
        "dwdp/devcluster/go/go.mod",
        "dwdp/devcluster/go/go.sum",
        "dwdp/kernels/gather_register.cu",
        "dwdp/kernels/gather_common.cuh",
    ):
        assert data in names, data
    assert not any(n.endswith(".pyc") for n in names)


def test_one_version_for_the_package_the_command_the_chart_and_the_images() -> None:
    """``dwdp --version`` prints ``dwdp.__version__``, which the wheel's metadata reads
    (pyproject's dynamic version), the chart's appVersion repeats (the operator image's
    default tag) and scripts/build-images.sh stamps on the images (their version label)."""
    out = subprocess.run(
        [sys.executable, "-m", "dwdp", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"dwdp {dwdp.__version__}"
    chart = yaml.safe_load((REPO / "charts" / "dwdp-operator" / "Chart.yaml").read_text())
    assert chart["appVersion"] == dwdp.__version__
    assert 'dynamic = ["version"]' in (REPO / "pyproject.toml").read_text()
