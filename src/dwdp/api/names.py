"""Kubernetes name formats, each with its rule in plain words.

A name field of the API (a Secret's, a ResourceClaimTemplate's, a namespace's, a node's, a
label key, the deployment's own) has one :class:`NameFormat`: the regular expression and
length bound Kubernetes applies, and the same rule said in words. A format is the one home
of that rule: ``Annotated[str, FORMAT]`` validates with it (a
:class:`~dwdp.api.errors.Problem` naming the field, the rule and the value, never the raw
regular expression) and writes the field's CRD schema as the length bounds plus one CEL
rule carrying the same words, so ``dwdp validate`` and the apiserver say the same thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from dwdp.api.base import cel_literal, cel_rule
from dwdp.api.errors import Problem, RuleViolations

__all__ = [
    "ABSOLUTE_PATH",
    "CIDR",
    "DNS1123_LABEL",
    "DNS1123_LABEL_PATTERN",
    "DNS1123_SUBDOMAIN",
    "DNS1123_SUBDOMAIN_PATTERN",
    "ENV_VAR_NAME",
    "EXTENDED_RESOURCE_NAME",
    "IMAGE_REFERENCE",
    "LINUX_CAPABILITY",
    "QUALIFIED_NAME",
    "QUALIFIED_NAME_PATTERN",
    "SECRET_KEY",
    "NameFormat",
]


@dataclass(frozen=True)
class NameFormat:
    """A name format: ``kind`` (``"DNS-1123 subdomain"``), the anchored ``pattern``, the
    longest name ``max_length`` and the ``characters`` allowed, in words.

    As the metadata of ``Annotated[str, ...]`` it is the field's validator and its schema.
    """

    kind: str
    pattern: str
    max_length: int
    characters: str

    @property
    def rule(self) -> str:
        """The rule in words (``must be a DNS-1123 subdomain: lowercase letters, ...``)."""
        article = "an" if self.kind[0] in "aeiouAEIOU" else "a"
        return (f"must be {article} {self.kind}: {self.characters}, at most "
                f"{self.max_length} characters")

    def fits(self, value: str) -> bool:
        """True when ``value`` is a name of this format."""
        return 0 < len(value) <= self.max_length and re.fullmatch(self.pattern, value) is not None

    def problems(self, value: str, path: tuple[str | int, ...] = ()) -> list[Problem]:
        """The broken rule at ``path`` when ``value`` is not a name of this format."""
        return [] if self.fits(value) else [Problem(path, value, self.rule)]

    def _validate(self, value: str) -> str:
        problems = self.problems(value)
        if problems:
            raise RuleViolations(problems)
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        # The bounds stay schema keywords (the apiserver's CEL cost estimate needs
        # maxLength); the pattern becomes a CEL rule so the refusal carries the words.
        out.update(minLength=1, maxLength=self.max_length)
        out["x-kubernetes-validations"] = [
            cel_rule(f"self.matches({cel_literal(self.pattern)})", self.rule)
        ]
        return out


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_ENDS = "starting and ending with a letter or digit"

DNS1123_LABEL_PATTERN = f"^{_DNS_LABEL}$"
DNS1123_SUBDOMAIN_PATTERN = f"^{_SUBDOMAIN}$"
QUALIFIED_NAME_PATTERN = rf"^({_SUBDOMAIN}/)?{_NAME_PART}$"

DNS1123_LABEL = NameFormat(
    "DNS-1123 label", DNS1123_LABEL_PATTERN, 63, f"lowercase letters, digits and '-', {_ENDS}"
)
"""A namespace's name."""
DNS1123_SUBDOMAIN = NameFormat(
    "DNS-1123 subdomain",
    DNS1123_SUBDOMAIN_PATTERN,
    253,
    f"lowercase letters, digits, '-' and '.', {_ENDS}",
)
"""The name of a Secret, a ResourceClaimTemplate, a node."""
_NAME_WORDS = f"at most 63 letters, digits, '-', '_' and '.', {_ENDS}"
QUALIFIED_NAME = NameFormat(
    "qualified name",
    QUALIFIED_NAME_PATTERN,
    317,
    f"an optional DNS-1123 subdomain and '/', then {_NAME_WORDS}",
)
"""A label key, a topology key."""
EXTENDED_RESOURCE_NAME = NameFormat(
    "domain-prefixed resource name",
    rf"^{_SUBDOMAIN}/{_NAME_PART}$",
    317,
    f"a DNS-1123 subdomain, '/', then {_NAME_WORDS}",
)
"""An extended resource of a device plugin (``nvidia.com/gpu``)."""
LINUX_CAPABILITY = NameFormat(
    "Linux capability",
    r"^(ALL|(CAP_)?[A-Z][A-Z0-9_]*)$",
    64,
    "ALL, or upper-case letters, digits and '_' starting with a letter, optionally after CAP_",
)
"""A container capability as Kubernetes writes it (``NET_ADMIN``, ``CAP_NET_ADMIN``, ``ALL``)."""
CIDR = NameFormat(
    "CIDR",
    r"^[0-9a-fA-F:.]+/[0-9]{1,3}$",
    64,
    "an IPv4 or IPv6 address, '/', then a prefix length of 1 to 3 digits",
)
"""An address block of a NetworkPolicy (``10.0.0.0/8``)."""
ENV_VAR_NAME = NameFormat(
    "environment variable name",
    r"^[A-Za-z_][A-Za-z0-9_]*$",
    128,
    "letters, digits and '_', not starting with a digit",
)
"""The name of a container's environment variable (as a shell takes it)."""
ABSOLUTE_PATH = NameFormat(
    "absolute path",
    r"^(/(\.|\.\.[^/]+|\.?[^/.][^/]*)?)+$",
    4096,
    "starting with '/', no '..' part",
)
"""A folder of the host or of the container; no part is ``..`` (the apiserver refuses a hostPath
volume with one, so it is refused before any pod is made)."""
SECRET_KEY = NameFormat(
    "Secret key", r"^[-._a-zA-Z0-9]+$", 253, "letters, digits, '-', '_' and '.'"
)
"""A key of a Secret's data."""
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
_REGISTRY = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = NameFormat(
    "image reference",
    rf"^(?:{_REGISTRY}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::[A-Za-z0-9_][-.A-Za-z0-9_]{{0,127}})?"
    rf"(?:@{_DIGEST})?$",
    1024,
    "an optional registry host[:port] and '/', a lowercase repository path (letters, digits, "
    "'.', '_', '-' inside, parts joined by '/'), then an optional ':tag' and an optional "
    "'@algorithm:hex' digest of at least 32 hex digits",
)
"""A container image as the container runtime takes it (``ghcr.io/org/dwdp-worker:0.1.0``,
``registry:5000/worker@sha256:...``): the grammar of the distribution project's reference
package."""
