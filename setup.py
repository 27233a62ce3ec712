"""Package list for the folder layout of DESIGN.md section 2.

The sub-packages of ``dwdp`` live in top-level folders (``api/`` is ``dwdp.api``), which
setuptools' automatic discovery cannot name; this walks each mapped folder and lists
every package below it. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "dwdp": "dwdp",
    "dwdp.api": "api",
    "dwdp.operator": "operator",
    "dwdp.worker": "worker",
    "dwdp.kernels": "kernels",
    "dwdp.devcluster": "tools/devcluster",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        root = Path(folder)
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root).parts
            if any(part.startswith(".") or part in {"__pycache__", "go"} for part in rel):
                continue
            pkg = ".".join((name, *rel))
            packages.append(pkg)
            package_dir[pkg] = str(init.parent)
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
