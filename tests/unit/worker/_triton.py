"""Running a Triton kernel's test on the CPU: Triton's interpreter (``TRITON_INTERPRET=1``)
must be set before triton is imported, so each such test runs its code in a child process."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(code: str, *args: str, timeout: float = 600) -> None:
    """Run ``code`` (a Python program printing ``ok`` at its end) with ``args`` under Triton's
    interpreter; fails the calling test with the child's stderr tail otherwise."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
