"""A pod as the operator starts one, on this machine: ``dwdp launch`` of ``world`` local ranks
(cpu backend, TCP store), each serving HTTP on base port + local rank, until every rank is
ready; stopped with SIGTERM when the caller is done."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from ports import free_port, free_port_block

from dwdp_dev.worker.cgroups import MemoryCgroup


@contextlib.contextmanager
def launched_pod(root: Path, launch: dict[str, Any], world: int, ready_s: float = 400,
                 env: dict[str, str] | None = None, cgroup: MemoryCgroup | None = None,
                 ) -> Iterator[tuple[subprocess.Popen, list[str], str, Path]]:
    """Yield ``(process, rank URLs, group, termination log)`` of a pod running the launch
    config ``launch`` (``serverPort`` is chosen here), with ``env`` on top of the pod's
    environment, in the memory cgroup ``cgroup`` when given (as a container runs in its
    own); fails the test when the pod exits or a rank is not ready within ``ready_s``
    seconds."""
    base = free_port_block(world)
    config = root / "launch.yaml"
    config.write_text(yaml.safe_dump({**launch, "serverPort": base}))
    group = f"p{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "DWDP_GROUP": group,
        "DWDP_INCARNATION": "i0",
        "DWDP_RANK": "0",
        "DWDP_WORLD_SIZE": str(world),
        "DWDP_RENDEZVOUS": f"127.0.0.1:{free_port()}",
        "DWDP_RENDEZVOUS_TIMEOUT_S": "300",
        "DWDP_ROLE": "ctx0",
        "DWDP_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    term = root / "termination-log"
    cmd = [sys.executable, "-m", "dwdp", "launch", "--config", str(config), "--nproc",
           str(world), "--host", "127.0.0.1", "--termination-log", str(term)]
    if cgroup is not None:
        cmd = cgroup.join_command(cmd)
    proc = subprocess.Popen(cmd, env=env)
    urls = [f"http://127.0.0.1:{base + k}" for k in range(world)]
    try:
        deadline = time.monotonic() + ready_s
        for url in urls:
            while True:
                assert proc.poll() is None, term.read_text() if term.exists() else "exited"
                assert time.monotonic() < deadline, f"{url} never became ready"
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        yield proc, urls, group, term
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
