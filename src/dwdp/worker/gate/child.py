"""The vllm-router child of the gate: one process on a loopback port, calling the workers with
the key it was started with.

vllm-router reads its workers' key from ``OPENAI_API_KEY`` at every call, but a process's
environment cannot change from outside: a new key needs a new process (``Gate.rotate``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
from collections.abc import Sequence

import httpx

log = logging.getLogger(__name__)

ROUTER_KEY_ENV = "OPENAI_API_KEY"
"""The variable vllm-router sends to the workers as ``Authorization: Bearer <value>``."""
READINESS_PATH = "/readiness"
"""vllm-router's readiness: 200 once its prefill and decode servers passed a health check."""
LOOPBACK = "127.0.0.1"


class GateError(RuntimeError):
    """The router child cannot serve (it exited, or never became ready); one line."""


def free_loopback_port() -> int:
    """A TCP port free on the loopback address now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class RouterChild:
    """``argv`` (vllm-router and its arguments, without ``--host``/``--port``) started on a
    free loopback port with ``OPENAI_API_KEY`` = ``key`` (unset for ``None``); its output goes
    to the gate's. ``base``: its URL."""

    def __init__(self, argv: Sequence[str], key: str | None) -> None:
        self.port = free_loopback_port()
        self.base = f"http://{LOOPBACK}:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != ROUTER_KEY_ENV}
        if key is not None:
            env[ROUTER_KEY_ENV] = key
        args = [*argv, "--host", LOOPBACK, "--port", str(self.port)]
        self.proc = subprocess.Popen(args, env=env)
        log.info("router child %d started on %s", self.proc.pid, self.base)

    @property
    def exited(self) -> int | None:
        """The exit status once the process ended, else ``None``."""
        return self.proc.poll()

    async def wait_ready(self, client: httpx.AsyncClient, *, poll_s: float = 0.2) -> None:
        """Return once ``/readiness`` answers 200; ``GateError`` when the process exits first."""
        while True:
            if self.exited is not None:
                raise GateError(f"vllm-router exited with status {self.exited} before it was "
                                "ready (its log is above)")
            try:
                r = await client.get(self.base + READINESS_PATH, timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds; returns once the process is gone
        (its ports free). Safe to repeat."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
