"""The package builds are quiet, ship what the runtime reads from files, and keep the product
apart from its development tooling.

Both distributions, the product (``dwdp``, the repository root) and the development tooling
(``dwdp-dev``, tools/), are built through setuptools' PEP 517 backend (what pip runs) from a
copy of the files their builds read. setuptools warns about every folder it finds with files but
no declaration ("Package 'dwdp_dev.devcluster.go' is absent from the `packages` configuration",
about 50 lines each); no build may print a warning. The product wheel holds the CUDA kernels'
sources and no development module (local control plane, test helpers, fake backend, wave
engine); the development wheel holds the Go sources of the local control plane.
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
PRODUCT_INPUTS = ("pyproject.toml", "src")
"""What the product build reads (the images copy the same, and nothing else: no README.md, so
an edit of it rebuilds no image)."""

_BUILD = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
out = sys.argv[1]
print("BUILT", build_meta.build_wheel(out))
print("BUILT", build_meta.build_editable(out))
"""

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def _build(src: Path, out: Path) -> None:
    """Build the wheel and the editable wheel of the project in ``src`` into ``out``; assert
    the build succeeds and prints no warning."""
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


def _wheel_names(out: Path, dist: str) -> set[str]:
    (wheel,) = (p for p in out.glob(f"{dist}-*.whl") if "editable" not in p.name)
    assert wheel.name.startswith(f"{dist}-{dwdp.__version__}-"), wheel.name
    return set(zipfile.ZipFile(wheel).namelist())


def test_product_wheel_ships_the_kernels_and_no_development_code(tmp_path: Path) -> None:
    src = tmp_path / "product"
    src.mkdir()
    for name in PRODUCT_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=_IGNORE)
        else:
            shutil.copy2(REPO / name, src / name)
    _build(src, tmp_path / "dist")
    names = _wheel_names(tmp_path / "dist", "dwdp")
    kernels = ("dwdp/kernels/gather_register.cu", "dwdp/kernels/gather_common.cuh")
    for data in ("dwdp/py.typed", *kernels):
        assert data in names, data
    modules = {n for n in names if n.endswith(".py")}
    assert "dwdp/worker/server/app.py" in modules and "dwdp/operator/plan.py" in modules
    tops = {n.split("/")[0] for n in names if not n.startswith("dwdp-")}
    assert tops == {"dwdp"}, tops  # no top-level `operator`, no dwdp_dev
    # exactly the modules of src/dwdp: nothing of tools/ (the local control plane, test
    # helpers, the fake backend, the wave engine) rides along
    sources = {str(f.relative_to(REPO / "src")) for f in (REPO / "src" / "dwdp").rglob("*.py")}
    assert modules == sources, sorted(modules ^ sources)
    dev_words = ("devcluster", "testing", "fake_backend", "wave_engine", "rankprog")
    assert [n for n in modules if any(w in n for w in dev_words)] == []
    assert not any(n.endswith(".pyc") for n in names)


def test_development_wheel_ships_the_control_plane_sources(tmp_path: Path) -> None:
    src = tmp_path / "tools"
    shutil.copytree(REPO / "tools", src, ignore=_IGNORE)
    _build(src, tmp_path / "dist")
    names = _wheel_names(tmp_path / "dist", "dwdp_dev")
    for data in (
        "dwdp_dev/devcluster/go/main.go",
        "dwdp_dev/devcluster/go/go.mod",
        "dwdp_dev/devcluster/go/go.sum",
        "dwdp_dev/operator/rankprog.py",
        "dwdp_dev/worker/fake_backend.py",
    ):
        assert data in names, data
    assert {n.split("/")[0] for n in names if not n.startswith("dwdp_dev-")} == {"dwdp_dev"}


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


def test_nothing_at_the_repository_root_hides_a_standard_library_module() -> None:
    """A Python started in the repository root (``sys.path[0]`` is the current folder) imports
    the standard library's ``operator``, not the operator's folder, and no top-level entry of
    the repository is importable under a standard-library name."""
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import operator; print(operator.__file__)"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert not Path(out.stdout.strip()).resolve().is_relative_to(REPO), out.stdout
    shadows = sorted(
        p.name
        for p in REPO.iterdir()
        if (p.stem if p.suffix == ".py" else p.name) in sys.stdlib_module_names
        and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    assert shadows == []


def test_the_repository_holds_no_symbolic_link() -> None:
    """Tools that read imports as written see the real files: ``git ls-files`` lists no
    symbolic link (mode 120000)."""
    listing = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in listing.splitlines() if line.startswith("120000")]
    assert links == []
