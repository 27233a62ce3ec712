"""An offline stand-in for the apiserver's checks of a custom resource on create.

It applies, in the apiserver's order, what a CRD's structural schema does to a request
body: strict field validation (unknown fields are errors, as ``kubectl apply`` asks for by
default), pruning of nulls in non-nullable fields, defaulting, the OpenAPI checks (type,
enum, bounds, lengths, pattern, required) and every ``x-kubernetes-validations`` CEL rule,
evaluated with cel-python on the defaulted object. The status is dropped first, as the
status subresource does on create. Error lines look like the apiserver's
(``spec.context.dwdp.gatherKernel: Invalid value: ...: message``).

cel-python lacks the Kubernetes CEL libraries and the cost checks; the real apiserver run
is tests/cluster/test_crd_dryrun.py.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import celpy

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def cel_holds(rule: str, value: Any, *, converted: Any = None) -> bool:
    """Evaluate one CEL rule with ``self`` bound to ``value``; an evaluation error fails.

    ``converted`` is ``value`` already turned into CEL values (to share among rules)."""
    bound = converted if converted is not None else celpy.json_to_cel(value)
    try:
        result = _program(rule).evaluate({"self": bound})
    except celpy.CELEvalError:
        return False
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def _path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class OfflineApiserver:
    """Checks documents against one CRD version's ``openAPIV3Schema``."""

    def __init__(self, crd: dict[str, Any], version: str = "v1alpha1") -> None:
        (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        self.schema = ver["schema"]["openAPIV3Schema"]
        self.status_subresource = "status" in ver.get("subresources", {})

    def errors(self, document: dict[str, Any]) -> list[str]:
        """Every error the apiserver would report for a create of ``document``."""
        obj = copy.deepcopy(document)
        if self.status_subresource:
            obj.pop("status", None)
        meta = obj.get("metadata") or {}
        errors: list[str] = []
        if not meta.get("name") and not meta.get("generateName"):
            errors.append("metadata.name: Required value: name or generateName is required")
        self._unknown(obj, self.schema, [], errors)
        if errors:
            return errors  # strict decoding fails before any validation runs
        self._prune_and_default(obj, self.schema)
        self._validate(obj, self.schema, [], errors)
        return errors

    def default_errors(self) -> list[str]:
        """What the apiserver checks when the CRD is created: every schema ``default`` must
        pass its own node's checks and CEL rules as written, before nested defaults."""
        errors: list[str] = []

        def walk(node: dict[str, Any], path: list) -> None:
            if "default" in node:
                self._validate(copy.deepcopy(node["default"]), node, [*path, "default"], errors)
            for key, sub in (node.get("properties") or {}).items():
                walk(sub, [*path, key])
            for key in ("items", "additionalProperties"):
                if isinstance(node.get(key), dict):
                    walk(node[key], [*path, key])

        walk(self.schema, [])
        return errors

    # -- strict decoding -------------------------------------------------------------

    def _unknown(self, value: Any, schema: dict[str, Any], path: list, errors: list) -> None:
        if isinstance(value, dict):
            props = schema.get("properties")
            if props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                for key in value:
                    if key not in props:
                        errors.append(f'unknown field "{_path([*path, key])}"')
            for key, sub in value.items():
                if not path and key == "metadata":
                    continue  # the apiserver checks metadata fields itself
                if props and key in props:
                    self._unknown(sub, props[key], [*path, key], errors)
                elif isinstance(schema.get("additionalProperties"), dict):
                    self._unknown(sub, schema["additionalProperties"], [*path, key], errors)
        elif isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self._unknown(item, schema["items"], [*path, i], errors)

    # -- pruning nulls and defaulting ------------------------------------------------

    def _prune_and_default(self, value: Any, schema: dict[str, Any]) -> None:
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            for key in [k for k, v in value.items() if v is None]:
                if not (props.get(key) or {}).get("nullable"):
                    del value[key]
            for key, sub in props.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
            for key, sub in value.items():
                if key in props:
                    self._prune_and_default(sub, props[key])
                elif isinstance(schema.get("additionalProperties"), dict):
                    self._prune_and_default(sub, schema["additionalProperties"])
        elif isinstance(value, list) and "items" in schema:
            for item in value:
                self._prune_and_default(item, schema["items"])

    # -- OpenAPI checks and CEL ------------------------------------------------------

    def _validate(self, value: Any, schema: dict[str, Any], path: list, errors: list) -> None:
        where = _path(path) or "<root>"
        if not self._type_ok(value, schema):
            want = schema.get("type")
            errors.append(f"{where}: Invalid value: {value!r}: wrong type, want {want}")
            return
        if "enum" in schema and value not in schema["enum"]:
            errors.append(f"{where}: Unsupported value: {value!r}: supported {schema['enum']}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            low, high = schema.get("minimum"), schema.get("maximum")
            open_low, open_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
            if low is not None and (value <= low if open_low else value < low):
                errors.append(f"{where}: Invalid value: {value}: should be above {low}")
            if high is not None and (value >= high if open_high else value > high):
                errors.append(f"{where}: Invalid value: {value}: should be below {high}")
        if isinstance(value, str):
            if len(value) < schema.get("minLength", 0):
                errors.append(f"{where}: Invalid value: {value!r}: too short")
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                errors.append(f"{where}: Too long: may not be longer than {schema['maxLength']}")
            if "pattern" in schema and not re.search(schema["pattern"], value):
                pattern = schema["pattern"]
                errors.append(f"{where}: Invalid value: {value!r}: should match {pattern}")
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                errors.append(f"{where}: Too many: must have at most {schema['maxItems']} items")
            if len(value) < schema.get("minItems", 0):
                least = schema["minItems"]
                errors.append(f"{where}: Invalid value: should have at least {least} items")
            for i, item in enumerate(value):
                self._validate(item, schema.get("items", {}), [*path, i], errors)
        if isinstance(value, dict):
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                errors.append(f"{where}: Too many: at most {schema['maxProperties']} properties")
            for key in schema.get("required", []):
                if key not in value:
                    errors.append(f"{_path([*path, key])}: Required value")
            props = schema.get("properties") or {}
            for key, sub in value.items():
                if key in props:
                    self._validate(sub, props[key], [*path, key], errors)
                elif isinstance(schema.get("additionalProperties"), dict):
                    self._validate(sub, schema["additionalProperties"], [*path, key], errors)
        rules = schema.get("x-kubernetes-validations", [])
        converted = celpy.json_to_cel(value) if rules else None
        for rule in rules:
            if not cel_holds(rule["rule"], value, converted=converted):
                at = _path(path) + rule.get("fieldPath", "") if path else rule.get(
                    "fieldPath", "<root>"
                ).lstrip(".")
                errors.append(f"{at}: Invalid value: \"object\": {rule['message']}")

    @staticmethod
    def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
        if schema.get("x-kubernetes-int-or-string"):
            whole = isinstance(value, int) and not isinstance(value, bool)
            return isinstance(value, str) or whole
        kind = schema.get("type")
        if kind is None:
            return True
        return {
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "string": lambda v: isinstance(v, str),
            "boolean": lambda v: isinstance(v, bool),
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        }[kind](value)
