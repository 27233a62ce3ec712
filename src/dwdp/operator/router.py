"""The router of disaggregated serving: vllm-router in PD mode, as pure builders.

The router (``spec.router``) is a Deployment and a Service ``NAME-router`` running
``vllm-router --vllm-pd-disaggregation`` with one ``--prefill URL`` per committed rank of every
committed context group and one ``--decode URL`` per rank of every ready generation server,
behind the gate (``dwdp router-gate``, ``dwdp.worker.gate``) on the router's port: vllm-router
authenticates no client and calls the workers with its own key, so the gate checks the
deployment's API key on every request but the probes' and runs vllm-router on a loopback port
with that key (the mounted Secret file, never in the arguments; a rotated key restarts it).
Invariant, as for every builder: nothing here reads the cluster or the clock; the same
servers give the same objects, byte for byte.

[Note: static router URLs] vllm-router's label discovery (``--service-discovery`` with
``--prefill-selector``) counts one server per Ready pod, at ``podIP:port`` for one port, while
a context pod runs one server per local rank (``server.port + k``): discovery would send every
prefill to local rank 0 and leave the other ranks of the group idle. Its worker-management API
is not served in PD mode. So the operator, which knows exactly which ranks committed (the
commit gate), renders the URL list itself: the router pod never reads the Kubernetes API (no
RBAC, no service-account token), a group receives prefills only once its ranks committed, and
a change of the committed set rolls the router's pods (the URL list's hash is a pod-template
annotation). With no committed group or no ready generation server the router has no server
to start with (vllm-router refuses an empty ``--prefill``): its Deployment then has 0 replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dwdp.api.deployment import DwdpDeploymentSpec
from dwdp.operator import constants as c
from dwdp.operator import naming
from dwdp.operator.builders import (
    Owner,
    _finish,
    _ingress_policy,
    _labels,
    api_key_env,
    api_key_volumes,
    image_pull_secrets,
    router_selector,
)
from dwdp.operator.observe import ObservedPod, RouterPod
from dwdp.operator.revision import stable_hash

__all__ = [
    "RouterServers",
    "rank_urls",
    "ready_router_pods",
    "router_args",
    "router_deployment",
    "router_endpoint",
    "router_objects",
    "router_policy",
    "router_service",
]

READINESS_PATH = "/readiness"
"""vllm-router's readiness endpoint: 200 once its servers passed their health checks."""
READINESS_PERIOD_S = 2
"""Seconds between readiness probes of a router pod."""
LIVENESS_PERIOD_S = 10
"""Seconds between liveness probes of a router pod (3 failures in a row restart it)."""


@dataclass(frozen=True, slots=True)
class RouterServers:
    """The URLs the router routes to (``http://IP:PORT``, sorted): every rank of every
    committed context group (prefill) and of every ready generation server (decode)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """Both lists have a server: the router can start (vllm-router needs both)."""
        return bool(self.prefill) and bool(self.decode)

    @property
    def digest(self) -> str:
        """A short hash of both lists (the pod-template annotation)."""
        return stable_hash({"prefill": list(self.prefill), "decode": list(self.decode)})


def rank_urls(pods: Iterable[ObservedPod], *, base_port: int) -> tuple[str, ...]:
    """``http://IP:PORT`` of every rank of ``pods``: a pod with k ranks serves ports
    ``base_port`` .. ``base_port + k - 1``; pods without an address are left out. Sorted by
    pod name, then local rank, so equal inputs give equal lists."""
    return tuple(
        f"http://{p.ip}:{base_port + k}"
        for p in sorted(pods, key=lambda p: p.name)
        if p.ip is not None
        for k in range(p.ranks)
    )


def router_args(spec: DwdpDeploymentSpec, servers: RouterServers) -> list[str]:
    """The arguments of the gate (after its command): where it listens (the pod's address,
    ``$(POD_IP)``: on the local control plane pods share one network namespace, and
    ``router.port``), then ``--`` and vllm-router's command line: PD mode, its metrics on the
    pod's address, the policies, the request bound, ``--prefill URL`` per prefill server and
    ``--decode URL`` per decode server (the gate adds the loopback ``--host``/``--port``)."""
    r = spec.router
    host = f"$({c.ROUTER_POD_IP_ENV})"
    args = [
        "--host",
        host,
        "--port",
        str(r.port),
        "--",
        c.VLLM_ROUTER,
        "--vllm-pd-disaggregation",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(r.metrics_port),
        "--prefill-policy",
        r.prefill_policy.value,
        "--decode-policy",
        r.decode_policy.value,
        "--request-timeout-secs",
        str(r.request_timeout_seconds),
        "--log-level",
        "info",
    ]
    for url in servers.prefill:
        args += ["--prefill", url]
    for url in servers.decode:
        args += ["--decode", url]
    return args


def _router_env(spec: DwdpDeploymentSpec) -> list[dict[str, Any]]:
    """The pod's address, and ``DWDP_API_KEY_FILE`` (the mounted key) when the workers
    require a key."""
    env: list[dict[str, Any]] = [
        {"name": c.ROUTER_POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]
    return env + api_key_env(spec)


def router_deployment(
    spec: DwdpDeploymentSpec, owner: Owner, servers: RouterServers
) -> dict[str, Any]:
    """The router's Deployment: ``router.replicas`` pods once ``servers`` is complete (else
    0), rolled one surge pod at a time (never below the wanted count), each with the
    restrictive security context of the workers, no service-account token, a read-only
    root with a writable /tmp, the API key's Secret mounted, a readiness probe (the gate
    forwards it to vllm-router's ``/readiness``), a liveness probe (the gate's
    ``/liveness``) and a ``preStop`` sleep (``ROUTER_STOP_DELAY_S``: a pod rolled out of the
    Service refuses no connection kube-proxy still sends it). Running the worker image
    (``router.image`` unset), the pods pull it with the workers' ``spec.imagePullSecrets``;
    another image gets none of them."""
    r = spec.router
    labels = _labels(owner, c.Component.ROUTER)
    key_volumes, key_mounts = api_key_volumes(spec)
    container = {
        "name": c.ROUTER_CONTAINER,
        "image": r.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(c.ROUTER_COMMAND),
        "args": router_args(spec, servers),
        "env": _router_env(spec),
        "ports": [
            {"name": "http", "containerPort": r.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": r.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": {  # 5 s as the liveness probe: under the 1 s default, a slow
            # answer on a busy node takes the router out of its Service
            "httpGet": {"path": READINESS_PATH, "port": r.port},
            "periodSeconds": READINESS_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": c.ROUTER_LIVENESS_PATH, "port": r.port},
            "periodSeconds": LIVENESS_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": c.ROUTER_STOP_DELAY_S}}},
        "resources": (r.resources.to_yaml_dict() if r.resources else {}) or {},
        "securityContext": spec.security_context.to_yaml_dict(),
        "volumeMounts": [{"name": c.TMP_VOLUME, "mountPath": c.TMP_DIR}, *key_mounts],
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": c.ROUTER_GRACE_S,
        "securityContext": spec.pod_security_context.to_yaml_dict(),
        "containers": [container],
        "volumes": [{"name": c.TMP_VOLUME, "emptyDir": {}}, *key_volumes],
    }
    if r.image is None and spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = image_pull_secrets(spec)
    template = {
        "metadata": {
            "labels": dict(labels),
            "annotations": {c.ANNOTATION_ROUTER_SERVERS: servers.digest},
        },
        "spec": pod_spec,
    }
    return _finish(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": naming.router(owner.name), "labels": labels},
            "spec": {
                "replicas": r.replicas if servers.complete else 0,
                "selector": router_selector(owner),
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": template,
            },
        },
        owner,
    )


def router_service(spec: DwdpDeploymentSpec, owner: Owner) -> dict[str, Any]:
    """The router's ClusterIP Service (``NAME-router``): the clients' entry on
    ``router.port``, and its metrics port."""
    r = spec.router
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": naming.router(owner.name),
                "labels": _labels(owner, c.Component.ROUTER),
            },
            "spec": {
                "type": "ClusterIP",
                "selector": router_selector(owner)["matchLabels"],
                "ports": [
                    {"name": "http", "port": r.port, "targetPort": r.port, "protocol": "TCP"},
                    {
                        "name": "metrics",
                        "port": r.metrics_port,
                        "targetPort": r.metrics_port,
                        "protocol": "TCP",
                    },
                ],
            },
        },
        owner,
    )


def router_policy(spec: DwdpDeploymentSpec, owner: Owner) -> dict[str, Any]:
    """The router pods' NetworkPolicy: ingress on its API and metrics ports only, from
    ``spec.networkPolicy.servingFrom`` (unset: any source, as for the serving ports). The
    gate checks the API key; the metrics port is open, like the workers'."""
    r = spec.router
    rule: dict[str, Any] = {
        "ports": [
            {"protocol": "TCP", "port": r.port},
            {"protocol": "TCP", "port": r.metrics_port},
        ]
    }
    peers = spec.network_policy.serving_from
    if peers is not None:
        rule["from"] = [p.to_yaml_dict() for p in peers]
    return _ingress_policy(owner, naming.router(owner.name), router_selector(owner), rule)


def router_objects(
    spec: DwdpDeploymentSpec, owner: Owner, servers: RouterServers
) -> list[dict[str, Any]]:
    """Every router child the spec wants: none when the router is off; else its
    Deployment, its Service and (unless ``networkPolicy.enabled`` is false) its
    NetworkPolicy."""
    if not spec.router_enabled:
        return []
    objs = [router_deployment(spec, owner, servers), router_service(spec, owner)]
    if spec.network_policy.enabled:
        objs.append(router_policy(spec, owner))
    return objs


def router_endpoint(spec: DwdpDeploymentSpec, owner: Owner) -> str:
    """The router's URL: ``http://NAME-router.NAMESPACE.svc:PORT``."""
    return f"http://{naming.router(owner.name)}.{owner.namespace}.svc:{spec.router.port}"


def ready_router_pods(pods: Iterable[RouterPod], servers: RouterServers) -> int:
    """Router pods that are Ready, not being deleted, and run ``servers`` (their
    template's server-list hash)."""
    return sum(1 for p in pods if p.ready and not p.deleting and p.servers == servers.digest)
