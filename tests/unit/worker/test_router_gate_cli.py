"""``dwdp router-gate`` fails clearly: without a router command, with a key file that holds no
key, and when its router exits before it is ready (exit 1, so the kubelet restarts the pod's
container rather than leaving a gate that answers 503 for ever)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dwdp_dev.worker.servers import free_port


def _gate(*router: str, key_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DWDP_API_KEY_FILE": str(key_file)}
    args = [sys.executable, "-m", "dwdp", "router-gate", "--host", "127.0.0.1", "--port",
            str(free_port()), *router]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_a_router_that_exits_before_it_is_ready_ends_the_gate(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k1")
    proc = _gate("--", sys.executable, "-c", "import sys; sys.exit(3)", key_file=key)
    assert proc.returncode == 1, proc.stderr
    assert "vllm-router exited with status 3 before it was ready" in proc.stderr


def test_the_command_and_the_key_are_checked_before_anything_starts(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k1")
    proc = _gate(key_file=key)
    assert proc.returncode == 1
    assert "router-gate: give the router command after '--'" in proc.stderr
    empty = tmp_path / "empty"
    empty.write_text("")
    proc = _gate("--", "vllm-router", key_file=empty)
    assert proc.returncode == 1
    assert f"{empty}: the API key file is empty" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_port_in_use_is_one_line_naming_the_address_and_the_cause(tmp_path: Path) -> None:
    import socket

    key = tmp_path / "key"
    key.write_text("k1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "DWDP_API_KEY_FILE": str(key)}
        proc = subprocess.run(
            [sys.executable, "-m", "dwdp", "router-gate", "--host", "127.0.0.1", "--port",
             str(port), "--", sys.executable, "-c", "import time; time.sleep(60)"],
            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
