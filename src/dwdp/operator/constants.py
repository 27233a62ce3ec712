"""Every name the operator writes into the cluster: label and annotation keys, condition
types and reasons, event reasons, the field manager (the rank contract's environment
names, status phases and termination words live in :mod:`dwdp.api.contract`).

The invariant: no other module spells one of these strings; they import them from here, so
a key is renamed in one place and tests compare against the same constant.
"""

from __future__ import annotations

import enum

from dwdp.api.contract import Env
from dwdp.api.deployment import GROUP, PLURAL, VERSION
from dwdp.api.deployment import GroupPhase as GroupPhase  # status.groups[].phase values
from dwdp.api.placement import DEFAULT_GPU_RESOURCE

API_GROUP = GROUP
"""API group of DwdpDeployment (``dwdp.io``)."""
API_VERSION = VERSION
"""Served version of DwdpDeployment (``v1alpha1``)."""
RESOURCE_PLURAL = PLURAL
"""Plural resource name of DwdpDeployment (``dwdpdeployments``)."""

FIELD_MANAGER = "dwdp-operator"
"""Field manager of every server-side apply the operator sends (never changes: a new name
would leave the old manager owning the fields)."""

FINALIZER = "dwdp.io/finalizer"
"""kopf's finalizer name; the operator's handlers never need one (children are garbage-
collected through owner references), so no DwdpDeployment ever carries it in practice."""
KOPF_PREFIX = "dwdp.io"
"""Prefix of kopf's own annotations (diff base), instead of kopf.zalando.org."""
KOPF_PROGRESS_FIELD = "status.kopf"
"""Where kopf keeps handler progress (status keeps unknown fields; the CRD says so)."""

# ----------------------------------------------------------------------------- labels
LABEL_DEPLOYMENT = "dwdp.io/deployment"
"""Name of the owning DwdpDeployment; on every child."""
LABEL_ROLE = "dwdp.io/role"
"""``context`` or ``generation``; on every child that belongs to one role."""
LABEL_LLMD_ROLE = "llm-d.ai/role"
"""llm-d's serving role on every worker pod: ``prefill`` (context) or ``decode`` (generation),
so an llm-d scheduler or gateway routes to them unchanged."""
LLMD_ROLES = {"context": "prefill", "generation": "decode"}
LABEL_LLMD_SERVING = "llm-d.ai/inferenceServing"
"""``"true"`` on every worker pod: llm-d's InferencePool selects serving pods by it."""
LABEL_LLMD_MODEL = "llm-d.ai/model"
"""The served model name, made a valid label value (``naming.label_value``), on every worker
pod: llm-d selects a model's pods by it."""
LABEL_GROUP = "dwdp.io/group"
"""Name of the DWDP group (context) or server (generation) a pod belongs to."""
LABEL_GROUP_INDEX = "dwdp.io/group-index"
"""Index of the group within its role (0, 1, ...), as decimal text."""
LABEL_POD_INDEX = "dwdp.io/pod-index"
"""Index of the pod within its group incarnation (0 is the rendezvous host)."""
LABEL_REVISION = "dwdp.io/revision"
"""Revision hash of what reaches the pod (see :mod:`dwdp.operator.revision`)."""
LABEL_INCARNATION = "dwdp.io/incarnation"
"""Incarnation of the group (0, 1, ...); a restarted group gets the next one."""
LABEL_ENGINE = "dwdp.io/engine"
"""On the pods of a vLLM generation tier only: :data:`ENGINE_VLLM` (they answer no
``/dwdp/status``; their readiness stands for their one rank's report)."""
ENGINE_VLLM = "vllm"
LABEL_COMPONENT = "app.kubernetes.io/component"
"""Which kind of child: ``worker``, ``config``, ``service``, ``endpoints``."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
"""Always :data:`MANAGED_BY` on every child."""
MANAGED_BY = "dwdp-operator"

LABEL_SERVICE_NAME = "kubernetes.io/service-name"
"""The EndpointSlice label that ties a slice to its Service."""
LABEL_SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
"""Which controller owns an EndpointSlice (the endpoint-slice controller skips others)."""
SLICE_MANAGED_BY = "dwdp-operator.dwdp.io"

# ----------------------------------------------------------------------------- annotations
ANNOTATION_APPLIED_HASH = "dwdp.io/applied-hash"
"""Hash of the object as the operator last applied it; equal hash: no write."""

ANNOTATION_ROUTER_SERVERS = "dwdp.io/router-servers"
"""On the router's pod template: a hash of the prefill and decode URL lists in its arguments,
so a changed set of committed ranks rolls the router (and its pods say which list they run)."""

# ----------------------------------------------------------------------------- pods
GATE_CONDITION = "dwdp.io/group-ready"
"""Pod readiness gate: True when every rank of the incarnation committed with one revision
and one layout digest (the commit gate)."""
GATE_REASON_COMMITTED = "GroupCommitted"
"""Reason of an open gate."""
GATE_REASON_NOT_COMMITTED = "GroupNotCommitted"
"""Reason of a gate closed because the group is not (or no longer) committed."""
GATE_REASON_DRAINING = "GroupDraining"
"""Reason of a gate closed before the group is deleted (rollout, scale-down); the
operator reads it back, so a restarted operator finishes the drain it started."""
GPU_RESOURCE = DEFAULT_GPU_RESOURCE
"""Extended resource requested per pod, one per rank, unless ``spec.gpu`` names another one
or a DRA claim gives the GPUs."""
GPU_CLAIM = "gpus"
"""Name of the pod's resource claim on ``spec.gpu.resourceClaimTemplateName`` (DRA)."""
WORKER_CONTAINER = "worker"
"""Name of the one container of a worker pod."""
CONFIG_VOLUME = "launch-config"
CONFIG_DIR = "/etc/dwdp"
CONFIG_KEY_CONTEXT = "context.yaml"
CONFIG_KEY_GENERATION = "generation.yaml"
MODEL_VOLUME = "model"
RENDEZVOUS_VOLUME = "rendezvous-secret"
"""Volume of a worker pod holding its incarnation's rendezvous Secret."""
RENDEZVOUS_SECRET_MODE = 0o400
"""File mode of the mounted rendezvous secret (read by the worker's user only)."""
API_KEY_VOLUME = "api-key"
"""Volume of a worker or router pod holding the API key (``spec.server.apiKeySecretRef``); a
Secret volume, so the kubelet writes a rotated key into the running pod."""
API_KEY_MODE = 0o400
"""File mode of the mounted API key."""
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TMP_VOLUME = "tmp"
"""Writable emptyDir of a worker pod at ``/tmp`` (the root filesystem is read-only)."""
TMP_DIR = "/tmp"
SHM_VOLUME = "dshm"
"""Memory-backed emptyDir at ``/dev/shm``: shared memory between a pod's local ranks (the
cpu backend's stores) beyond a container runtime's 64 MiB default."""
SHM_DIR = "/dev/shm"
CACHE_ENV = {
    "XDG_CACHE_HOME": f"{TMP_DIR}/.cache",
    "TRITON_CACHE_DIR": f"{TMP_DIR}/.cache/triton",
}
"""Caches (the gather kernels' cubins, Hugging Face, Triton) pointed at the writable /tmp
of a pod whose root filesystem is read-only; a name the spec's ``env`` sets wins."""
DEFAULT_WORKER_COMMAND = ("dwdp", "launch", "--host", f"$({Env.POD_IP.value})")
"""Container command of a worker pod (``dwdp launch`` binds the pod's own address)."""

# ----------------------------------------------------------------------------- router
ROUTER_COMMAND = ("dwdp", "router-gate")
"""Container command of a router pod: the gate (``dwdp.worker.gate``), which checks the API key
and starts vllm-router behind it (the worker image ships both)."""
VLLM_ROUTER = "vllm-router"
"""The console script of the ``vllm-router`` package, the gate's child (in the worker image,
and in the local control plane's virtual environment)."""
ROUTER_LIVENESS_PATH = "/liveness"
"""The gate's liveness path: the gate answers and its vllm-router child answers."""
ROUTER_CONTAINER = "router"
"""Name of the one container of a router pod."""
ROUTER_POD_IP_ENV = "POD_IP"
"""The router pod's own address (a fieldRef), which it binds."""
ROUTER_GRACE_S = 35
"""Termination grace period of a router pod, in seconds (in-flight requests finish)."""
ROUTER_STOP_DELAY_S = 5
"""A stopping router pod keeps serving this long (its ``preStop`` sleep, within
``ROUTER_GRACE_S``) before the gate stops listening: kube-proxy takes it out of the Service's
rules first, so a connection opened during a roll is never refused."""

# ----------------------------------------------------------------------------- conditions
COND_READY = "Ready"
COND_PROGRESSING = "Progressing"
COND_DEGRADED = "Degraded"
COND_INVALID = "Invalid"
COND_ROUTER_READY = "RouterReady"
"""True while the router's pods that route to the current server list are all Ready."""
COND_REPLICA_FAILURE = "ReplicaFailure"
"""True while the apiserver refuses to create a child (quota, admission); its message is
the API's."""

# ----------------------------------------------------------------------------- gang, NVLink
PODGROUP_API = "scheduling.k8s.io/v1beta1"
"""The Workload/PodGroup scheduling API (gang scheduling) the operator uses when served."""
COMPUTE_DOMAIN_API = "resource.nvidia.com/v1beta1"
"""NVIDIA's ComputeDomain API (multi-node NVLink / IMEX channels)."""
CHANNEL_CLAIM = "compute-domain-channel"
"""Name of the pod's resource claim on its incarnation's ComputeDomain channel."""


class Reason(enum.StrEnum):
    """Reasons of conditions and Events (CamelCase, as Kubernetes writes them)."""

    ALL_GROUPS_SERVING = "AllGroupsServing"
    GROUPS_NOT_READY = "GroupsNotReady"
    GROUPS_STARTING = "GroupsStarting"
    SCALING = "Scaling"
    ROLLING_OUT = "RollingOut"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    STABLE = "Stable"
    GROUP_FAILED = "GroupFailed"
    HEALTHY = "Healthy"
    INVALID_SPEC = "InvalidSpec"
    # Events only
    CREATED_GROUP = "CreatedGroup"
    DELETED_GROUP = "DeletedGroup"
    GATE_OPENED = "GateOpened"
    GATE_CLOSED = "GateClosed"
    APPLY_FAILED = "ApplyFailed"
    RESTARTED_GROUP = "RestartedGroup"
    DRAINING_GROUP = "DrainingGroup"
    FORCE_DELETED = "ForceDeleted"
    FAILED_CREATE = "FailedCreate"
    COMPUTE_DOMAIN_UNAVAILABLE = "ComputeDomainUnavailable"
    # RouterReady
    ROUTER_AVAILABLE = "RouterAvailable"
    ROUTER_NOT_READY = "RouterNotReady"
    NO_SERVERS = "NoServers"


class Component(enum.StrEnum):
    """Values of :data:`LABEL_COMPONENT`."""

    WORKER = "worker"
    CONFIG = "config"
    SERVICE = "service"
    ENDPOINTS = "endpoints"
    NETWORK_POLICY = "network-policy"
    ROUTER = "router"
