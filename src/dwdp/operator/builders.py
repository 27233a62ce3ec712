"""Pure constructors of the children of a DwdpDeployment (plain dicts, ready to apply).

Each builder takes the validated spec and the owner and returns one Kubernetes object with
the owner reference, the labels of :mod:`dwdp.operator.constants` and the
``dwdp.io/applied-hash`` annotation (a hash of the rest of the object, so the operator can
tell without a write whether the object in the cluster is the one it wants). Invariant: the
builders never read the cluster and never look at the clock.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dwdp.api.contract import (
    API_KEY_DIR,
    API_KEY_PATH,
    RENDEZVOUS_SECRET_DIR,
    RENDEZVOUS_SECRET_KEY,
    RENDEZVOUS_SECRET_PATH,
    Env,
)
from dwdp.api.deployment import API_VERSION, KIND, DwdpDeploymentSpec, launch_config_for
from dwdp.api.enums import Role
from dwdp.api.launch import opens_rendezvous_store, served_model_name, validate_launch
from dwdp.operator import constants as c
from dwdp.operator import naming
from dwdp.operator import vllm as vllm_server
from dwdp.operator.revision import revision_of, stable_hash

__all__ = [
    "Owner",
    "RoleShape",
    "client_service",
    "compute_domain",
    "config_map",
    "endpoint_slices",
    "group_policy",
    "headless_service",
    "image_pull_secrets",
    "launch_config_text",
    "pod_group",
    "reads_launch_config",
    "rendezvous_secret",
    "rendezvous_secret_needed",
    "role_shapes",
    "role_template",
    "router_selector",
    "runs_vllm",
    "serving_policy",
    "with_secret_value",
    "worker_pod",
]

READINESS_PERIOD_S = 2
"""Seconds between readiness probes of a rank's ``/ready`` (and of a vLLM server's
``/health``)."""
VLLM_HEALTH_TIMEOUT_S = 5
"""Timeout of one probe of a vLLM server's ``/health``, in seconds (a busy server on a few
cores answers slowly)."""
DEFAULT_GRACE_S = 30
"""Pod termination grace period when the spec sets no graceful-shutdown bound, in seconds."""
GRACE_MARGIN_S = 10
"""Seconds added to ``gracefulShutdownTimeoutSeconds`` for the pod's grace period."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The DwdpDeployment that owns the children (name, namespace, uid)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        """Read the owner from a DwdpDeployment object (mapping with ``metadata``)."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])

    def reference(self) -> dict[str, Any]:
        """The ownerReference every child carries (controller, blocks owner deletion)."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class RoleShape:
    """How one role's groups look: counts in groups, pods and ranks."""

    role: Role
    replicas: int
    """Desired groups (context) or servers (generation)."""
    ranks_per_pod: int
    world_size: int
    """Ranks of one group (context: dwdpSize x instance size; generation: instance size)."""

    @property
    def pods_per_group(self) -> int:
        """Pods of one group incarnation."""
        return self.world_size // self.ranks_per_pod

    @property
    def config_key(self) -> str:
        """Key of this role's launch config in its ConfigMap."""
        return c.CONFIG_KEY_CONTEXT if self.role is Role.CONTEXT else c.CONFIG_KEY_GENERATION


def role_shapes(spec: DwdpDeploymentSpec) -> dict[Role, RoleShape]:
    """The shape of every role the spec runs (generation only when it has a section)."""
    ctx = spec.context
    shapes = {
        Role.CONTEXT: RoleShape(Role.CONTEXT, ctx.replicas, ctx.ranks_per_pod, ctx.ranks_per_group)
    }
    gen = spec.generation
    if gen is not None:
        shapes[Role.GENERATION] = RoleShape(
            Role.GENERATION, gen.replicas, gen.ranks_per_pod, gen.ranks_per_server
        )
    return shapes


def _labels(owner: Owner, component: c.Component, role: Role | None = None) -> dict[str, str]:
    labels = {
        c.LABEL_DEPLOYMENT: owner.name,
        c.LABEL_COMPONENT: component.value,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
    }
    if role is not None:
        labels[c.LABEL_ROLE] = role.value
    return labels


def _finish(obj: dict[str, Any], owner: Owner) -> dict[str, Any]:
    """Add namespace, owner reference and the applied-hash annotation (hash of the rest)."""
    meta = obj["metadata"]
    meta["namespace"] = owner.namespace
    meta["ownerReferences"] = [owner.reference()]
    meta.setdefault("annotations", {})[c.ANNOTATION_APPLIED_HASH] = stable_hash(obj)
    return obj


def _placed_pod(name: str, labels: dict[str, str], pod_spec: dict[str, Any],
                template: Mapping[str, Any], owner: Owner) -> dict[str, Any]:
    """The finished Pod ``name`` of ``pod_spec``, placed as ``template`` says (node selector,
    tolerations, affinity, image pull secrets, where given)."""
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = template[key]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
           "spec": pod_spec}
    return _finish(pod, owner)


def applied_hash(obj: Mapping[str, Any]) -> str | None:
    """The ``dwdp.io/applied-hash`` annotation of an object (None when absent)."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_APPLIED_HASH)


# ----------------------------------------------------------------------------- config


def runs_vllm(spec: DwdpDeploymentSpec, role: Role) -> bool:
    """The pods of ``role`` are vLLM servers (``generation.vllm``), not dwdp workers."""
    return role is Role.GENERATION and spec.vllm is not None


def reads_launch_config(spec: DwdpDeploymentSpec, role: Role) -> bool:
    """The pods of ``role`` read a launch config (its ConfigMap exists): dwdp workers do,
    vLLM servers do not."""
    return not runs_vllm(spec, role)


def launch_config_text(spec: DwdpDeploymentSpec, role: Role) -> str:
    """The launch config YAML a worker of ``role`` reads (``DWDP_CONFIG``).

    Raises:
        dwdp.api.launch.LaunchError: when the launch breaks a rule of docs/design.md §3.2 (the
            same check the worker runs on its host).
        ValueError: for the generation role without a generation section.
    """
    cfg = launch_config_for(spec, role)
    validate_launch(cfg)
    return yaml.safe_dump(cfg.to_yaml_dict(), sort_keys=True)


def config_map(spec: DwdpDeploymentSpec, owner: Owner, role: Role, revision: str) -> dict[str, Any]:
    """The launch ConfigMap of ``role`` at ``revision`` (immutable: a new revision gets a
    new ConfigMap, so a live group never sees a changed config)."""
    shape = role_shapes(spec)[role]
    labels = _labels(owner, c.Component.CONFIG, role)
    labels[c.LABEL_REVISION] = revision
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": naming.config_map(owner.name, role, revision), "labels": labels},
            "immutable": True,
            "data": {shape.config_key: launch_config_text(spec, role)},
        },
        owner,
    )


# ----------------------------------------------------------------------------- services


def headless_service(spec: DwdpDeploymentSpec, owner: Owner, role: Role) -> dict[str, Any]:
    """The headless Service of ``role``: DNS names for its pods, ready or not (the
    rendezvous happens before any rank is ready)."""
    shape = role_shapes(spec)[role]
    ports = [{"name": "rendezvous", "port": spec.rendezvous.port, "protocol": "TCP"}]
    ports += [
        {"name": f"rank-{k}", "port": spec.server.port + k, "protocol": "TCP"}
        for k in range(shape.ranks_per_pod)
    ]
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": naming.headless_service(owner.name, role),
                "labels": _labels(owner, c.Component.SERVICE, role),
            },
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {c.LABEL_DEPLOYMENT: owner.name, c.LABEL_ROLE: role.value},
                "ports": ports,
            },
        },
        owner,
    )


def client_service(spec: DwdpDeploymentSpec, owner: Owner) -> dict[str, Any]:
    """The client Service: no selector; the operator writes its EndpointSlices (one per
    local-rank port) with the committed context groups only."""
    k = spec.context.ranks_per_pod
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": naming.client_service(owner.name),
                "labels": _labels(owner, c.Component.SERVICE, Role.CONTEXT),
            },
            "spec": {
                "type": "ClusterIP",
                "ports": [
                    {
                        "name": f"rank-{r}",
                        "port": spec.server.port + r,
                        "targetPort": spec.server.port + r,
                        "protocol": "TCP",
                    }
                    for r in range(k)
                ],
            },
        },
        owner,
    )


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One serving pod in an EndpointSlice."""

    pod: str
    ip: str


def endpoint_slices(
    spec: DwdpDeploymentSpec, owner: Owner, endpoints: list[Endpoint]
) -> list[dict[str, Any]]:
    """The client Service's EndpointSlices: slice k lists every pod in ``endpoints`` on
    port ``server.port + k`` (sorted by pod name, so equal inputs give equal objects)."""
    slices = []
    for k in range(spec.context.ranks_per_pod):
        labels = _labels(owner, c.Component.ENDPOINTS, Role.CONTEXT)
        labels[c.LABEL_SERVICE_NAME] = naming.client_service(owner.name)
        labels[c.LABEL_SLICE_MANAGED_BY] = c.SLICE_MANAGED_BY
        slices.append(
            _finish(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {"name": naming.endpoint_slice(owner.name, k), "labels": labels},
                    "addressType": "IPv4",
                    "ports": [
                        {"name": f"rank-{k}", "port": spec.server.port + k, "protocol": "TCP"}
                    ],
                    "endpoints": [
                        {
                            "addresses": [e.ip],
                            "conditions": {"ready": True, "serving": True, "terminating": False},
                            "targetRef": {
                                "kind": "Pod",
                                "name": e.pod,
                                "namespace": owner.namespace,
                            },
                        }
                        for e in sorted(endpoints, key=lambda e: e.pod)
                    ],
                },
                owner,
            )
        )
    return slices


# ----------------------------------------------------------------------------- network policies


def _worker_selector(owner: Owner) -> dict[str, Any]:
    return {
        "matchLabels": {
            c.LABEL_DEPLOYMENT: owner.name,
            c.LABEL_COMPONENT: c.Component.WORKER.value,
        }
    }


def router_selector(owner: Owner) -> dict[str, Any]:
    """The label selector of the deployment's router pods."""
    return {
        "matchLabels": {
            c.LABEL_DEPLOYMENT: owner.name,
            c.LABEL_COMPONENT: c.Component.ROUTER.value,
        }
    }


def _ingress_policy(
    owner: Owner, name: str, selector: dict[str, Any], rule: dict[str, Any]
) -> dict[str, Any]:
    """A NetworkPolicy ``name`` admitting only ``rule``'s ingress to the pods ``selector``
    picks (egress left open)."""
    return _finish(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": _labels(owner, c.Component.NETWORK_POLICY)},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": [rule]},
        },
        owner,
    )


def serving_policy(
    spec: DwdpDeploymentSpec, owner: Owner, *, operator_namespace: str | None = None
) -> dict[str, Any]:
    """The NetworkPolicy of every worker pod of the deployment: ingress only on the
    serving ports (``server.port`` up to the widest role's last local-rank port), from
    ``spec.networkPolicy.servingFrom`` (unset: any source; set: those peers, every pod
    of ``operator_namespace``, whose operator reads ``/dwdp/status``, and the deployment's
    router pods when it runs one). Other ports are reached only under :func:`group_policy`;
    egress is not restricted."""
    first = spec.server.port
    width = max(s.ranks_per_pod for s in role_shapes(spec).values())
    port: dict[str, Any] = {"protocol": "TCP", "port": first}
    if width > 1:
        port["endPort"] = first + width - 1
    rule: dict[str, Any] = {"ports": [port]}
    peers = spec.network_policy.serving_from
    if peers is not None:
        rule["from"] = [p.to_yaml_dict() for p in peers]
        if operator_namespace is not None:
            ns = {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}
            rule["from"].append({"namespaceSelector": ns})
        if spec.router_enabled:
            rule["from"].append({"podSelector": router_selector(owner)})
    return _ingress_policy(owner, naming.serving_policy(owner.name), _worker_selector(owner), rule)


def kv_transfer_policy(owner: Owner) -> dict[str, Any]:
    """The NetworkPolicy of disaggregated serving: the deployment's generation pods (dwdp or
    vLLM servers: both carry the generation role label) reach its context pods on every port
    (NIXL's UCX endpoints listen on ephemeral ports; a dwdp reader's side channel is the
    serving port, which :func:`serving_policy` may restrict to other peers; a vLLM reader's is
    ``generation.vllm.sideChannelPort`` + local rank, which authenticates no peer: this policy
    is its boundary)."""
    context = _worker_selector(owner)
    context["matchLabels"][c.LABEL_ROLE] = Role.CONTEXT.value
    generation = _worker_selector(owner)
    generation["matchLabels"][c.LABEL_ROLE] = Role.GENERATION.value
    rule = {"from": [{"podSelector": generation}]}
    return _ingress_policy(owner, naming.kv_transfer_policy(owner.name), context, rule)


def group_policy(owner: Owner, group: str) -> dict[str, Any]:
    """The NetworkPolicy of one group (every incarnation of it): its pods reach each other
    on every port (the rendezvous store on pod 0, and NCCL, MPI or UCX, which pick
    ephemeral ports); no other pod reaches them there (the rendezvous port included)."""
    selector = _worker_selector(owner)
    selector["matchLabels"][c.LABEL_GROUP] = group
    rule = {"from": [{"podSelector": copy.deepcopy(selector)}]}
    return _ingress_policy(owner, naming.group_policy(group), selector, rule)


# ----------------------------------------------------------------------------- pods


def _grace_seconds(spec: DwdpDeploymentSpec) -> int:
    bound = spec.graceful_shutdown_timeout_seconds
    return DEFAULT_GRACE_S if bound is None else bound + GRACE_MARGIN_S


def role_template(
    spec: DwdpDeploymentSpec, role: Role, *, command: tuple[str, ...] = c.DEFAULT_WORKER_COMMAND
) -> dict[str, Any]:
    """Everything that reaches every pod of ``role`` (the revision's input, see
    :mod:`dwdp.operator.revision`): container, volumes, placement, GPUs, ports, rendezvous
    timeout and the launch config text. Group, incarnation and pod index are not in it.

    The keys of the optional pod fields (``imagePullSecrets``, ``affinity``,
    ``resourceClaims``) are present only when the spec sets them, so a spec without them
    keeps the revision it had before the fields existed (an operator upgrade rolls no group);
    so is ``DWDP_MEMORY_LIMIT`` in ``env``, present only with a memory limit in
    ``spec.resources``.
    The generation role of a vLLM tier has :func:`vllm_template` instead.
    """
    if runs_vllm(spec, role):
        return vllm_template(spec)
    shape = role_shapes(spec)[role]
    volumes, mounts = _model_volumes(spec)
    key_volumes, key_mounts = api_key_volumes(spec)
    template: dict[str, Any] = {
        "role": role.value,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(command),
        "env": [
            *api_key_env(spec),
            *_memory_limit_env(spec),
            *_default_env(spec, c.CACHE_ENV),
            *(e.to_yaml_dict() for e in spec.env or ()),
        ],
        "securityContext": spec.security_context.to_yaml_dict(),
        "podSecurityContext": spec.pod_security_context.to_yaml_dict(),
        "resources": _container_resources(spec, shape.ranks_per_pod),
        "nodeSelector": dict(spec.node_selector or {}),
        "tolerations": [t.to_yaml_dict() for t in spec.tolerations or ()],
        "volumes": volumes + key_volumes + _WRITABLE_VOLUMES,
        "volumeMounts": mounts + key_mounts + _WRITABLE_MOUNTS,
        "serverPort": spec.server.port,
        "rendezvousPort": spec.rendezvous.port,
        "rendezvousTimeoutSeconds": spec.rendezvous.timeout_seconds,
        "ranksPerPod": shape.ranks_per_pod,
        "worldSize": shape.world_size,
        "terminationGracePeriodSeconds": _grace_seconds(spec),
        "launchConfig": launch_config_text(spec, role),
        **_optional_pod_fields(spec),
    }
    claim = spec.gpu.claim_template(role)
    if claim is not None:
        template["resourceClaims"] = [{"name": c.GPU_CLAIM, "resourceClaimTemplateName": claim}]
    return template


def _optional_pod_fields(spec: DwdpDeploymentSpec) -> dict[str, Any]:
    """``imagePullSecrets`` and ``affinity`` of every worker pod, each only when set."""
    fields: dict[str, Any] = {}
    if spec.image_pull_secrets:
        fields["imagePullSecrets"] = image_pull_secrets(spec)
    if spec.affinity is not None and (affinity := spec.affinity.to_yaml_dict()):
        fields["affinity"] = affinity
    return fields


def vllm_template(spec: DwdpDeploymentSpec) -> dict[str, Any]:
    """Everything that reaches every pod of a vLLM generation tier (its revision's input,
    as :func:`role_template` for dwdp pods): the vLLM image, command line
    (:mod:`dwdp.operator.vllm`), environment (the defaults of a read-only root and of vLLM less
    the names ``spec.env`` sets, ``spec.env``, then the operator's: the pod's address and the
    API key reference), ``generation.vllm.resources`` (else ``spec.resources``; no GPU: vLLM
    runs on CPU), the workers' security contexts, model volume, writable volumes, placement
    and grace period."""
    vllm = vllm_server.vllm_spec(spec)
    volumes, mounts = _model_volumes(spec)
    resources = vllm.resources or spec.resources
    return {
        "role": Role.GENERATION.value,
        "engine": c.ENGINE_VLLM,
        "image": vllm.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": vllm_server.vllm_command(),
        "args": vllm_server.vllm_args(spec),
        "env": [
            *_default_env(spec, {**c.CACHE_ENV, **vllm_server.DEFAULT_ENV}),
            *(e.to_yaml_dict() for e in spec.env or ()),
            *vllm_server.vllm_env(spec),
        ],
        "securityContext": spec.security_context.to_yaml_dict(),
        "podSecurityContext": spec.pod_security_context.to_yaml_dict(),
        "resources": copy.deepcopy((resources.to_yaml_dict() if resources else {}) or {}),
        "nodeSelector": dict(spec.node_selector or {}),
        "tolerations": [t.to_yaml_dict() for t in spec.tolerations or ()],
        "volumes": volumes + _WRITABLE_VOLUMES,
        "volumeMounts": mounts + _WRITABLE_MOUNTS,
        "serverPort": spec.server.port,
        "terminationGracePeriodSeconds": _grace_seconds(spec),
        **_optional_pod_fields(spec),
    }


def image_pull_secrets(spec: DwdpDeploymentSpec) -> list[dict[str, str]]:
    """``spec.imagePullSecrets`` as a pod's ``imagePullSecrets`` (``[{"name": ...}]``;
    empty when unset)."""
    return [s.to_yaml_dict() for s in spec.image_pull_secrets or ()]


def _container_resources(spec: DwdpDeploymentSpec, gpus: int) -> dict[str, Any]:
    """The worker container's resources: ``spec.resources`` with ``gpus`` of the device
    plugin's resource (``spec.gpu``) in both limits and requests, or, when a DRA claim gives
    the GPUs, ``spec.resources`` as it is (the claim is added to the pod and container)."""
    resources = copy.deepcopy((spec.resources.to_yaml_dict() if spec.resources else {}) or {})
    name = spec.gpu.device_plugin_resource
    if name is not None:
        resources.setdefault("limits", {})[name] = gpus
        resources.setdefault("requests", {})[name] = gpus
    return resources


def _model_volumes(spec: DwdpDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checkpoint's volume and read-only mount (none without pvcName or hostPath)."""
    model = spec.model
    if model.pvc_name is not None:
        source: dict[str, Any] = {
            "persistentVolumeClaim": {"claimName": model.pvc_name, "readOnly": True}
        }
    elif model.host_path is not None:
        source = {"hostPath": {"path": model.host_path, "type": "Directory"}}
    else:
        return [], []
    mount = {"name": c.MODEL_VOLUME, "mountPath": model.mount_path, "readOnly": True}
    return [{"name": c.MODEL_VOLUME, **source}], [mount]


_WRITABLE_VOLUMES = [
    {"name": c.TMP_VOLUME, "emptyDir": {}},
    {"name": c.SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
]
"""The writable volumes of a worker pod (its root filesystem is read-only by default)."""
_WRITABLE_MOUNTS = [
    {"name": c.TMP_VOLUME, "mountPath": c.TMP_DIR},
    {"name": c.SHM_VOLUME, "mountPath": c.SHM_DIR},
]


def _default_env(spec: DwdpDeploymentSpec, defaults: Mapping[str, str]) -> list[dict[str, Any]]:
    """``defaults`` (such as :data:`~dwdp.operator.constants.CACHE_ENV`) less the names
    ``spec.env`` sets."""
    own = {e.name for e in spec.env or ()}
    return [{"name": k, "value": v} for k, v in defaults.items() if k not in own]


def revisions(
    spec: DwdpDeploymentSpec, *, command: tuple[str, ...] = c.DEFAULT_WORKER_COMMAND
) -> dict[Role, str]:
    """The current revision of every role of ``spec``."""
    return {
        role: revision_of(role_template(spec, role, command=command)) for role in role_shapes(spec)
    }


def api_key_env(spec: DwdpDeploymentSpec) -> list[dict[str, Any]]:
    """``DWDP_API_KEY_FILE``, the path of the mounted API key (``api_key_volumes``), or nothing
    without ``spec.server.apiKeySecretRef``: the key itself never appears in the pod spec."""
    if spec.server.api_key_secret_ref is None:
        return []
    return [{"name": Env.API_KEY_FILE.value, "value": API_KEY_PATH}]


def _memory_limit_env(spec: DwdpDeploymentSpec) -> list[dict[str, Any]]:
    """``DWDP_MEMORY_LIMIT``, the worker container's memory limit in bytes through the
    downward API (``resourceFieldRef``), or nothing when ``spec.resources`` sets no memory
    limit: the ranks size their host memory within it where they cannot read their cgroup."""
    if "memory" not in ((spec.resources.limits if spec.resources else None) or {}):
        return []
    ref = {"containerName": c.WORKER_CONTAINER, "resource": "limits.memory", "divisor": "1"}
    return [{"name": Env.MEMORY_LIMIT.value, "valueFrom": {"resourceFieldRef": ref}}]


def api_key_volumes(
    spec: DwdpDeploymentSpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the API key: the Secret key ``spec.server.apiKeySecretRef``
    names as the file ``API_KEY_PATH`` (mode 0400, read-only), or nothing without one. A
    Secret volume rather than a ``secretKeyRef``: the kubelet writes a rotated key into the
    running pod, where the servers re-read it (``dwdp.worker.apikey``)."""
    ref = spec.server.api_key_secret_ref
    if ref is None:
        return [], []
    volume = {
        "name": c.API_KEY_VOLUME,
        "secret": {
            "secretName": ref.name,
            "defaultMode": c.API_KEY_MODE,
            "items": [{"key": ref.key, "path": API_KEY_PATH.rsplit("/", 1)[1]}],
        },
    }
    mount = {"name": c.API_KEY_VOLUME, "mountPath": API_KEY_DIR, "readOnly": True}
    return [volume], [mount]


def worker_pod(
    spec: DwdpDeploymentSpec,
    owner: Owner,
    *,
    role: Role,
    group_index: int,
    incarnation: int,
    pod_index: int,
    revision: str,
    command: tuple[str, ...] = c.DEFAULT_WORKER_COMMAND,
    pod_group: str | None = None,
    channel_template: str | None = None,
    secret: str | None = None,
) -> dict[str, Any]:
    """Pod ``pod_index`` of incarnation ``incarnation`` of group ``group_index`` of
    ``role``: ranks ``pod_index * ranksPerPod`` onwards, the rendezvous environment of
    docs/design.md §4.2, one GPU per rank, restartPolicy Never, the commit-gate readiness gate.
    ``secret``: the incarnation's rendezvous Secret, mounted read-only at
    ``RENDEZVOUS_SECRET_DIR`` and named by ``DWDP_RENDEZVOUS_SECRET_FILE`` (its path, never
    its value). The generation pods of a vLLM tier are :func:`vllm_pod`'s."""
    if runs_vllm(spec, role):
        return vllm_pod(
            spec,
            owner,
            group_index=group_index,
            incarnation=incarnation,
            revision=revision,
            pod_group=pod_group,
        )
    t = role_template(spec, role, command=command)
    shape = role_shapes(spec)[role]
    group = naming.group_name(owner.name, role, group_index)
    name = naming.pod_name(group, incarnation, pod_index)
    labels = _incarnation_labels(owner, role, group_index, incarnation)
    labels.update({c.LABEL_POD_INDEX: str(pod_index), c.LABEL_REVISION: revision})
    labels.update(_llmd_labels(spec))
    rendezvous = naming.rendezvous_address(
        group=group,
        incarnation=incarnation,
        deployment=owner.name,
        role=role,
        namespace=owner.namespace,
        port=spec.rendezvous.port,
    )
    env = [
        {"name": Env.GROUP.value, "value": group},
        {"name": Env.INCARNATION.value, "value": str(incarnation)},
        {"name": Env.RANK.value, "value": str(pod_index * shape.ranks_per_pod)},
        {"name": Env.WORLD_SIZE.value, "value": str(shape.world_size)},
        {"name": Env.LOCAL_WORLD_SIZE.value, "value": str(shape.ranks_per_pod)},
        {"name": Env.RENDEZVOUS.value, "value": rendezvous},
        {"name": Env.RENDEZVOUS_TIMEOUT_S.value, "value": str(spec.rendezvous.timeout_seconds)},
        {"name": Env.ROLE.value, "value": role.value},
        {"name": Env.REVISION.value, "value": revision},
        {"name": Env.CONFIG.value, "value": f"{c.CONFIG_DIR}/{shape.config_key}"},
        {"name": Env.PORT.value, "value": str(spec.server.port)},
        {"name": Env.POD_IP.value, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *t["env"],
    ]
    ports = [
        {"name": f"rank-{k}", "containerPort": spec.server.port + k, "protocol": "TCP"}
        for k in range(shape.ranks_per_pod)
    ]
    if pod_index == 0:
        ports.append(
            {"name": "rendezvous", "containerPort": spec.rendezvous.port, "protocol": "TCP"}
        )
    container = {
        "name": c.WORKER_CONTAINER,
        "image": t["image"],
        "imagePullPolicy": t["imagePullPolicy"],
        "command": t["command"],
        "env": env,
        "ports": ports,
        "resources": t["resources"],
        "securityContext": t["securityContext"],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": spec.server.port},
            "periodSeconds": READINESS_PERIOD_S,
            "failureThreshold": 3,
        },
        "terminationMessagePath": c.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": c.CONFIG_VOLUME, "mountPath": c.CONFIG_DIR, "readOnly": True},
            *t["volumeMounts"],
        ],
    }
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": naming.headless_service(owner.name, role),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": t["terminationGracePeriodSeconds"],
        "readinessGates": [{"conditionType": c.GATE_CONDITION}],
        "securityContext": t["podSecurityContext"],
        "containers": [container],
        "volumes": [
            {
                "name": c.CONFIG_VOLUME,
                "configMap": {"name": naming.config_map(owner.name, role, revision)},
            },
            *t["volumes"],
        ],
    }
    if pod_group is not None:
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group}
    claims = list(t.get("resourceClaims", ()))
    if channel_template is not None:
        claims.append({"name": c.CHANNEL_CLAIM, "resourceClaimTemplateName": channel_template})
    if claims:
        pod_spec["resourceClaims"] = claims
        container["resources"] = {
            **container["resources"],
            "claims": [{"name": claim["name"]} for claim in claims],
        }
    if secret is not None:
        _mount_secret(pod_spec, container, secret)
    return _placed_pod(name, labels, pod_spec, t, owner)


def vllm_pod(
    spec: DwdpDeploymentSpec,
    owner: Owner,
    *,
    group_index: int,
    incarnation: int,
    revision: str,
    pod_group: str | None = None,
) -> dict[str, Any]:
    """The pod of vLLM generation server ``group_index`` (incarnation ``incarnation``): one
    vLLM container (:func:`vllm_template`), with the labels of a dwdp generation pod (llm-d's
    role ``decode`` among them) and ``dwdp.io/engine: vllm``, restartPolicy Never, readiness
    on vLLM's ``/health`` and the commit-gate readiness gate (the operator opens it once that
    readiness holds), and no launch config, rendezvous or GPU."""
    t = vllm_template(spec)
    group = naming.group_name(owner.name, Role.GENERATION, group_index)
    name = naming.pod_name(group, incarnation, 0)
    labels = _incarnation_labels(owner, Role.GENERATION, group_index, incarnation)
    labels.update({c.LABEL_POD_INDEX: "0", c.LABEL_REVISION: revision})
    labels.update(_llmd_labels(spec))
    labels[c.LABEL_ENGINE] = c.ENGINE_VLLM
    container = {
        "name": vllm_server.CONTAINER,
        "image": t["image"],
        "imagePullPolicy": t["imagePullPolicy"],
        "command": t["command"],
        "args": t["args"],
        "env": t["env"],
        "ports": [{"name": "http", "containerPort": spec.server.port, "protocol": "TCP"}],
        "resources": t["resources"],
        "securityContext": t["securityContext"],
        "readinessProbe": {
            "httpGet": {"path": vllm_server.HEALTH_PATH, "port": spec.server.port},
            "periodSeconds": READINESS_PERIOD_S,
            "timeoutSeconds": VLLM_HEALTH_TIMEOUT_S,
            "failureThreshold": 3,
        },
        "terminationMessagePath": c.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": t["volumeMounts"],
    }
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": naming.headless_service(owner.name, Role.GENERATION),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": t["terminationGracePeriodSeconds"],
        "readinessGates": [{"conditionType": c.GATE_CONDITION}],
        "securityContext": t["podSecurityContext"],
        "containers": [container],
        "volumes": t["volumes"],
    }
    if pod_group is not None:
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group}
    return _placed_pod(name, labels, pod_spec, t, owner)


def _mount_secret(pod_spec: dict[str, Any], container: dict[str, Any], secret: str) -> None:
    """Add the rendezvous Secret ``secret`` to a worker pod: a secret volume (key
    ``secret`` only, mode 0400), its read-only mount and the env var naming the file."""
    pod_spec["volumes"].append(
        {
            "name": c.RENDEZVOUS_VOLUME,
            "secret": {
                "secretName": secret,
                "defaultMode": c.RENDEZVOUS_SECRET_MODE,
                "items": [{"key": RENDEZVOUS_SECRET_KEY, "path": RENDEZVOUS_SECRET_KEY}],
            },
        }
    )
    container["volumeMounts"].append(
        {"name": c.RENDEZVOUS_VOLUME, "mountPath": RENDEZVOUS_SECRET_DIR, "readOnly": True}
    )
    env = {"name": Env.RENDEZVOUS_SECRET_FILE.value, "value": RENDEZVOUS_SECRET_PATH}
    container["env"].append(env)


# ----------------------------------------------------------------------------- per incarnation


def _llmd_labels(spec: DwdpDeploymentSpec) -> dict[str, str]:
    """llm-d's serving and model labels of a worker pod (its role label comes with the
    incarnation's)."""
    model = served_model_name(spec.model.served_name, spec.model.path)
    return {c.LABEL_LLMD_SERVING: "true", c.LABEL_LLMD_MODEL: naming.label_value(model)}


def _incarnation_labels(owner: Owner, role: Role, group_index: int, incarnation: int) -> dict:
    labels = _labels(owner, c.Component.WORKER, role)
    labels.update(
        {
            c.LABEL_LLMD_ROLE: c.LLMD_ROLES[role.value],
            c.LABEL_GROUP: naming.group_name(owner.name, role, group_index),
            c.LABEL_GROUP_INDEX: str(group_index),
            c.LABEL_INCARNATION: str(incarnation),
        }
    )
    return labels


def pod_group(
    owner: Owner, *, role: Role, group_index: int, incarnation: int, min_count: int
) -> dict[str, Any]:
    """The gang PodGroup of one group incarnation: the scheduler binds its ``min_count``
    pods together or none of them (``scheduling.k8s.io/v1beta1``)."""
    group = naming.group_name(owner.name, role, group_index)
    return _finish(
        {
            "apiVersion": c.PODGROUP_API,
            "kind": "PodGroup",
            "metadata": {
                "name": naming.incarnation(group, incarnation),
                "labels": _incarnation_labels(owner, role, group_index, incarnation),
            },
            "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
        },
        owner,
    )


def compute_domain(
    owner: Owner, *, role: Role, group_index: int, incarnation: int, nodes: int
) -> dict[str, Any]:
    """The NVIDIA ComputeDomain of one group incarnation (one multi-node NVLink / IMEX
    domain over its ``nodes`` pods); its channel ResourceClaimTemplate is what the pods
    claim."""
    group = naming.group_name(owner.name, role, group_index)
    return _finish(
        {
            "apiVersion": c.COMPUTE_DOMAIN_API,
            "kind": "ComputeDomain",
            "metadata": {
                "name": naming.incarnation(group, incarnation),
                "labels": _incarnation_labels(owner, role, group_index, incarnation),
            },
            "spec": {
                "numNodes": nodes,
                "channel": {
                    "resourceClaimTemplate": {
                        "name": naming.channel_claim_template(group, incarnation)
                    }
                },
            },
        },
        owner,
    )


def rendezvous_secret_needed(spec: DwdpDeploymentSpec, role: Role) -> bool:
    """The ranks of a ``role`` group meet at rank 0's TCP store, so each incarnation needs a
    rendezvous Secret (``dwdp.api.launch.opens_rendezvous_store``, the rule the worker
    follows too); a vLLM server never does."""
    if runs_vllm(spec, role):
        return False
    return opens_rendezvous_store(launch_config_for(spec, role))


def rendezvous_secret(
    owner: Owner, *, role: Role, group_index: int, incarnation: int
) -> dict[str, Any]:
    """The rendezvous Secret of one group incarnation, without its value (type Opaque,
    labelled and owned like the incarnation's pods). The value is random and so never
    planned: :func:`with_secret_value` adds it just before the creation."""
    group = naming.group_name(owner.name, role, group_index)
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": naming.rendezvous_secret(group, incarnation),
                "labels": _incarnation_labels(owner, role, group_index, incarnation),
            },
            "type": "Opaque",
        },
        owner,
    )


def with_secret_value(obj: Mapping[str, Any], value: bytes) -> dict[str, Any]:
    """A copy of the rendezvous Secret ``obj`` whose ``data[secret]`` is ``value``
    (raw bytes, base64-encoded as the API wants)."""
    out = copy.deepcopy(dict(obj))
    out["data"] = {RENDEZVOUS_SECRET_KEY: base64.b64encode(value).decode("ascii")}
    return out
