"""Validation problems that name the field, the value and the rule.

Every rejection in ``dwdp.api`` becomes a :class:`Problem`: the field path in the YAML/CRD
spelling (camelCase, ``spec.context.dwdp.gatherKernel``, list items as ``[i]``), the value
found there and the rule it breaks, in words. Pydantic's own errors (types, bounds, enums,
unknown fields) and this package's cross-field rules end up in the same shape, so the CLI
prints one line per problem and callers never parse pydantic output.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from dwdp.api.dropped import unknown_field_rules

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
    """``("spec", "tolerations", 0, "key")`` -> ``spec.tolerations[0].key``; a key that is
    empty or holds whitespace or a control character is quoted as JSON in brackets
    (``parallel["\\n"]``), so a path is always one line."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part or not part.isprintable() or any(c.isspace() for c in part):
            out += f"[{json.dumps(part)}]"
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
    scope: tuple[PathPart, ...] | None = field(default=None, compare=False)
    """For a problem a model's rule over several fields found (its fields each validated):
    where that model is (its rules were all checked); ``None`` for a field's own type or
    range."""

    @property
    def where(self) -> str:
        """The path as text, e.g. ``spec.context.dwdp.gatherKernel``."""
        return format_path(self.path)

    def under(self, prefix: Sequence[PathPart]) -> Problem:
        """The same problem seen from a parent object at ``prefix``."""
        scope = None if self.scope is None else (*prefix, *self.scope)
        return Problem((*prefix, *self.path), self.value, self.rule, scope)

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
    exc: ValidationError,
    prefix: Sequence[PathPart] = (),
    *,
    model: type[BaseModel] | None = None,
) -> list[Problem]:
    """Turn a pydantic ``ValidationError`` into problems with camelCase paths.

    Paths come from pydantic's ``loc`` (aliases, since every model sets
    ``loc_by_alias``); tagged-union and function-validator segments are dropped. An
    unknown field is worded by :func:`dwdp.api.dropped.unknown_field_rules`; ``model``,
    the validated class, lets it name the nearest known field.
    """
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(part for part in err["loc"] if not _is_machinery(part))
        ctx = err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, RuleViolations):
            problems.extend(dataclasses.replace(p.under((*prefix, *loc)), scope=(*prefix, *loc))
                            for p in inner.problems)
            continue
        kind = err["type"]
        if kind == "extra_forbidden":
            known = _field_names(model, loc[:-1])
            rules = unknown_field_rules((*prefix, *loc), err.get("input"), known)
            problems.extend(Problem(path, UNSET, rule) for path, rule in rules)
            continue
        value = UNSET if kind == "missing" else err.get("input", UNSET)
        rule = _PLAIN_WORDS.get(kind) or _length_rule(err) or _lower_first(err["msg"])
        problems.append(Problem((*prefix, *loc), value, rule))
    return problems


def _length_rule(err: Mapping[str, Any]) -> str | None:
    """A list's length rule in plain words ("must have 3 items" where the least and the most
    are equal), ``None`` for any other error."""
    ctx = err.get("ctx") or {}
    low, high = ctx.get("min_length"), ctx.get("max_length")
    if err["type"] == "too_short":
        return f"must have {'' if low == high else 'at least '}{low} items"
    if err["type"] == "too_long":
        return f"must have {'' if low == high else 'at most '}{high} items"
    return None


MAX_PASSES = 4
"""Validation passes of :func:`all_problems` at most (each drops the fields found broken)."""


def all_problems(model: type[BaseModel], data: object) -> list[Problem]:
    """Every problem of ``data`` as ``model``, in one report (no rounds).

    pydantic checks a model's cross-field rules only once its fields validated, so a broken
    field (wrong type, out of range, or breaking a rule of its own object) hides the rules
    of the objects around it until it is fixed. Each pass validates a copy of ``data``
    without the fields the earlier passes found broken (they take their defaults) and adds
    the problems at paths not reported yet (nor above or below one). A field dropped for a
    cross-field rule leaves that rule's object fully checked already: new problems of its
    rules or of the objects inside it (its default meeting another rule) are not the
    document's and are left out.
    Stops when a pass adds nothing (at most ``MAX_PASSES``)."""
    found: dict[tuple[PathPart, ...], Problem] = {}
    checked: list[tuple[PathPart, ...]] = []  # objects whose every rule already ran
    doc = copy.deepcopy(data)
    for _ in range(MAX_PASSES):
        try:
            model.model_validate(doc, by_name=False)  # a document: camelCase names only
            break
        except ValidationError as exc:
            new = [p for p in problems_from_validation_error(exc, model=model)
                   if not _related(p.path, found) and not _rechecked(p, checked)]
        if not new:
            break
        for problem in new:
            found.setdefault(problem.path, problem)
            if problem.scope is not None:
                checked.append(problem.scope)
            _drop(doc, problem.path)
    return list(found.values())


def _rechecked(problem: Problem, checked: Sequence[tuple[PathPart, ...]]) -> bool:
    """Whether ``problem`` comes from a rule of an object (or of one inside it) whose rules
    all ran in an earlier pass."""
    scope = problem.scope
    return scope is not None and any(scope[: len(s)] == s for s in checked)


def _related(path: tuple[PathPart, ...], found: Mapping[tuple[PathPart, ...], Problem]) -> bool:
    """Whether ``path`` lies under, is, or holds a field already reported broken (an object
    left empty by a drop reports at its own path what its dropped field already said)."""
    return any(path[: len(p)] == p or p[: len(path)] == path for p in found)


def _drop(doc: object, path: Sequence[PathPart]) -> None:
    """Remove the field at ``path`` from ``doc`` in place (nothing when it is not there),
    and each object above it that only held it (an unknown section of dropped fields). A
    list item goes with its whole list (every item's problems are reported in the same
    pass), so the rules around the list run in the next one."""
    if path and isinstance(path[-1], int):
        _drop(doc, path[:-1])
        return
    *parents, leaf = path or (None,)
    chain: list[tuple[Any, PathPart]] = []
    node: Any = doc
    for part in parents:
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_list or (isinstance(node, Mapping) and part in node)):
            return
        chain.append((node, part))
        node = node[part]
    if not (isinstance(node, dict) and leaf in node):
        return
    del node[leaf]
    for parent, part in reversed(chain):
        if not (isinstance(parent, dict) and parent[part] == {}):
            break
        del parent[part]


def _field_names(model: type[BaseModel] | None, loc: Sequence[PathPart]) -> list[str]:
    """The camelCase field names of the model at ``loc`` under ``model`` (list items
    followed through), or none when the path leaves the models."""
    current = model
    for part in loc:
        if current is None:
            return []
        if isinstance(part, str):
            fields = current.model_fields.items()
            info = next((f for n, f in fields if (f.alias or n) == part), None)
            current = _model_in(info.annotation) if info is not None else None
    return [] if current is None else [f.alias or n for n, f in current.model_fields.items()]


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The model class an annotation holds (itself, or inside Optional, list, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in reversed(typing.get_args(annotation)):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_machinery(part: object) -> bool:
    return isinstance(part, str) and (
        part.startswith("function-") or part in {"json-or-python[json=...,python=...]"}
    )


def _lower_first(text: str) -> str:
    text = text.removeprefix("Value error, ")
    if text.startswith("Input should be"):
        text = "must be" + text[len("Input should be") :]
    return text[:1].lower() + text[1:]
