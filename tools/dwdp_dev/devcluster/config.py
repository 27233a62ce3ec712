"""The settings of one local cluster (``cluster.json``), below the modules that read them
(cluster.py, realnode.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass
class NodeSpec:
    """Capacity of each process-kubelet node (cpu in cores, memory as a quantity string)."""

    cpu: str = "32"
    memory: str = "128Gi"
    gpus: int = 8
    pods: int = 110


@dataclasses.dataclass
class ClusterConfig:
    """Settings of one cluster, chosen at first ``up`` and stored in ``cluster.json``.

    ``pod_net`` is the first two octets of the cluster's pod network (``100.64`` means
    100.64.0.0/16, in the shared address space of RFC 6598): ``up`` routes it to the loopback
    device as local addresses, so every pod address is bindable and reachable on this host,
    and clusters on one machine never hand out the same address. (127.0.0.0/8 cannot be
    used: the apiserver rejects loopback addresses in EndpointSlices.)
    ``venv_bin`` is put first on the PATH of pods.

    ``node_kind`` is ``"real"`` (the default: one real node, containerd, kubelet, kube-proxy in
    a network namespace of its own, its pod network routed to it through a veth; see
    realnode.py) or ``"process"`` (process kubelets: pods run as host processes); ``node_dev``
    is the default route's device (guarded; the real node's addresses follow from ``pod_net``,
    :func:`node_network`), ``node_images`` the store images it imports (None: every current
    one). A real node's cpu and memory are the host's: ``node.cpu``/``node.memory`` apply to
    process kubelets only.
    """

    etcd_port: int = 0
    etcd_peer_port: int = 0
    apiserver_port: int = 0
    controller_manager_port: int = 0
    scheduler_port: int = 0
    kubelet_port: int = 0
    pod_net: str = "100.64"
    nodes: int = 1
    node_name: str = "dwdp-dev"
    node: NodeSpec = dataclasses.field(default_factory=NodeSpec)
    venv_bin: str | None = None
    node_kind: str = "real"
    node_dev: str = ""
    node_healthz_port: int = 0
    proxy_healthz_port: int = 0
    proxy_metrics_port: int = 0
    dns_ready_port: int = 0
    node_images: list[str] | None = None

    def node_names(self) -> list[str]:
        """Return the node names (one per process kubelet; a real node is one node)."""
        if self.nodes == 1 or self.node_kind == "real":
            return [self.node_name]
        return [f"{self.node_name}-{i}" for i in range(self.nodes)]

    @classmethod
    def load(cls, path: Path) -> ClusterConfig:
        """Read a ``cluster.json``."""
        data = json.loads(path.read_text())
        node = NodeSpec(**data.pop("node", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(node=node, **{k: v for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        """Write this config as ``cluster.json``."""
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
