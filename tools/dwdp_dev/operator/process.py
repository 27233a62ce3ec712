"""Run ``dwdp operator`` as a real subprocess for tests and benches, and stop it cleanly.

:class:`OperatorProcess` starts the console script with the test rank program as the worker
command, its own liveness port and (optionally) a validating webhook on 127.0.0.1 whose
ValidatingWebhookConfiguration kopf manages; it waits for the liveness endpoint, keeps the
log in a file, and on :meth:`stop` sends SIGTERM to its process group (SIGKILL after a
grace period) and deletes the webhook configuration it made.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["RANKPROG_COMMAND", "OperatorProcess", "free_port"]

RANKPROG_COMMAND = "python -m dwdp_dev.operator.rankprog"
"""Worker command that runs the test rank program instead of the real worker."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OperatorProcess:
    """One ``dwdp operator`` subprocess against the cluster of ``env`` (KUBECONFIG)."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        webhook: str | None = None,
        extra_args: tuple[str, ...] = (),
        compute_domains: str = "off",
    ) -> None:
        self.env = dict(env)
        self.log_path = log_path
        self.webhook = webhook
        """Name of the ValidatingWebhookConfiguration to manage; None: no webhook."""
        self.extra_args = extra_args
        self.compute_domains = compute_domains
        """``--compute-domains``: off by default (the rank program runs on CPUs, fabric is
        nominal there); ``auto`` to test ComputeDomains."""
        self.proc: subprocess.Popen | None = None
        self.liveness_port = 0

    def start(self, timeout: float = 60) -> None:
        """Start the operator and wait until its liveness endpoint answers.

        Raises:
            RuntimeError: when it exits or does not answer within ``timeout`` seconds.
        """
        self.liveness_port = free_port()
        args = [
            str(Path(sys.executable).with_name("dwdp")),
            "--log-level",
            "DEBUG" if os.environ.get("DWDP_OPERATOR_DEBUG") else "INFO",
            "operator",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--worker-command",
            RANKPROG_COMMAND,
            "--compute-domains",
            self.compute_domains,
            *self.extra_args,
        ]
        if self.webhook:
            args += [
                "--webhook-listen",
                f"127.0.0.1:{free_port()}",
                "--webhook-manage",
                self.webhook,
            ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dwdp operator exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dwdp operator not live after {timeout} s:\n{self.log()}")
            time.sleep(0.3)
        if self.webhook:
            self._wait_webhook_config(deadline)

    def _wait_webhook_config(self, deadline: float) -> None:
        kubectl = self._kubectl()
        while time.monotonic() < deadline:
            proc = subprocess.run(
                [kubectl, "get", "validatingwebhookconfiguration", self.webhook or ""],
                env=self.env,
                capture_output=True,
            )
            if proc.returncode == 0:
                time.sleep(1.0)  # the apiserver picks up new webhook configurations lazily
                return
            time.sleep(0.3)
        raise RuntimeError(f"no ValidatingWebhookConfiguration {self.webhook}:\n{self.log()}")

    def _kubectl(self) -> str:
        for folder in self.env.get("PATH", "").split(os.pathsep):
            candidate = Path(folder) / "kubectl"
            if candidate.is_file():
                return str(candidate)
        return "kubectl"

    def writes(self) -> dict:
        """The operator's API write counters from its liveness endpoint: ``total``, ``by``
        (``"VERB Kind"`` -> count) and ``at`` (wall time of the reading). kopf caches probe
        results for 10 s: readings less than 10 s apart may repeat the previous one."""
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())["writes"]

    def fresh_writes(self) -> dict:
        """:meth:`writes` read now: waits out kopf's 10 s cache of the probe results when
        the reading is older than a second."""
        w = self.writes()
        if w["at"] < time.time() - 1:
            time.sleep(max(0.0, w["at"] + 10.5 - time.time()))
            w = self.writes()
        return w

    def log(self) -> str:
        """The operator's log so far (last 20000 characters)."""
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM the operator's process group, SIGKILL after ``grace_s`` seconds; delete
        the webhook configuration it managed."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self.webhook:
            subprocess.run(
                [
                    self._kubectl(),
                    "delete",
                    "validatingwebhookconfiguration",
                    self.webhook,
                    "--ignore-not-found",
                ],
                env=self.env,
                capture_output=True,
            )
