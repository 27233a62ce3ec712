"""The vLLM 0.32.0 environment of the interop tests (``import vllm_env``: ``tests/support`` is on
pytest's ``pythonpath``).

``scripts/vllm-cpu-venv.sh`` makes it in ``.venv-vllm`` at the repository root (``scripts/test.sh``
runs it with ``DWDP_TEST_VLLM=1``); ``DWDP_VLLM_PYTHON`` names another interpreter. Tests that
need it carry ``needs_vllm`` and are skipped, naming the interpreter, where it is missing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("DWDP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
"""The interpreter with vllm-cpu 0.32.0 and nixl."""


def vllm_ready(python: Path = VLLM_PYTHON) -> bool:
    """Whether ``python`` imports nixl and has vllm-cpu 0.32.0 installed."""
    if not python.exists():
        return False
    probe = "import importlib.metadata as m; import nixl; print(m.version('vllm-cpu'))"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "0.32.0"


needs_vllm = pytest.mark.skipif(
    not vllm_ready(), reason=f"no vllm-cpu 0.32.0 + nixl at {VLLM_PYTHON} "
    "(make it with scripts/vllm-cpu-venv.sh)")
