"""Validation problems that name the field, the value and the rule.

Every rejection in ``dwdp.api`` becomes a :class:`Problem`: the field path in the YAML/CRD
spelling (camelCase, ``spec.context.dwdp.gatherKernel``, list items as ``[i]``), the value
found there and the rule it breaks, in words. Pydantic's own errors (types, bounds, enums,
unknown fields) and this package's cross-field rules end up in the same shape, so the CLI
prints one line per problem and callers never parse pydantic output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pydantic import ValidationError

__all__ = [
    "UNSET",
    "DwdpValidationError",
    "Problem",
    "RuleViolations",
    "first_per_field",
    "format_path",
    "problems_from_validation_error",
]

PathPart = str | int


class _Unset:
    """The value of a field that is absent (distinct from an explicit null)."""

    def __repr__(self) -> str:
        return "unset"


UNSET: Final = _Unset()


def format_path(path: Sequence[PathPart]) -> str:
    """``("spec", "tolerations", 0, "key")`` -> ``spec.tolerations[0].key``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(document)"


def _show(value: object) -> str:
    """The value as YAML/JSON writes it (``true``, ``"tma"``, ``4``), shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (``path``), what was there (``value``) and why (``rule``)."""

    path: tuple[PathPart, ...]
    value: object
    rule: str

    @property
    def where(self) -> str:
        """The path as text, e.g. ``spec.context.dwdp.gatherKernel``."""
        return format_path(self.path)

    def under(self, prefix: Sequence[PathPart]) -> Problem:
        """The same problem seen from a parent object at ``prefix``."""
        return Problem((*prefix, *self.path), self.value, self.rule)

    def __str__(self) -> str:
        shown = "" if self.value is UNSET else f" (got {_show(self.value)})"
        return f"{self.where}: {self.rule}{shown}"


def first_per_field(problems: Iterable[Problem]) -> list[Problem]:
    """``problems`` in order, keeping only the first one of each path (the rule listed
    first names a field; later rules on the same field are left out)."""
    found: dict[tuple[PathPart, ...], Problem] = {}
    for problem in problems:
        found.setdefault(problem.path, problem)
    return list(found.values())


class RuleViolations(ValueError):
    """Raised inside a model validator: the cross-field problems of one object.

    Paths are relative to the object that raised. Pydantic keeps the exception in the
    error's context, and :func:`problems_from_validation_error` takes the problems back out.
    """

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


@dataclass
class DwdpValidationError(ValueError):
    """A configuration that breaks one or more rules; ``problems`` lists them in order."""

    problems: list[Problem] = field(default_factory=list)
    subject: str = "configuration"

    def __post_init__(self) -> None:
        super().__init__(str(self))

    @property
    def first(self) -> Problem:
        """The first problem (the one a launch reports)."""
        return self.problems[0]

    def lines(self) -> list[str]:
        """One line per problem."""
        return [str(p) for p in self.problems]

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"invalid {self.subject}: {self.problems[0]}"
        listed = "; ".join(str(p) for p in self.problems)
        return f"invalid {self.subject} ({len(self.problems)} problems): {listed}"


_PLAIN_WORDS = {
    "missing": "is required",
    "extra_forbidden": "is not a known field (check its spelling and indentation)",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping of fields",
    "model_attributes_type": "must be a mapping of fields",
    "dict_type": "must be a mapping",
    "list_type": "must be a list",
    "float_type": "must be a number",
}


def problems_from_validation_error(
    exc: ValidationError, prefix: Sequence[PathPart] = ()
) -> list[Problem]:
    """Turn a pydantic ``ValidationError`` into problems with camelCase paths.

    Paths come from pydantic's ``loc`` (aliases, since every model sets
    ``loc_by_alias``); tagged-union and function-validator segments are dropped.
    """
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(part for part in err["loc"] if not _is_machinery(part))
        ctx = err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, RuleViolations):
            problems.extend(p.under((*prefix, *loc)) for p in inner.problems)
            continue
        kind = err["type"]
        value = UNSET if kind == "missing" else err.get("input", UNSET)
        rule = _PLAIN_WORDS.get(kind) or _lower_first(err["msg"])
        if kind == "extra_forbidden":
            value = UNSET
        problems.append(Problem((*prefix, *loc), value, rule))
    return problems


def _is_machinery(part: object) -> bool:
    return isinstance(part, str) and (
        part.startswith("function-") or part in {"json-or-python[json=...,python=...]"}
    )


def _lower_first(text: str) -> str:
    text = text.removeprefix("Value error, ")
    if text.startswith("Input should be"):
        text = "must be" + text[len("Input should be") :]
    return text[:1].lower() + text[1:]
