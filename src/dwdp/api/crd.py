"""Generate the DwdpDeployment CustomResourceDefinition from the pydantic models.

:func:`crd_manifest` turns the JSON schema pydantic writes for the spec and status models
into a Kubernetes *structural* schema: references inlined, optional fields without the
``null`` branch, no titles, no ``additionalProperties: false`` (the apiserver rejects
unknown fields itself under strict field validation), OpenAPI 3.0 bounds, quantities as
int-or-string, and the models' ``x-kubernetes-validations`` CEL rules kept on their
objects. ``dwdp crd`` prints :func:`crd_yaml`; ``crds/dwdp.io_dwdpdeployments.yaml`` is its
committed copy and a unit test fails when they differ.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from dwdp.api.deployment import (
    GROUP,
    KIND,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    PLURAL,
    QUANTITY_PATTERN,
    SHORT_NAME,
    SINGULAR,
    VERSION,
    DwdpDeploymentSpec,
    DwdpDeploymentStatus,
)

__all__ = ["CRD_FILENAME", "committed_crd_path", "crd_manifest", "crd_yaml", "structural"]

CRD_FILENAME = f"{GROUP}_{PLURAL}.yaml"
"""File name of the committed CRD under ``crds/``."""

# Keys of pydantic's JSON schema that a Kubernetes schema does not take.
_DROP = {"title", "propertyNames", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        merged = copy.deepcopy(defs[name])
        for key, value in node.items():
            if key != "$ref":
                merged[key] = value  # the field's description and default win
        return _resolve(merged, defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


def _is_null(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null"


def _string_pattern(branches: list[dict[str, Any]]) -> str:
    """The pattern of an int-or-string field's strings: its words (a ``Literal``, e.g.
    ``auto``), else a Kubernetes quantity. The integer branch's bounds are the model's CEL
    rules' business (a structural schema keeps no type-specific bound in ``anyOf``)."""
    text = next(b for b in branches if b.get("type") == "string")
    words = [text["const"]] if "const" in text else text.get("enum")
    if words:
        return "^(" + "|".join(re.escape(str(w)) for w in words) + ")$"
    return QUANTITY_PATTERN


def _convert(node: Any) -> Any:
    """Rewrite one resolved JSON-schema node (recursively) as a structural schema node."""
    if isinstance(node, list):
        return [_convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        branches = [b for b in any_of if not _is_null(b)]
        if node.get("default", 0) is None:
            node.pop("default")
        if len(branches) == 1:
            merged = dict(branches[0])
            merged.update(node)  # description, default of the field
            node = merged
        elif sorted(b.get("type", "") for b in branches) == ["integer", "string"]:
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            node["pattern"] = _string_pattern(branches)
            node["x-kubernetes-int-or-string"] = True
        else:
            raise ValueError(f"no structural form for anyOf {any_of!r}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "additionalProperties" and value is False):
            continue
        if key == "additionalProperties" and value is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "properties":
            out[key] = {name: _convert(sub) for name, sub in value.items()}
        elif key in {"items", "additionalProperties"}:
            out[key] = _convert(value)
        elif key == "description" and isinstance(value, str):
            first_paragraph = value.strip().split("\n\n")[0]
            out[key] = " ".join(first_paragraph.replace("``", "").split())
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out or "additionalProperties" in out:
        out.setdefault("type", "object")
    return _ordered(out)


_FIRST = ("type", "description", "default", "enum", "required", "properties")
_LAST = ("x-kubernetes-validations",)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Keys in a reading order: type and description first, CEL rules last."""
    head = [k for k in _FIRST if k in node]
    tail = [k for k in _LAST if k in node]
    middle = sorted(k for k in node if k not in head and k not in tail)
    return {k: node[k] for k in (*head, *middle, *tail)}


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of one pydantic model class (validation view, camelCase)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(_resolve(raw, raw.get("$defs", {})))


def _root_schema() -> dict[str, Any]:
    # At the root, a CRD may restrict metadata.name (and generateName) and nothing else:
    # a DNS-1035 label, short enough for the suffixes of the children's names.
    name = {"type": "string", "maxLength": NAME_MAX_LENGTH, "pattern": NAME_PATTERN}
    return {
        "type": "object",
        "description": (
            "A DwdpDeployment runs context (prefill) servers as DWDP groups, whose ranks "
            "share one copy of the mixture-of-experts weights, plus generation servers."
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object", "properties": {"name": name}},
            "spec": structural(DwdpDeploymentSpec),
            "status": structural(DwdpDeploymentStatus),
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition of DwdpDeployment, as a mapping."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "annotations": {"dwdp.io/generated-by": "dwdp crd (dwdp.api.crd)"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _root_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.context.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "integer",
                            "description": "Context DWDP groups committed and serving.",
                            "jsonPath": ".status.readyGroups",
                        },
                        {
                            "name": "Groups",
                            "type": "integer",
                            "description": "Desired context DWDP groups.",
                            "jsonPath": ".spec.context.replicas",
                        },
                        {
                            "name": "Up-to-date",
                            "type": "integer",
                            "description": "Context groups at the current revision.",
                            "jsonPath": ".status.updatedGroups",
                        },
                        {
                            "name": "Phase",
                            "type": "string",
                            "jsonPath": ".status.phase",
                        },
                        {
                            "name": "DWDP",
                            "type": "integer",
                            "description": "Ranks per DWDP group (dwdpSize).",
                            "jsonPath": ".spec.context.dwdp.dwdpSize",
                        },
                        {
                            "name": "Dense",
                            "type": "boolean",
                            "description": "Dense DWDP on the context servers.",
                            "jsonPath": ".spec.context.dwdp.enableDense",
                        },
                        {
                            "name": "Router",
                            "type": "string",
                            "description": "The router's URL (vllm-router, PD mode).",
                            "jsonPath": ".status.router.endpoint",
                        },
                        {
                            "name": "Age",
                            "type": "date",
                            "jsonPath": ".metadata.creationTimestamp",
                        },
                    ],
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Block-style YAML with long strings kept on one line, mappings in insertion order."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def crd_yaml() -> str:
    """The CRD as YAML text (what ``dwdp crd`` prints and ``crds/`` holds)."""
    header = "# Generated by `dwdp crd` from dwdp.api (src/dwdp/api/crd.py). Do not edit by hand.\n"
    body = yaml.dump(
        crd_manifest(), Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True
    )
    return header + body


def committed_crd_path(root: Path | None = None) -> Path:
    """``crds/dwdp.io_dwdpdeployments.yaml`` under the repository ``root`` (default: this
    checkout, found from this file)."""
    base = root if root is not None else Path(__file__).resolve().parents[3]
    return base / "crds" / CRD_FILENAME
