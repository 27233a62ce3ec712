"""Where the local control plane keeps its files: the shared cache and per-cluster state.

The cache (``$DWDP_CACHE_DIR``, default ``~/.cache/dwdp``) lies outside the repository so
clean clones reuse the built binary and the unpacked kubectl/helm. Each cluster has its own
state directory (``$DWDP_STATE_DIR``, default ``<cache>/clusters/default``) holding its
certificates, etcd data, logs and pod files.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The folder holding the Go wrapper module (go.mod, go.sum, *.go).
GO_DIR = Path(__file__).resolve().parent / "go"

#: The repository root when running from a checkout (tools/dwdp_dev/devcluster/../../..), else
#: None.
_REPO = Path(__file__).resolve().parents[3]
REPO_ROOT: Path | None = _REPO if (_REPO / "pyproject.toml").is_file() else None


def cache_dir() -> Path:
    """Return the shared cache folder (``$DWDP_CACHE_DIR`` or ``~/.cache/dwdp``)."""
    env = os.environ.get("DWDP_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dwdp"


def default_state_dir() -> Path:
    """Return the state folder of the default cluster (``$DWDP_STATE_DIR`` or the cache's)."""
    env = os.environ.get("DWDP_STATE_DIR")
    return Path(env).expanduser() if env else cache_dir() / "clusters" / "default"


def default_venv_bin() -> Path | None:
    """Return the repository's ``.venv/bin`` if it exists (pods get it first on PATH)."""
    if REPO_ROOT is not None and (REPO_ROOT / ".venv" / "bin").is_dir():
        return REPO_ROOT / ".venv" / "bin"
    return None
