"""The real node's cluster DNS: CoreDNS (``go/coredns``, built by :func:`build.build_coredns`)
run as a host process beside kube-proxy, answering ``cluster.local`` from the API as CoreDNS
does in a kubeadm cluster: Services, headless Services' pods by ``<hostname>.<subdomain>``
(the names the operator's rank pods meet by), and reverse lookups.

- It listens on the node IP, port 53 (UDP and TCP): the address the kubelet writes into every
  pod's ``resolv.conf`` (``clusterDNS``). Pods reach it through their gateway, the host
  directly; the real node's INPUT guard drops port 53 arriving on the default route's device,
  so no other machine can query it.
- It answers the cluster's zones only; any other name is refused at once (pods reach no
  other machine, so there is nothing upstream to forward to).
- It reads the API as ``system:coredns`` (its client certificate, :func:`pki.ensure_node_pki`)
  with :data:`ROLE`: list and watch of what its ``kubernetes`` plugin reads, nothing else.
- ``http://<node IP>:<dns_ready_port>/ready`` answers 200 once the plugin has synced.
"""

from __future__ import annotations

from typing import Any, Protocol

DOMAIN = "cluster.local"
"""The cluster domain (the kubelet's ``clusterDomain``)."""
ZONES = (DOMAIN, "in-addr.arpa", "ip6.arpa")
"""The zones the server answers: the cluster's names and reverse lookups."""
USER = "system:coredns"
"""The server's user name (the common name of its client certificate)."""
ROLE = "system:coredns"
"""The ClusterRole (and ClusterRoleBinding) :func:`apply_rbac` gives :data:`USER`."""
FIELD_MANAGER = "dwdp-dev"


class Api(Protocol):
    def __call__(self, method: str, path: str, body: Any = None, ctype: str = ...) -> Any: ...


def corefile(node_ip: str, ready_port: int, kubeconfig: str) -> str:
    """The Corefile: one server block for :data:`ZONES` on ``node_ip:53``, the API read
    with ``kubeconfig`` (context ``dwdp-dev``), answers cached by clients for 5 s."""
    zones = " ".join(ZONES)
    return f"""{" ".join(f"{z}:53" for z in ZONES)} {{
    bind {node_ip}
    errors
    ready {node_ip}:{ready_port}
    kubernetes {zones} {{
        kubeconfig {kubeconfig} dwdp-dev
        ttl 5
    }}
}}
"""


def rbac() -> list[dict[str, Any]]:
    """The ClusterRole and ClusterRoleBinding of :data:`USER` (the rules of the upstream
    ``system:coredns`` role: list and watch, no write)."""
    read = ["list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": ROLE},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": read,
            },
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": ROLE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    return [role, binding]


def apply_rbac(api: Api) -> None:
    """Server-side apply :func:`rbac` with ``api`` (an admin client: method, path, body,
    content type), so a second ``up`` changes nothing."""
    for obj in rbac():
        plural = "clusterroles" if obj["kind"] == "ClusterRole" else "clusterrolebindings"
        api(
            "PATCH",
            f"/apis/rbac.authorization.k8s.io/v1/{plural}/{obj['metadata']['name']}"
            f"?fieldManager={FIELD_MANAGER}&force=true",
            obj,
            "application/apply-patch+yaml",
        )
