"""Where the worker pods run, what they pull with and how they get their GPUs.

The fields are the Kubernetes core API's, a typed subset: ``LocalObjectReference`` for the
image pull Secrets, ``Affinity`` (``nodeAffinity``, ``podAffinity``, ``podAntiAffinity``
with their standard sub-structure), checked with the rules the apiserver applies to a pod
(an operator's values, weights 1..100, a topology key), so a bad term is refused on the
DwdpDeployment and not later, when the operator creates pods. :class:`GpuSpec` says how a
worker pod gets its ``ranksPerPod`` GPUs: as the device plugin's extended resource (default
``nvidia.com/gpu``), or through Dynamic Resource Allocation from a ResourceClaimTemplate of
the deployment's namespace (the generation pods from one of their own when set). The name
fields take their format and its plain-words rule from :mod:`dwdp.api.names`. Every model
here turns into a schema of the CRD with the same rules as CEL (:mod:`dwdp.api.crd`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from dwdp.api.base import ApiModel, cel_rule, cel_rules
from dwdp.api.enums import Role
from dwdp.api.errors import Problem, RuleViolations
from dwdp.api.names import DNS1123_LABEL, DNS1123_SUBDOMAIN, EXTENDED_RESOURCE_NAME, QUALIFIED_NAME
from dwdp.api.security import LabelSelector

__all__ = [
    "DEFAULT_GPU_RESOURCE",
    "Affinity",
    "GpuSpec",
    "LocalObjectReference",
    "NodeAffinity",
    "NodeSelector",
    "NodeSelectorFieldRequirement",
    "NodeSelectorRequirement",
    "NodeSelectorTerm",
    "PodAffinity",
    "PodAffinityTerm",
    "PodAntiAffinity",
    "PreferredSchedulingTerm",
    "WeightedPodAffinityTerm",
]

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource NVIDIA's device plugin advertises, one per GPU."""

SubdomainName = Annotated[str, DNS1123_SUBDOMAIN]
NamespaceName = Annotated[str, DNS1123_LABEL]
QualifiedName = Annotated[str, QUALIFIED_NAME]
LabelValue = Annotated[str, Field(max_length=63)]
Weight = Annotated[int, Field(strict=True, ge=1, le=100)]
"""A preference's weight, 1..100 (the scheduler adds the weights of the terms a node meets)."""


class LocalObjectReference(ApiModel):
    """An object of the deployment's namespace, by name (Kubernetes
    ``LocalObjectReference``)."""

    name: SubdomainName = Field(description="Name of the object (a DNS-1123 subdomain).")


# --------------------------------------------------------------------------- node affinity

_NODE_VALUES_RULE = (
    "In and NotIn need at least one value, Gt and Lt exactly one (an integer), Exists and "
    "DoesNotExist none"
)
_INTEGER = r"^-?[0-9]{1,18}$"


class NodeSelectorRequirement(ApiModel):
    """One ``matchExpressions`` entry of a node selector term: a node label, an operator
    and values."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "self.operator in ['In', 'NotIn'] ? has(self.values) && size(self.values) > 0"
                    " : self.operator in ['Gt', 'Lt'] ? has(self.values) && "
                    f"size(self.values) == 1 && self.values[0].matches('{_INTEGER}')"
                    " : !has(self.values) || size(self.values) == 0",
                    _NODE_VALUES_RULE,
                    field_path=".values",
                )
            ]
        )
    )

    key: QualifiedName = Field(description="Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt (Gt and Lt compare the label "
        "as an integer)."
    )
    values: list[LabelValue] | None = Field(
        default=None,
        max_length=64,
        description="Values: at least one for In and NotIn, exactly one integer for Gt and "
        "Lt, none for Exists and DoesNotExist.",
    )

    @model_validator(mode="after")
    def _check(self) -> NodeSelectorRequirement:
        values = self.values or []
        if self.operator in ("In", "NotIn"):
            ok = bool(values)
        elif self.operator in ("Gt", "Lt"):
            ok = len(values) == 1 and _is_integer(values[0])
        else:
            ok = not values
        if not ok:
            raise RuleViolations([Problem(("values",), self.values, _NODE_VALUES_RULE)])
        return self


def _is_integer(text: str) -> bool:
    digits = text.removeprefix("-")
    return 1 <= len(digits) <= 18 and digits.isascii() and digits.isdigit()


class NodeSelectorFieldRequirement(ApiModel):
    """One ``matchFields`` entry of a node selector term: the node's name (the only node
    field Kubernetes selects by), In or NotIn one name."""

    key: Literal["metadata.name"] = Field(description="metadata.name (the node's name).")
    operator: Literal["In", "NotIn"] = Field(description="In or NotIn.")
    values: list[SubdomainName] = Field(
        min_length=1, max_length=1, description="Exactly one node name."
    )


class NodeSelectorTerm(ApiModel):
    """Node requirements that must all hold (an empty term matches no node)."""

    match_expressions: list[NodeSelectorRequirement] | None = Field(
        default=None, max_length=16, description="Requirements on node labels."
    )
    match_fields: list[NodeSelectorFieldRequirement] | None = Field(
        default=None, max_length=4, description="Requirements on node fields (the name)."
    )


class NodeSelector(ApiModel):
    """Node selector terms, any one of which a node must meet."""

    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1, max_length=8, description="The terms (ORed), at least one."
    )


class PreferredSchedulingTerm(ApiModel):
    """A node preference: nodes meeting ``preference`` score ``weight`` more."""

    weight: Weight = Field(description="Weight of the preference, 1..100.")
    preference: NodeSelectorTerm = Field(description="The node requirements preferred.")


class NodeAffinity(ApiModel):
    """Which nodes the worker pods may run on, or prefer (Kubernetes ``NodeAffinity``)."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes a pod may be scheduled on, only."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = (
        Field(default=None, max_length=16, description="Nodes preferred, by weight.")
    )


# --------------------------------------------------------------------------- pod affinity


class PodAffinityTerm(ApiModel):
    """Pods (by labels, in namespaces) whose topology domain a pod joins or avoids: the
    nodes sharing the value of label ``topologyKey``."""

    label_selector: LabelSelector | None = Field(
        default=None, description="The pods the term refers to; unset: none."
    )
    namespaces: list[NamespaceName] | None = Field(
        default=None,
        max_length=16,
        description="Namespaces of those pods; unset (and no namespaceSelector): the "
        "deployment's.",
    )
    namespace_selector: LabelSelector | None = Field(
        default=None,
        description="Namespaces of those pods by label (an empty selector: every namespace).",
    )
    topology_key: QualifiedName = Field(
        description="Node label whose value is the domain (kubernetes.io/hostname: a node, "
        "topology.kubernetes.io/zone: a zone)."
    )


class WeightedPodAffinityTerm(ApiModel):
    """A pod (anti-)affinity preference: nodes meeting the term score ``weight`` more."""

    weight: Weight = Field(description="Weight of the preference, 1..100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term preferred.")


class PodAffinity(ApiModel):
    """Run the worker pods in the topology domains of other pods (Kubernetes
    ``PodAffinity``)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = Field(
        default=None, max_length=16, description="Terms every pod must meet (ANDed)."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = (
        Field(default=None, max_length=16, description="Terms preferred, by weight.")
    )


class PodAntiAffinity(PodAffinity):
    """Keep the worker pods out of the topology domains of other pods (Kubernetes
    ``PodAntiAffinity``; the same terms as ``PodAffinity``)."""


class Affinity(ApiModel):
    """Scheduling constraints of every worker pod (Kubernetes ``Affinity``)."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node constraints.")
    pod_affinity: PodAffinity | None = Field(
        default=None, description="Co-locate with other pods."
    )
    pod_anti_affinity: PodAntiAffinity | None = Field(
        default=None, description="Stay apart from other pods."
    )


# --------------------------------------------------------------------------- GPUs

_GPU_ONE_OF = (
    "set at most one of resourceName (the device plugin) and resourceClaimTemplateName (DRA)"
)
_GENERATION_NEEDS_DRA = (
    "needs resourceClaimTemplateName (DRA): it is the generation pods' DRA claim, and "
    "without DRA every pod gets the device plugin's GPUs"
)


class GpuSpec(ApiModel):
    """How each worker pod gets its ``ranksPerPod`` GPUs: the device plugin's extended
    resource (the default, ``nvidia.com/gpu``) or DRA ResourceClaimTemplates.

    With ``resourceClaimTemplateName`` the pod claims ``gpus`` from that template (which
    must exist in the deployment's namespace and allocate ``ranksPerPod`` GPUs: the operator
    does not own the template and cannot check its count) and requests no extended resource.
    The generation pods claim ``generationResourceClaimTemplateName`` instead when it is set
    (a template of ``generation.ranksPerPod`` GPUs); the spec requires it when the two roles'
    ``ranksPerPod`` differ.
    """

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            [
                cel_rule(
                    "!(has(self.resourceName) && has(self.resourceClaimTemplateName))",
                    _GPU_ONE_OF,
                    field_path=".resourceClaimTemplateName",
                ),
                cel_rule(
                    "!has(self.generationResourceClaimTemplateName) || "
                    "has(self.resourceClaimTemplateName)",
                    _GENERATION_NEEDS_DRA,
                    field_path=".generationResourceClaimTemplateName",
                ),
            ]
        )
    )

    resource_name: Annotated[str, EXTENDED_RESOURCE_NAME] | None = Field(
        default=None,
        description="Extended resource of the device plugin (a domain-prefixed qualified "
        "name); each worker container requests and limits ranksPerPod of it. Unset: "
        "nvidia.com/gpu, unless resourceClaimTemplateName is set.",
    )
    resource_claim_template_name: SubdomainName | None = Field(
        default=None,
        description="A ResourceClaimTemplate (resource.k8s.io) of the deployment's namespace "
        "that allocates context.ranksPerPod GPUs: each worker pod claims it as 'gpus' instead "
        "of requesting an extended resource (the generation pods too, unless "
        "generationResourceClaimTemplateName is set). The operator cannot check the count in "
        "a template it does not own.",
    )
    generation_resource_claim_template_name: SubdomainName | None = Field(
        default=None,
        description="The ResourceClaimTemplate of the generation pods, allocating "
        "generation.ranksPerPod GPUs (DRA only: needs resourceClaimTemplateName). Required "
        "when generation.ranksPerPod differs from context.ranksPerPod; unset: the generation "
        "pods claim resourceClaimTemplateName.",
    )

    @property
    def device_plugin_resource(self) -> str | None:
        """The extended resource each worker container requests, one per rank; None under
        DRA (``resourceClaimTemplateName`` set)."""
        if self.resource_claim_template_name is not None:
            return None
        return self.resource_name or DEFAULT_GPU_RESOURCE

    def claim_template(self, role: Role) -> str | None:
        """The ResourceClaimTemplate the pods of ``role`` claim their GPUs from; None
        without DRA. Generation pods take ``generationResourceClaimTemplateName`` when set."""
        if role is Role.GENERATION and self.generation_resource_claim_template_name is not None:
            return self.generation_resource_claim_template_name
        return self.resource_claim_template_name

    @model_validator(mode="after")
    def _check(self) -> GpuSpec:
        problems = []
        if self.resource_name is not None and self.resource_claim_template_name is not None:
            problems.append(
                Problem(
                    ("resourceClaimTemplateName",), self.resource_claim_template_name, _GPU_ONE_OF
                )
            )
        generation = self.generation_resource_claim_template_name
        if generation is not None and self.resource_claim_template_name is None:
            problems.append(
                Problem(("generationResourceClaimTemplateName",), generation, _GENERATION_NEEDS_DRA)
            )
        if problems:
            raise RuleViolations(problems)
        return self
