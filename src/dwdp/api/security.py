"""Pod hardening settings of a DwdpDeployment: security contexts and the NetworkPolicy.

The fields are the Kubernetes core API's (``SecurityContext``, ``PodSecurityContext``,
``NetworkPolicyPeer``), a typed subset, with restrictive defaults: no privilege
escalation, every capability dropped, a read-only root filesystem, a non-root user,
``seccompProfile: RuntimeDefault``, and a NetworkPolicy per deployment. A field the spec
sets replaces that field's default only (the apiserver fills the others), so
``readOnlyRootFilesystem: false`` keeps the rest restrictive.

Why nothing needs a capability: the ranks of a pod share the DWDP stores as POSIX file
descriptors passed over a Unix socket (``SCM_RIGHTS``), and fabric handles come through
the IMEX channel device a DRA claim gives the pod; neither needs ``CAP_SYS_PTRACE``,
``CAP_IPC_LOCK`` or host IPC. Kubernetes' own rules that the apiserver or the kubelet would
enforce late (``privileged`` with ``allowPrivilegeEscalation: false``, ``runAsNonRoot`` with
``runAsUser: 0``, a Localhost seccomp profile without its file) are refused here, before
any pod exists.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from dwdp.api.base import ApiModel, Bool, cel_rule, cel_rules
from dwdp.api.errors import UNSET, Problem, RuleViolations
from dwdp.api.names import CIDR, LINUX_CAPABILITY

__all__ = [
    "Capabilities",
    "IpBlock",
    "LabelSelector",
    "LabelSelectorRequirement",
    "NetworkPolicyPeer",
    "NetworkPolicySpec",
    "PodSecurityContext",
    "SeccompProfile",
    "SecurityContext",
]

_EMPTY_DEFAULT: dict = {"default": {}}

CapabilityName = Annotated[str, LINUX_CAPABILITY]
"""A Linux capability as Kubernetes writes it (``NET_ADMIN``, ``CAP_NET_ADMIN``, ``ALL``)."""
Id = Annotated[int, Field(strict=True, ge=0, le=2147483647)]
"""A user or group id."""
Cidr = Annotated[str, CIDR]
"""An IPv4 or IPv6 CIDR (``10.0.0.0/8``)."""
_LABEL_KEY = Annotated[str, Field(min_length=1, max_length=316)]
_LABEL_VALUE = Annotated[str, Field(max_length=63)]


class Capabilities(ApiModel):
    """Linux capabilities added to and dropped from the container's set."""

    add: list[CapabilityName] = Field(
        default=[], max_length=64, description="Capabilities to add (default none)."
    )
    drop: list[CapabilityName] = Field(
        default=["ALL"],
        max_length=64,
        description="Capabilities to drop (default ALL).",
    )


_PROFILE_PATH_RULE = (
    "localhostProfile is a path relative to the kubelet's seccomp folder (no leading '/', "
    "no '..'); whether the file exists on the node is checked only when the pod starts"
)


class SeccompProfile(ApiModel):
    """The seccomp filter of the pod's containers."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.type == 'Localhost' ? has(self.localhostProfile) "
                    ": !has(self.localhostProfile)",
                    "localhostProfile is required with type Localhost and must be unset otherwise",
                    field_path=".localhostProfile",
                ),
                cel_rule(
                    "!has(self.localhostProfile) || (!self.localhostProfile.startsWith('/') "
                    "&& !self.localhostProfile.contains('..'))",
                    _PROFILE_PATH_RULE,
                    field_path=".localhostProfile",
                ),
            ]
        )
    )

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        default="RuntimeDefault",
        description="RuntimeDefault (the container runtime's filter), Localhost or Unconfined.",
    )
    localhost_profile: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="Profile file under the kubelet's seccomp folder (type Localhost only).",
    )

    @model_validator(mode="after")
    def _check(self) -> SeccompProfile:
        path = self.localhost_profile
        if path is not None and (path.startswith("/") or ".." in path):
            raise RuleViolations([Problem(("localhostProfile",), path, _PROFILE_PATH_RULE)])
        if (self.type == "Localhost") != (self.localhost_profile is not None):
            raise RuleViolations(
                [
                    Problem(
                        ("localhostProfile",),
                        self.localhost_profile,
                        "localhostProfile is required with type Localhost and must be unset "
                        "otherwise",
                    )
                ]
            )
        return self


_PRIVILEGED_RULE = (
    "privileged: true needs allowPrivilegeEscalation: true (a privileged container can always "
    "escalate; Kubernetes refuses the pair)"
)


class SecurityContext(ApiModel):
    """The security context of every worker container (Kubernetes ``SecurityContext``)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "!self.privileged || self.allowPrivilegeEscalation",
                    _PRIVILEGED_RULE,
                    field_path=".allowPrivilegeEscalation",
                )
            ]
        )
    )

    allow_privilege_escalation: Bool = Field(
        default=False, description="Whether a process may gain privileges (setuid, file caps)."
    )
    privileged: Bool = Field(default=False, description="Run the container privileged.")
    read_only_root_filesystem: Bool = Field(
        default=True,
        description="Mount the image read-only; the pod writes only to its /tmp and "
        "/dev/shm volumes (emptyDirs the operator adds).",
    )
    capabilities: Capabilities = Field(
        default_factory=Capabilities, json_schema_extra=_EMPTY_DEFAULT
    )

    @model_validator(mode="after")
    def _check(self) -> SecurityContext:
        if self.privileged and not self.allow_privilege_escalation:
            raise RuleViolations([Problem(("allowPrivilegeEscalation",), False, _PRIVILEGED_RULE)])
        return self


_ROOT_RULE = "runAsUser 0 is root, which runAsNonRoot: true forbids (the kubelet refuses the pod)"


class PodSecurityContext(ApiModel):
    """The security context of every worker pod (Kubernetes ``PodSecurityContext``)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "!self.runAsNonRoot || !has(self.runAsUser) || self.runAsUser != 0",
                    _ROOT_RULE,
                    field_path=".runAsUser",
                )
            ]
        )
    )

    run_as_non_root: Bool = Field(
        default=True, description="The kubelet refuses to start a container as root."
    )
    run_as_user: Id | None = Field(
        default=1000, description="User id of the containers' processes (default 1000)."
    )
    run_as_group: Id | None = Field(
        default=1000, description="Primary group id of the containers' processes (default 1000)."
    )
    fs_group: Id | None = Field(
        default=1000,
        description="Group that owns the pod's volumes (the mounted Secrets and ConfigMaps "
        "become readable to it; default 1000).",
    )
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] = Field(
        default="OnRootMismatch",
        description="OnRootMismatch (change ownership only when the volume's root differs; "
        "fast on a large model volume) or Always.",
    )
    supplemental_groups: list[Id] | None = Field(
        default=None, max_length=32, description="Further group ids of the processes."
    )
    seccomp_profile: SeccompProfile = Field(
        default_factory=SeccompProfile, json_schema_extra=_EMPTY_DEFAULT
    )

    @model_validator(mode="after")
    def _check(self) -> PodSecurityContext:
        if self.run_as_non_root and self.run_as_user == 0:
            raise RuleViolations([Problem(("runAsUser",), 0, _ROOT_RULE)])
        return self


_VALUES_RULE = "In and NotIn need at least one value; Exists and DoesNotExist take none"


class LabelSelectorRequirement(ApiModel):
    """One ``matchExpressions`` entry of a label selector."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "(self.operator in ['In', 'NotIn']) == "
                    "(has(self.values) && size(self.values) > 0)",
                    _VALUES_RULE,
                    field_path=".values",
                )
            ]
        )
    )

    key: _LABEL_KEY = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[_LABEL_VALUE] | None = Field(
        default=None, max_length=64, description="Values (In and NotIn only, at least one)."
    )

    @model_validator(mode="after")
    def _check(self) -> LabelSelectorRequirement:
        needs = self.operator in ("In", "NotIn")
        if needs != bool(self.values):
            raise RuleViolations([Problem(("values",), self.values, _VALUES_RULE)])
        return self


class LabelSelector(ApiModel):
    """A Kubernetes label selector (``matchLabels`` and ``matchExpressions`` both hold)."""

    match_labels: dict[_LABEL_KEY, _LABEL_VALUE] | None = Field(
        default=None, max_length=64, description="Labels the object must carry."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=32, description="Set-based requirements."
    )


class IpBlock(ApiModel):
    """Addresses outside the cluster (a CIDR, minus exceptions)."""

    cidr: Cidr = Field(description="A CIDR such as 10.0.0.0/8.")
    except_: list[Cidr] | None = Field(
        default=None, alias="except", max_length=32, description="CIDRs left out."
    )


_PEER_RULE = (
    "a peer is either ipBlock or podSelector/namespaceSelector (at least one of them), as in "
    "a NetworkPolicy"
)


class NetworkPolicyPeer(ApiModel):
    """A source allowed to reach the serving ports (Kubernetes ``NetworkPolicyPeer``)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "has(self.ipBlock) ? !has(self.podSelector) && !has(self.namespaceSelector) "
                    ": has(self.podSelector) || has(self.namespaceSelector)",
                    _PEER_RULE,
                )
            ]
        )
    )

    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods (in the deployment's namespace unless namespaceSelector)."
    )
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces whose pods (podSelector) may connect."
    )
    ip_block: IpBlock | None = Field(default=None, description="Addresses (no selectors then).")

    @model_validator(mode="after")
    def _check(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if (self.ip_block is not None) == selectors:
            raise RuleViolations([Problem((), UNSET, _PEER_RULE)])
        return self


class NetworkPolicySpec(ApiModel):
    """The NetworkPolicies the operator makes (opt-out).

    One per deployment: its worker pods accept traffic on the serving ports only (from
    ``servingFrom``, default any source). One per group: the pods of that group reach each
    other on every port (the rendezvous store, and NCCL/MPI/UCX, which use ephemeral
    ports); no other pod reaches a group's rendezvous port. Enforced by the cluster's
    network plugin (Calico, Cilium, ...); a cluster without one ignores them.
    """

    enabled: Bool = Field(default=True, description="Create the NetworkPolicies.")
    serving_from: list[NetworkPolicyPeer] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="Sources allowed on the serving ports (routers, clients, Prometheus), at "
        "least one; unset: any source. The operator's own namespace is added when the "
        "operator runs in a pod (POD_NAMESPACE, set by the chart): it reads /dwdp/status.",
    )
