#!/usr/bin/env python3
"""Prototype (issue 36): a throwaway dwdp control plane for a REAL kubelet + kube-proxy.

Usage: up.py STATE_DIR HOST_IP POD_CIDR [up|down]

Starts etcd/apiserver/controller-manager/scheduler with the devcluster Python API and no
process kubelet (nodes=0), on free ports in STATE_DIR, then writes what a real node needs:
  pki/node.crt/.key      client cert CN=system:node:<node> O=system:nodes (Node authorizer)
  pki/node-serving.crt   kubelet serving cert for HOST_IP and 127.0.0.1 (apiserver verifies it)
  pki/proxy.crt/.key     client cert CN=system:kube-proxy (bound to system:node-proxier)
  node.kubeconfig, proxy.kubeconfig, kubelet.yaml, kube-proxy.yaml, cni/10-rn.conflist
The apiserver differs from devcluster's in three flags so pods in their own network namespace
can reach it through the `kubernetes` Service: --bind-address=0.0.0.0,
--advertise-address=HOST_IP, --endpoint-reconciler-type=lease.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

import yaml

from dwdp_dev.devcluster import build, cluster, paths, pki

NODE = "rn-node"
def _cp_binary() -> Path:
    """$DWDP_DEVCLUSTER_BIN, the binary for this checkout's inputs, or else the newest cached
    devcluster-* (this branch's go.mod differs from main's, so its hash is not built)."""
    found = build.find_binary()
    if found:
        return found
    cached = sorted((p for p in (paths.cache_dir() / "bin").glob("devcluster-*")
                     if ".tmp" not in p.name), key=lambda p: p.stat().st_mtime)
    if not cached:
        sys.exit("no control-plane binary: run `dwdp dev build` or set DWDP_DEVCLUSTER_BIN")
    return cached[-1]


class RealNodeCluster(cluster.Cluster):
    def __init__(self, state_dir: Path, host_ip: str) -> None:
        super().__init__(state_dir)
        self.host_ip = host_ip

    def _component_cmd(self, name, cfg, binary):
        cmd = super()._component_cmd(name, cfg, binary)
        if name != "apiserver":
            return cmd
        out = []
        for a in cmd:
            if a == "--bind-address=127.0.0.1":
                a = "--bind-address=0.0.0.0"
            elif a == "--advertise-address=127.0.0.1":
                a = f"--advertise-address={self.host_ip}"
            elif a == "--endpoint-reconciler-type=none":
                a = "--endpoint-reconciler-type=lease"
            out.append(a)
        return out


def kubeconfig(c: cluster.Cluster, port: int, user: str) -> dict:
    def b64(name: str) -> str:
        return base64.b64encode((c.pki / name).read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rn", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "rn", "context": {"cluster": "rn", "user": user}}],
        "current-context": "rn",
    }


def main(argv: list[str]) -> None:
    state, host_ip, pod_cidr, action = Path(argv[0]).resolve(), argv[1], argv[2], argv[3]
    c = RealNodeCluster(state, host_ip)
    if action == "down":
        c.down(timeout_s=10)
        return
    secs = c.up(binary=_cp_binary(), nodes=0, pod_net="100.99", timeout_s=120)
    cfg = c.config()
    ca = pki._load(c.pki, "ca")
    pki._issue(c.pki, "node", pki._name(f"system:node:{NODE}", "system:nodes"),
               server=False, ca=ca)
    pki._issue(c.pki, "node-serving", pki._name(NODE), server=True, ca=ca,
               dns=(NODE, "localhost"), ips=(host_ip, "127.0.0.1"))
    pki._issue(c.pki, "proxy", pki._name("system:kube-proxy"), server=False, ca=ca)
    for user in ("node", "proxy"):
        p = state / f"{user}.kubeconfig"
        p.write_text(yaml.safe_dump(kubeconfig(c, cfg.apiserver_port, user), sort_keys=False))
        p.chmod(0o600)
    kubelet_port, healthz_port, proxy_metrics, proxy_healthz = (cluster._free_port() for _ in range(4))
    kubelet_root = state / "kubelet"
    kubelet_cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # the host: cgroup v1 (hybrid, /sys/fs/cgroup is tmpfs), no systemd, no swap
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        # no CAP_SYS_RESOURCE here: lowering an oom_score_adj is refused (EACCES)
        "oomScoreAdj": 0,
        "containerRuntimeEndpoint": "unix:///tmp/rn/containerd/containerd.sock",
        "address": "0.0.0.0",
        "port": kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(c.pki / "node-serving.crt"),
        "tlsPrivateKeyFile": str(c.pki / "node-serving.key"),
        "authentication": {"x509": {"clientCAFile": str(c.pki / "ca.crt")},
                           "webhook": {"enabled": True}, "anonymous": {"enabled": False}},
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "podCIDR": pod_cidr,
        "podLogsDir": str(state / "pod-logs"),
        "resolvConf": "/etc/resolv.conf",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "featureGates": {"GenericWorkload": True},
    }
    (state / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_cfg, sort_keys=False))
    proxy_cfg = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(state / "proxy.kubeconfig")},
        "mode": os.environ.get("RN_PROXY_MODE", "iptables"),
        "clusterCIDR": pod_cidr,
        "hostnameOverride": NODE,
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": f"127.0.0.1:{proxy_healthz}",
        "metricsBindAddress": f"127.0.0.1:{proxy_metrics}",
        "conntrack": {"maxPerCore": 0},
        "oomScoreAdj": 0,
        "featureGates": {"GenericWorkload": True},
    }
    (state / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy_cfg, sort_keys=False))
    cni = {
        "cniVersion": "1.0.0",
        "name": "rn-pods",
        "plugins": [
            {"type": "bridge", "bridge": "rnbr0", "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                      "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(state / "cni-ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    Path("/tmp/rn/cni/net.d").mkdir(parents=True, exist_ok=True)
    Path("/tmp/rn/cni/net.d/10-rn.conflist").write_text(json.dumps(cni, indent=2))
    kubelet_root.mkdir(exist_ok=True)
    print(json.dumps({"up_s": round(secs, 1), "apiserver_port": cfg.apiserver_port,
                      "kubelet_port": kubelet_port, "healthz_port": healthz_port,
                      "kubeconfig": str(c.kubeconfig)}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
