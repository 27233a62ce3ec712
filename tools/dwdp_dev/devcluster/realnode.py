"""The real node of the local cluster (opt-in: ``dwdp dev up --node real``, or
``Cluster.up(node_kind="real")``): the kubelet and kube-proxy of the control-plane binary (the
same pinned Kubernetes release), Debian's containerd + runc, the CNI bridge plugins.

What it adds to the host, and what :meth:`RealNode.down` takes away again (issue 36):

- containerd, spawned from the cluster (pid file, log) with its root under the state folder and
  its state and sockets in :data:`RUN_DIR` (unix socket paths are short); cgroupfs, runc,
  overlayfs, ``restrict_oom_score_adj`` (this host has no CAP_SYS_RESOURCE: runc fails to lower
  a sandbox's oom_score_adj otherwise);
- images: a static pause built from ``go/pause`` and every image of the local OCI store that
  is current (:func:`images.lookup`), imported into containerd's ``k8s.io`` namespace under
  their references and ``<repo>@<manifest digest>``; unchanged ones are not imported again;
- the kubelet (``failCgroupV1: false``, ``cgroupDriver: cgroupfs``, ``failSwapOn: false``,
  ``oomScoreAdj: 0``, image GC off: the images cannot be pulled again), registered with a
  ``system:node:<name>`` client certificate; its serving certificate names the node IP;
- the CNI bridge :data:`BRIDGE` with the pod network ``<pod_net>.0.0/16`` (host-local IPAM, no
  masquerade: pods reach no other machine);
- the Service CIDR routed to ``lo`` (*before* kube-proxy runs, so a packet for a ClusterIP
  never takes the default route off the machine), ``net.ipv4.ip_forward=1`` (pod to Service to
  pod is routed) behind a FORWARD guard that drops whatever would be forwarded from or to the
  default route's device, and an INPUT guard on that device for the apiserver's, the
  kubelet's and the DNS server's ports (the apiserver binds every address so pods reach it
  through the ``kubernetes`` Service);
- kube-proxy (iptables mode);
- the cluster DNS, CoreDNS on the node IP's port 53 (:mod:`dwdp_dev.devcluster.clusterdns`),
  the kubelet's ``clusterDNS``;
- the fake ``nvidia.com/gpu`` capacity, patched into the Node's status after it registers.

One real node per host (kube-proxy's chains and the Service route are host-wide): the owner's
state folder is recorded in :data:`RUN_DIR`. The sysctls and nftables tables found before the
node started are recorded in ``<state>/real-node-host.json`` and restored by ``down``.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import ipaddress
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
from pathlib import Path
from typing import Any

import yaml

from dwdp_dev.devcluster import build, clusterdns, images, pki
from dwdp_dev.devcluster.cluster import (
    SERVICE_CIDR,
    Cluster,
    ClusterConfig,
    read_pidfile,
    stop_pids,
)

PACKAGES = ("containerd", "runc", "containernetworking-plugins")
"""The Debian packages the real node needs (containerd 1.6, runc 1.1, the CNI plugins)."""
CNI_BIN = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
RUN_DIR = Path("/run/dwdp-real-node")
"""containerd's state and sockets, the runc root, and ``owner`` (the state folder of the one
real node of this host)."""
BRIDGE = "dwdpbr0"
GUARD = "dwdp-real-node"
"""The comment of every iptables rule the real node adds (its guards)."""
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")
"""iptables chains the kubelet makes by itself (kube-proxy's go with ``--cleanup``)."""
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "net.ipv6.conf.all.forwarding",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
"""Sysctls the kubelet, kube-proxy or the bridge plugin may change; restored by ``down``."""
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


def default_device() -> tuple[str, str]:
    """The default route's device and its first IPv4 address (the node IP: the kubelet
    refuses a loopback one). Raises RealNodeError without a default route."""
    routes = json.loads(_sh("ip", "-j", "route", "show", "default") or "[]")
    if not routes or "dev" not in routes[0]:
        raise RealNodeError("no default route: the real node takes its IP from its device")
    dev = routes[0]["dev"]
    for link in json.loads(_sh("ip", "-j", "-4", "addr", "show", "dev", dev) or "[]"):
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                return dev, addr["local"]
    raise RealNodeError(f"the default route's device {dev} has no IPv4 address")


def service_route_ok(service_cidr: str) -> bool:
    """True if the Service CIDR's first address is routed to ``lo`` (never off the machine)."""
    first = str(next(ipaddress.ip_network(service_cidr).hosts()))
    return " dev lo " in _sh("ip", "route", "get", first, check=False) + " "


def _check_service_routes() -> None:
    """Raise RealNodeError if the host routes any address of the Service CIDR elsewhere
    than ``lo`` (the real node routes all of it to ``lo``, and ``down`` removes that)."""
    ours = f"{SERVICE_CIDR} dev lo"
    shown = _sh("ip", "route", "show", "table", "all", "root", SERVICE_CIDR)
    others = [
        ln.strip() for ln in shown.splitlines() if ln.strip() and not ln.strip().startswith(ours)
    ]
    if others:
        raise RealNodeError(
            f"this host routes addresses of the Service CIDR {SERVICE_CIDR} already"
            f" ({'; '.join(others)}); the real node routes all of it to lo"
        )


# ----------------------------------------------------------------------------- images
def pause_archive(binary: Path) -> bytes:
    """A one-layer OCI image archive (what ``ctr image import`` reads) of the static pause
    ``binary`` as ``/pause``, named :data:`PAUSE_IMAGE`."""

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
                    "annotations": {"io.containerd.image.name": PAUSE_IMAGE},
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


class RealNode:
    """The real node of one cluster (``cluster.config().node_kind == "real"``)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.state_dir = cluster.state_dir
        self.containerd_root = self.state_dir / "containerd"
        self.socket = RUN_DIR / "containerd.sock"
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

    def owner(self) -> Path | None:
        """The state folder of the real node that owns this host's :data:`RUN_DIR`, if any."""
        try:
            return Path((RUN_DIR / "owner").read_text().strip())
        except OSError:
            return None

    def preflight(self) -> None:
        """Raise RealNodeError if this host cannot run the node now (see :func:`check_host`)
        or another cluster's real node runs here; nothing is started or changed."""
        check_host()
        _check_service_routes()
        self._claim_host(claim=False)
        cfg = self.cluster.config()
        if cfg is not None and "coredns" not in self.cluster.running():
            taken = clusterdns.port_taken(cfg.node_ip)
            if taken:
                raise RealNodeError(f"{taken}: the real node's cluster DNS listens there")

    def _claim_host(self, claim: bool = True) -> None:
        owner = self.owner()
        if (
            owner is not None
            and owner != self.state_dir
            and read_pidfile(owner / "run" / "containerd.pid") is not None
        ):
            raise RealNodeError(
                f"another real node runs on this host (state {owner}); one per host:"
                f" `dwdp dev down --state-dir {owner}` first"
            )
        if not claim:
            return
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / "owner").write_text(f"{self.state_dir}\n")

    def _record_host(self) -> None:
        """Record the sysctls and nftables tables as found (once: a second ``up`` keeps the
        first record, which ``down`` restores and removes)."""
        if self.host_file.exists():
            return
        values = {}
        for key in SYSCTLS:
            path = Path("/proc/sys") / key.replace(".", "/")
            with contextlib.suppress(OSError):
                values[key] = path.read_text().strip()
        tables = (
            _sh("nft", "list", "tables", check=False).split("\n") if shutil.which("nft") else []
        )
        record = {
            "sysctls": values,
            "nft_tables": [t.strip() for t in tables if t.strip()],
            "run_containerd": Path("/run/containerd").exists(),
        }
        self.host_file.write_text(json.dumps(record, indent=1) + "\n")

    # -- configuration ---------------------------------------------------------------------
    def pod_cidr(self, cfg: ClusterConfig) -> str:
        return f"{cfg.pod_net}.0.0/16"

    def _write_configs(self, cfg: ClusterConfig) -> None:
        c, p = self.cluster, self.cluster.pki
        pki.ensure_node_pki(p, cfg.node_name, cfg.node_ip)
        c.write_kubeconfig(cfg, self.state_dir / "node.kubeconfig", "node")
        c.write_kubeconfig(cfg, self.state_dir / "proxy.kubeconfig", "proxy")
        c.write_kubeconfig(cfg, self.state_dir / "coredns.kubeconfig", "coredns")
        _write_if_changed(
            self.state_dir / "Corefile",
            clusterdns.corefile(
                cfg.node_ip, cfg.dns_ready_port, str(self.state_dir / "coredns.kubeconfig")
            ),
        )
        for d in (
            self.containerd_root,
            self.kubelet_root,
            self.cni_conf,
            self.state_dir / "pod-logs",
        ):
            d.mkdir(parents=True, exist_ok=True)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        _write_if_changed(
            self.state_dir / "containerd.toml",
            f"""version = 2
root = "{self.containerd_root}"
state = "{RUN_DIR / "state"}"
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
        Root = "{RUN_DIR / "runc"}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{self.cni_conf}"
""",
        )
        cni = {
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
                        "ranges": [[{"subnet": self.pod_cidr(cfg)}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.state_dir / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        _write_if_changed(self.cni_conf / "10-dwdp.conflist", json.dumps(cni, indent=1) + "\n")
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # cgroup v1 hierarchies (a cgroup2 mount beside them), no systemd, no swap
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
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
            "clusterDNS": [cfg.node_ip],
            "podCIDR": self.pod_cidr(cfg),
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
        _write_if_changed(self.state_dir / "kubelet.yaml", yaml.safe_dump(kubelet, sort_keys=False))
        proxy = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.state_dir / "proxy.kubeconfig")},
            "mode": "iptables",
            "clusterCIDR": self.pod_cidr(cfg),
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
        # kube-proxy exits when its config file is written, even with the same content
        proxy_yaml = yaml.safe_dump(proxy, sort_keys=False)
        _write_if_changed(self.state_dir / "kube-proxy.yaml", proxy_yaml)

    # -- network -------------------------------------------------------------------------
    def _guard_rules(self, cfg: ClusterConfig) -> list[tuple[str, list[str]]]:
        dev = cfg.node_dev
        ports = f"{cfg.apiserver_port},{cfg.kubelet_port},53"
        mark = ["-m", "comment", "--comment", GUARD, "-j", "DROP"]
        rules = [
            ("iptables", ["FORWARD", "-i", dev, *mark]),
            ("iptables", ["FORWARD", "-o", dev, *mark]),
        ]
        for ipt in ("iptables", "ip6tables"):
            if shutil.which(ipt):
                rules.append(
                    (
                        ipt,
                        [
                            "INPUT",
                            "-i",
                            dev,
                            "-p",
                            "tcp",
                            "-m",
                            "multiport",
                            "--dports",
                            ports,
                            *mark,
                        ],
                    )
                )
                rules.append((ipt, ["INPUT", "-i", dev, "-p", "udp", "--dport", "53", *mark]))
        return rules

    def _network_up(self, cfg: ClusterConfig) -> None:
        _check_service_routes()
        if not service_route_ok(SERVICE_CIDR):
            _sh("ip", "route", "add", SERVICE_CIDR, "dev", "lo")
        if not service_route_ok(SERVICE_CIDR):
            raise RealNodeError(f"the Service CIDR {SERVICE_CIDR} is not routed to lo")
        for ipt, rule in self._guard_rules(cfg):
            if subprocess.run([ipt, "-C", *rule], capture_output=True, check=False).returncode:
                _sh(ipt, "-I", rule[0], "1", *rule[1:])
        # pod -> ClusterIP -> pod is routed (DNAT), not bridged; only behind the guard above
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")

    # -- start ---------------------------------------------------------------------------
    def up(self, cfg: ClusterConfig, binary: Path, timeout_s: float) -> None:
        """Start containerd, import the images, start the kubelet; the caller waits for the
        Node to be Ready and then calls :meth:`after_ready`. Raises RealNodeError."""
        check_host()
        self._claim_host()
        self._record_host()
        self._write_configs(cfg)
        running = self.cluster.running()
        if "containerd" not in running:
            pid = self.cluster.spawn(
                "containerd", ["containerd", "--config", str(self.state_dir / "containerd.toml")]
            )
            self.cluster.wait_for_component(
                "containerd",
                pid,
                lambda: self.socket.exists() and self.ctr("version", check=False) != "",
                timeout_s,
            )
        self.import_images(cfg)
        # the Service route and the guards before anything may send to a ClusterIP
        self._network_up(cfg)
        if "coredns" not in running:
            self._start_dns(cfg, timeout_s)
        if "node-kubelet" not in running:
            self.cluster.spawn(
                "node-kubelet",
                [
                    str(binary),
                    "kubelet",
                    f"--config={self.state_dir / 'kubelet.yaml'}",
                    f"--kubeconfig={self.state_dir / 'node.kubeconfig'}",
                    f"--root-dir={self.kubelet_root}",
                    f"--cert-dir={self.kubelet_root / 'pki'}",
                    f"--hostname-override={cfg.node_name}",
                    f"--node-ip={cfg.node_ip}",
                    "--v=1",
                ],
            )
        if "kube-proxy" not in running:
            if not service_route_ok(SERVICE_CIDR):
                raise RealNodeError("refusing to start kube-proxy: the Service CIDR is not local")
            self.cluster.spawn(
                "kube-proxy",
                [
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
            [str(build.build_coredns()), "-conf", str(self.state_dir / "Corefile")],
        )
        url = f"http://127.0.0.1:{cfg.dns_ready_port}/ready"
        self.cluster.wait_for_component(
            "coredns", pid, lambda: self.cluster._get(url)[0] == 200, timeout_s
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
        for ref, entry in sorted(refs.items()):
            if cfg.node_images is not None and entry.get("name") not in cfg.node_images:
                continue
            stored, why = images.lookup(ref)
            if stored is None:
                print(f"dwdp dev: real node: not importing {ref}: {why}", file=sys.stderr)
                continue
            if any(ref in line and stored.digest in line for line in listed.splitlines()):
                continue
            print(f"dwdp dev: real node: importing {ref} into containerd", file=sys.stderr)
            repo = stored.repository
            tar = subprocess.Popen(
                ["tar", "-C", str(stored.layout), "-cf", "-", "."], stdout=subprocess.PIPE
            )
            imp = subprocess.run(
                [
                    "ctr",
                    "--address",
                    str(self.socket),
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    "--base-name",
                    repo,
                    "-",
                ],
                stdin=tar.stdout,
                capture_output=True,
                check=False,
            )
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
            if imp.returncode != 0:
                raise RealNodeError(
                    f"ctr images import of {stored.layout} failed: {imp.stderr.decode()[-500:]}"
                )
            if ref not in self.ctr("images", "ls", "-q").split():
                raise RealNodeError(f"{stored.layout} was imported, but not as {ref}")
            # also by digest, as an image pulled from a registry: the kubelet then reports
            # `<repo>@<manifest digest>` as the containers' imageID (``stored.image_id``)
            self.ctr("images", "tag", "--force", ref, stored.image_id)
            for name in images.LOCAL_NAMES.get(str(entry.get("name")), ()):
                self.ctr("images", "tag", "--force", ref, _qualified(name))
            done.append(ref)
        return done

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
        tasks are killed directly). When another cluster's real node owns the host (this one
        never started its node), only this cluster's own node processes are stopped: the
        host-wide state is the other's."""
        running = self.cluster.running()
        owner = self.owner()
        if owner is not None and owner != self.state_dir:
            stop_pids([running[n] for n in COMPONENTS if n in running], timeout_s)
            for name in COMPONENTS:
                (self.cluster.run / f"{name}.pid").unlink(missing_ok=True)
            return
        binary = self._binary(running)
        if "containerd" in running and "node-kubelet" in running and "apiserver" in running:
            self.delete_pods(timeout_s)
        stop_pids([running[n] for n in ("kube-proxy", "coredns") if n in running], timeout_s)
        if binary is not None:
            subprocess.run(
                [str(binary), "kube-proxy", "--cleanup"], capture_output=True, check=False
            )
        if "node-kubelet" in running:
            stop_pids([running["node-kubelet"]], timeout_s)
        netns = set()
        if "containerd" in running:
            netns = self._kill_containers()
        shims = self._shim_pids()
        if "containerd" in running:
            stop_pids([running["containerd"]], timeout_s)
        stop_pids([p for p in shims if _is_shim(p)], 5.0)
        self._unmount()
        for ns in netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        _sh("ip", "route", "del", SERVICE_CIDR, "dev", "lo", check=False)
        self._iptables_down()
        self._restore_host()
        for name in COMPONENTS:
            (self.cluster.run / f"{name}.pid").unlink(missing_ok=True)
        shutil.rmtree(RUN_DIR, ignore_errors=True)

    def _binary(self, running: dict[str, int]) -> Path | None:
        """The binary the node runs (for ``kube-proxy --cleanup``): the running kubelet's or
        kube-proxy's, else the built one of the current inputs."""
        for name in ("kube-proxy", "node-kubelet"):
            if name in running:
                with contextlib.suppress(OSError):
                    exe = Path(os.readlink(f"/proc/{running[name]}/exe"))
                    if exe.is_file():
                        return exe
        with contextlib.suppress(build.BuildError):
            return build.find_binary()
        return None

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

    def _shim_pids(self) -> list[int]:
        pids = []
        for f in (RUN_DIR / "state").glob("io.containerd.runtime.v2.task/*/*/shim.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(f.read_text().strip()))
        return pids

    def _unmount(self) -> None:
        roots = (str(self.kubelet_root), str(self.containerd_root), str(RUN_DIR))
        mounts = []
        for line in Path("/proc/mounts").read_text().splitlines():
            target = line.split()[1].encode().decode("unicode_escape")
            if any(target == r or target.startswith(r + "/") for r in roots):
                mounts.append(target)
        for target in sorted(set(mounts), key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)

    def _iptables_down(self) -> None:
        for ipt in ("iptables", "ip6tables"):
            if not shutil.which(ipt):
                continue
            for table in ("filter", "nat", "mangle"):
                rules = _sh(ipt, "-t", table, "-S", check=False).splitlines()
                for rule in rules:
                    words = rule.split()
                    if words[:1] != ["-A"]:
                        continue
                    if GUARD in rule or any(f"-j {c}" in rule for c in KUBELET_CHAINS):
                        subprocess.run(
                            [ipt, "-t", table, "-D", *shlex.split(rule)[1:]],
                            capture_output=True,
                            check=False,
                        )
                for chain in KUBELET_CHAINS:
                    subprocess.run(
                        [ipt, "-t", table, "-F", chain], capture_output=True, check=False
                    )
                    subprocess.run(
                        [ipt, "-t", table, "-X", chain], capture_output=True, check=False
                    )

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
        if shutil.which("nft"):
            before = set(record.get("nft_tables", []))
            for line in _sh("nft", "list", "tables", check=False).splitlines():
                table = line.strip()
                if not table or table in before:
                    continue
                family_name = table.split()[1:]
                body = _sh("nft", "list", *line.split(), check=False)
                # left by iptables-nft: only base chains, no rule
                if all(
                    w.startswith(("table", "chain", "type", "}", "policy")) or not w
                    for w in (x.strip() for x in body.splitlines())
                ):
                    subprocess.run(
                        ["nft", "delete", "table", *family_name], capture_output=True, check=False
                    )
        if not record.get("run_containerd") and Path("/run/containerd").exists():
            for d in sorted(Path("/run/containerd").rglob("*"), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                Path("/run/containerd").rmdir()
        self.host_file.unlink(missing_ok=True)


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
