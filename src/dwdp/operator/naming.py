"""Names of the children of a DwdpDeployment, derived from its name alone.

Invariant: every name here is a DNS-1035 label of at most 63 characters for a deployment
name of at most ``NAME_MAX_LENGTH`` (40) characters, and two different children of one
deployment never get the same name.
"""

from __future__ import annotations

import re

from dwdp.api.enums import Role

__all__ = [
    "channel_claim_template",
    "client_service",
    "config_map",
    "endpoint_slice",
    "group_name",
    "group_policy",
    "headless_service",
    "incarnation",
    "pod_name",
    "rendezvous_address",
    "rendezvous_secret",
    "router",
    "serving_policy",
]

_GROUP_PREFIX = {Role.CONTEXT: "g", Role.GENERATION: "gen"}


def config_map(deployment: str, role: Role, revision: str) -> str:
    """The launch ConfigMap of one role at one revision (``demo-context-1a2b3c4d5e``).

    One ConfigMap per revision: a live group keeps reading the config it started with.
    """
    return f"{deployment}-{role.value}-{revision}"


def headless_service(deployment: str, role: Role) -> str:
    """The headless Service of a role (``demo-context``): stable DNS names of its pods."""
    return f"{deployment}-{role.value}"


def client_service(deployment: str) -> str:
    """The client Service (``demo``): every rank of every committed context group."""
    return deployment


def endpoint_slice(deployment: str, local_rank: int) -> str:
    """The EndpointSlice of the client Service for local rank ``local_rank``'s port."""
    return f"{deployment}-rank-{local_rank}"


def serving_policy(deployment: str) -> str:
    """The NetworkPolicy of every worker pod's serving ports (``demo-serving``)."""
    return f"{deployment}-serving"


def kv_transfer_policy(deployment: str) -> str:
    """The NetworkPolicy letting generation pods read context pods' KV (``demo-kv-transfer``)."""
    return f"{deployment}-kv-transfer"


def router(deployment: str) -> str:
    """The router's Deployment, Service and NetworkPolicy (``demo-router``)."""
    return f"{deployment}-router"


def group_policy(group: str) -> str:
    """The NetworkPolicy letting a group's pods reach each other (``demo-g0-group``)."""
    return f"{group}-group"


def group_name(deployment: str, role: Role, index: int) -> str:
    """The name of group ``index`` of ``role``: ``demo-g0`` (context), ``demo-gen0``."""
    return f"{deployment}-{_GROUP_PREFIX[role]}{index}"


def pod_name(group: str, incarnation: int, pod_index: int) -> str:
    """Pod ``pod_index`` of incarnation ``incarnation`` of ``group`` (``demo-g0-i0-p1``);
    also the pod's hostname under its role's headless Service."""
    return f"{group}-i{incarnation}-p{pod_index}"


def incarnation(group: str, incarnation: int) -> str:
    """The per-incarnation children (gang PodGroup, ComputeDomain): ``demo-g0-i3``."""
    return f"{group}-i{incarnation}"


def channel_claim_template(group: str, incarnation: int) -> str:
    """The ResourceClaimTemplate the incarnation's ComputeDomain makes for its channel."""
    return f"{group}-i{incarnation}-channel"


def rendezvous_secret(group: str, incarnation: int) -> str:
    """The Secret holding the incarnation's rendezvous secret: ``demo-g0-i3-rdzv``."""
    return f"{group}-i{incarnation}-rdzv"


def rendezvous_address(
    *, group: str, incarnation: int, deployment: str, role: Role, namespace: str, port: int
) -> str:
    """``host:port`` of the group's store: pod 0's headless DNS name and the store port."""
    host = f"{pod_name(group, incarnation, 0)}.{headless_service(deployment, role)}.{namespace}.svc"
    return f"{host}:{port}"


LABEL_VALUE_MAX = 63
"""Characters of a Kubernetes label value at most."""


def label_value(text: str) -> str:
    """``text`` as a valid label value: characters outside ``[A-Za-z0-9._-]`` become ``-``,
    at most :data:`LABEL_VALUE_MAX` characters, starting and ending with a letter or digit
    (``Qwen/Qwen3-30B-A3B`` -> ``Qwen-Qwen3-30B-A3B``); empty when nothing is left."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:LABEL_VALUE_MAX]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)
