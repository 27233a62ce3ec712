"""Start, check and stop one local cluster: etcd, apiserver, controller-manager, scheduler
and its node, each a process of its own whose pid is kept in the state folder. The node is a
real one (``node_kind="real"``, the default): containerd, the kubelet, kube-proxy and the
cluster DNS in a network namespace of their own (:mod:`dwdp_dev.devcluster.realnode`); with
``node_kind="process"`` it is one or more process kubelets instead (:mod:`.kubelet`).

``up()`` is idempotent (it starts only what is not running and keeps ports, certificates and
etcd data across restarts); ``down()`` stops everything, pod processes included, and leaves
no process behind. Layout of a state folder::

    cluster.json   ports, pod network and node settings (chosen once, then kept)
    kubeconfig     admin kubeconfig (certificates embedded)
    pki/           see pki.py
    etcd/          etcd data
    logs/          one log per component, and audit.log: the apiserver's audit log of
                   every request a service account made (Metadata level, JSON lines)
    run/           one pid file per component
    pods/          a process kubelet's per-pod folders (volumes, logs, pid files)

A real node adds ``containerd/`` (its image store), ``kubelet/`` (the kubelet's root),
``pod-logs/``, ``cni/`` and the node's configuration files (see realnode.py).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from dwdp_dev.devcluster import build, paths, pki, realnode
from dwdp_dev.devcluster.config import ClusterConfig
from dwdp_dev.devcluster.pids import alive, read_pidfile, stop_pids, write_pidfile

#: Feature gates for every component: the Workload/PodGroup API and gang scheduling.
FEATURE_GATES = "GenericWorkload=true"
#: API versions served in addition to the defaults (Workload and PodGroup live here).
RUNTIME_CONFIG = "scheduling.k8s.io/v1beta1=true"
SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}
"""What the apiserver audits: every request of a service account (who, verb, resource,
response code), nothing else. Pods run under service accounts (the Helm-installed operator
among them), so a test can derive the API calls a component really made."""

COMPONENTS = ("etcd", "apiserver", "controller-manager", "scheduler")


class ClusterError(RuntimeError):
    """A component failed to start or to become ready; the message names its log."""


_PORT_RANGE = (20000, 32000)
"""Where cluster ports are picked: below Linux's ephemeral range (32768-60999), so an
outgoing connection made between the pick and the component's start cannot take the port."""


def _free_port() -> int:
    """A port of ``_PORT_RANGE`` that is free on 127.0.0.1 now (random, so clusters started
    side by side do not probe the same ports). Raises ``ClusterError`` if none is found."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if _port_free(port):
            return port
    raise ClusterError(f"no free port in {_PORT_RANGE[0]}-{_PORT_RANGE[1]} on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _route(action: str, pod_net: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "route", action, "local", f"{pod_net}.0.0/16", "dev", "lo"],
        capture_output=True,
        text=True,
        check=False,
    )


def ensure_pod_route(pod_net: str) -> None:
    """Make every address of ``<pod_net>.0.0/16`` local to this host (an AnyIP route on lo).

    Needs root (CAP_NET_ADMIN); raises ClusterError if the route cannot be added.
    """
    shown = subprocess.run(
        ["ip", "route", "show", "table", "local"], capture_output=True, text=True, check=False
    ).stdout
    if f"local {pod_net}.0.0/16 dev lo" in shown:
        return
    res = _route("add", pod_net)
    if res.returncode != 0:
        raise ClusterError(
            f"cannot route pod network {pod_net}.0.0/16 to lo (needs root): {res.stderr.strip()}"
        )


def node_network(cfg: ClusterConfig) -> realnode.NodeNetwork | None:
    """A real node's names and addresses (from the cluster's pod network); None for process
    kubelets."""
    if cfg.node_kind != "real":
        return None
    return realnode.NodeNetwork(cfg.pod_net)


def service_cidr(cfg: ClusterConfig) -> str:
    """The cluster's Service range: a real node's own (:class:`realnode.NodeNetwork`),
    :data:`SERVICE_CIDR` with process kubelets (which serve no ClusterIP)."""
    net = node_network(cfg)
    return net.service_cidr if net else SERVICE_CIDR


def kubernetes_service_ip(cfg: ClusterConfig) -> str:
    """The ``kubernetes`` Service's ClusterIP: the first address of the Service range."""
    return str(next(ipaddress.ip_network(service_cidr(cfg)).hosts()))


def free_pod_net(preferred: str) -> str:
    """``preferred`` (e.g. ``100.64``) unless another cluster on this host already routes
    it; then the first ``100.N`` (N 65..127) that no cluster routes. Every cluster thus has
    a pod network of its own, and ``down`` of one never removes another's route. Raises
    ``ClusterError`` when all are taken."""
    routed = routed_pod_nets()
    candidates = [preferred] + [f"100.{n}" for n in range(65, 128)]
    for net in candidates:
        if net not in routed:
            return net
    raise ClusterError("every pod network 100.64-100.127 is routed by another cluster")


def routed_pod_nets() -> set[str]:
    """The ``100.N`` pod networks this host routes already, in any table: a process
    kubelet's ``local 100.N.0.0/16 dev lo`` or a real node's bridge ``100.N.0.0/16``."""
    shown = subprocess.run(
        ["ip", "route", "show", "table", "all"], capture_output=True, text=True, check=False
    ).stdout
    return {f"100.{m}" for m in re.findall(r"(?:^|\s)100\.(\d+)\.", shown, re.MULTILINE)}


def remove_pod_route(pod_net: str) -> None:
    """Remove the pod network's local route (no error if it is not there)."""
    _route("del", pod_net)


class Cluster:
    """One local cluster, identified by its state folder (default: ``paths.default_state_dir``).

    Raises ClusterError from ``up`` if a component does not start; the error names its log.
    """

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir or paths.default_state_dir()).resolve()
        self.pki = self.state_dir / "pki"
        self.logs = self.state_dir / "logs"
        self.audit_log = self.logs / "audit.log"
        self.run = self.state_dir / "run"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.config_path = self.state_dir / "cluster.json"

    # -- configuration -----------------------------------------------------------------
    def config(self) -> ClusterConfig | None:
        """Return the stored config, or None before the first ``up``."""
        return ClusterConfig.load(self.config_path) if self.config_path.exists() else None

    def _prepare(self, overrides: dict) -> ClusterConfig:
        """The cluster's settings: stored ones with ``overrides``, checked (ClusterError)
        before anything is written to the state folder."""
        stored = self.config()
        cfg = stored or ClusterConfig(
            venv_bin=str(paths.default_venv_bin()) if paths.default_venv_bin() else None
        )
        if stored is None and "pod_net" not in overrides:
            cfg.pod_net = free_pod_net(cfg.pod_net)
        node = overrides.pop("node", None)
        if node:
            cfg.node = dataclasses.replace(cfg.node, **node)
        running = self.running()
        kind = overrides.get("node_kind", cfg.node_kind)
        if kind not in ("process", "real"):
            raise ClusterError(f"unknown node kind {kind!r} (process or real)")
        if kind != cfg.node_kind and running:
            raise ClusterError(
                f"the cluster in {self.state_dir} runs with a {cfg.node_kind} node; "
                "`dwdp dev down` it before starting it with another"
            )
        for key, value in overrides.items():
            setattr(cfg, key, value)
        real = cfg.node_kind == "real"
        if real:
            if cfg.nodes != 1:
                raise ClusterError(
                    f"a real node is one node (nodes={cfg.nodes}): process kubelets"
                    " (`--node process`) run several"
                )
            try:
                cfg.node_dev = realnode.default_device()
            except realnode.RealNodeError as exc:
                raise ClusterError(str(exc)) from None
        kubelet = "node-kubelet" if real else "kubelet-0"
        for field, comp in (
            ("etcd_port", "etcd"),
            ("etcd_peer_port", "etcd"),
            ("apiserver_port", "apiserver"),
            ("controller_manager_port", "controller-manager"),
            ("scheduler_port", "scheduler"),
            ("kubelet_port", kubelet),
            *(
                (f, c)
                for f, c in (
                    ("node_healthz_port", kubelet),
                    ("proxy_healthz_port", "kube-proxy"),
                    ("proxy_metrics_port", "kube-proxy"),
                    ("dns_ready_port", "coredns"),
                )
                if real
            ),
        ):
            port = getattr(cfg, field)
            if not port or (comp not in running and not _port_free(port)):
                setattr(cfg, field, _free_port())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for d in (self.logs, self.run, self.state_dir / "pods"):
            d.mkdir(exist_ok=True)
        cfg.save(self.config_path)
        pki.ensure_pki(self.pki, apiserver_ips=self._apiserver_ips(cfg))
        self.write_kubeconfig(cfg)
        return cfg

    @staticmethod
    def _apiserver_ips(cfg: ClusterConfig) -> tuple[str, ...]:
        """The addresses the apiserver's certificate names: loopback, the ``kubernetes``
        Service's, and a real node's host end of its veth (where the node's programs reach
        it)."""
        net = node_network(cfg)
        return ("127.0.0.1", kubernetes_service_ip(cfg), *([net.host_ip] if net else []))

    def write_kubeconfig(
        self,
        cfg: ClusterConfig,
        path: Path | None = None,
        user: str = "admin",
        host: str = "127.0.0.1",
    ) -> None:
        """Write a kubeconfig for the client certificate ``pki/<user>.crt`` (default: the
        admin kubeconfig) naming the apiserver at ``host``."""
        path = path or self.kubeconfig

        def b64(name: str) -> str:
            return base64.b64encode((self.pki / name).read_bytes()).decode()

        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "dwdp-dev",
                    "cluster": {
                        "server": f"https://{host}:{cfg.apiserver_port}",
                        "certificate-authority-data": b64("ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": b64(f"{user}.crt"),
                        "client-key-data": b64(f"{user}.key"),
                    },
                }
            ],
            "contexts": [{"name": "dwdp-dev", "context": {"cluster": "dwdp-dev", "user": user}}],
            "current-context": "dwdp-dev",
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        tmp.chmod(0o600)
        os.replace(tmp, path)

    # -- processes ---------------------------------------------------------------------
    def running(self) -> dict[str, int]:
        """Return {component: pid} of the components of this cluster that run now."""
        out = {}
        for pidfile in sorted(self.run.glob("*.pid")) if self.run.exists() else []:
            pid = read_pidfile(pidfile)
            if pid is not None:
                out[pidfile.stem] = pid
        return out

    def _audit_policy(self) -> Path:
        """Write :data:`AUDIT_POLICY` into the state folder; return its path."""
        path = self.state_dir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
        return path

    def _component_cmd(self, name: str, cfg: ClusterConfig, binary: Path) -> list[str]:
        p, kc = self.pki, str(self.kubeconfig)
        common = [f"--feature-gates={FEATURE_GATES}", "--bind-address=127.0.0.1"]
        if name == "etcd":
            return [
                str(binary),
                "etcd",
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-url=http://127.0.0.1:{cfg.etcd_port}",
                f"--listen-peer-url=http://127.0.0.1:{cfg.etcd_peer_port}",
            ]
        if name == "apiserver":
            # A real node's pods reach the apiserver through the `kubernetes` Service, whose
            # endpoint is the advertised address: the host's end of the node's veth, every
            # address bound (the real node's INPUT guard drops the port on the default
            # route's device).
            real = cfg.node_kind == "real"
            net = node_network(cfg)
            return [
                str(binary),
                "apiserver",
                f"--feature-gates={FEATURE_GATES}",
                f"--bind-address={'0.0.0.0' if real else '127.0.0.1'}",
                f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
                f"--secure-port={cfg.apiserver_port}",
                f"--advertise-address={net.host_ip if net else '127.0.0.1'}",
                f"--cert-dir={self.state_dir / 'apiserver-certs'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={service_cidr(cfg)}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                f"--runtime-config={RUNTIME_CONFIG}",
                f"--kubelet-client-certificate={p / 'admin.crt'}",
                f"--kubelet-client-key={p / 'admin.key'}",
                f"--kubelet-certificate-authority={p / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--endpoint-reconciler-type={'lease' if real else 'none'}",
                "--profiling=false",
                f"--audit-policy-file={self._audit_policy()}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=200",
                "--audit-log-maxbackup=1",
            ]
        auth = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        if name == "controller-manager":
            return [
                str(binary),
                "controller-manager",
                *common,
                *auth,
                f"--secure-port={cfg.controller_manager_port}",
                f"--cert-dir={self.state_dir / 'controller-manager-certs'}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={p / 'sa.key'}",
                f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}",
                f"--cluster-signing-key-file={p / 'ca.key'}",
                f"--service-cluster-ip-range={service_cidr(cfg)}",
                "--concurrent-gc-syncs=5",
            ]
        if name == "scheduler":
            return [
                str(binary),
                "scheduler",
                *common,
                *auth,
                f"--secure-port={cfg.scheduler_port}",
                f"--cert-dir={self.state_dir / 'scheduler-certs'}",
            ]
        raise ValueError(name)

    def _kubelet_cmd(self, index: int, cfg: ClusterConfig) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "dwdp_dev.devcluster.kubelet",
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            cfg.node_names()[index],
            "--node-index",
            str(index),
            "--cpu",
            cfg.node.cpu,
            "--memory",
            cfg.node.memory,
            "--gpus",
            str(cfg.node.gpus),
            "--max-pods",
            str(cfg.node.pods),
            "--pod-net",
            cfg.pod_net,
            "--port",
            str(cfg.kubelet_port + index if index else cfg.kubelet_port),
            "--apiserver-port",
            str(cfg.apiserver_port),
        ]
        if cfg.venv_bin:
            cmd += ["--path-prepend", cfg.venv_bin]
        return cmd

    def spawn(self, name: str, cmd: list[str]) -> int:
        """Start ``cmd`` as component ``name`` (own session, log ``logs/<name>.log``, pid
        file ``run/<name>.pid``); return its pid."""
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (handed to the child)
        log.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.state_dir,
            env=env,
            start_new_session=True,
        )
        log.close()
        write_pidfile(self.run / f"{name}.pid", proc.pid)
        return proc.pid

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def get(self, url: str, timeout: float = 2.0) -> tuple[int, str]:
        """``(status, body)`` of a GET of ``url`` (https: as the cluster's admin); status 0
        and the error when nothing answers."""
        ctx = self._ssl_context() if url.startswith("https") else None
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            return 0, str(exc)

    def wait_for_component(self, name: str, pid: int, check, timeout_s: float) -> None:
        """Wait until ``check()`` is true; raise ClusterError naming the log if process
        ``pid`` exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if not alive(pid):
                raise ClusterError(
                    f"{name} exited at start; see {self.logs / (name + '.log')}\n"
                    + self._log_tail(name)
                )
            time.sleep(0.1)
        raise ClusterError(
            f"{name} not ready after {timeout_s:.0f} s; see "
            f"{self.logs / (name + '.log')}\n" + self._log_tail(name)
        )

    def _log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(
                (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
            )
        except OSError:
            return ""

    def apiserver_ready(self) -> bool:
        """Return True if the apiserver answers ``/readyz`` with 200."""
        cfg = self.config()
        if cfg is None:
            return False
        return self.get(f"https://127.0.0.1:{cfg.apiserver_port}/readyz")[0] == 200

    def node_ready(self) -> dict[str, bool]:
        """Return {node name: Ready condition is True} for this cluster's nodes."""
        cfg = self.config()
        if cfg is None:
            return {}
        out = {}
        for name in cfg.node_names():
            code, body = self.get(f"https://127.0.0.1:{cfg.apiserver_port}/api/v1/nodes/{name}")
            ready = False
            if code == 200:
                for cond in json.loads(body).get("status", {}).get("conditions", []):
                    if cond.get("type") == "Ready":
                        ready = cond.get("status") == "True"
            out[name] = ready
        return out

    def up(self, *, binary: Path | None = None, timeout_s: float = 120.0, **overrides) -> float:
        """Start every component that is not running; return the seconds it took.

        ``overrides`` are ClusterConfig fields (``nodes``, ``node={"gpus": 4}``, ports ...).
        Raises ClusterError (names the failing component's log) or build.BuildError if the
        binary is not built.
        """
        start = time.monotonic()
        created = not self.state_dir.exists()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            with self._locked():
                return self._up(start, binary, timeout_s, overrides)
        except ClusterError:
            if created and not self.config_path.exists():  # refused before anything was set up
                shutil.rmtree(self.state_dir, ignore_errors=True)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold this cluster's file lock (one ``up``/``down`` at a time)."""
        import fcntl

        with open(self.state_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _up(self, start: float, binary: Path | None, timeout_s: float, overrides: dict) -> float:
        binary = binary or build.find_binary()
        if binary is None:
            raise build.BuildError("the control-plane binary is not built; run `dwdp dev build`")
        cfg = self._prepare(dict(overrides))
        running = self.running()
        if cfg.node_kind == "real":
            try:  # before any process starts
                realnode.RealNode(self).preflight()
            except realnode.RealNodeError as exc:
                raise ClusterError(str(exc)) from None
        if "etcd" not in running:
            pid = self.spawn("etcd", self._component_cmd("etcd", cfg, binary))
            url = f"http://127.0.0.1:{cfg.etcd_port}/health"
            self.wait_for_component("etcd", pid, lambda: '"true"' in self.get(url)[1], timeout_s)
        if "apiserver" not in running:
            pid = self.spawn("apiserver", self._component_cmd("apiserver", cfg, binary))
            self.wait_for_component("apiserver", pid, self.apiserver_ready, timeout_s)
        for name in ("controller-manager", "scheduler"):
            if name not in running:
                self.spawn(name, self._component_cmd(name, cfg, binary))
        if cfg.node_kind == "real":
            node = realnode.RealNode(self)
            try:
                node.up(cfg, binary, timeout_s)
            except realnode.RealNodeError as exc:
                raise ClusterError(str(exc)) from None
            node_components: tuple[str, ...] = realnode.COMPONENTS
        else:
            ensure_pod_route(cfg.pod_net)
            for i in range(cfg.nodes):
                if f"kubelet-{i}" not in running:
                    self.spawn(f"kubelet-{i}", self._kubelet_cmd(i, cfg))
            node_components = tuple(f"kubelet-{i}" for i in range(cfg.nodes))
        pids = self.running()
        deadline = time.monotonic() + timeout_s
        while not all(self.node_ready().values()):
            for name in ("controller-manager", "scheduler", *node_components):
                if name not in pids or not alive(pids[name]):
                    raise ClusterError(
                        f"{name} exited at start; see {self.logs / (name + '.log')}\n"
                        + self._log_tail(name)
                    )
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes not Ready after {timeout_s:.0f} s; see {self.logs}")
            time.sleep(0.1)
        if cfg.node_kind == "real":
            node.after_ready(cfg)
        return time.monotonic() - start

    def pod_pidfiles(self) -> Iterator[Path]:
        """Yield the pid files of pod processes the kubelet recorded."""
        pods = self.state_dir / "pods"
        if pods.exists():
            yield from pods.glob("*/run/*.pid")

    def down(self, timeout_s: float = 20.0) -> None:
        """Stop every process of this cluster (kubelets and their pods first), SIGKILL after
        ``timeout_s`` seconds per stage. Leaves the state (certs, etcd data) in place. A
        folder that holds no cluster (no ``cluster.json``) is left as it is: nothing is
        written there, not even the lock file."""
        if not self.config_path.exists():
            return
        with self._locked():
            self._down(timeout_s)

    def _down(self, timeout_s: float) -> None:
        running = self.running()
        cfg = self.config()
        if cfg is not None and cfg.node_kind == "real":
            # nothing may re-create pods while the real node deletes them
            stop_pids(
                [running[n] for n in ("scheduler", "controller-manager") if n in running], timeout_s
            )
            realnode.RealNode(self).down(timeout_s)
            running = self.running()
        kubelets = [pid for name, pid in running.items() if name.startswith("kubelet")]
        stop_pids(kubelets, timeout_s)
        pod_pids = [p for f in self.pod_pidfiles() if (p := read_pidfile(f)) is not None]
        stop_pids(pod_pids, 5.0)
        for stage in (("scheduler", "controller-manager"), ("apiserver",), ("etcd",)):
            stop_pids([running[n] for n in stage if n in running], timeout_s)
        for pidfile in self.run.glob("*.pid") if self.run.exists() else []:
            pidfile.unlink(missing_ok=True)
        if cfg is not None and cfg.node_kind != "real":
            remove_pod_route(cfg.pod_net)

    def status(self) -> dict:
        """Return a summary: state dir, components running, apiserver ready, nodes ready."""
        cfg = self.config()
        running = self.running()
        if cfg is not None and cfg.node_kind == "real":
            names = list(COMPONENTS) + list(realnode.COMPONENTS)
        else:
            names = list(COMPONENTS) + [f"kubelet-{i}" for i in range(cfg.nodes if cfg else 1)]
        return {
            "state_dir": str(self.state_dir),
            "node_kind": cfg.node_kind if cfg else "process",
            "kubeconfig": str(self.kubeconfig),
            "components": {n: running.get(n) for n in names},
            "apiserver_ready": self.apiserver_ready() if "apiserver" in running else False,
            "nodes_ready": self.node_ready() if "apiserver" in running else {},
        }
