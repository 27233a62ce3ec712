"""The real node of the local cluster (opt-in: ``dwdp dev up --node real``, or
``Cluster.up(node_kind="real")``): the kubelet and kube-proxy of the control-plane binary (the
same pinned Kubernetes release), Debian's containerd + runc, the CNI bridge plugins.

Each real node lives in a network namespace of its own (:class:`NodeNetwork`, from the
cluster's pod network ``<pod_net>``): containerd, the kubelet, kube-proxy and the cluster DNS
run in it (``nsenter --net``), so kube-proxy's rules, the pod bridge and the node's ports never
touch the host's, and several clusters with real nodes run side by side on one host. What a
node adds to the host, and what :meth:`RealNode.down` takes away again:

- the namespace ``dwdp-node-<N>`` and a veth pair into it: the host end ``<pod_net>.255.253``,
  the node's end (the node IP) ``<pod_net>.255.254``; the host routes ``<pod_net>.0.0/16``
  (pods ``<pod_net>.0.0/17``, Services ``<pod_net>.128.0/24``) to the node through it, so a
  ClusterIP answers from the host and no packet for a pod or a Service leaves the machine;
- inside the namespace: the CNI bridge :data:`BRIDGE` of the pods (host-local IPAM, no
  masquerade), ``net.ipv4.ip_forward=1``, the Service CIDR routed to ``lo`` (a Service without
  endpoints is refused there, never sent back to the host), kube-proxy (iptables mode) and
  the cluster DNS, CoreDNS on the node IP's port 53 (:mod:`dwdp_dev.devcluster.clusterdns`),
  the kubelet's ``clusterDNS``;
- host guards (iptables, comment ``dwdp-real-node-<N>``): nothing is forwarded into or out of
  the node's veth (pods reach the host, never another machine or another cluster), and the
  apiserver's port, bound on every address so that pods reach it through the ``kubernetes``
  Service, is dropped on the default route's device;
- containerd, spawned from the cluster (pid file, log) with its root in a store of the cache
  that keeps the imported images for the next node (:mod:`.nodestore`; ``<state>/containerd``
  links to it) and its state and sockets in ``<RUN_ROOT>/<N>`` (unix socket paths are short);
  cgroupfs, runc, overlayfs, ``restrict_oom_score_adj`` (this host has no CAP_SYS_RESOURCE:
  runc fails to lower a sandbox's oom_score_adj otherwise);
- the node's cgroup root (``/dwdp-node-<N>`` in every hierarchy) with the CPU weight
  :data:`NODE_CPU_SHARES`;
- images: a static pause built from ``go/pause`` and every image of the local OCI store that
  is current (:func:`images.lookup`), imported into containerd's ``k8s.io`` namespace under
  their references and ``<repo>@<manifest digest>``; unchanged ones are not imported again;
- the kubelet (``failCgroupV1: false``, ``cgroupDriver: cgroupfs``, ``failSwapOn: false``,
  ``oomScoreAdj: 0``, image GC off: the images cannot be pulled again, its pods' cgroups
  under ``/dwdp-node-<N>`` in every hierarchy), registered with a ``system:node:<name>``
  client certificate; its serving certificate names the node IP;
- the fake ``nvidia.com/gpu`` capacity, patched into the Node's status after it registers.

The kernel settings the kubelet writes outside any namespace (``vm.*``, ``kernel.*``) are
recorded in ``<state>/real-node-host.json`` and restored by the ``down`` of the last real node
of the host.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

from dwdp_dev.devcluster import build, clusterdns, images, nodestore, pki
from dwdp_dev.devcluster.config import ClusterConfig
from dwdp_dev.devcluster.pids import read_pidfile, stop_pids

PACKAGES = ("containerd", "runc", "containernetworking-plugins")
"""The Debian packages the real node needs (containerd 1.6, runc 1.1, the CNI plugins)."""
CNI_BIN = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
RUN_ROOT = Path("/run/dwdp-real-node")
"""One folder per real node of this host (``<N>``): containerd's state and sockets, the runc
root, and ``owner`` (the node's state folder)."""
BRIDGE = "dwdpbr0"
"""The pods' bridge, inside each node's network namespace."""
GUARD = "dwdp-real-node"
"""The comment of the host's iptables rules a real node adds (its guards), ``-<N>`` after it."""
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
"""Sysctls outside any network namespace the kubelet may change; restored by ``down``."""
SYNC_FREQUENCY = "5s"
"""The local node's kubelet sync period (``syncFrequency``): at most how late a rotated Secret
reaches a running pod's volume (the default, one minute, made the rotated-key test wait 59.5
and 78.9 s)."""
NODE_CPU_SHARES = 8192
"""The CPU weight (cgroup v1 ``cpu.shares``) of the node's cgroup root, where all its pods run.
The default, 1024, is the weight of one busy process of the host: beside the unit tests (whose
torch threads run in the host's root cgroup) the nine pods of the demo deployment then shared
one process's part of the CPU. 8192 gives them together about the weight they had as nine
host processes under the process kubelet; inside, the kubelet divides it by requests."""
COMPONENTS = ("containerd", "node-kubelet", "kube-proxy", "coredns")
"""The pid-file names of the real node's processes."""


class RealNodeError(RuntimeError):
    """The real node cannot start (missing packages, another real node, a failed step)."""


def missing_packages() -> list[str]:
    """The Debian packages of :data:`PACKAGES` whose programs are not installed."""
    missing = []
    if not (shutil.which("containerd") and shutil.which("ctr")):
        missing.append("containerd")
    if not shutil.which("runc"):
        missing.append("runc")
    if not all((CNI_BIN / p).is_file() for p in CNI_PLUGINS):
        missing.append("containernetworking-plugins")
    return missing


def check_host() -> None:
    """Raise RealNodeError naming what is missing: root, the packages, iptables."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root (the kubelet, containerd and kube-proxy need it)")
    missing = missing_packages()
    if missing:
        problems.append(
            f"the Debian packages {' '.join(missing)} "
            f"(apt-get install -y {' '.join(PACKAGES)}; scripts/test.sh installs them)"
        )
    if not shutil.which("iptables"):
        problems.append("iptables (apt-get install -y iptables)")
    if problems:
        raise RealNodeError("the real node needs " + "; ".join(problems))


def _sh(*cmd: str, check: bool = True, input: bytes | None = None) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, input=input, check=False)
    if check and proc.returncode != 0:
        raise RealNodeError(
            f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode(errors='replace')}"
        )
    return proc.stdout.decode(errors="replace")


def default_device() -> str:
    """The default route's device (the host's guards drop the apiserver's port there).
    Raises RealNodeError without a default route."""
    routes = json.loads(_sh("ip", "-j", "route", "show", "default") or "[]")
    if not routes or "dev" not in routes[0]:
        raise RealNodeError("no default route: the real node guards its device")
    return str(routes[0]["dev"])


class NodeNetwork:
    """The names and addresses of the real node of pod network ``pod_net`` (``100.N``).

    ``netns``: the node's network namespace (``/run/netns/<netns>``); ``host_veth`` /
    ``node_veth``: the ends of the veth pair; ``host_ip`` / ``node_ip``: their addresses (a /30
    at the top of the pod network; the node IP is the kubelet's, its DNS's and its Node's);
    ``pod_cidr``: the pods' bridge subnet; ``service_cidr``: the Services' range (its first
    address is the ``kubernetes`` Service's); ``routed``: what the host routes to the node."""

    def __init__(self, pod_net: str) -> None:
        n = int(pod_net.split(".")[1])
        self.netns = f"dwdp-node-{n}"
        self.host_veth, self.node_veth = f"dwdp{n}h", f"dwdp{n}n"
        self.host_ip, self.node_ip = f"{pod_net}.255.253", f"{pod_net}.255.254"
        self.pod_cidr = f"{pod_net}.0.0/17"
        self.service_cidr = f"{pod_net}.128.0/24"
        self.routed = f"{pod_net}.0.0/16"
        self.run_dir = RUN_ROOT / str(n)
        self.cgroup = f"/dwdp-node-{n}"
        self.guard = f"{GUARD}-{n}"

    @property
    def enter(self) -> list[str]:
        """The command prefix that runs a program in the node's namespace (network only)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]


def cgroup_hierarchies() -> list[Path]:
    """The mount points of this host's cgroup hierarchies (v1 and the cgroup2 beside them)."""
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        words = line.split()
        if len(words) > 2 and words[2] in ("cgroup", "cgroup2"):
            out.append(Path(words[1]))
    return out


# ----------------------------------------------------------------------------- images
def pause_archive(binary: Path, name: str = PAUSE_IMAGE) -> bytes:
    """A one-layer OCI image archive (what ``ctr image import`` reads) of the static pause
    ``binary`` as ``/pause``, named ``name``."""

    def sha(b: bytes) -> str:
        return "sha256:" + hashlib.sha256(b).hexdigest()

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("dev", "etc", "proc", "sys"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        data = binary.read_bytes()
        info = tarfile.TarInfo("pause")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    layer_tar = raw.getvalue()
    layer = gzip.compress(layer_tar, mtime=0)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [sha(layer_tar)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha(layer),
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": sha(manifest),
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": name},
                }
            ],
        }
    ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        blobs = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]
        blobs += [(f"blobs/sha256/{sha(b)[7:]}", b) for b in (config, manifest, layer)]
        for name, blob in blobs:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return out.getvalue()


class ControlPlane(Protocol):
    """What a real node uses of its cluster (``dwdp_dev.devcluster.cluster.Cluster``, which
    imports this module): its folders, its settings and kubeconfigs, and its way to start,
    find and check components."""

    state_dir: Path
    pki: Path
    run: Path
    """The pid files' folder."""

    def config(self) -> ClusterConfig | None:
        """The stored settings; None before the first ``up``."""

    def write_kubeconfig(
        self, cfg: ClusterConfig, path: Path | None = None, user: str = "admin",
        host: str = "127.0.0.1",
    ) -> None:
        """Write a kubeconfig for the client certificate ``pki/<user>.crt`` at ``path``,
        naming the apiserver at ``host``."""

    def running(self) -> dict[str, int]:
        """The pid of every component that runs, by name."""

    def spawn(self, name: str, cmd: list[str]) -> int:
        """Start ``cmd`` as component ``name``; its pid."""

    def wait_for_component(
        self, name: str, pid: int, check: Callable[[], bool], timeout_s: float
    ) -> None:
        """Wait until ``check()`` is true; a ``ClusterError`` when ``pid`` exits first or the
        time is up."""

    def get(self, url: str, timeout: float = 2.0) -> tuple[int, str]:
        """``(status, body)`` of a GET of ``url``."""


class RealNode:
    """The real node of one cluster (``cluster.config().node_kind == "real"``)."""

    def __init__(self, cluster: ControlPlane) -> None:
        self.cluster = cluster
        self.state_dir = cluster.state_dir
        cfg = cluster.config()
        if cfg is None:
            raise RealNodeError(f"{cluster.state_dir} holds no cluster (no cluster.json)")
        self.net = NodeNetwork(cfg.pod_net)
        self.containerd_root = self.state_dir / "containerd"
        self.socket = self.net.run_dir / "containerd.sock"
        self.kubelet_root = self.state_dir / "kubelet"
        self.cni_conf = self.state_dir / "cni" / "net.d"
        self.host_file = self.state_dir / "real-node-host.json"

    # -- helpers -----------------------------------------------------------------------
    def ctr(self, *args: str, check: bool = True, input: bytes | None = None) -> str:
        """Run ``ctr`` on this node's containerd, namespace ``k8s.io``; its stdout."""
        return _sh(
            "ctr", "--address", str(self.socket), "-n", "k8s.io", *args, check=check, input=input
        )

    def _api(self, method: str, path: str, body: Any = None, ctype: str = "application/json"):
        cfg = self.cluster.config()
        assert cfg is not None
        ctx = ssl.create_default_context(cafile=str(self.cluster.pki / "ca.crt"))
        ctx.load_cert_chain(
            str(self.cluster.pki / "admin.crt"), str(self.cluster.pki / "admin.key")
        )
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"https://127.0.0.1:{cfg.apiserver_port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": ctype},
        )
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read() or b"{}")

    def task_pid(self, container_id: str) -> int:
        """The host pid of the main process of container ``container_id`` (its containerd
        task). Raises RealNodeError if containerd runs no such task."""
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            words = line.split()
            if len(words) >= 2 and words[0] == container_id:
                return int(words[1])
        raise RealNodeError(f"containerd runs no task {container_id}")

    def preflight(self) -> None:
        """Raise RealNodeError if this host cannot run the node now (see :func:`check_host`)
        or another cluster's real node holds this one's network namespace; nothing is
        started or changed."""
        check_host()
        owner = _running_owner(self.net.run_dir)
        if owner is not None and owner != self.state_dir:
            raise RealNodeError(
                f"the real node of {owner} runs in {self.net.netns} (pod network"
                f" {self.net.routed}): `dwdp dev down --state-dir {owner}` first"
            )

    def _record_host(self) -> None:
        """Record the host-wide sysctls as found (once: a second ``up`` keeps the first
        record; the last real node's ``down`` restores it), unless another real node runs
        here already (then its record holds the host's values)."""
        if self.host_file.exists() or _other_nodes(self.state_dir):
            return
        values = {}
        for key in SYSCTLS:
            path = Path("/proc/sys") / key.replace(".", "/")
            with contextlib.suppress(OSError):
                values[key] = path.read_text().strip()
        record = {"sysctls": values, "run_containerd": Path("/run/containerd").exists()}
        self.host_file.write_text(json.dumps(record, indent=1) + "\n")

    # -- configuration ---------------------------------------------------------------------
    def _write_configs(self, cfg: ClusterConfig) -> None:
        c, p = self.cluster, self.cluster.pki
        pki.ensure_node_pki(p, cfg.node_name, self.net.node_ip)
        # the node's programs reach the apiserver at the host's end of the veth
        for user in ("node", "proxy", "coredns"):
            c.write_kubeconfig(
                cfg, self.state_dir / f"{user}.kubeconfig", user, host=self.net.host_ip
            )
        _write_if_changed(
            self.state_dir / "Corefile",
            clusterdns.corefile(
                self.net.node_ip, cfg.dns_ready_port, str(self.state_dir / "coredns.kubeconfig")
            ),
        )
        for d in (
            self.containerd_root,
            self.kubelet_root,
            self.cni_conf,
            self.state_dir / "pod-logs",
        ):
            d.mkdir(parents=True, exist_ok=True)
        _write_if_changed(self.state_dir / "containerd.toml", self._containerd_toml())
        conflist = json.dumps(self._cni_conflist(), indent=1) + "\n"
        _write_if_changed(self.cni_conf / "10-dwdp.conflist", conflist)
        kubelet = yaml.safe_dump(self._kubelet_config(cfg), sort_keys=False)
        _write_if_changed(self.state_dir / "kubelet.yaml", kubelet)
        # kube-proxy exits when its config file is written, even with the same content
        proxy = yaml.safe_dump(self._proxy_config(cfg), sort_keys=False)
        _write_if_changed(self.state_dir / "kube-proxy.yaml", proxy)

    def _containerd_toml(self) -> str:
        """containerd's configuration: its root, state and socket under the node's folders,
        the CRI plugin with runc (cgroupfs) and the CNI bridge."""
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{self.containerd_root.resolve()}"
state = "{self.net.run_dir / "state"}"
oom_score = 0
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which("runc") or "/usr/sbin/runc"}"
        Root = "{self.net.run_dir / "runc"}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{self.cni_conf}"
"""

    def _cni_conflist(self) -> dict[str, Any]:
        """The pods' network: the bridge with host-local addresses, and port mappings."""
        return {
            "cniVersion": "1.0.0",
            "name": "dwdp-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.net.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.state_dir / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _kubelet_config(self, cfg: ClusterConfig) -> dict[str, Any]:
        """The kubelet's KubeletConfiguration (cgroup v1 hierarchies, no systemd, no swap)."""
        p = self.cluster.pki
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # cgroup v1 hierarchies (a cgroup2 mount beside them), no systemd, no swap
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            # each real node of the host has its own cgroup root (made by `up`)
            "cgroupRoot": self.net.cgroup,
            # a rotated Secret reaches running pods at the pod's next sync: within seconds
            # here (the default, a minute, is what a production node keeps)
            "syncFrequency": SYNC_FREQUENCY,
            # no CAP_SYS_RESOURCE: lowering an oom_score_adj is refused
            "oomScoreAdj": 0,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "0.0.0.0",
            "port": cfg.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": cfg.node_healthz_port,
            "tlsCertFile": str(p / "node-serving.crt"),
            "tlsPrivateKeyFile": str(p / "node-serving.key"),
            "authentication": {
                "x509": {"clientCAFile": str(p / "ca.crt")},
                "webhook": {"enabled": True},
                "anonymous": {"enabled": False},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": clusterdns.DOMAIN,
            "clusterDNS": [self.net.node_ip],
            "podCIDR": self.net.pod_cidr,
            "podLogsDir": str(self.state_dir / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            "maxPods": cfg.node.pods,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            # the imported images cannot be pulled again: never collect them
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "featureGates": {"GenericWorkload": True},
        }

    def _proxy_config(self, cfg: ClusterConfig) -> dict[str, Any]:
        """kube-proxy's KubeProxyConfiguration (iptables mode, the host's conntrack left alone)."""
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.state_dir / "proxy.kubeconfig")},
            "mode": "iptables",
            "clusterCIDR": self.net.pod_cidr,
            "hostnameOverride": cfg.node_name,
            "bindAddress": "0.0.0.0",
            "healthzBindAddress": f"127.0.0.1:{cfg.proxy_healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{cfg.proxy_metrics_port}",
            # leave the host's conntrack table size and timeouts alone
            "conntrack": {
                "maxPerCore": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            "oomScoreAdj": 0,
            "featureGates": {"GenericWorkload": True},
        }

    # -- network -------------------------------------------------------------------------
    def _guard_rules(self, cfg: ClusterConfig) -> list[tuple[str, list[str]]]:
        """The host's iptables rules of this node: nothing forwarded into or out of its veth,
        the apiserver's port dropped on the default route's device."""
        mark = ["-m", "comment", "--comment", self.net.guard, "-j", "DROP"]
        veth = self.net.host_veth
        rules = [
            ("iptables", ["FORWARD", "-i", veth, *mark]),
            ("iptables", ["FORWARD", "-o", veth, *mark]),
        ]
        for ipt in ("iptables", "ip6tables"):
            if shutil.which(ipt):
                port = ["-p", "tcp", "--dport", str(cfg.apiserver_port)]
                rules.append((ipt, ["INPUT", "-i", cfg.node_dev, *port, *mark]))
        return rules

    def _network_up(self, cfg: ClusterConfig) -> None:
        """Make the node's namespace and veth, route the pod network and the Services to it,
        add the guards (idempotent: a second ``up`` finds them)."""
        net = self.net
        if not Path(f"/run/netns/{net.netns}").exists():
            _sh("ip", "netns", "add", net.netns)
        inside = [*net.enter, "ip"]
        if subprocess.run(["ip", "link", "show", net.host_veth], capture_output=True).returncode:
            _sh("ip", "link", "add", net.host_veth, "type", "veth", "peer", "name",
                net.node_veth, "netns", net.netns)
            _sh("ip", "addr", "add", f"{net.host_ip}/30", "dev", net.host_veth)
            _sh(*inside, "addr", "add", f"{net.node_ip}/30", "dev", net.node_veth)
        _sh("ip", "link", "set", net.host_veth, "up")
        for dev in (net.node_veth, "lo"):
            _sh(*inside, "link", "set", dev, "up")
        _sh(*inside, "route", "replace", "default", "via", net.host_ip)
        # a ClusterIP without endpoints ends here, never back on the host
        _sh(*inside, "route", "replace", net.service_cidr, "dev", "lo")
        _sh(*net.enter, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _sh("ip", "route", "replace", net.routed, "via", net.node_ip, "dev", net.host_veth)
        for ipt, rule in self._guard_rules(cfg):
            if subprocess.run([ipt, "-C", *rule], capture_output=True, check=False).returncode:
                _sh(ipt, "-I", rule[0], "1", *rule[1:])

    def _cgroups_up(self) -> None:
        """The node's cgroup root in every hierarchy (the kubelet refuses a missing one),
        with the CPU weight of :data:`NODE_CPU_SHARES` (cgroup v1 ``cpu.shares``)."""
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.net.cgroup.lstrip("/")
            with contextlib.suppress(OSError):
                root.mkdir(exist_ok=True)
            if (root / "cpu.shares").exists():
                with contextlib.suppress(OSError):
                    (root / "cpu.shares").write_text(f"{NODE_CPU_SHARES}\n")

    # -- start ---------------------------------------------------------------------------
    def up(self, cfg: ClusterConfig, binary: Path, timeout_s: float) -> None:
        """Start containerd, import the images, start the kubelet; the caller waits for the
        Node to be Ready and then calls :meth:`after_ready`. Raises RealNodeError."""
        self.preflight()
        self.net.run_dir.mkdir(parents=True, exist_ok=True)
        (self.net.run_dir / "owner").write_text(f"{self.state_dir}\n")
        self._record_host()
        running = self.cluster.running()
        enter = self.net.enter
        # a store of the cache for containerd's root (images kept between clusters), held
        # until containerd has opened it
        with (
            nodestore.claimed(self.containerd_root)
            if "containerd" not in running
            else contextlib.nullcontext(self.containerd_root)
        ):
            self._write_configs(cfg)
            # the namespace, its routes and the guards before anything may send to a ClusterIP
            self._network_up(cfg)
            self._cgroups_up()
            if "containerd" not in running:
                pid = self.cluster.spawn(
                    "containerd",
                    [*enter, "containerd", "--config", str(self.state_dir / "containerd.toml")],
                )
                self.cluster.wait_for_component(
                    "containerd",
                    pid,
                    lambda: self.socket.exists() and self.ctr("version", check=False) != "",
                    timeout_s,
                )
        self.import_images(cfg)
        if "coredns" not in running:
            self._start_dns(cfg, timeout_s)
        if "node-kubelet" not in running:
            self.cluster.spawn(
                "node-kubelet",
                [
                    *enter,
                    str(binary),
                    "kubelet",
                    f"--config={self.state_dir / 'kubelet.yaml'}",
                    f"--kubeconfig={self.state_dir / 'node.kubeconfig'}",
                    f"--root-dir={self.kubelet_root}",
                    f"--cert-dir={self.kubelet_root / 'pki'}",
                    f"--hostname-override={cfg.node_name}",
                    f"--node-ip={self.net.node_ip}",
                    "--v=1",
                ],
            )
        if "kube-proxy" not in running:
            self.cluster.spawn(
                "kube-proxy",
                [
                    *enter,
                    str(binary),
                    "kube-proxy",
                    f"--config={self.state_dir / 'kube-proxy.yaml'}",
                    "--v=1",
                ],
            )

    def _start_dns(self, cfg: ClusterConfig, timeout_s: float) -> None:
        """Give the DNS server its role, start it, and wait until it has read the API.
        Raises RealNodeError if the API refuses the role."""
        try:
            clusterdns.apply_rbac(self._api)
        except (OSError, ValueError) as exc:  # urllib's HTTPError and URLError are OSErrors
            raise RealNodeError(f"cannot give the cluster DNS its role: {exc}") from None
        pid = self.cluster.spawn(
            "coredns",
            [*self.net.enter, str(build.build_coredns()), "-conf",
             str(self.state_dir / "Corefile")],
        )
        url = f"http://{self.net.node_ip}:{cfg.dns_ready_port}/ready"
        self.cluster.wait_for_component(
            "coredns", pid, lambda: self.cluster.get(url)[0] == 200, timeout_s
        )

    def import_images(self, cfg: ClusterConfig) -> list[str]:
        """Import the pause image and the current images of the local store (all, or those
        named in ``cfg.node_images``) that containerd lacks; return the references imported."""
        listed = self.ctr("images", "ls")
        done = []
        if PAUSE_IMAGE not in listed:
            self.ctr("images", "import", "-", input=pause_archive(build.build_pause()))
            done.append(PAUSE_IMAGE)
        refs = images._read_refs()
        stored_names = {entry.get("name") for entry in refs.values()}
        for name in sorted(set(cfg.node_images or ()) - stored_names):
            # e.g. another checkout's build of that image replaced this one's (one per name)
            print(
                f"dwdp dev: real node: no image {name!r} in the local store {images.store_dir()}"
                f" to import (`dwdp dev images --only {name}` builds it)",
                file=sys.stderr,
            )
        for ref, entry in sorted(refs.items()):
            if cfg.node_images is not None and entry.get("name") not in cfg.node_images:
                continue
            stored, why = images.lookup(ref)
            if stored is None:
                print(f"dwdp dev: real node: not importing {ref}: {why}", file=sys.stderr)
                continue
            if any(ref in line and stored.digest in line for line in listed.splitlines()):
                continue
            self._import(stored)
            if ref not in self.ctr("images", "ls", "-q").split():
                raise RealNodeError(f"{stored.layout} was imported, but not as {ref}")
            # also by digest, as an image pulled from a registry: the kubelet then reports
            # `<repo>@<manifest digest>` as the containers' imageID (``stored.image_id``)
            self.ctr("images", "tag", "--force", ref, stored.image_id)
            for name in images.LOCAL_NAMES.get(str(entry.get("name")), ()):
                self.ctr("images", "tag", "--force", ref, _qualified(name))
            self._drop_earlier_builds(stored)
            done.append(ref)
        return done

    def _import(self, stored: images.StoredImage) -> None:
        """``ctr images import`` of ``stored``'s layout with only the blobs containerd lacks
        (:func:`archive_members`): the layers an earlier build shares by digest are in the
        content store already, so a src/ change imports the thin product layer, not
        gigabytes."""
        members = archive_members(stored.layout, set(self.ctr("content", "ls", "-q").split()))
        blobs = members[2:]
        size = sum((stored.layout / b).stat().st_size for b in blobs)
        print(f"dwdp dev: real node: importing {stored.reference} into containerd: "
              f"{len(blobs)} new blobs, {size / 2**20:.0f} MiB", file=sys.stderr)
        self._import_files(stored, members)

    def _import_files(self, stored: images.StoredImage, files: list[str]) -> None:
        tar = subprocess.Popen(["tar", "-C", str(stored.layout), "-cf", "-", *files],
                               stdout=subprocess.PIPE)
        imp = subprocess.run(
            ["ctr", "--address", str(self.socket), "-n", "k8s.io", "images", "import",
             "--base-name", stored.repository, "-"],
            stdin=tar.stdout, capture_output=True, check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        if imp.returncode != 0:
            raise RealNodeError(
                f"ctr images import of {stored.layout} failed: {imp.stderr.decode()[-500:]}"
            )

    def _drop_earlier_builds(self, stored: images.StoredImage) -> None:
        """Remove the names of ``stored``'s repository that hold another digest (an earlier
        build, kept by a store of the cache), and the names of any image then known only by
        its ID (the CRI plugin names every image ``sha256:<config digest>`` too, which alone
        keeps it), and collect their blobs and snapshots at once (``--sync``; containerd's
        collector would otherwise wait for 100 changes): a store keeps one build of each
        image."""
        rows = [line.split()[:3] for line in self.ctr("images", "ls").splitlines()[1:]]
        stale = {
            name
            for name, _, _ in rows
            if name.startswith(f"{stored.repository}@") and name != stored.image_id
        }
        names_of: dict[str, list[str]] = {}
        for name, _, digest in rows:
            if name not in stale:
                names_of.setdefault(digest, []).append(name)
        for names in names_of.values():
            if all(name.startswith("sha256:") for name in names):
                stale.update(names)
        if stale:
            self.ctr("images", "rm", "--sync", *sorted(stale), check=False)

    def after_ready(self, cfg: ClusterConfig) -> None:
        """Patch the fake ``nvidia.com/gpu`` capacity into the Node's status (lost whenever
        the Node registers anew, so every ``up`` applies it)."""
        if cfg.node.gpus <= 0:
            return
        patch = [
            {"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(cfg.node.gpus)}
        ]
        self._api(
            "PATCH", f"/api/v1/nodes/{cfg.node_name}/status", patch, "application/json-patch+json"
        )

    # -- stop ----------------------------------------------------------------------------
    def delete_pods(self, timeout_s: float) -> None:
        """Delete every pod through the API (the kubelet stops its containers and tears its
        network down) and wait until containerd runs no task, at most ``timeout_s``."""
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            pods = self._api("GET", "/api/v1/pods").get("items", [])
            for pod in pods:
                meta = pod["metadata"]
                with contextlib.suppress(OSError, urllib.error.URLError):
                    self._api(
                        "DELETE",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0},
                    )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q", check=False).strip():
            time.sleep(0.2)

    def down(self, timeout_s: float) -> None:
        """Stop the node and undo every host change (see the module docstring). The control
        plane must still run for the pods to be deleted through the API (else containerd's
        tasks are killed directly)."""
        running = self.cluster.running()
        if "containerd" in running and "node-kubelet" in running and "apiserver" in running:
            self.delete_pods(timeout_s)
        stop_pids([running[n] for n in ("kube-proxy", "coredns") if n in running], timeout_s)
        if "node-kubelet" in running:
            stop_pids([running["node-kubelet"]], timeout_s)
        netns: set[str] = set()
        emptied = False
        if "containerd" in running:
            netns = self._kill_containers()
            emptied = self._holds_no_container()
        shims = self._shim_pids()
        if "containerd" in running:
            stop_pids([running["containerd"]], timeout_s)
            if emptied:
                nodestore.mark_clean(self.containerd_root)  # its images serve the next node
        stop_pids([p for p in shims if _is_shim(p)], 5.0)
        self._unmount()
        for ns in netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        # the node's namespace takes its veth, bridge, rules and routes with it
        subprocess.run(["ip", "netns", "del", self.net.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.net.host_veth], capture_output=True, check=False)
        self._cgroups_down()
        self._iptables_down()
        if not _other_nodes(self.state_dir):
            self._restore_host()
        for name in COMPONENTS:
            (self.cluster.run / f"{name}.pid").unlink(missing_ok=True)
        shutil.rmtree(self.net.run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            RUN_ROOT.rmdir()  # the last node's

    def _cgroups_down(self) -> None:
        """Remove the node's cgroup root (its pods' cgroups first) from every hierarchy."""
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.net.cgroup.lstrip("/")
            if not root.is_dir():
                continue
            for d in sorted((p for p in root.rglob("*") if p.is_dir()),
                            key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()

    def _kill_containers(self) -> set[str]:
        """Kill and remove what containerd still runs; return the names of the network
        namespaces (under /run/netns) its sandboxes held."""
        netns = set()
        for cid in self.ctr("containers", "ls", "-q", check=False).split():
            with contextlib.suppress(ValueError, KeyError):
                info = json.loads(self.ctr("containers", "info", cid, check=False) or "{}")
                for ns in info["Spec"]["linux"]["namespaces"]:
                    if ns.get("type") == "network" and ns.get("path", "").startswith(
                        "/var/run/netns/"
                    ):
                        netns.add(Path(ns["path"]).name)
        tasks = self.ctr("tasks", "ls", "-q", check=False).split()
        for t in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q", check=False).strip():
            time.sleep(0.1)
        for t in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "rm", "-f", t, check=False)
        for cid in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", cid, check=False)
        return netns

    def _holds_no_container(self) -> bool:
        """Whether containerd answers that it holds no container (no sandbox either)."""
        try:
            return not self.ctr("containers", "ls", "-q").strip()
        except RealNodeError:
            return False

    def _shim_pids(self) -> list[int]:
        pids = []
        for f in (self.net.run_dir / "state").glob("io.containerd.runtime.v2.task/*/*/shim.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(f.read_text().strip()))
        return pids

    def _unmount(self) -> None:
        roots = (str(self.kubelet_root), str(self.containerd_root.resolve()), str(self.net.run_dir))
        mounts = []
        for line in Path("/proc/mounts").read_text().splitlines():
            target = line.split()[1].encode().decode("unicode_escape")
            if any(target == r or target.startswith(r + "/") for r in roots):
                mounts.append(target)
        for target in sorted(set(mounts), key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)

    def _iptables_down(self) -> None:
        """Delete this node's guards from the host's tables."""
        for ipt in ("iptables", "ip6tables"):
            if not shutil.which(ipt):
                continue
            for rule in _sh(ipt, "-S", check=False).splitlines():
                words = shlex.split(rule)
                if words[:1] == ["-A"] and self.net.guard in words:
                    subprocess.run([ipt, "-D", *words[1:]], capture_output=True, check=False)

    def _restore_host(self) -> None:
        try:
            record = json.loads(self.host_file.read_text())
        except (OSError, ValueError):
            return
        for key, value in record.get("sysctls", {}).items():
            path = Path("/proc/sys") / key.replace(".", "/")
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value + "\n")
        if not record.get("run_containerd") and Path("/run/containerd").exists():
            for d in sorted(Path("/run/containerd").rglob("*"), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                Path("/run/containerd").rmdir()
        self.host_file.unlink(missing_ok=True)


def _running_owner(run_dir: Path) -> Path | None:
    """The state folder of the real node whose run folder is ``run_dir``, if its containerd
    runs now."""
    try:
        owner = Path((run_dir / "owner").read_text().strip())
    except OSError:
        return None
    return owner if read_pidfile(owner / "run" / "containerd.pid") is not None else None


def _other_nodes(state_dir: Path) -> list[Path]:
    """The state folders of the real nodes of this host that run now, but ``state_dir``'s."""
    runs = sorted(RUN_ROOT.glob("*")) if RUN_ROOT.is_dir() else []
    return [o for d in runs if (o := _running_owner(d)) is not None and o != state_dir]


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds exactly that: a second ``up`` of a running
    node must not touch the files its components watch (kube-proxy stops when its config
    file is written)."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    path.write_text(text)


def archive_members(layout: Path, have: set[str]) -> list[str]:
    """The files of OCI layout ``layout`` that an import into a containerd holding the blobs
    ``have`` (``sha256:<hex>`` digests) needs: ``oci-layout``, ``index.json`` and each blob
    not in ``have`` (containerd resolves the others from its content store)."""
    blobs = sorted(p for p in (layout / "blobs").glob("*/*")
                   if f"{p.parent.name}:{p.name}" not in have)
    return ["oci-layout", "index.json", *(p.relative_to(layout).as_posix() for p in blobs)]


def _qualified(name: str) -> str:
    """``name`` as the kubelet asks containerd for it: a reference without a registry host
    is Docker Hub's (``docker.io/library/...`` for one path component, as the CRI normalizes
    it); one with a host stays as it is."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if rest else f"docker.io/library/{name}"


def _is_shim(pid: int) -> bool:
    try:
        return b"containerd-shim" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
