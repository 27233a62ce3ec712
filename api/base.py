"""The base of every API model: camelCase aliases, strict scalars, unknown fields refused.

Python code uses the snake_case field names; YAML and the CRD use the camelCase aliases;
both are accepted on input (``populate_by_name``). Scalars are strict (``"4"`` is not a
whole number, ``"true"`` is not a boolean), as the apiserver's schema check is, so the
models and the CRD reach the same verdict on the same document.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "ApiModel",
    "Bool",
    "NonNegInt",
    "PosInt",
    "cel_rule",
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


PosInt = Annotated[int, Field(strict=True, ge=1)]
"""A whole number >= 1 (strings and floats refused)."""
NonNegInt = Annotated[int, Field(strict=True, ge=0)]
"""A whole number >= 0 (strings and floats refused)."""
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
