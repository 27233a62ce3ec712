"""DwdpDeployment: the custom resource's spec and status models (docs/design.md §3.3).

Group ``dwdp.io``, version ``v1alpha1``, kind ``DwdpDeployment``, plural ``dwdpdeployments``,
short name ``dwdp``. The spec says what to run (model, image, the context DWDP groups, the
generation servers, rendezvous, rollout and failure policy); the status is what the operator
observed. :func:`deployment_problems` applies every rule (field rules, docs/design.md §3.1 through
:class:`~dwdp.api.config.DwdpConfig`, the launch rules of §3.2 through
:func:`~dwdp.api.launch.launch_problems`, the settings this worker does not run from
:mod:`~dwdp.api.support`) and names each broken one; the CRD carries the
same rules as schema constraints and CEL, generated from these classes by
:mod:`dwdp.api.crd`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from dwdp.api.base import ApiModel, Bool, Int64, NonNegInt, PosInt, cel_rule, cel_rules
from dwdp.api.config import DwdpConfig
from dwdp.api.contract import USER_ENV
from dwdp.api.defaults import (
    MAX_BATCH_SIZE,
    MAX_NUM_TOKENS,
    ROUTER_PORT,
    SERVER_PORT,
    VLLM_SIDE_CHANNEL_PORT,
    VLLM_VERSIONS,
)
from dwdp.api.enums import HandleType, Role, Transport
from dwdp.api.errors import (
    UNSET,
    DwdpValidationError,
    Problem,
    RuleViolations,
    all_problems,
    first_per_field,
)
from dwdp.api.launch import (
    Dtype,
    EngineSpec,
    KvCacheConfig,
    KvTransferConfig,
    LaunchConfig,
    LaunchModel,
    StagingTokens,
    VllmConnectorConfig,
    launch_problems,
)
from dwdp.api.names import (
    ABSOLUTE_PATH,
    DNS1123_SUBDOMAIN,
    ENV_VAR_NAME,
    IMAGE_REFERENCE,
    SECRET_KEY,
    NameFormat,
)
from dwdp.api.placement import DEFAULT_GPU_RESOURCE, Affinity, GpuSpec, LocalObjectReference
from dwdp.api.security import NetworkPolicySpec, PodSecurityContext, SecurityContext
from dwdp.api.support import Scope, SectionView, worker_limit_problems, worker_limit_rules
from dwdp.api.vllm import (
    dwdp_only_problems,
    dwdp_only_rules,
    side_channel_cel,
    side_channel_problems,
    vllm_spec_problems,
    vllm_spec_rules,
)

__all__ = [
    "API_VERSION",
    "DEPLOYMENT_NAME",
    "GROUP",
    "KIND",
    "NAME_MAX_LENGTH",
    "PLURAL",
    "SHORT_NAME",
    "SINGULAR",
    "VERSION",
    "Condition",
    "ContextSpec",
    "DeploymentPhase",
    "DwdpDeployment",
    "DwdpDeploymentSpec",
    "DwdpDeploymentStatus",
    "EnvVar",
    "FailurePolicy",
    "FailureRecord",
    "GenerationSpec",
    "GenerationStatus",
    "GroupPhase",
    "GroupStatus",
    "ModelSpec",
    "ObjectMeta",
    "RendezvousSpec",
    "ResourceRequirements",
    "RolloutSpec",
    "RouterPolicy",
    "RouterSpec",
    "RouterStatus",
    "ServerSpec",
    "Toleration",
    "VllmGenerationSpec",
    "deployment_problems",
    "launch_config_for",
    "parse_deployment",
]

GROUP = "dwdp.io"
"""API group of the custom resource."""
VERSION = "v1alpha1"
"""The one served and stored version."""
API_VERSION = f"{GROUP}/{VERSION}"
"""``apiVersion`` of every DwdpDeployment."""
KIND = "DwdpDeployment"
PLURAL = "dwdpdeployments"
SINGULAR = "dwdpdeployment"
SHORT_NAME = "dwdp"

NAME_MAX_LENGTH = 40
"""Longest accepted deployment name: child objects append suffixes and Service names are
DNS-1035 labels of at most 63 characters."""
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label: lower-case letters, digits and '-', starting with a letter."""
DEPLOYMENT_NAME = NameFormat(
    "DNS-1035 label",
    NAME_PATTERN,
    NAME_MAX_LENGTH,
    "lowercase letters, digits and '-', starting with a letter and ending with a letter or "
    "digit",
)
"""``metadata.name`` of a DwdpDeployment; the CRD's root schema restricts it with
``NAME_PATTERN`` and ``NAME_MAX_LENGTH`` (all a CRD may restrict in metadata)."""

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A Kubernetes resource quantity written as a string (``8Gi``, ``500m``, ``1``)."""

_EMPTY_DEFAULT: dict[str, Any] = {"default": {}}
"""Schema extra of an object field whose absence means "all defaults" (the apiserver then
fills the nested defaults too)."""

Quantity = Annotated[
    Annotated[int, Field(strict=True)] | str, Field(union_mode="left_to_right")
]
LabelKey = Annotated[str, Field(max_length=316)]
LabelValue = Annotated[str, Field(max_length=63)]
EnvName = Annotated[str, ENV_VAR_NAME]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]


# --------------------------------------------------------------------------- spec


class ModelSpec(ApiModel):
    """Where the checkpoint is: a directory in the worker, optionally on a mounted volume."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.path.startsWith('/')",
                    "path must be an absolute directory path",
                    field_path=".path",
                ),
                cel_rule(
                    "!(has(self.pvcName) && has(self.hostPath))",
                    "set at most one of pvcName and hostPath",
                    field_path=".hostPath",
                ),
                cel_rule(
                    "(!has(self.pvcName) && !has(self.hostPath)) || self.path == self.mountPath"
                    " || self.path.startsWith(self.mountPath + '/')",
                    "path must lie under mountPath when pvcName or hostPath mounts a volume",
                    field_path=".path",
                ),
            ]
        )
    )

    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Checkpoint directory inside the worker (absolute; a local Hugging Face "
        "directory with safetensors).",
    )
    architecture: str | None = Field(
        default=None,
        max_length=128,
        description="Architecture name, when the checkpoint's config.json does not give it.",
    )
    served_name: str | None = Field(
        default=None, max_length=253, description="Model name the HTTP API answers to."
    )
    dtype: Dtype = Field(
        default="auto",
        description="Compute dtype: auto (the checkpoint's), bfloat16, float16 or float32. An FP8 "
        "checkpoint's weights stay FP8 (docs/operations.md, checkpoint formats).",
    )
    pvc_name: str | None = Field(
        default=None,
        max_length=253,
        description="PersistentVolumeClaim holding the checkpoint, mounted read-only at "
        "mountPath.",
    )
    host_path: Annotated[str, ABSOLUTE_PATH] | None = Field(
        default=None,
        description="Host directory holding the checkpoint, mounted read-only at mountPath.",
    )
    mount_path: Annotated[str, ABSOLUTE_PATH] = Field(
        default="/models",
        description="Where pvcName or hostPath is mounted in the worker.",
    )

    def rule_problems(self) -> list[Problem]:
        """The cross-field rules of the model source; paths relative to ``model``."""
        problems = []
        if not self.path.startswith("/"):
            problems.append(Problem(("path",), self.path, "must be an absolute directory path"))
        if self.pvc_name is not None and self.host_path is not None:
            problems.append(
                Problem(("hostPath",), self.host_path, "set at most one of pvcName and hostPath")
            )
        volume = self.pvc_name is not None or self.host_path is not None
        inside = self.path == self.mount_path or self.path.startswith(self.mount_path + "/")
        if volume and not inside:
            problems.append(
                Problem(
                    ("path",),
                    self.path,
                    f"must lie under mountPath {self.mount_path} when pvcName or hostPath "
                    "mounts a volume",
                )
            )
        return problems

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        problems = self.rule_problems()
        if problems:
            raise RuleViolations(problems)
        return self


class Toleration(ApiModel):
    """A pod toleration (as in the Kubernetes core API)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.operator != 'Exists' || !has(self.value)",
                    "value must be unset when operator is Exists",
                    field_path=".value",
                )
            ]
        )
    )

    key: str | None = Field(
        default=None, max_length=316, description="Taint key; unset matches all."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; unset matches all."
    )
    toleration_seconds: Int64 | None = Field(
        default=None,
        description="How long a NoExecute taint is tolerated, in seconds.",
    )

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise RuleViolations(
                [Problem(("value",), self.value, "must be unset when operator is Exists")]
            )
        return self


_RESERVED_ENV = (
    "names starting with DWDP_ are reserved: the operator sets them (a user may set "
    + ", ".join(USER_ENV)
    + ")"
)


class EnvVar(ApiModel):
    """An environment variable of every worker container (a literal value)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "!self.name.startsWith('DWDP_') || self.name in "
                    + "[" + ", ".join(f"'{n}'" for n in USER_ENV) + "]",
                    _RESERVED_ENV,
                    field_path=".name",
                )
            ]
        )
    )

    name: EnvName = Field(description="Variable name (a C identifier).")
    value: str = Field(default="", max_length=32768, description="Literal value.")

    @model_validator(mode="after")
    def _check(self) -> EnvVar:
        if self.name.startswith("DWDP_") and self.name not in USER_ENV:
            raise RuleViolations([Problem(("name",), self.name, _RESERVED_ENV)])
        return self


class ResourceRequirements(ApiModel):
    """Container resources per worker pod (quantities such as ``8Gi``, ``500m``, ``1``)."""

    limits: dict[LabelKey, Quantity] | None = Field(
        default=None, max_length=32, description="Resource limits by name."
    )
    requests: dict[LabelKey, Quantity] | None = Field(
        default=None, max_length=32, description="Resource requests by name."
    )

    @model_validator(mode="after")
    def _check(self) -> ResourceRequirements:
        problems = []
        for part in ("limits", "requests"):
            for name, value in (getattr(self, part) or {}).items():
                if isinstance(value, str) and not _quantity_ok(value):
                    problems.append(
                        Problem(
                            (part, name),
                            value,
                            "is not a resource quantity (for example 8Gi, 500m or 1)",
                        )
                    )
        if problems:
            raise RuleViolations(problems)
        return self


def _quantity_ok(text: str) -> bool:
    return re.fullmatch(QUANTITY_PATTERN[1:-1], text) is not None


class VllmGenerationSpec(ApiModel):
    """Unmodified vLLM servers as the generation (decode) tier (docs/vllm-fleet.md): vLLM's
    OpenAI server (``python3 -m vllm.entrypoints.openai.api_server``) in ``image``, on CPU,
    its NIXL connector a ``kv_consumer`` reading the KV the context ranks prefilled; the router
    lists them as decode servers. The rules are :mod:`dwdp.api.vllm`'s."""

    model_config = ConfigDict(json_schema_extra=cel_rules(vllm_spec_rules))

    image: Annotated[str, IMAGE_REFERENCE] = Field(
        description="vLLM image: a CPU build of vLLM (version) with nixl, whose python3 runs "
        "vllm.entrypoints.openai.api_server.",
    )
    version: str = Field(
        default=VLLM_VERSIONS[0],
        max_length=32,
        description="The vLLM version of image; the context ranks speak its NIXL connector. "
        f"Supported: {', '.join(VLLM_VERSIONS)}.",
    )
    args: list[Annotated[str, Field(max_length=1024)]] | None = Field(
        default=None,
        max_length=64,
        description="More arguments of vLLM's server (--max-model-len 4096, --max-num-seqs "
        "16, ...). Refused: those the operator sets (--model, --served-model-name, --host, "
        "--port, --uds, --api-key, --kv-transfer-config, --dtype) and those the context ranks "
        "cannot serve (--kv-cache-dtype, --tensor-parallel-size, --pipeline-parallel-size, "
        "--disable-hybrid-kv-cache-manager, --config).",
    )
    hybrid_kv_cache_manager: Bool = Field(
        default=True,
        description="vLLM's hybrid KV cache manager (its default with the NIXL connector); "
        "false passes --disable-hybrid-kv-cache-manager. Part of vLLM's compatibility hash: "
        "the context ranks are told the same.",
    )
    side_channel_port: Port = Field(
        default=VLLM_SIDE_CHANNEL_PORT,
        description="Port of the context ranks' side channel (vLLM's "
        "VLLM_NIXL_SIDE_CHANNEL_PORT) the vLLM servers handshake with; local rank k listens "
        "on sideChannelPort + k, on the pod's address. It authenticates no peer: the "
        "NetworkPolicy admits only the deployment's generation pods.",
    )
    staging_tokens: StagingTokens | None = Field(
        default=None,
        description="Tokens of prefilled KV each context rank holds for the vLLM servers to "
        "read: its staging buffer, in vLLM's layout (whole blocks of 128 tokens), where a "
        "request's KV waits from the end of its prefill until its vLLM server has read it. The "
        "buffer takes stagingTokens x the model's KV bytes per token of the rank's host "
        "memory, out of that memory before the KV cache pool is sized (/dwdp/status "
        "memory.kv_staging). A prefill that finds it full waits for room for up to "
        "context.kvCache.transferLeaseSeconds, then is answered 503 naming this setting "
        "(the router sends it again to other context ranks, at most once per rank; when they "
        "are all full its client gets a 500 with that message). "
        "At least context.maxModelLen (a request is staged whole); unset: the larger "
        "of context.maxModelLen (else the model's context length) and 2 x "
        "context.maxNumTokens.",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of the vLLM container; unset: spec.resources. No GPU is "
        "requested: the vLLM servers run on CPU.",
    )

    @model_validator(mode="after")
    def _check(self) -> VllmGenerationSpec:
        problems = vllm_spec_problems(self.version, self.args)
        if problems:
            raise RuleViolations(problems)
        return self


def _rules_context() -> list[dict[str, str]]:
    attached = "self.dwdp.enableDense && self.dwdp.enableExperts"
    world = "self.dwdp.dwdpSize"
    rules = [
        (f"!({attached}) || {world} > 1",
         "attached dense DWDP (enableDense with enableExperts) needs dwdp.dwdpSize > 1",
         ".dwdp.dwdpSize"),
        (f"{world} % self.ranksPerPod == 0",
         "ranksPerPod must divide the ranks of a group (dwdp.dwdpSize)", ".ranksPerPod"),
        (f"!(self.handleType in ['posixFd', 'shm']) || self.ranksPerPod == {world}",
         "handleType posixFd or shm shares stores within one host only: ranksPerPod must "
         "equal the ranks of a group (dwdp.dwdpSize)", ".ranksPerPod"),
    ]
    return worker_limit_rules(Scope.CONTEXT) + [
        cel_rule(rule, message, field_path=path) for rule, message, path in rules
    ] + [KV_TOKENS_RULE]


_ONE_RANK_SERVER = "a generation server is one rank (each rank serves one whole model)"
_KV_ONE_REQUEST = "the KV cache pool must hold one request of the longest context"
KV_TOKENS_RULE = cel_rule(
    "!has(self.maxModelLen) || !has(self.kvCache.maxTokens) || "
    "self.kvCache.maxTokens >= self.maxModelLen",
    f"kvCache.maxTokens must be at least maxModelLen: {_KV_ONE_REQUEST}",
    field_path=".kvCache.maxTokens",
)
"""The section rule a worker would otherwise refuse at start (``check_max_tokens``)."""


class _ServingSection(ApiModel):
    """Settings shared by the context and generation sections."""

    replicas: NonNegInt = Field(default=1, description="Number of servers (context: DWDP groups).")
    ranks_per_pod: PosInt = Field(
        default=1, description="GPUs (ranks) per pod; a pod runs one rank process per GPU."
    )
    transport: Transport = Field(
        default=Transport.TCP_STORE, description="tcpStore or mpi: how a server's ranks meet."
    )
    max_num_tokens: PosInt = Field(
        default=MAX_NUM_TOKENS, description="Tokens per forward pass, at most."
    )
    max_batch_size: PosInt = Field(
        default=MAX_BATCH_SIZE, description="Requests per forward pass, at most."
    )
    max_model_len: PosInt | None = Field(
        default=None,
        description="Prompt plus generated tokens of one request, at most; unset: the "
        "model's max_position_embeddings.",
    )
    kv_cache: KvCacheConfig = Field(
        default_factory=KvCacheConfig, json_schema_extra=_EMPTY_DEFAULT
    )
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra=_EMPTY_DEFAULT)

    def kv_problems(self) -> list[Problem]:
        """``kvCache.maxTokens`` below ``maxModelLen`` when the section sets both."""
        tokens, length = self.kv_cache.max_tokens, self.max_model_len
        if tokens is None or length is None or tokens >= length:
            return []
        return [
            Problem(
                ("kvCache", "maxTokens"),
                tokens,
                f"must be at least maxModelLen {length}: {_KV_ONE_REQUEST}",
            )
        ]


class ContextSpec(_ServingSection):
    """The context (prefill) servers: ``replicas`` DWDP groups, each one unit."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_rules_context))

    dwdp: DwdpConfig = Field(default_factory=DwdpConfig, json_schema_extra=_EMPTY_DEFAULT)
    handle_type: HandleType = Field(
        default=HandleType.FABRIC,
        description="fabric (multi-node NVLink), posixFd (one host) or shm (cpu backend: "
        "copyMode per_slice or batched).",
    )

    @property
    def ranks_per_group(self) -> int:
        """Ranks of one DWDP group: dwdp_size (each rank serves one whole model)."""
        return self.dwdp.dwdp_size

    @property
    def pods_per_group(self) -> int:
        """Pods of one DWDP group (ranks_per_group / ranks_per_pod)."""
        return self.ranks_per_group // self.ranks_per_pod

    def rule_problems(self) -> list[Problem]:
        """The settings this worker does not run (:mod:`dwdp.api.support`), the launch rules
        (docs/design.md §3.2) and the pod-shape rules; one problem per field, paths relative to
        context."""
        probe = LaunchConfig(
            role=Role.CONTEXT,
            model=LaunchModel(path="/"),  # the model takes no part in these rules
            transport=self.transport,
            handle_type=self.handle_type,
            dwdp=self.dwdp,
            engine=self.engine,
        )
        view = SectionView(self.transport, self.dwdp, self.handle_type, self.engine.cuda_graphs)
        problems = first_per_field(
            [*worker_limit_problems(view, Scope.CONTEXT), *launch_problems(probe)]
        )
        world = self.ranks_per_group
        if world % self.ranks_per_pod:
            problems.append(
                Problem(
                    ("ranksPerPod",),
                    self.ranks_per_pod,
                    f"must divide the {world} ranks of a group (dwdp.dwdpSize)",
                )
            )
        elif self.handle_type in (HandleType.POSIX_FD, HandleType.SHM) and (
            self.ranks_per_pod != world
        ):
            problems.append(
                Problem(
                    ("ranksPerPod",),
                    self.ranks_per_pod,
                    f"must be {world} (all ranks of a group in one pod): handleType "
                    f"{self.handle_type.value} shares stores within one host only",
                )
            )
        return problems + self.kv_problems()

    @model_validator(mode="after")
    def _check(self) -> ContextSpec:
        problems = self.rule_problems()
        if problems:
            raise RuleViolations(problems)
        return self


class GenerationSpec(_ServingSection):
    """The generation (decode) servers: dwdp servers (they never run dense DWDP), or with
    ``vllm`` unmodified vLLM servers (the dwdp engine settings then keep their defaults)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            lambda: [
                cel_rule(
                    "self.ranksPerPod == 1",
                    f"ranksPerPod must be 1: {_ONE_RANK_SERVER}",
                    field_path=".ranksPerPod",
                ),
                KV_TOKENS_RULE,
                *dwdp_only_rules(),
            ]
        )
    )

    vllm: VllmGenerationSpec | None = Field(
        default=None,
        description="Run unmodified vLLM servers (on CPU) as the generation servers, reading "
        "the context ranks' KV through vLLM's NIXL connector; unset: dwdp generation servers. "
        "Needs context.handleType shm and an explicit model.dtype (docs/vllm-fleet.md).",
    )

    @property
    def ranks_per_server(self) -> int:
        """Ranks of one generation server: 1 (each rank serves one whole model)."""
        return 1

    def rule_problems(self) -> list[Problem]:
        """The pod shape and the KV cache bound; paths relative to generation."""
        problems = []
        if self.ranks_per_pod != self.ranks_per_server:
            rule = f"must be 1: {_ONE_RANK_SERVER}"
            problems.append(Problem(("ranksPerPod",), self.ranks_per_pod, rule))
        problems += self.kv_problems()
        if self.vllm is not None:
            problems += dwdp_only_problems(self)
        return first_per_field(problems)

    @model_validator(mode="after")
    def _check(self) -> GenerationSpec:
        problems = self.rule_problems()
        if problems:
            raise RuleViolations(problems)
        return self


class RendezvousSpec(ApiModel):
    """The group rendezvous: a TCP store on pod 0 of each group."""

    port: Port = Field(default=29500, description="TCP port of the store on the group's pod 0.")
    timeout_seconds: PosInt = Field(
        default=1800, description="How long a rank waits for its peers, in seconds."
    )


class SecretKeyRef(ApiModel):
    """One key of a Secret in the deployment's namespace."""

    name: Annotated[str, DNS1123_SUBDOMAIN] = Field(
        description="Name of the Secret (a DNS-1123 subdomain)."
    )
    key: Annotated[str, SECRET_KEY] = Field(
        default="api-key",
        description="Key of the Secret's data that holds the value.",
    )


class ServerSpec(ApiModel):
    """The HTTP servers of the workers."""

    port: Port = Field(
        default=SERVER_PORT,
        description="Port of local rank 0 in a pod; local rank k serves port + k.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="A Secret key holding the API key clients must send as 'Authorization: "
        "Bearer <key>' on /v1/* of the ranks (like vLLM's --api-key) and on every path of the "
        "router but its probes; /health, /ready, /metrics and /dwdp/status stay open. Mounted "
        "as a file: a changed Secret takes effect without a restart. Unset: no key.",
    )


class RouterPolicy(enum.StrEnum):
    """How vllm-router picks a server among the context ranks (prefill) or the generation
    servers (decode): the policies of vllm-router that need nothing but the URLs."""

    ROUND_ROBIN = "round_robin"
    """Each server in turn (every committed rank gets prefill traffic)."""
    RANDOM = "random"
    """A server chosen at random."""
    CACHE_AWARE = "cache_aware"
    """The server whose prefix tree matches the prompt best, balanced by load."""
    POWER_OF_TWO = "power_of_two"
    """The less loaded of two servers chosen at random."""
    CONSISTENT_HASH = "consistent_hash"
    """A hash of the request (session affinity)."""


_ROUTER_PORTS = "metricsPort must differ from port: both listen on the router pod's address"


class RouterSpec(ApiModel):
    """The request router of disaggregated serving: vllm-router in PD mode
    (``--vllm-pd-disaggregation``), one Deployment and Service ``NAME-router``. It sends each
    request's prefill to a context rank of a committed group and its decode to a ready
    generation server; the operator lists every committed rank's URL in its arguments."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [cel_rule("self.port != self.metricsPort", _ROUTER_PORTS, field_path=".metricsPort")]
        )
    )

    enabled: Bool | None = Field(
        default=None,
        description="Run the router; unset: on when the spec has generation servers "
        "(generation.replicas > 0). True needs generation servers.",
    )
    replicas: PosInt = Field(default=1, description="Router pods.")
    port: Port = Field(
        default=ROUTER_PORT, description="Port of the router's OpenAI API (the Service's)."
    )
    metrics_port: Port = Field(
        default=29000, description="Port of the router's Prometheus metrics."
    )
    image: Annotated[str, IMAGE_REFERENCE] | None = Field(
        default=None,
        description="Router image (it runs 'dwdp router-gate', the gate that checks the API "
        "key, and the vllm-router console script behind it); unset: the worker image, which "
        "ships both.",
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="Resources of the router container."
    )
    prefill_policy: RouterPolicy = Field(
        default=RouterPolicy.ROUND_ROBIN,
        description="How a context rank is picked for a prefill: round_robin, random, "
        "cache_aware, power_of_two or consistent_hash.",
    )
    decode_policy: RouterPolicy = Field(
        default=RouterPolicy.ROUND_ROBIN,
        description="How a generation server is picked for a decode (same values).",
    )
    request_timeout_seconds: PosInt = Field(
        default=1800, description="Bound on one request through the router, in seconds."
    )

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if self.port == self.metrics_port:
            raise RuleViolations([Problem(("metricsPort",), self.metrics_port, _ROUTER_PORTS)])
        return self


class RolloutSpec(ApiModel):
    """How a new revision replaces the groups, counted in whole DWDP groups."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.maxSurge > 0 || self.maxUnavailable > 0",
                    "maxSurge and maxUnavailable cannot both be 0: the rollout could never "
                    "make progress",
                    field_path=".maxUnavailable",
                )
            ]
        )
    )

    max_surge: NonNegInt = Field(
        default=1, description="Extra new-revision groups during a rollout."
    )
    max_unavailable: NonNegInt = Field(
        default=0, description="Groups that may be missing (below replicas) during a rollout."
    )
    progress_deadline_seconds: PosInt = Field(
        default=600,
        description="A group at the current revision that has not committed this many "
        "seconds after it started (restarts included) makes Progressing False with reason "
        "ProgressDeadlineExceeded, like a Deployment's progressDeadlineSeconds; the rollout "
        "waits and old groups keep serving.",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise RuleViolations(
                [
                    Problem(
                        ("maxUnavailable",),
                        0,
                        "maxSurge and maxUnavailable cannot both be 0: the rollout could "
                        "never make progress",
                    )
                ]
            )
        return self


class FailurePolicy(ApiModel):
    """Restarts of failed groups (fail-together: a whole group restarts)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.backoffMaxSeconds >= self.backoffInitialSeconds",
                    "backoffMaxSeconds must be at least backoffInitialSeconds",
                    field_path=".backoffMaxSeconds",
                )
            ]
        )
    )

    backoff_initial_seconds: PosInt = Field(
        default=10, description="Wait before the first restart of a failed group, in seconds."
    )
    backoff_max_seconds: PosInt = Field(
        default=300, description="Upper bound of the doubling restart wait, in seconds."
    )
    restart_limit: NonNegInt | None = Field(
        default=None, description="Restarts of one group before it stays failed; unset: no limit."
    )
    scheduling_timeout_seconds: PosInt = Field(
        default=600,
        description="A group whose pods are not all scheduled by then fails, in seconds.",
    )

    @model_validator(mode="after")
    def _check(self) -> FailurePolicy:
        if self.backoff_max_seconds < self.backoff_initial_seconds:
            raise RuleViolations(
                [
                    Problem(
                        ("backoffMaxSeconds",),
                        self.backoff_max_seconds,
                        f"must be at least backoffInitialSeconds ({self.backoff_initial_seconds})",
                    )
                ]
            )
        return self


_SERVER_PORTS_RANGE = (
    "must leave room for every local rank (server.port + context.ranksPerPod - 1 at most "
    "65535): local rank k serves server.port + k"
)


_ROUTER_NEEDS_GENERATION = (
    "router.enabled needs generation servers (generation.replicas > 0): the router sends "
    "every decode to one; leave router.enabled unset to run the router only when there are some"
)


_MTP_BOTH_SIDES = (
    "the generation server's MTP layer reads its KV of a prompt from the context server that "
    "prefilled it (set mtp on both sections, or on neither)"
)


def _mtp_cel(section: str) -> str:
    """CEL: the section's ``engine.speculative.method`` is mtp."""
    s = f"self.{section}"
    return (f"(has({s}.engine) && has({s}.engine.speculative) && "
            f"has({s}.engine.speculative.method) && {s}.engine.speculative.method == 'mtp')")


_DRA_WITH_DEVICE_PLUGIN = (
    f"must not hold {DEFAULT_GPU_RESOURCE} when gpu.resourceClaimTemplateName is set: the DRA "
    "claim gives the pod its GPUs"
)


_GENERATION_TEMPLATE = (
    "is required under DRA (gpu.resourceClaimTemplateName) when there are generation servers "
    "and generation.ranksPerPod differs from context.ranksPerPod: the context template gives "
    "each pod context.ranksPerPod GPUs"
)


_VLLM_HANDLE = (
    "must be shm with generation.vllm: the context ranks stage their KV into vLLM's CPU "
    "attention layout (the one layout dwdp speaks to vLLM), so the context runs the cpu backend"
)
_VLLM_DTYPE = (
    "must be bfloat16, float16 or float32 with generation.vllm: the KV dtype is part of vLLM's "
    "compatibility hash, and vLLM's auto makes a float32 checkpoint 16-bit where dwdp keeps "
    "float32"
)
_VLLM_NO_GPU = (
    "must be unset with generation.vllm: the vLLM servers run on CPU and claim no GPU"
)
_VLLM_STAGING = "a context rank stages each request's KV whole"


def _rules_vllm() -> list[dict[str, str]]:
    """The spec-wide rules of a vLLM generation tier (``generation.vllm``)."""
    vllm = "has(self.generation) && has(self.generation.vllm)"
    return [
        cel_rule(
            f"!({vllm}) || self.context.handleType == 'shm'",
            f"context.handleType {_VLLM_HANDLE}",
            field_path=".context.handleType",
        ),
        cel_rule(
            f"!({vllm}) || self.model.dtype != 'auto'",
            f"model.dtype {_VLLM_DTYPE}",
            field_path=".model.dtype",
        ),
        cel_rule(
            f"!({vllm}) || !has(self.gpu) || !has(self.gpu.generationResourceClaimTemplateName)",
            f"gpu.generationResourceClaimTemplateName {_VLLM_NO_GPU}",
            field_path=".gpu.generationResourceClaimTemplateName",
        ),
        cel_rule(
            f"!({vllm}) || !has(self.generation.vllm.stagingTokens) || "
            "!has(self.context.maxModelLen) || "
            "self.generation.vllm.stagingTokens >= self.context.maxModelLen",
            f"generation.vllm.stagingTokens must be at least context.maxModelLen: {_VLLM_STAGING}",
            field_path=".generation.vllm.stagingTokens",
        ),
        *side_channel_cel(),
    ]


def _rules_spec() -> list[dict[str, str]]:
    plugin = f"'{DEFAULT_GPU_RESOURCE}'"
    return [
        cel_rule(
            "!has(self.gpu) || !has(self.gpu.resourceClaimTemplateName) || "
            "has(self.gpu.generationResourceClaimTemplateName) || !has(self.generation) || "
            "has(self.generation.vllm) || self.generation.replicas == 0 || "
            "self.generation.ranksPerPod == self.context.ranksPerPod",
            f"gpu.generationResourceClaimTemplateName {_GENERATION_TEMPLATE}",
            field_path=".gpu.generationResourceClaimTemplateName",
        ),
        cel_rule(
            "!has(self.gpu) || !has(self.gpu.resourceClaimTemplateName) || !has(self.resources)"
            f" || ((!has(self.resources.limits) || !({plugin} in self.resources.limits)) && "
            f"(!has(self.resources.requests) || !({plugin} in self.resources.requests)))",
            f"resources {_DRA_WITH_DEVICE_PLUGIN}",
            field_path=".resources",
        ),
        cel_rule(
            "self.server.port + self.context.ranksPerPod - 1 <= 65535",
            f"server.port {_SERVER_PORTS_RANGE}",
            field_path=".server.port",
        ),
        cel_rule(
            "self.rendezvous.port < self.server.port || "
            "self.rendezvous.port >= self.server.port + self.context.ranksPerPod",
            "rendezvous.port must not be one of the server ports (server.port up to "
            "server.port + context.ranksPerPod - 1)",
            field_path=".rendezvous.port",
        ),
        cel_rule(
            "!has(self.router) || !has(self.router.enabled) || !self.router.enabled || "
            "(has(self.generation) && self.generation.replicas > 0)",
            _ROUTER_NEEDS_GENERATION,
            field_path=".router.enabled",
        ),
        *_rules_vllm(),
        *_rules_mtp(),
    ]


def _rules_mtp() -> list[dict[str, str]]:
    """MTP drafts on both sides of the KV transfer or on neither (``_mtp_problems``)."""
    dwdp_generation = ("has(self.generation) && !has(self.generation.vllm) && "
                       "self.generation.replicas > 0")
    context, generation = _mtp_cel("context"), _mtp_cel("generation")
    return [
        cel_rule(
            f"!({dwdp_generation}) || !{generation} || {context}",
            f"generation.engine.speculative.method mtp needs context.engine.speculative.method "
            f"mtp: {_MTP_BOTH_SIDES}",
            field_path=".generation.engine.speculative.method",
        ),
        cel_rule(
            f"!({dwdp_generation}) || !{context} || {generation}",
            f"context.engine.speculative.method mtp needs generation.engine.speculative.method "
            f"mtp: {_MTP_BOTH_SIDES}",
            field_path=".context.engine.speculative.method",
        ),
    ]


class DwdpDeploymentSpec(ApiModel):
    """What to run: the model, the worker image, context DWDP groups, generation servers."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_rules_spec))

    model: ModelSpec
    image: Annotated[str, IMAGE_REFERENCE] = Field(description="Worker container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Always, IfNotPresent or Never."
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None,
        max_length=16,
        description="Secrets (kubernetes.io/dockerconfigjson, in the deployment's namespace) "
        "the worker pods pull their image with, and the router pods when they run the worker "
        "image (router.image unset).",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of each worker container (context and generation pods). A "
        "memory limit also bounds the ranks' host memory: they read it as DWDP_MEMORY_LIMIT.",
    )
    node_selector: dict[LabelKey, LabelValue] | None = Field(
        default=None, max_length=64, description="Node labels every worker pod requires."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Tolerations of every worker pod."
    )
    affinity: Affinity | None = Field(
        default=None,
        description="Node affinity, pod affinity and pod anti-affinity of every worker pod.",
    )
    gpu: GpuSpec = Field(
        default_factory=GpuSpec,
        json_schema_extra=_EMPTY_DEFAULT,
        description="How each worker pod gets its ranksPerPod GPUs: the device plugin's "
        "resource (default nvidia.com/gpu) or DRA ResourceClaimTemplates (the generation pods' "
        "own when their GPU count differs from the context pods').",
    )
    env: list[EnvVar] | None = Field(
        default=None, max_length=128, description="Extra environment variables of every worker."
    )
    security_context: SecurityContext = Field(
        default_factory=SecurityContext,
        json_schema_extra=_EMPTY_DEFAULT,
        description="Security context of every worker container; a field set here replaces "
        "only that field's restrictive default.",
    )
    pod_security_context: PodSecurityContext = Field(
        default_factory=PodSecurityContext,
        json_schema_extra=_EMPTY_DEFAULT,
        description="Security context of every worker pod (user, groups, seccomp).",
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        json_schema_extra=_EMPTY_DEFAULT,
        description="The NetworkPolicies of the worker pods (opt-out).",
    )
    context: ContextSpec = Field(description="The context (prefill) servers: DWDP groups.")
    generation: GenerationSpec | None = Field(
        default=None, description="The generation (decode) servers; unset: none."
    )
    rendezvous: RendezvousSpec = Field(
        default_factory=RendezvousSpec, json_schema_extra=_EMPTY_DEFAULT
    )
    server: ServerSpec = Field(default_factory=ServerSpec, json_schema_extra=_EMPTY_DEFAULT)
    router: RouterSpec = Field(
        default_factory=RouterSpec,
        json_schema_extra=_EMPTY_DEFAULT,
        description="The vllm-router in front of the context and generation servers.",
    )
    graceful_shutdown_timeout_seconds: PosInt | None = Field(
        default=None,
        description="Bound on a server's graceful stop, in seconds (a positive integer); "
        "unset: no bound.",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=_EMPTY_DEFAULT)
    failure_policy: FailurePolicy = Field(
        default_factory=FailurePolicy, json_schema_extra=_EMPTY_DEFAULT
    )

    @property
    def router_enabled(self) -> bool:
        """The operator runs the router: ``router.enabled``, or when unset, generation
        servers exist (``generation.replicas > 0``)."""
        if self.router.enabled is not None:
            return self.router.enabled
        return self.generation is not None and self.generation.replicas > 0

    def _gpu_problems(self) -> list[Problem]:
        """The rules of a DRA claim (``gpu.resourceClaimTemplateName``): ``resources`` must
        not name the device plugin's GPU, and generation servers whose pods hold another GPU
        count than the context pods need a template of their own
        (``gpu.generationResourceClaimTemplateName``)."""
        gpu = self.gpu
        if gpu.resource_claim_template_name is None:
            return []
        problems = []
        gen, ranks = self.generation, self.context.ranks_per_pod
        if (
            gen is not None
            and gen.vllm is None
            and gen.replicas > 0
            and gen.ranks_per_pod != ranks
            and gpu.generation_resource_claim_template_name is None
        ):
            counts = f"(here {ranks}, generation.ranksPerPod {gen.ranks_per_pod})"
            rule = f"{_GENERATION_TEMPLATE} {counts}"
            problems.append(Problem(("gpu", "generationResourceClaimTemplateName"), UNSET, rule))
        parts = () if self.resources is None else ("limits", "requests")
        held = {
            part: values
            for part in parts
            if DEFAULT_GPU_RESOURCE in (values := getattr(self.resources, part) or {})
        }
        if held:
            problems.append(Problem(("resources",), held, _DRA_WITH_DEVICE_PLUGIN))
        return problems

    @property
    def vllm(self) -> VllmGenerationSpec | None:
        """``generation.vllm``: the generation servers are vLLM's (None: dwdp's, or none)."""
        return None if self.generation is None else self.generation.vllm

    def _vllm_problems(self) -> list[Problem]:
        """The spec-wide rules of a vLLM generation tier (none without one)."""
        vllm = self.vllm
        if vllm is None:
            return []
        problems = []
        if self.context.handle_type is not HandleType.SHM:
            handle = self.context.handle_type.value
            problems.append(Problem(("context", "handleType"), handle, _VLLM_HANDLE))
        if self.model.dtype == "auto":
            problems.append(Problem(("model", "dtype"), "auto", _VLLM_DTYPE))
        claim = self.gpu.generation_resource_claim_template_name
        if claim is not None:
            path = ("gpu", "generationResourceClaimTemplateName")
            problems.append(Problem(path, claim, _VLLM_NO_GPU))
        ports = side_channel_problems(
            vllm.side_channel_port,
            ranks_per_pod=self.context.ranks_per_pod,
            server_port=self.server.port,
            rendezvous_port=self.rendezvous.port,
        )
        return problems + [p.under(("generation", "vllm")) for p in ports] + (
            self._staging_problems(vllm.staging_tokens))

    def _staging_problems(self, tokens: int | None) -> list[Problem]:
        """``generation.vllm.stagingTokens`` below ``context.maxModelLen`` when both are set
        (a context rank would refuse it at start: ``resolve_kv_staging``)."""
        length = self.context.max_model_len
        if tokens is None or length is None or tokens >= length:
            return []
        rule = f"must be at least context.maxModelLen {length}: {_VLLM_STAGING}"
        return [Problem(("generation", "vllm", "stagingTokens"), tokens, rule)]

    def _mtp_problems(self) -> list[Problem]:
        """MTP drafts on one side of the KV transfer only (dwdp generation servers): the
        context servers' KV layout would differ from the generation servers'."""
        generation = self.generation
        if generation is None or generation.vllm is not None or generation.replicas == 0:
            return []
        sides = {"context": self.context.engine, "generation": generation.engine}
        mtp = {name: e.speculative is not None and e.speculative.method == "mtp"
               for name, e in sides.items()}
        if mtp["context"] == mtp["generation"]:
            return []
        this, other = ("context", "generation") if mtp["context"] else ("generation", "context")
        rule = f"needs {other}.engine.speculative.method mtp too: {_MTP_BOTH_SIDES}"
        return [Problem((this, "engine", "speculative", "method"), "mtp", rule)]

    @model_validator(mode="after")
    def _check(self) -> DwdpDeploymentSpec:
        problems = self._vllm_problems() + self._mtp_problems()
        rdv, first = self.rendezvous.port, self.server.port
        last = first + self.context.ranks_per_pod - 1
        if last > 65535:
            problems.append(Problem(("server", "port"), first, _SERVER_PORTS_RANGE))
        if first <= rdv <= last:
            problems.append(
                Problem(
                    ("rendezvous", "port"),
                    rdv,
                    f"must not be one of the server ports {first}..{last} (server.port "
                    "up to server.port + context.ranksPerPod - 1)",
                )
            )
        problems += self._gpu_problems()
        generation = self.generation is not None and self.generation.replicas > 0
        if self.router.enabled and not generation:
            problems.append(Problem(("router", "enabled"), True, _ROUTER_NEEDS_GENERATION))
        if problems:
            raise RuleViolations(problems)
        return self


# --------------------------------------------------------------------------- status


class DeploymentPhase(enum.StrEnum):
    """Values of ``status.phase``."""

    PENDING = "Pending"
    """Accepted; no group has started yet."""
    PROGRESSING = "Progressing"
    """Groups are starting or a rollout is under way."""
    READY = "Ready"
    """Every desired group committed and serves."""
    DEGRADED = "Degraded"
    """Some groups serve, others are failing or restarting."""
    FAILED = "Failed"
    """No group serves and restarts are exhausted, or the spec cannot run."""


class GroupPhase(enum.StrEnum):
    """Values of ``status.groups[].phase`` (one DWDP group incarnation); the operator
    writes exactly these (``dwdp.operator.constants.GroupPhase`` is this enum)."""

    PENDING = "Pending"
    """Not every pod exists yet, or a pod's containers have not started."""
    SCHEDULING = "Scheduling"
    """Some pod is not bound to a node yet."""
    RENDEZVOUS = "Rendezvous"
    """Every pod runs; ranks are meeting (or have not reported yet)."""
    SETTING_UP = "SettingUp"
    """Ranks report model load or DWDP setup, not all committed."""
    SERVING = "Serving"
    """Every rank committed with one revision and layout digest; the gate is open."""
    FAILED = "Failed"
    """A pod or rank of the incarnation failed (or it is out of restarts)."""
    RESTARTING = "Restarting"
    """The failed incarnation is being replaced by the next one (after its backoff)."""
    DRAINING = "Draining"
    """Removed from traffic and being deleted (scale-down or rollout)."""


class _StatusModel(ApiModel):
    """Status models keep fields they do not know (the operator's bookkeeping)."""

    model_config = ConfigDict(extra="allow")


class Condition(_StatusModel):
    """A standard condition (types Ready, Progressing, Degraded)."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(default=None, max_length=1024)
    message: str | None = Field(default=None, max_length=32768)
    last_transition_time: str | None = Field(default=None, max_length=64)
    observed_generation: int | None = None


class FailureRecord(_StatusModel):
    """The last failure of a group: where it failed and why."""

    phase: str = Field(max_length=128, description="Phase that failed (e.g. rendezvous, P4).")
    message: str = Field(default="", max_length=32768)
    reason: str | None = Field(default=None, max_length=128, description="Classified failure.")
    time: str | None = Field(default=None, max_length=64)


class GroupStatus(_StatusModel):
    """One DWDP group as the operator sees it."""

    name: str = Field(max_length=253)
    revision: str = Field(default="", max_length=128)
    incarnation: int = 0
    phase: str = Field(
        default="Pending", max_length=64, description="One of: " + ", ".join(GroupPhase) + "."
    )
    ranks_ready: int = 0
    ranks_total: int = 0
    layout_digest: str | None = Field(default=None, max_length=256)
    leaks: int = 0
    restarts: int = 0
    last_failure: FailureRecord | None = None
    rank_starts: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None,
        max_length=4096,
        description="Start ids of the rank processes that committed, by rank: a rank "
        "answering with another one was restarted in place and fails the group.",
    )
    started_at: str | None = Field(
        default=None,
        max_length=64,
        description="When the group started at its revision (RFC 3339); restarts at the "
        "same revision keep it (the progress deadline counts from it).",
    )


class GenerationStatus(_StatusModel):
    """The generation servers."""

    replicas: int = 0
    ready_replicas: int = 0
    next_index: int | None = Field(
        default=None,
        description="Index of the next generation server (indices only grow: names are "
        "never reused).",
    )


class RouterStatus(_StatusModel):
    """The router (vllm-router) as the operator last saw it."""

    replicas: int = Field(
        default=0, description="Router pods wanted (0 until a group commits and a generation "
        "server is ready: the router starts only with servers to route to)."
    )
    ready_replicas: int = Field(default=0, description="Router pods Ready.")
    prefill_servers: int = Field(
        default=0, description="Context rank URLs the router sends prefills to."
    )
    decode_servers: int = Field(
        default=0, description="Generation server URLs the router sends decodes to."
    )
    endpoint: str | None = Field(
        default=None, max_length=1024, description="The router's URL (its Service)."
    )


class DwdpDeploymentStatus(_StatusModel):
    """What the operator observed; written through the status subresource only."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    phase: str | None = Field(default=None, max_length=64, description="One of DeploymentPhase.")
    conditions: list[Condition] | None = Field(default=None, max_length=16)
    observed_generation: int | None = None
    replicas: int = Field(default=0, description="Context groups that exist, in any phase.")
    ready_groups: int = Field(default=0, description="Context groups committed and serving.")
    updated_groups: int = Field(
        default=0, description="Context groups at the current revision, in any phase."
    )
    next_group_index: int | None = Field(
        default=None,
        description="Index of the next context group: indices only grow over the "
        "deployment's life, so two group lifetimes never share a name (pods, events, metrics).",
    )
    selector: str | None = Field(
        default=None, max_length=1024, description="Label selector of the context pods (scale)."
    )
    revision: str | None = Field(default=None, max_length=128, description="Current spec revision.")
    groups: list[GroupStatus] | None = Field(default=None, max_length=1024)
    generation: GenerationStatus | None = None
    endpoint: str | None = Field(default=None, max_length=1024, description="Client-facing URL.")
    router: RouterStatus | None = Field(
        default=None, description="The router, when the operator runs one."
    )


# --------------------------------------------------------------------------- object


class ObjectMeta(ApiModel):
    """The metadata fields this API reads; the others are kept as they are."""

    model_config = ConfigDict(extra="allow")

    name: str | None = Field(default=None, max_length=253)
    generate_name: str | None = Field(default=None, max_length=253)
    namespace: str | None = Field(default=None, max_length=63)
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @model_validator(mode="after")
    def _check(self) -> ObjectMeta:
        if self.name is None:
            if self.generate_name is None:
                raise RuleViolations(
                    [Problem(("name",), None, "is required (or generateName)")]
                )
            return self
        problems = DEPLOYMENT_NAME.problems(self.name, ("name",))
        if problems:
            raise RuleViolations(problems)
        return self


class DwdpDeployment(ApiModel):
    """A DwdpDeployment object (apiVersion ``dwdp.io/v1alpha1``)."""

    api_version: Literal["dwdp.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["DwdpDeployment"]
    metadata: ObjectMeta
    spec: DwdpDeploymentSpec
    status: DwdpDeploymentStatus | None = None


# --------------------------------------------------------------------------- functions


def deployment_problems(data: object) -> list[Problem]:
    """Every rule a DwdpDeployment document breaks (empty when valid).

    ``data`` is the parsed YAML/JSON mapping. Paths are camelCase from the document root.
    """
    if not isinstance(data, Mapping):
        return [Problem((), data, "a DwdpDeployment must be a mapping of fields")]
    return all_problems(DwdpDeployment, data)


def parse_deployment(data: object) -> DwdpDeployment:
    """Validate a DwdpDeployment document.

    Raises:
        DwdpValidationError: listing every problem (field path, value, rule).
    """
    problems = deployment_problems(data)
    if problems:
        raise DwdpValidationError(problems, subject="DwdpDeployment")
    return DwdpDeployment.model_validate(data, by_name=False)


def launch_config_for(
    spec: DwdpDeploymentSpec, role: Role, *, model_path: str | None = None
) -> LaunchConfig:
    """The launch configuration a worker of ``role`` gets from ``spec``.

    Args:
        spec: a validated spec.
        role: ``Role.CONTEXT`` (the context section, with its DwdpConfig) or
            ``Role.GENERATION`` (the generation section, default DwdpConfig).
        model_path: the checkpoint path inside the worker, if it differs from
            ``spec.model.path``.

    Raises:
        ValueError: for the generation role when the spec has no generation section or its
            servers are vLLM's (``generation.vllm``), or for ``Role.AGGREGATED`` (the spec has
            no such section).
    """
    if role is Role.CONTEXT:
        section: _ServingSection = spec.context
        dwdp = spec.context.dwdp
        handle = spec.context.handle_type
    elif role is Role.GENERATION:
        if spec.generation is None:
            raise ValueError("the spec has no generation section")
        if spec.vllm is not None:
            raise ValueError("the generation servers are vLLM's: they read no launch config")
        section, dwdp, handle = spec.generation, DwdpConfig(), HandleType.FABRIC
    else:
        raise ValueError(f"no section of a DwdpDeployment has the role {role.value}")
    return LaunchConfig(
        role=role,
        model=LaunchModel(
            path=model_path or spec.model.path,
            architecture=spec.model.architecture,
            served_name=spec.model.served_name,
            dtype=spec.model.dtype,
        ),
        transport=section.transport,
        handle_type=handle,
        dwdp=dwdp,
        gracefulShutdownTimeoutSeconds=spec.graceful_shutdown_timeout_seconds,
        max_num_tokens=section.max_num_tokens,
        max_batch_size=section.max_batch_size,
        max_model_len=section.max_model_len,
        kv_cache=section.kv_cache,
        engine=section.engine,
        server_port=spec.server.port,
        kv_transfer=_kv_transfer(spec, role, model_path or spec.model.path),
    )


def _kv_transfer(spec: DwdpDeploymentSpec, role: Role, model_path: str) -> KvTransferConfig:
    """Who reads the KV of a context rank: with ``generation.vllm`` vLLM's NIXL connector, its
    ``model`` the path the vLLM servers are started with (the same mounted checkpoint,
    ``model_path``); otherwise (and for any other role) dwdp generation servers."""
    vllm = spec.vllm
    if role is not Role.CONTEXT or vllm is None:
        return KvTransferConfig()
    connector = VllmConnectorConfig(
        version=vllm.version,
        side_channel_port=vllm.side_channel_port,
        model=model_path,
        hybrid_kv_cache_manager=vllm.hybrid_kv_cache_manager,
        staging_tokens=vllm.staging_tokens,
    )
    return KvTransferConfig(vllm=connector)
