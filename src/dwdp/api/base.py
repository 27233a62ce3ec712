"""The base of every API model: camelCase aliases, strict scalars, unknown fields refused.

Python code uses the snake_case field names (the constructors accept them:
``populate_by_name``); documents (YAML, the CRD's objects, a launch config file) use the
camelCase aliases only, as the apiserver reads them (``model_validate(..., by_name=False)``:
``num_speculative_tokens`` in a document is an unknown field, as the apiserver's strict field
validation says). Scalars are strict (``"4"`` is not a
whole number, ``"true"`` is not a boolean), as the apiserver's schema check is, so the
models and the CRD reach the same verdict on the same document.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

__all__ = [
    "ApiModel",
    "Bool",
    "Int64",
    "NonNegInt",
    "PosInt",
    "cel_literal",
    "cel_rule",
    "cel_rules",
]


class ApiModel(BaseModel):
    """Base model: camelCase aliases, names accepted too, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        loc_by_alias=True,
        validate_assignment=False,
    )

    def to_yaml_dict(self) -> dict[str, Any]:
        """The camelCase view, unset optional fields left out (what YAML and the CRD hold)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The whole numbers the apiserver takes for an ``integer`` field (int64)."""


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        bound = f"at most {INT64_MAX}" if value > 0 else f"at least {INT64_MIN}"
        raise ValueError(
            f"must be {bound}: the apiserver stores whole numbers as 64-bit integers"
        )
    return value


Int64 = Annotated[int, Field(strict=True), AfterValidator(_int64)]
"""A whole number the apiserver can store (int64; strings and floats refused)."""
PosInt = Annotated[int, Field(strict=True, ge=1), AfterValidator(_int64)]
"""A whole number >= 1 and at most :data:`INT64_MAX` (strings and floats refused)."""
NonNegInt = Annotated[int, Field(strict=True, ge=0), AfterValidator(_int64)]
"""A whole number >= 0 and at most :data:`INT64_MAX` (strings and floats refused)."""
Bool = Annotated[bool, Field(strict=True)]
"""true or false (strings and numbers refused)."""


def cel_rule(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str = "FieldValueInvalid",
) -> dict[str, str]:
    """One ``x-kubernetes-validations`` entry (CEL ``rule``, ``message``, ``fieldPath``).

    ``field_path`` is relative to the object the rule sits on (``.gatherKernel``); the
    apiserver reports the failure at that field.
    """
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    entry["reason"] = reason
    return entry


_SELF_PATH = re.compile(r"(?<!has\()\bself((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _field_by_alias(model: type[BaseModel], alias: str) -> FieldInfo | None:
    for name, info in model.model_fields.items():
        if (info.alias or name) == alias:
            return info
    return None


def cel_literal(value: object) -> str:
    """``value`` as a CEL literal: ``true``, ``4``, ``'tma'`` (enums by their value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise TypeError(f"no CEL literal for default {value!r}")


def _guarded(model: type[BaseModel], match: re.Match[str]) -> str:
    """``self.a.b`` -> ``((has(self.a) && has(self.a.b)) ? self.a.b : <default of b>)``.

    Only the leading parts that name fields are resolved (``self.path.startsWith`` keeps
    its method); a field without a default is left as written.
    """
    parts = match.group(1).lstrip(".").split(".")
    current: type[BaseModel] | None = model
    resolved: list[str] = []
    info: FieldInfo | None = None
    for part in parts:
        if current is None:
            break
        info = _field_by_alias(current, part)
        if info is None:
            break
        resolved.append(part)
        annotation = info.annotation
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        current = annotation if is_model and isinstance(annotation, type) else None
    rest = parts[len(resolved):]
    tail = "".join(f".{p}" for p in rest)
    if not resolved or info is None or info.is_required():
        return match.group(0)
    default = info.get_default(call_default_factory=True)
    if default is None or isinstance(default, BaseModel):
        return match.group(0)
    path = ".".join(resolved)
    guards = " && ".join(f"has(self.{'.'.join(resolved[: i + 1])})" for i in range(len(resolved)))
    return f"(({guards}) ? self.{path} : {cel_literal(default)}){tail}"


def cel_rules(
    rules: list[dict[str, str]] | Callable[[], list[dict[str, str]]],
) -> Callable[[dict[str, Any], type[BaseModel]], None]:
    """A ``json_schema_extra`` that puts ``rules`` on the model's schema as
    ``x-kubernetes-validations``.

    Every ``self.field`` (or ``self.a.b``) in a rule whose field has a default is rewritten
    to fall back to that default when the field is absent: the apiserver checks each
    schema ``default`` (``{}`` here) against the rules *before* nested defaults fill it,
    and a rule must not fail on a missing key. ``has(self.x)`` tests stay as written.
    """

    def extra(schema: dict[str, Any], model: type[BaseModel]) -> None:
        entries = rules() if callable(rules) else rules
        out = []
        for entry in entries:
            rewritten = dict(entry)
            rewritten["rule"] = _SELF_PATH.sub(lambda m: _guarded(model, m), entry["rule"])
            out.append(rewritten)
        schema["x-kubernetes-validations"] = out

    return extra
