"""The process kubelet: runs the pods bound to its Node as local processes, no containers.

Run as ``python -m dwdp_dev.devcluster.kubelet --state-dir DIR --node-name NAME ...`` (``dwdp dev
up`` does). What it does, per the Kubernetes kubelet contract, and how:

- Registers its Node (cpu, memory, pods and ``nvidia.com/gpu`` capacity), keeps the Ready
  condition and the node Lease fresh (every 10 s), marks the node NotReady when it stops.
- Watches every pod of the cluster (for the hosts files) and runs those bound to its node.
- Each pod gets its own address <pod-net>.<n>.<m> (a /16 that ``dwdp dev up`` routes to lo
  as local addresses; loopback 127/8 cannot be used, EndpointSlices reject it). Its
  processes run in a private mount and UTS namespace (``unshare``; needs root) where
  ``/etc/hosts`` is a per-pod file naming every pod that has ``hostname`` + ``subdomain``
  (``<hostname>.<subdomain>[.<ns>[.svc[.cluster.local]]]``), the hostname is the pod's, and
  the pod's volumes (emptyDir, configMap, secret, projected with serviceAccountToken from
  TokenRequest, downwardAPI, hostPath, PVC bound to a hostPath or local PV) are bind-mounted
  at their mount paths (a mount over a folder above a host path the pod still needs, such
  as an emptyDir at /tmp above the state folder or the virtual environment, is made last;
  such an emptyDir is an overlay whose lower layer is the host folder, since the host is
  this kubelet's "image"; configMap, secret and projected volumes are re-read every
  ``VOLUME_SYNC_S`` and rewritten atomically when their content changed, as the kubelet's
  periodic sync does, so a rotated Secret reaches running pods). The service-account token
  therefore sits at
  /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT point at
  the apiserver, so in-cluster clients work and RBAC applies.
- A container is ``command + args`` from the host (its image is ignored: images run on the
  local cluster's real node, realnode.py; this kubelet is what runs a program of the host's
  virtual environments, which no image holds) with its env resolved
  (value, fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef, envFrom, ``$(VAR)``), in
  its own process group, stdout+stderr to a log file (``kubectl logs`` works through the
  kubelet's HTTPS port). PATH starts with ``--path-prepend`` (the repo's .venv/bin), so a
  console script of the environment is a container command as it is in the worker image
  (``dwdp launch`` of worker pods, ``dwdp router-gate`` and its ``vllm-router`` of the
  operator's router pods).
- Init containers, startup/readiness/liveness probes (httpGet, tcpSocket, exec), readiness
  gates, restartPolicy with back-off, terminationMessagePath/Policy, phase, podIP and
  container states with exit codes.
- Deletion: SIGTERM to every container's process group, SIGKILL after the grace period, then
  the pod is removed with grace 0. On SIGTERM the kubelet stops all its pods the same way.

- A container's ``securityContext``: ``readOnlyRootFilesystem`` remounts ``/`` read-only in
  the pod's mount namespace (its volumes stay writable or read-only as mounted),
  ``allowPrivilegeEscalation: false`` sets no_new_privs, ``capabilities`` become the
  process's bounding and inheritable sets (``setpriv``). Not applied: runAsUser/runAsGroup/
  fsGroup (containers run as the kubelet's user), seccomp profiles; NetworkPolicies are not
  enforced (no network plugin).

Pods bind their own address, so two pods can serve the same port. Mount points missing on
the host (e.g. /var/run/secrets/kubernetes.io/serviceaccount) are created empty on the host.
Not supported: images, ``kubectl exec``/``attach``/``port-forward``,
ClusterIP routing (no kube-proxy: reach pods by their address or headless names), resource
limits enforcement.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import datetime as dt
import hashlib
import http.client
import http.server
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import urllib3

from dwdp.operator.kube import ApiError, api_request
from dwdp_dev.devcluster.pids import kill_group, read_pidfile, stop_pids, write_pidfile

log = logging.getLogger("dwdp_dev.devcluster.kubelet")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TICK_S = 0.2
VOLUME_SYNC_S = 5.0
"""Seconds between two re-reads of a running pod's configMap/secret/projected volumes (the
real kubelet: its sync period, 1 minute by default, plus its Secret cache's delay)."""
HEARTBEAT_S = 10.0
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
K8S_VERSION = "v1.37.2"


def now_iso() -> str:
    """Return the current UTC time in the API's RFC 3339 seconds format."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """Return the current UTC time in the API's MicroTime format."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class SetupError(Exception):
    """A pod cannot start yet (missing ConfigMap, unsupported volume ...); retried."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ----------------------------------------------------------------------------- API access
class Api:
    """A thin JSON client over the kubernetes package (dicts in, dicts out).

    Methods raise ``ApiError`` (the operator's: status code and the Status's message) on a
    non-2xx answer, ``ApiUnreachable`` when no answer comes.
    """

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 64
        self.client = client.ApiClient(cfg)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict | None = None,
        content_type: str = "application/json",
        stream: bool = False,
        timeout: float | None = 30,
    ) -> Any:
        """Send one request; return the decoded JSON (or the raw response if ``stream``)."""
        try:
            return api_request(self.client, method, path, body, query, content_type,
                               timeout=timeout, stream=stream)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnreachable(exc) from exc

    def get(self, path: str, **query: Any) -> Any:
        """GET ``path``; return the object."""
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: dict) -> Any:
        """POST ``body`` to ``path``."""
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict, strategic: bool = True) -> Any:
        """PATCH ``path`` (strategic merge by default, else JSON merge patch)."""
        ctype = (
            "application/strategic-merge-patch+json"
            if strategic
            else "application/merge-patch+json"
        )
        return self.request("PATCH", path, body, content_type=ctype)

    def delete(self, path: str, body: dict | None = None) -> Any:
        """DELETE ``path`` with optional DeleteOptions."""
        return self.request("DELETE", path, body)


class ApiUnreachable(ApiError):
    """No answer at all (connection refused or reset, timeout): the apiserver is down or
    unreachable. A kubelet keeps its containers running through it and retries."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(0, f"apiserver unreachable: {cause}")


def pod_path(ns: str, name: str, sub: str = "") -> str:
    """Return the API path of a pod (or of its sub-resource)."""
    return f"/api/v1/namespaces/{ns}/pods/{name}" + (f"/{sub}" if sub else "")


# ----------------------------------------------------------------------------- helpers
def parse_quantity(q: Any) -> float:
    """Parse a Kubernetes quantity (``500m``, ``2Gi``, ``1e3``) into a float of base units."""
    s = str(q).strip()
    suffixes = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "Pi": 2**50,
        "Ei": 2**60,
        "n": 1e-9,
        "u": 1e-6,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "P": 1e15,
        "E": 1e18,
    }
    for suf in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * suffixes[suf]
    return float(s)


def _files_digest(files: dict[str, tuple[bytes, int | None]]) -> bytes:
    """A digest of a volume's files (paths, modes, contents): equal for equal volumes."""
    h = hashlib.sha256()
    for rel in sorted(files):
        content, mode = files[rel]
        h.update(f"{rel}\0{mode}\0{len(content)}\0".encode())
        h.update(content)
    return h.digest()


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Expand ``$(VAR)`` references as Kubernetes does (``$$`` escapes a ``$``)."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, value)


def _setpriv_caps(capabilities: dict) -> str:
    """``-all,+ipc_lock`` from a ``capabilities`` stanza (drop first, then add)."""

    def name(cap: str) -> str:
        return cap.lower().removeprefix("cap_")

    drop = [str(x) for x in capabilities.get("drop") or []]
    parts = ["-all"] if "ALL" in drop else [f"-{name(x)}" for x in drop]
    parts += [f"+{name(str(x))}" for x in capabilities.get("add") or []]
    return ",".join(parts)


def privilege_argv(security: dict) -> list[str]:
    """The ``setpriv`` prefix that applies a container's ``securityContext`` to its
    process: ``allowPrivilegeEscalation: false`` -> no_new_privs; ``capabilities`` -> the
    bounding and inheritable sets (a root process keeps only the added ones). Empty for a
    privileged container or a context that asks for neither. runAsUser/runAsGroup and
    seccomp are not applied (the processes run as the kubelet's user)."""
    if security.get("privileged"):
        return []
    argv = []
    if security.get("allowPrivilegeEscalation") is False:
        argv.append("--no-new-privs")
    caps = _setpriv_caps(security.get("capabilities") or {})
    if caps:
        argv += [f"--bounding-set={caps}", f"--inh-caps={caps}"]
    return ["setpriv", *argv, "--"] if argv else []


def _fs_group(pod: dict) -> int | None:
    """The pod's ``securityContext.fsGroup`` (None: unset)."""
    value = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    return None if value is None else int(value)


def field_value(pod: dict, path: str) -> str:
    """Resolve a downward-API fieldPath (``metadata.name``, ``status.podIP`` ...) of ``pod``."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\[['\"]?(.+?)['\"]?\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", []) or []),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", []) or []),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise SetupError("CreateContainerConfigError", f"unsupported fieldPath {path!r}")
    return str(simple[path] or "")


def resource_value(container: dict, ref: dict, node_alloc: dict[str, float]) -> str:
    """Resolve a resourceFieldRef (``limits.cpu``, ``requests.memory`` ...) as a string."""
    kind, _, res = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(res)
    if raw is None and kind == "requests":
        raw = (resources.get("limits") or {}).get(res)
    value = parse_quantity(raw) if raw is not None else node_alloc.get(res, 0.0)
    divisor = parse_quantity(ref.get("divisor") or "1")
    out = value / divisor
    return str(int(-(-out // 1)))  # ceiling, as the kubelet does


# ----------------------------------------------------------------------------- containers
class Probe:
    """State of one probe of one container (counts in consecutive results)."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.period = float(spec.get("periodSeconds") or 10)
        self.timeout = float(spec.get("timeoutSeconds") or 1)
        self.success_threshold = int(spec.get("successThreshold") or 1)
        self.failure_threshold = int(spec.get("failureThreshold") or 3)
        self.next_at = 0.0
        self.successes = 0
        self.failures = 0
        self.running = False

    def reset(self, started_at: float) -> None:
        """Restart counting for a fresh container start (``started_at`` monotonic s)."""
        self.next_at = started_at + float(self.spec.get("initialDelaySeconds") or 0)
        self.successes = self.failures = 0


class Container:
    """One container of a pod: its spec, its current process and what to report."""

    def __init__(self, spec: dict, init: bool) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen | None = None
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.restart_count = 0
        self.ready = False
        self.started = False  # startup probe passed (or none)
        self.done = False  # terminated and will not be restarted
        self.restart_at: float | None = None
        self.backoff = BACKOFF_INITIAL_S
        self.kill_deadline: float | None = None
        self.kill_reason: str | None = None
        self.started_mono = 0.0
        self.env: dict[str, str] = {}
        self.probes = {
            kind: Probe(spec[key])
            for kind, key in (
                ("startup", "startupProbe"),
                ("readiness", "readinessProbe"),
                ("liveness", "livenessProbe"),
            )
            if spec.get(key)
        }

    @property
    def running(self) -> bool:
        """True while the main process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def status(self, pod_ip: str | None) -> dict:
        """Return this container's entry of ``containerStatuses``."""
        out = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": bool(self.running and self.started),
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.proc is not None:
            out["containerID"] = f"process://{self.proc.pid}"
        return out


class PodWorker(threading.Thread):
    """Runs one pod: setup, init containers, containers, probes, status, deletion."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.name_: str = meta["name"]
        self.lock = threading.Lock()
        self.removed = False  # the watch saw DELETED
        self.dir = kubelet.state_dir / "pods" / f"{self.ns}_{self.name_}_{self.uid[:8]}"
        self.ip: str | None = None
        self.gpus: list[int] = []
        self.phase = "Pending"
        self.start_time: str | None = None
        self.init_containers = [Container(c, True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, False) for c in pod["spec"]["containers"]]
        self.setup_done = False
        self.setup_error: SetupError | None = None
        self.last_status: dict | None = None
        self.condition_times: dict[str, tuple[str, str]] = {}
        self.token_refresh: list[tuple[float, dict, Path]] = []
        self.synced_volumes: dict[str, tuple[dict, Path, bytes]] = {}
        """Volume name -> (its spec, its folder, a digest of the files last written)."""
        self.volumes_synced_at = time.monotonic()
        self.terminating_since: float | None = None
        self.grace_deadline: float | None = None
        self.stop_event = threading.Event()
        self.finished = threading.Event()
        self.base_env: dict[str, str] = {}
        self.status_backoff_s = 0.0
        """Current wait between status patches the apiserver did not answer (0: none)."""
        self.status_retry_at = 0.0

    # -- from the watch -------------------------------------------------------------
    def update(self, pod: dict) -> None:
        """Take a newer version of the pod object (from the watch)."""
        with self.lock:
            self.pod = pod

    def mark_removed(self) -> None:
        """The pod object is gone from the API: stop the processes and end."""
        self.removed = True

    # -- setup ----------------------------------------------------------------------
    def _setup(self) -> None:
        pod = self.snapshot()
        (self.dir / "run").mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        (self.dir / "volumes").mkdir(exist_ok=True)
        if self.ip is None:
            self.ip = self.kubelet.allocate_ip(self.uid, (pod.get("status") or {}).get("podIP"))
            # Publish the address first: fieldRefs (status.podIP) and sibling hosts need it.
            self.start_time = self.start_time or now_iso()
            self._patch_status(
                {
                    "podIP": self.ip,
                    "podIPs": [{"ip": self.ip}],
                    "hostIP": "127.0.0.1",
                    "hostIPs": [{"ip": "127.0.0.1"}],
                    "startTime": self.start_time,
                }
            )
            pod = self.snapshot()
            pod.setdefault("status", {})["podIP"] = self.ip
            pod["status"]["podIPs"] = [{"ip": self.ip}]
            pod["status"]["hostIP"] = "127.0.0.1"
            pod["status"]["hostIPs"] = [{"ip": "127.0.0.1"}]
        if not self.gpus:
            want = sum(
                int(
                    parse_quantity(
                        (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0)
                    )
                )
                for c in pod["spec"]["containers"]
            )
            if want:
                self.gpus = self.kubelet.allocate_gpus(self.uid, want)
        self.hosts_file = self.dir / "hosts"
        if not self.hosts_file.exists():
            self.hosts_file.write_text("")
        self.kubelet.refresh_hosts()
        self.volumes = self._materialize_volumes(pod)
        self.base_env = self._base_env(pod)
        self.setup_done = True

    def _base_env(self, pod: dict) -> dict[str, str]:
        k = self.kubelet
        env = {
            key: v
            for key, v in os.environ.items()
            if key != "KUBECONFIG" and not key.startswith("KUBERNETES_")
        }
        path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        if k.path_prepend:
            path = os.pathsep.join([*k.path_prepend, path])
        env["PATH"] = path
        env.update(self._cluster_env(pod))
        return env

    def _cluster_env(self, pod: dict) -> dict[str, str]:
        """What every container's environment gets from the kubelet: HOSTNAME, the
        apiserver's KUBERNETES_* variables and the pod's GPUs."""
        port = str(self.kubelet.apiserver_port)
        env = {"HOSTNAME": self.hostname(pod)}
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port,
                "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
                "KUBERNETES_PORT_443_TCP": f"tcp://127.0.0.1:{port}",
                "KUBERNETES_PORT_443_TCP_ADDR": "127.0.0.1",
                "KUBERNETES_PORT_443_TCP_PORT": port,
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
            }
        )
        if self.gpus:
            devices = ",".join(str(g) for g in self.gpus)
            env["NVIDIA_VISIBLE_DEVICES"] = devices
            env["CUDA_VISIBLE_DEVICES"] = devices
        return env

    @staticmethod
    def hostname(pod: dict) -> str:
        """Return the pod's hostname (``spec.hostname`` or its name, at most 63 chars)."""
        return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]

    def _materialize_volumes(self, pod: dict) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            target = self.dir / "volumes" / name
            if "emptyDir" in vol:
                target.mkdir(exist_ok=True)
                out[name] = target
            elif "hostPath" in vol:
                hp = vol["hostPath"]
                path = Path(hp["path"])
                if hp.get("type") == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                elif hp.get("type") == "FileOrCreate" and not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
                if not path.exists():
                    raise SetupError("ContainerCreating", f"hostPath {path} does not exist")
                out[name] = path
            elif "persistentVolumeClaim" in vol:
                out[name] = self._pvc_path(vol["persistentVolumeClaim"]["claimName"])
            elif any(k in vol for k in ("configMap", "secret", "downwardAPI", "projected")):
                files = self._volume_files(pod, vol)
                self._write_files(target, files, vol, _fs_group(pod))
                self.synced_volumes[name] = (vol, target, _files_digest(files))
                out[name] = target
            else:
                kinds = sorted(k for k in vol if k != "name")
                raise SetupError(
                    "CreateContainerConfigError",
                    f"volume {name!r}: type {kinds} is not supported by the process kubelet",
                )
        return out

    def _pvc_path(self, claim: str) -> Path:
        try:
            pvc = self.kubelet.api.get(
                f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{claim}"
            )
        except ApiError as exc:
            raise SetupError(
                "ContainerCreating", f"persistentvolumeclaim {claim!r}: {exc}"
            ) from None
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        if not pv_name or (pvc.get("status") or {}).get("phase") != "Bound":
            raise SetupError("ContainerCreating", f"persistentvolumeclaim {claim!r} is not bound")
        pv = self.kubelet.api.get(f"/api/v1/persistentvolumes/{pv_name}")
        spec = pv.get("spec") or {}
        src = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        if not src:
            raise SetupError(
                "CreateContainerConfigError",
                f"persistentvolume {pv_name!r} is neither hostPath nor local",
            )
        Path(src).mkdir(parents=True, exist_ok=True)
        return Path(src)

    def _fetch(self, kind: str, name: str, optional: bool) -> dict | None:
        path = f"/api/v1/namespaces/{self.ns}/{kind}s/{name}"
        try:
            obj = self.kubelet.api.get(path)
        except ApiError as exc:
            if exc.status == 404 and optional:
                return None
            raise SetupError(
                "ContainerCreating" if exc.status == 404 else "CreateContainerConfigError",
                f"{kind} {name!r} not found",
            ) from None
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        if kind == "secret":
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v)
        return data

    def _keyed_files(
        self, kind: str, src: dict, optional_default: bool = False
    ) -> dict[str, tuple[bytes, int | None]]:
        name = str(src.get("name") or src.get("secretName"))
        data = self._fetch(kind, name, bool(src.get("optional", optional_default)))
        if data is None:
            return {}
        items = src.get("items")
        if not items:
            return {k: (v, None) for k, v in data.items()}
        out = {}
        for item in items:
            if item["key"] not in data:
                if src.get("optional"):
                    continue
                raise SetupError(
                    "CreateContainerConfigError", f"{kind} {name!r} has no key {item['key']!r}"
                )
            out[item["path"]] = (data[item["key"]], item.get("mode"))
        return out

    def _downward_files(self, pod: dict, items: list[dict]) -> dict[str, tuple[bytes, int | None]]:
        out = {}
        for item in items:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"])
            else:
                ctr = next(
                    (
                        c
                        for c in pod["spec"]["containers"]
                        if c["name"] == item["resourceFieldRef"].get("containerName")
                    ),
                    pod["spec"]["containers"][0],
                )
                value = resource_value(ctr, item["resourceFieldRef"], self.kubelet.allocatable)
            out[item["path"]] = (value.encode(), item.get("mode"))
        return out

    def _token(self, src: dict) -> tuple[bytes, float]:
        pod = self.snapshot()
        sa = pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": int(src.get("expirationSeconds") or 3600),
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.name_,
                "uid": self.uid,
            },
        }
        if src.get("audience"):
            spec["audiences"] = [src["audience"]]
        try:
            resp = self.kubelet.api.create(
                f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
            )
        except ApiError as exc:
            raise SetupError(
                "ContainerCreating", f"token for serviceaccount {sa!r}: {exc}"
            ) from None
        lifetime = float(spec["expirationSeconds"])
        return resp["status"]["token"].encode(), time.monotonic() + 0.8 * lifetime

    def _volume_files(self, pod: dict, vol: dict) -> dict[str, tuple[bytes, int | None]]:
        if "configMap" in vol:
            return self._keyed_files("configmap", vol["configMap"])
        if "secret" in vol:
            return self._keyed_files("secret", vol["secret"])
        if "downwardAPI" in vol:
            return self._downward_files(pod, vol["downwardAPI"].get("items") or [])
        files: dict[str, tuple[bytes, int | None]] = {}
        for src in vol["projected"].get("sources") or []:
            if "serviceAccountToken" in src:
                sat = src["serviceAccountToken"]
                token, refresh_at = self._token(sat)
                files[sat["path"]] = (token, None)
                self.token_refresh.append((refresh_at, vol, self.dir / "volumes" / vol["name"]))
            elif "configMap" in src:
                files.update(self._keyed_files("configmap", src["configMap"]))
            elif "secret" in src:
                files.update(self._keyed_files("secret", src["secret"]))
            elif "downwardAPI" in src:
                files.update(self._downward_files(pod, src["downwardAPI"].get("items") or []))
            elif "clusterTrustBundle" in src or "podCertificate" in src:
                raise SetupError(
                    "CreateContainerConfigError",
                    "projected source not supported by the process kubelet",
                )
        return files

    @staticmethod
    def _write_files(
        target: Path,
        files: dict[str, tuple[bytes, int | None]],
        vol: dict,
        fs_group: int | None = None,
    ) -> None:
        """Write a volume's files atomically (a new ``..data`` folder swapped in, as the
        kubelet does), so a bind mount of ``target`` sees updates. With the pod's
        ``fsGroup`` they belong to that group and it may read them (files ``| 0o440``,
        folders ``| 0o2550``), as the kubelet's volume ownership makes them; a file mode of
        0o400 (a Secret for the pod's user) is then readable by a non-root container."""
        body: dict[str, Any] = next(
            (vol[k] for k in ("configMap", "secret", "downwardAPI", "projected") if k in vol), {}
        )
        default_mode = body.get("defaultMode", 0o644)
        target.mkdir(parents=True, exist_ok=True)
        stamp = f"..{time.time_ns()}"
        data_dir = target / stamp
        for rel, (content, mode) in files.items():
            path = data_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            path.chmod(mode if mode is not None else default_mode)
        data_dir.mkdir(exist_ok=True)
        if fs_group is not None:
            for path in [data_dir, *data_dir.rglob("*")]:
                os.chown(path, -1, fs_group)
                path.chmod(path.stat().st_mode & 0o7777 | (0o2550 if path.is_dir() else 0o440))
        tmp_link = target / "..data_tmp"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(stamp)
        old = os.readlink(target / "..data") if (target / "..data").is_symlink() else None
        os.replace(tmp_link, target / "..data")
        for rel in files:
            top = rel.split("/")[0]
            link = target / top
            if not link.is_symlink() and not link.exists():
                link.symlink_to(f"..data/{top}")
        if old and old != stamp:
            shutil.rmtree(target / old, ignore_errors=True)

    def _resync_volumes(self) -> None:
        """Every ``VOLUME_SYNC_S``: re-read the configMap/secret/projected volumes and rewrite
        those whose content changed (a missing source keeps the files last written)."""
        now = time.monotonic()
        if now - self.volumes_synced_at < VOLUME_SYNC_S or not self.synced_volumes:
            return
        self.volumes_synced_at = now
        pod = self.snapshot()
        for name, (vol, target, digest) in list(self.synced_volumes.items()):
            if "projected" in vol and any(
                "serviceAccountToken" in src for src in vol["projected"].get("sources") or []
            ):
                continue  # tokens have their own refresh (_refresh_tokens)
            try:
                files = self._volume_files(pod, vol)
            except SetupError as exc:
                log.warning("%s: volume %s not resynced: %s", self.name, name, exc)
                continue
            if _files_digest(files) != digest:
                self._write_files(target, files, vol, _fs_group(pod))
                self.synced_volumes[name] = (vol, target, _files_digest(files))
                log.info("%s: volume %s updated", self.name, name)

    def _refresh_tokens(self) -> None:
        now = time.monotonic()
        due = [t for t in self.token_refresh if t[0] <= now]
        if not due:
            return
        self.token_refresh = [t for t in self.token_refresh if t[0] > now]
        for _, vol, target in due:
            try:
                pod = self.snapshot()
                self._write_files(target, self._volume_files(pod, vol), vol, _fs_group(pod))
            except SetupError as exc:
                log.warning("%s: token refresh failed: %s", self.name, exc)
                self.token_refresh.append((now + 10, vol, target))

    # -- containers -----------------------------------------------------------------
    def snapshot(self) -> dict:
        """Return a copy of the latest pod object."""
        with self.lock:
            return copy.deepcopy(self.pod)

    def _container_env(self, pod: dict, spec: dict) -> dict[str, str]:
        env = dict(self.base_env)
        pod_env: dict[str, str] = {}
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._fetch("configmap", ref["name"], bool(ref.get("optional")))
            else:
                ref = src["secretRef"]
                data = self._fetch("secret", ref["name"], bool(ref.get("optional")))
            for k, v in (data or {}).items():
                pod_env[prefix + k] = v.decode(errors="replace")
        for var in spec.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                pod_env[name] = expand(var.get("value", ""), {**env, **pod_env})
                continue
            vf = var["valueFrom"]
            if "fieldRef" in vf:
                pod_env[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                ref = vf["resourceFieldRef"]
                ctr = next(
                    (c for c in pod["spec"]["containers"] if c["name"] == ref.get("containerName")),
                    spec,
                )
                pod_env[name] = resource_value(ctr, ref, self.kubelet.allocatable)
            else:
                kind, ref = (
                    ("configmap", vf["configMapKeyRef"])
                    if "configMapKeyRef" in vf
                    else ("secret", vf["secretKeyRef"])
                )
                data = self._fetch(kind, ref["name"], bool(ref.get("optional")))
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise SetupError(
                        "CreateContainerConfigError",
                        f"{kind} {ref['name']!r} has no key {ref['key']!r}",
                    )
                pod_env[name] = data[ref["key"]].decode(errors="replace")
        env.update(pod_env)
        return env

    def _mounts(self, pod: dict, ctr: Container) -> list[tuple[Path, str, bool, bool]]:
        """``(source, mountPath, readOnly, emptyDir)`` of every volumeMount of ``ctr``
        (subPath resolved), then its termination-log file."""
        empty = {v["name"] for v in pod["spec"].get("volumes") or [] if "emptyDir" in v}
        out = []
        for m in ctr.spec.get("volumeMounts") or []:
            src = self.volumes.get(m["name"])
            if src is None:
                raise SetupError(
                    "CreateContainerConfigError", f"volumeMount {m['name']!r} names no volume"
                )
            sub = m.get("subPath") or ""
            if m.get("subPathExpr"):
                sub = expand(m["subPathExpr"], ctr.env)
            if sub:
                resolved = src / sub
                if (src / "..data").is_symlink():
                    resolved = src / "..data" / sub
                src = resolved
                if not src.exists():
                    src.mkdir(parents=True, exist_ok=True)
            out.append(
                (src, m["mountPath"], bool(m.get("readOnly")), m["name"] in empty and not sub)
            )
        term = ctr.spec.get("terminationMessagePath") or "/dev/termination-log"
        term_file = self.dir / "run" / f"{ctr.name}.termination-log"
        term_file.write_text("")
        out.append((term_file, term, False, False))
        return out

    def _host_paths(self, mounts: list[tuple[Path, str, bool, bool]]) -> list[str]:
        """Host paths the pod still needs once its volumes are mounted: the volume sources,
        its own folder and the "image" (the kubelet's PATH folders and Python)."""
        return [
            str(self.dir),
            *(str(src) for src, _, _, _ in mounts),
            *self.kubelet.path_prepend,
            sys.prefix,
            sys.base_prefix,
        ]

    def _script(self, pod: dict, ctr: Container) -> Path:
        """Write the shell script that sets up the pod's mount namespace and execs.

        A mount whose path is a folder above a host path the pod still needs
        (:meth:`_host_paths`: e.g. an emptyDir at /tmp over a state folder or a virtual
        environment in /tmp) is made last; an emptyDir there is an overlay with the host
        folder below (the host is this kubelet's image: its programs stay visible, the
        pod's writes stay in the emptyDir)."""
        lines = ["#!/bin/sh", "set -e"]
        q = shlex.quote
        lines.append(f"mount --bind {q(str(self.hosts_file))} /etc/hosts")
        lines.append(f"hostname {q(self.hostname(pod))}")

        def target(src: Path, dest: str) -> None:
            if src.is_dir():
                lines.append(f"[ -d {q(dest)} ] || mkdir -p {q(dest)}")
            else:
                lines.append(
                    f"[ -e {q(dest)} ] || {{ mkdir -p {q(str(Path(dest).parent))}; "
                    f": > {q(dest)}; }}"
                )

        def bind(src: Path, dest: str, read_only: bool) -> None:
            target(src, dest)
            lines.append(f"mount --bind {q(str(src))} {q(dest)}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {q(dest)}")

        def overlay(src: Path, dest: str) -> None:
            work = src.with_name(f".{src.name}.overlay-work")
            work.mkdir(exist_ok=True)
            target(src, dest)
            options = f"lowerdir={dest},upperdir={src},workdir={work}"
            lines.append(f"mount -t overlay overlay -o {q(options)} {q(dest)}")

        mounts = self._mounts(pod, ctr)
        needed = self._host_paths(mounts)

        def shadows(dest: str) -> bool:
            top = os.path.normpath(dest)
            return any(os.path.commonpath([top, h]) == top for h in needed if os.path.isabs(h))

        later = sorted((m for m in mounts if shadows(m[1])), key=lambda m: m[1].count("/"))
        for src, dest, read_only, _ in (m for m in mounts if not shadows(m[1])):
            bind(src, dest, read_only)
        workdir = ctr.spec.get("workingDir") or str(self.dir / "work")
        lines.append(f"mkdir -p {q(workdir)} && cd {q(workdir)}")
        for src, dest, read_only, empty_dir in later:
            if empty_dir and os.path.isdir(dest):
                overlay(src, dest)
            else:
                bind(src, dest, read_only)
        security = ctr.spec.get("securityContext") or {}
        if security.get("readOnlyRootFilesystem"):
            # The root mount of this namespace only: volumes and /dev, /proc stay as mounted.
            lines.append("mount -o remount,bind,ro /")
        lines.append(" ".join(["exec", *privilege_argv(security), '"$@"']))
        script = self.dir / "run" / f"{ctr.name}.sh"
        script.write_text("\n".join(lines) + "\n")
        return script

    def _start(self, pod: dict, ctr: Container) -> None:
        command = list(ctr.spec.get("command") or []) + list(ctr.spec.get("args") or [])
        if not ctr.spec.get("command"):
            ctr.state = {
                "waiting": {
                    "reason": "CreateContainerConfigError",
                    "message": "the process kubelet runs no images: set the container's command",
                }
            }
            ctr.done = True
            return
        pod = copy.deepcopy(pod)
        status = pod.setdefault("status", {})
        status.update(
            {
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
            }
        )
        try:
            ctr.env = self._container_env(pod, ctr.spec)
            script = self._script(pod, ctr)
        except SetupError as exc:
            ctr.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
            ctr.restart_at = time.monotonic() + 1.0
            return
        argv = [expand(a, ctr.env) for a in command]
        log_path = self.dir / "logs" / f"{ctr.name}-{ctr.restart_count}.log"
        with open(log_path, "ab") as out:
            ctr.proc = subprocess.Popen(
                [
                    shutil.which("unshare") or "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "--",
                    "/bin/sh",
                    str(script),
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=ctr.env,
                start_new_session=True,
                cwd="/",
            )
        write_pidfile(self.dir / "run" / f"{ctr.name}.pid", ctr.proc.pid)
        (self.dir / "logs" / f"{ctr.name}.current").write_text(log_path.name)
        ctr.started_mono = time.monotonic()
        ctr.state = {"running": {"startedAt": now_iso()}}
        ctr.ready = False
        ctr.started = "startup" not in ctr.probes
        ctr.kill_deadline = None
        ctr.kill_reason = None
        ctr.restart_at = None
        for probe in ctr.probes.values():
            probe.reset(ctr.started_mono)
        log.info("%s: started %s pid %d: %s", self.name, ctr.name, ctr.proc.pid, argv)

    def _kill(self, ctr: Container, grace_s: float, reason: str | None = None) -> None:
        if not ctr.running or ctr.kill_deadline is not None:
            return
        assert ctr.proc is not None
        kill_group(ctr.proc.pid, signal.SIGTERM)
        ctr.kill_deadline = time.monotonic() + max(grace_s, 0.0)
        ctr.kill_reason = reason

    def _reap(self, ctr: Container, pod: dict) -> None:
        """Handle a container whose main process exited."""
        assert ctr.proc is not None
        code = ctr.proc.returncode
        kill_group(ctr.proc.pid, signal.SIGKILL)  # leftovers of its process group
        (self.dir / "run" / f"{ctr.name}.pid").unlink(missing_ok=True)
        term: dict[str, Any] = {"exitCode": code if code >= 0 else 128 - code}
        if code < 0:
            term["signal"] = -code
        term["reason"] = "Completed" if code == 0 else "Error"
        if ctr.kill_reason:
            term["reason"] = ctr.kill_reason if code != 0 else "Completed"
        term["startedAt"] = ctr.state.get("running", {}).get("startedAt", now_iso())
        term["finishedAt"] = now_iso()
        term["containerID"] = f"process://{ctr.proc.pid}"
        message = self._termination_message(ctr, code)
        if message:
            term["message"] = message
        ctr.state = {"terminated": term}
        ctr.ready = False
        ctr.started = False
        policy = pod["spec"].get("restartPolicy") or "Always"
        if ctr.init:
            restart = code != 0 and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if self.terminating_since is not None or self.removed:
            restart = False
        log.info(
            "%s: %s exited %s%s",
            self.name,
            ctr.name,
            term["exitCode"],
            " (will restart)" if restart else "",
        )
        if restart:
            ctr.restart_at = time.monotonic() + ctr.backoff
            ctr.backoff = min(ctr.backoff * 2, BACKOFF_MAX_S)
        else:
            ctr.done = True

    def _termination_message(self, ctr: Container, code: int) -> str:
        path = self.dir / "run" / f"{ctr.name}.termination-log"
        try:
            message = path.read_bytes()[:4096].decode(errors="replace")
        except OSError:
            message = ""
        policy = ctr.spec.get("terminationMessagePolicy") or "File"
        if not message and code != 0 and policy == "FallbackToLogsOnError":
            try:
                logf = self.dir / "logs" / f"{ctr.name}-{ctr.restart_count}.log"
                tail = logf.read_bytes()[-2048:].decode(errors="replace").splitlines()[-80:]
                message = "\n".join(tail)
            except OSError:
                message = ""
        return message

    def _restart(self, pod: dict, ctr: Container) -> None:
        ctr.last_state = ctr.state if "terminated" in ctr.state else ctr.last_state
        if ctr.proc is not None:
            ctr.restart_count += 1
        ctr.proc = None
        self._start(pod, ctr)

    # -- probes ---------------------------------------------------------------------
    def _probe_once(self, ctr: Container, spec: dict, timeout: float) -> bool:
        if "httpGet" in spec:
            hg = spec["httpGet"]
            port = self._port(ctr, hg["port"])
            host = hg.get("host") or self.ip or "127.0.0.1"
            conn_cls = (
                http.client.HTTPSConnection
                if hg.get("scheme") == "HTTPS"
                else http.client.HTTPConnection
            )
            kwargs: dict[str, Any] = {"timeout": timeout}
            if hg.get("scheme") == "HTTPS":
                kwargs["context"] = ssl._create_unverified_context()
            conn = conn_cls(host, port, **kwargs)
            try:
                headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}
                conn.request("GET", hg.get("path") or "/", headers=headers)
                return 200 <= conn.getresponse().status < 400
            except OSError:
                return False
            finally:
                conn.close()
        if "tcpSocket" in spec:
            ts = spec["tcpSocket"]
            try:
                with socket.create_connection(
                    (ts.get("host") or self.ip, self._port(ctr, ts["port"])), timeout=timeout
                ):
                    return True
            except OSError:
                return False
        if "exec" in spec:
            if not ctr.running:
                return False
            assert ctr.proc is not None
            cmd = [
                shutil.which("nsenter") or "nsenter",
                "--target",
                str(ctr.proc.pid),
                "--mount",
                "--uts",
                "--",
                *spec["exec"].get("command", []),
            ]
            try:
                res = subprocess.run(
                    cmd,
                    env=ctr.env,
                    capture_output=True,
                    timeout=timeout,
                    check=False,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired:
                return False
            return res.returncode == 0
        return True  # grpc probes are not supported: treated as passing

    @staticmethod
    def _port(ctr: Container, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in ctr.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no port named {port!r}")

    def _run_probes(self, pod: dict, ctr: Container) -> None:
        now = time.monotonic()
        if not ctr.running or ctr.kill_deadline is not None:
            return
        for kind in ("startup", "liveness", "readiness"):
            probe = ctr.probes.get(kind)
            if probe is None or probe.running or now < probe.next_at:
                continue
            if kind != "startup" and not ctr.started:
                continue
            if kind == "startup" and ctr.started:
                continue
            probe.next_at = now + probe.period
            probe.running = True
            threading.Thread(
                target=self._probe_thread, args=(pod, ctr, kind, probe), daemon=True
            ).start()

    def _probe_thread(self, pod: dict, ctr: Container, kind: str, probe: Probe) -> None:
        try:
            try:
                ok = self._probe_once(ctr, probe.spec, probe.timeout)
            except Exception as exc:
                log.debug("%s: %s probe error: %s", self.name, kind, exc)
                ok = False
            with self.lock:
                if ok:
                    probe.successes += 1
                    probe.failures = 0
                else:
                    probe.failures += 1
                    probe.successes = 0
                if kind == "startup":
                    if probe.successes >= 1:
                        ctr.started = True
                    elif probe.failures >= probe.failure_threshold:
                        self._kill(ctr, self._grace(pod, probe.spec), "StartupProbeFailed")
                elif kind == "readiness":
                    if probe.successes >= probe.success_threshold:
                        ctr.ready = True
                    elif probe.failures >= probe.failure_threshold:
                        ctr.ready = False
                elif kind == "liveness" and probe.failures >= probe.failure_threshold:
                    log.info("%s: %s liveness probe failed, killing", self.name, ctr.name)
                    self._kill(ctr, self._grace(pod, probe.spec), "Error")
        finally:
            probe.running = False
        self.kubelet.wake(self)

    @staticmethod
    def _grace(pod: dict, probe: dict | None = None) -> float:
        if probe and probe.get("terminationGracePeriodSeconds") is not None:
            return float(probe["terminationGracePeriodSeconds"])
        g = pod["spec"].get("terminationGracePeriodSeconds")
        return float(30 if g is None else g)

    # -- status ---------------------------------------------------------------------
    def _condition(self, ctype: str, status: bool, reason: str = "", message: str = "") -> dict:
        s = "True" if status else "False"
        prev = self.condition_times.get(ctype)
        if prev is None or prev[0] != s:
            self.condition_times[ctype] = (s, now_iso())
        cond = {
            "type": ctype,
            "status": s,
            "lastProbeTime": None,
            "lastTransitionTime": self.condition_times[ctype][1],
        }
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond

    def _compute_phase(self, pod: dict) -> str:
        if self.phase in ("Succeeded", "Failed"):
            return self.phase
        init_failed = any(
            c.done and c.state.get("terminated", {}).get("exitCode", 0) != 0
            for c in self.init_containers
        )
        if init_failed:
            return "Failed"
        if not all(c.done for c in self.init_containers) or not self.setup_done:
            return "Pending"
        if not any(c.proc is not None for c in self.containers):
            if all(c.done for c in self.containers):  # none could start (no command ...)
                return "Failed"
            return "Pending"
        if all(c.done for c in self.containers):
            codes = [c.state.get("terminated", {}).get("exitCode", 1) for c in self.containers]
            return "Succeeded" if all(code == 0 for code in codes) else "Failed"
        return "Running"

    def _status(self, pod: dict) -> dict:
        self.phase = self._compute_phase(pod)
        initialized = all(
            c.done and c.state.get("terminated", {}).get("exitCode") == 0
            for c in self.init_containers
        )
        ctrs_ready = all(c.ready for c in self.containers) and self.phase == "Running"
        not_ready = [c.name for c in self.containers if not c.ready]
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        current = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        missing = [g for g in gates if current.get(g, {}).get("status") != "True"]
        ready = ctrs_ready and not missing
        if not ctrs_ready:
            r_reason, r_msg = "ContainersNotReady", f"containers with unready status: {not_ready}"
        elif missing:
            r_reason = "ReadinessGatesNotReady"
            r_msg = f"corresponding condition of pod readiness gate {missing[0]!r} is not True"
        else:
            r_reason = r_msg = ""
        if self.phase in ("Succeeded", "Failed"):
            r_reason = r_reason and "PodCompleted"
        conditions = [
            self._condition("PodReadyToStartContainers", self.setup_done),
            self._condition(
                "Initialized", initialized, "" if initialized else "ContainersNotInitialized"
            ),
            self._condition("ContainersReady", ctrs_ready, "" if ctrs_ready else r_reason),
            self._condition("Ready", ready, r_reason, r_msg),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "containerStatuses": [c.status(self.ip) for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status(self.ip) for c in self.init_containers]
        if self.ip:
            status.update(
                {
                    "podIP": self.ip,
                    "podIPs": [{"ip": self.ip}],
                    "hostIP": "127.0.0.1",
                    "hostIPs": [{"ip": "127.0.0.1"}],
                }
            )
        if self.start_time:
            status["startTime"] = self.start_time
        if self.setup_error is not None and not self.setup_done:
            for entry in status["containerStatuses"]:
                entry["state"] = {
                    "waiting": {"reason": self.setup_error.reason, "message": str(self.setup_error)}
                }
        return status

    def _patch_status(self, status: dict) -> bool:
        """Send ``status``; False when the apiserver did not answer (the caller retries
        after :attr:`status_backoff_s`, doubling up to :data:`BACKOFF_MAX_S`)."""
        try:
            self.kubelet.api.patch(pod_path(self.ns, self.name_, "status"), {"status": status})
        except ApiUnreachable as exc:
            if self.status_backoff_s == 0:
                log.warning("%s: status patch failed, retrying with backoff: %s", self.name, exc)
            self.status_backoff_s = min(
                BACKOFF_MAX_S, max(BACKOFF_INITIAL_S, 2 * self.status_backoff_s)
            )
            self.status_retry_at = time.monotonic() + self.status_backoff_s
            return False
        except ApiError as exc:
            if exc.status == 404:
                self.removed = True
            else:
                log.warning("%s: status patch failed: %s", self.name, exc)
        if self.status_backoff_s:
            log.info("%s: status patch works again", self.name)
        self.status_backoff_s = 0.0
        return True

    def _publish(self, pod: dict) -> None:
        if time.monotonic() < self.status_retry_at:
            return
        status = self._status(pod)
        if status != self.last_status and self._patch_status(status):
            self.last_status = status

    # -- main loop ------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("%s: pod worker crashed", self.name)
            self._kill_all_now()
        finally:
            self.kubelet.release(self)
            self.finished.set()

    def _all(self) -> list[Container]:
        return [*self.init_containers, *self.containers]

    def _kill_all_now(self) -> None:
        stop_pids([c.proc.pid for c in self._all() if c.proc is not None and c.running], 2.0)

    def _run(self) -> None:
        while True:
            pod = self.snapshot()
            meta = pod["metadata"]
            if self.removed or self.stop_event.is_set():
                self._terminate(pod, final=True)
                return
            if meta.get("deletionTimestamp") and self.terminating_since is None:
                self.terminating_since = time.monotonic()
                grace = meta.get("deletionGracePeriodSeconds")
                grace = self._grace(pod) if grace is None else float(grace)
                self.grace_deadline = time.monotonic() + grace
                log.info("%s: deleting, grace %.0f s", self.name, grace)
                for c in self._all():
                    self._kill(c, grace, None)
            if not self.setup_done and self.terminating_since is None:
                try:
                    self._setup()
                    self.setup_error = None
                except SetupError as exc:
                    if str(exc) != str(self.setup_error):
                        log.info("%s: waiting: %s", self.name, exc)
                    self.setup_error = exc
                    self._publish(pod)
                    self.kubelet.wait(self, 1.0)
                    continue
                except ApiUnreachable as exc:  # setup reads Secrets/ConfigMaps: try again
                    log.info("%s: setup waits for the apiserver: %s", self.name, exc)
                    self.kubelet.wait(self, 1.0)
                    continue
            with self.lock:
                self._step(pod)
            self._publish(pod)
            if self.terminating_since is not None and not any(c.running for c in self._all()):
                self._delete_pod(pod)
                return
            try:
                self._refresh_tokens()
                self._resync_volumes()
            except ApiUnreachable as exc:
                log.info("%s: volume refresh waits for the apiserver: %s", self.name, exc)
            self.kubelet.wait(self, TICK_S)

    def _step(self, pod: dict) -> None:
        now = time.monotonic()
        for ctr in self._all():
            if ctr.proc is not None and ctr.proc.poll() is not None and "running" in ctr.state:
                self._reap(ctr, pod)
            if ctr.kill_deadline is not None and ctr.running and now >= ctr.kill_deadline:
                assert ctr.proc is not None
                log.info("%s: %s ignored SIGTERM, SIGKILL", self.name, ctr.name)
                kill_group(ctr.proc.pid, signal.SIGKILL)
                ctr.kill_deadline = float("inf")
        if self.terminating_since is not None or self.phase in ("Succeeded", "Failed"):
            return
        # Init containers run one after another, each to success.
        for ctr in self.init_containers:
            if ctr.done:
                if ctr.state.get("terminated", {}).get("exitCode") != 0:
                    return
                continue
            if ctr.proc is None and ctr.restart_at is None:
                self._start(pod, ctr)
            elif not ctr.running and ctr.restart_at is not None and now >= ctr.restart_at:
                self._restart(pod, ctr)
            elif ctr.restart_at is not None and not ctr.running:
                ctr.state = {"waiting": {"reason": "CrashLoopBackOff"}}
            return
        for ctr in self.containers:
            if ctr.done:
                continue
            if ctr.proc is None and ctr.restart_at is None:
                self._start(pod, ctr)
            elif not ctr.running and ctr.restart_at is not None and now >= ctr.restart_at:
                self._restart(pod, ctr)
            elif not ctr.running and ctr.restart_at is not None and ctr.proc is not None:
                ctr.last_state = ctr.state if "terminated" in ctr.state else ctr.last_state
                ctr.state = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off restarting {ctr.name}",
                    }
                }
            if ctr.running:
                if not ctr.probes.get("readiness") and ctr.started:
                    ctr.ready = True
                if ctr.running and now - ctr.started_mono > 10:
                    ctr.backoff = BACKOFF_INITIAL_S
                self._run_probes(pod, ctr)

    def _terminate(self, pod: dict, final: bool) -> None:
        """Stop every process (SIGTERM, the grace period, SIGKILL), used when the pod
        object vanished or the kubelet stops."""
        grace = self._grace(pod)
        if self.kubelet.stopping:
            grace = min(grace, 5.0)
        for c in self._all():
            self._kill(c, grace)
        deadline = time.monotonic() + grace
        while any(c.running for c in self._all()):
            if time.monotonic() >= deadline:
                for c in self._all():
                    if c.running:
                        assert c.proc is not None
                        kill_group(c.proc.pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        for c in self._all():
            if c.proc is not None:
                kill_group(c.proc.pid, signal.SIGKILL)
                (self.dir / "run" / f"{c.name}.pid").unlink(missing_ok=True)

    def _delete_pod(self, pod: dict) -> None:
        for c in self._all():
            if c.proc is not None:
                kill_group(c.proc.pid, signal.SIGKILL)
                (self.dir / "run" / f"{c.name}.pid").unlink(missing_ok=True)
        try:
            self.kubelet.api.delete(
                pod_path(self.ns, self.name_),
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("%s: final delete failed: %s", self.name, exc)
        log.info("%s: removed", self.name)


# ----------------------------------------------------------------------------- kubelet
class Kubelet:
    """The node agent: registration, heartbeats, the pod watch, hosts files, logs server."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.state_dir = Path(args.state_dir).resolve()
        self.node_name: str = args.node_name
        self.node_index: int = args.node_index
        self.pod_net: str = args.pod_net
        self.apiserver_port: int = args.apiserver_port
        self.port: int = args.port
        self.path_prepend: list[str] = [p for p in args.path_prepend if p]
        self.capacity = {
            "cpu": args.cpu,
            "memory": args.memory,
            "pods": str(args.max_pods),
            "nvidia.com/gpu": str(args.gpus),
            "ephemeral-storage": "100Gi",
        }
        self.allocatable = {k: parse_quantity(v) for k, v in self.capacity.items()}
        self.api = Api(self.state_dir / "kubeconfig")
        self.workers: dict[str, PodWorker] = {}
        self.all_pods: dict[str, dict] = {}  # uid -> pod (every node), for hosts files
        self.lock = threading.RLock()
        self.ips: dict[str, str] = {}
        self._transition: dict[str, str] = {}
        self._last_ready: str | None = None
        self.next_ip = 0
        self.gpu_owner: dict[int, str] = {}
        self.gpus = args.gpus
        self.stopping = False
        self.stop_event = threading.Event()
        self.wakeups: dict[str, threading.Event] = {}
        self.hosts_version = 0

    # -- resources ------------------------------------------------------------------
    def allocate_ip(self, uid: str, existing: str | None) -> str:
        """Return the pod's address: its existing one if ours and free, else the next free."""
        prefix = f"{self.pod_net}."
        with self.lock:
            used = set(self.ips.values())
            if existing and existing.startswith(prefix) and existing not in used:
                self.ips[uid] = existing
                return existing
            for _ in range(16 * 254):
                n = self.next_ip
                self.next_ip = (self.next_ip + 1) % (16 * 254)
                ip = f"{prefix}{self.node_index * 16 + n // 254}.{n % 254 + 1}"
                taken = ip in used or any(
                    (p.get("status") or {}).get("podIP") == ip for p in self.all_pods.values()
                )
                if not taken:
                    self.ips[uid] = ip
                    return ip
        raise SetupError("ContainerCreating", "no free pod address")

    def allocate_gpus(self, uid: str, count: int) -> list[int]:
        """Reserve ``count`` GPU indices for a pod; raises SetupError if too few are free."""
        with self.lock:
            free = [g for g in range(self.gpus) if g not in self.gpu_owner]
            if len(free) < count:
                raise SetupError("ContainerCreating", f"{count} GPUs wanted, {len(free)} free")
            for g in free[:count]:
                self.gpu_owner[g] = uid
            return free[:count]

    def release(self, worker: PodWorker) -> None:
        """Forget a finished pod worker and free its address and GPUs."""
        with self.lock:
            self.workers.pop(worker.uid, None)
            self.ips.pop(worker.uid, None)
            for g, owner in list(self.gpu_owner.items()):
                if owner == worker.uid:
                    del self.gpu_owner[g]
            self.wakeups.pop(worker.uid, None)

    def wake(self, worker: PodWorker) -> None:
        """Make a pod worker run its next step now."""
        ev = self.wakeups.get(worker.uid)
        if ev:
            ev.set()

    def wait(self, worker: PodWorker, timeout: float) -> None:
        """Sleep a pod worker up to ``timeout`` seconds or until woken."""
        ev = self.wakeups.setdefault(worker.uid, threading.Event())
        ev.wait(timeout)
        ev.clear()

    # -- hosts ----------------------------------------------------------------------
    def refresh_hosts(self) -> None:
        """Rewrite every local pod's hosts file in place (bind mounts see the change)."""
        with self.lock:
            named = []
            for pod in self.all_pods.values():
                ip = (pod.get("status") or {}).get("podIP")
                spec = pod.get("spec") or {}
                if ip and spec.get("subdomain") and not pod["metadata"].get("deletionTimestamp"):
                    named.append(
                        (
                            ip,
                            PodWorker.hostname(pod),
                            spec["subdomain"],
                            pod["metadata"]["namespace"],
                        )
                    )
            for worker in list(self.workers.values()):
                hosts = getattr(worker, "hosts_file", None)
                if hosts is None or not hosts.exists():
                    continue
                pod = worker.pod
                ns = worker.ns
                hn = PodWorker.hostname(pod)
                lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
                sub = pod["spec"].get("subdomain")
                own = (
                    [hn]
                    if not sub
                    else [
                        f"{hn}.{sub}.{ns}.svc.cluster.local",
                        f"{hn}.{sub}.{ns}.svc",
                        f"{hn}.{sub}.{ns}",
                        f"{hn}.{sub}",
                        hn,
                    ]
                )
                lines.append(f"{worker.ip}\t{' '.join(own)}")
                for ip, h, s, pns in sorted(named):
                    if ip == worker.ip:
                        continue
                    names = [
                        f"{h}.{s}.{pns}.svc.cluster.local",
                        f"{h}.{s}.{pns}.svc",
                        f"{h}.{s}.{pns}",
                    ]
                    if pns == ns:
                        names.append(f"{h}.{s}")
                    lines.append(f"{ip}\t{' '.join(names)}")
                text = "\n".join(lines) + "\n"
                try:
                    if hosts.read_text() != text:
                        with open(hosts, "r+") as f:
                            f.write(text)
                            f.truncate()
                except OSError as exc:
                    log.warning("hosts file %s: %s", hosts, exc)

    # -- node -----------------------------------------------------------------------
    def _node_status(self, ready: bool, reason: str) -> dict:
        now = now_iso()
        cond = [
            {
                "type": t,
                "status": "False",
                "reason": f"KubeletHasNo{t}" if t != "PIDPressure" else "KubeletHasSufficientPID",
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._transition.get(t, now),
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        ready_s = "True" if ready else "False"
        if self._last_ready != ready_s:
            self._transition["Ready"] = now
            self._last_ready = ready_s
        cond.append(
            {
                "type": "Ready",
                "status": ready_s,
                "reason": reason,
                "message": "process kubelet is posting ready status"
                if ready
                else "process kubelet stopped",
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._transition["Ready"],
            }
        )
        return {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": cond,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "dwdp process kubelet",
                "containerRuntimeVersion": "process://0.1",
                "kubeletVersion": K8S_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64" if platform.machine() == "x86_64" else platform.machine(),
            },
        }

    def register(self) -> None:
        """Create the Node (if missing) and post a Ready status."""
        self._transition = {}
        self._last_ready = None
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": "amd64",
                    "dwdp.io/process-kubelet": "true",
                    "node.kubernetes.io/instance-type": "process",
                },
            },
            "spec": {},
        }
        try:
            self.api.create("/api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self.post_status(True)
        self._lease()

    def post_status(self, ready: bool) -> None:
        """Patch the node status (conditions with a fresh heartbeat)."""
        self.api.patch(
            f"/api/v1/nodes/{self.node_name}/status",
            {"status": self._node_status(ready, "KubeletReady" if ready else "KubeletStopped")},
        )

    def _lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        body = {
            "spec": {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": 40,
                "renewTime": now_micro(),
            }
        }
        try:
            self.api.patch(path, body, strategic=False)
        except ApiError as exc:
            if exc.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
                **body,
            }
            with contextlib.suppress(ApiError):
                self.api.create(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease
                )

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(HEARTBEAT_S):
            try:
                self.post_status(True)
                self._lease()
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- pods -----------------------------------------------------------------------
    def _handle(self, etype: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        mine = (pod.get("spec") or {}).get("nodeName") == self.node_name
        with self.lock:
            if etype == "DELETED":
                self.all_pods.pop(uid, None)
            else:
                self.all_pods[uid] = pod
            worker = self.workers.get(uid)
            if etype == "DELETED":
                if worker:
                    worker.mark_removed()
                    self.wake(worker)
            elif mine:
                if worker:
                    worker.update(pod)
                    self.wake(worker)
                elif not self.stopping and not self._finished_before(pod):
                    worker = PodWorker(self, pod)
                    self.workers[uid] = worker
                    worker.start()
        self.refresh_hosts()

    @staticmethod
    def _finished_before(pod: dict) -> bool:
        phase = (pod.get("status") or {}).get("phase")
        return phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")

    def _watch_loop(self) -> None:
        rv = None
        while not self.stop_event.is_set():
            try:
                if rv is None:
                    listing = self.api.get("/api/v1/pods")
                    rv = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing["items"]:
                        seen.add(pod["metadata"]["uid"])
                        self._handle("MODIFIED", pod)
                    for uid in [u for u in self.all_pods if u not in seen]:
                        self._handle("DELETED", self.all_pods[uid])
                resp = self.api.request(
                    "GET",
                    "/api/v1/pods",
                    query={
                        "watch": "true",
                        "resourceVersion": rv,
                        "timeoutSeconds": 300,
                        "allowWatchBookmarks": "true",
                    },
                    stream=True,
                    timeout=None,
                )
                buf = b""
                for chunk in resp.stream(amt=None, decode_content=False):
                    if self.stop_event.is_set():
                        break
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            if obj.get("code") == 410:
                                rv = None
                            raise ApiError(obj.get("code", 500), obj.get("message"))
                        rv = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._handle(event["type"], obj)
                resp.release_conn()
            except ApiError as exc:
                log.info("pod watch restarts: %s", exc)
                time.sleep(0.2)
            except Exception as exc:
                log.warning("pod watch failed: %s", exc)
                rv = None
                time.sleep(1)

    # -- logs server ----------------------------------------------------------------
    def _serve_logs(self) -> None:
        kubelet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                q = urllib.parse.parse_qs(url.query)
                parts = url.path.strip("/").split("/")
                if parts == ["healthz"]:
                    self._send(200, b"ok")
                    return
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self._send(404, b"not supported by the process kubelet\n")
                    return
                _, ns, name, ctr = parts
                pod_dirs = sorted(
                    kubelet.state_dir.glob(f"pods/{ns}_{name}_*"), key=lambda p: p.stat().st_mtime
                )
                if not pod_dirs:
                    self._send(404, b"pod not found\n")
                    return
                logs = pod_dirs[-1] / "logs"
                try:
                    current = (logs / f"{ctr}.current").read_text().strip()
                except OSError:
                    self._send(404, b"container not started\n")
                    return
                if q.get("previous", ["false"])[0] == "true":
                    n = int(current.rsplit("-", 1)[1].split(".")[0]) - 1
                    current = f"{ctr}-{n}.log"
                path = logs / current
                if not path.exists():
                    self._send(404, b"no such log\n")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                data = path.read_bytes()
                if "tailLines" in q:
                    n = int(q["tailLines"][0])
                    data = b"".join(data.splitlines(keepends=True)[-n:]) if n else b""
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                    if q.get("follow", ["false"])[0] == "true":
                        with open(path, "rb") as f:
                            f.seek(0, os.SEEK_END)
                            while not kubelet.stop_event.is_set():
                                chunk = f.read(65536)
                                if chunk:
                                    self.wfile.write(chunk)
                                    self.wfile.flush()
                                else:
                                    if (logs / f"{ctr}.current").read_text().strip() != path.name:
                                        break
                                    time.sleep(0.2)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        pki = self.state_dir / "pki"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
        ctx.load_verify_locations(str(pki / "ca.crt"))
        ctx.verify_mode = ssl.CERT_REQUIRED
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._server = server
        server.serve_forever(poll_interval=0.5)

    # -- lifecycle ------------------------------------------------------------------
    def _sweep_leftovers(self) -> None:
        """Kill pod processes a previous kubelet of this state folder left running."""
        pids = []
        for f in (self.state_dir / "pods").glob("*/run/*.pid"):
            pid = read_pidfile(f)
            if pid is not None:
                pids.append(pid)
            f.unlink(missing_ok=True)
        if pids:
            log.info("stopping %d leftover pod processes", len(pids))
            stop_pids(pids, 5.0)

    def run(self) -> int:
        """Register, serve until SIGTERM/SIGINT, stop every pod; return the exit status."""
        Path(SA_DIR).mkdir(parents=True, exist_ok=True)
        if not Path("/dev/termination-log").exists():
            with contextlib.suppress(OSError):
                Path("/dev/termination-log").touch()
        self._sweep_leftovers()
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        self.register()
        threads = [
            threading.Thread(target=f, daemon=True, name=f.__name__)
            for f in (self._heartbeat_loop, self._watch_loop, self._serve_logs)
        ]
        for t in threads:
            t.start()
        log.info(
            "node %s ready (pods on %s.%d.0/20)",
            self.node_name,
            self.pod_net,
            self.node_index * 16,
        )
        self.stop_event.wait()
        log.info("stopping")
        self.stopping = True
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop_event.set()
            self.wake(w)
        for w in workers:
            w.finished.wait(15)
        with contextlib.suppress(Exception):
            self.post_status(False)
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dwdp_dev.devcluster.kubelet``; returns the exit status."""
    p = argparse.ArgumentParser(description="dwdp process kubelet")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--node-name", default="dwdp-dev")
    p.add_argument("--node-index", type=int, default=0)
    p.add_argument("--cpu", default="32", help="cpu capacity (cores)")
    p.add_argument("--memory", default="128Gi", help="memory capacity (quantity)")
    p.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity")
    p.add_argument("--max-pods", type=int, default=110)
    p.add_argument(
        "--pod-net",
        default="100.64",
        help="pods get <pod-net>.x.y (a /16 routed to lo as local addresses)",
    )
    p.add_argument("--port", type=int, required=True, help="HTTPS port for kubectl logs")
    p.add_argument("--apiserver-port", type=int, required=True)
    p.add_argument(
        "--path-prepend",
        action="append",
        default=[],
        help="folder put first on the PATH of pod processes (repeatable)",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(threadName)s: %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    return Kubelet(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
