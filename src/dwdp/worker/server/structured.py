"""Structured outputs as the OpenAI-compatible endpoints take them: the request fields that
constrain an answer, read into the engine's one ``StructuredOutput``.

The fields, as OpenAI and vLLM define them:

- ``response_format`` (OpenAI, chat): ``{"type": "text"}`` (free text), ``{"type":
  "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (an answer valid under ``schema``; ``strict`` or not,
  the grammar enforces the whole schema);
- ``structured_outputs`` (vLLM, completions and chat): exactly one of ``json`` (a schema, as an
  object or its JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or
  ``json_object: true``; ``disable_any_whitespace`` asks for compact JSON;
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older names of
  the same, still sent by older clients).

A request names at most one of them. A JSON schema is checked against its metaschema (JSON
Schema draft 2020-12, with ``jsonschema``) before the engine sees it: a malformed one is a 400
naming the path inside the schema (``response_format.json_schema.schema.properties.age.type:
'nonsense' is not valid ...``). What the metaschema allows but the grammar engine cannot
compile is the engine's 400 naming the field (``dwdp.worker.engine.grammar``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from dwdp.worker.engine.protocol import StructuredOutput
from dwdp.worker.server.errors import ServingError
from dwdp.worker.server.fields import RequestPart

MAX_SOURCE = 131_072
"""The longest schema (as JSON text), regex, grammar or list of choices a request may carry
(characters): a grammar's compile time grows with it (a 2 MB enum took minutes of a core)."""

MAX_SCHEMA_DEPTH = 64
"""The deepest nesting of objects and lists a JSON schema may have (OpenAI's own bound is 10;
a deeper one exhausts the checker's recursion)."""

Source = Annotated[str, Field(min_length=1, max_length=MAX_SOURCE)]


class JsonSchemaSpec(RequestPart):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=MAX_SOURCE)
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the answer is valid under.")
    strict: bool | None = Field(
        None, description="Accepted either way: the grammar enforces the whole schema.")


class ResponseFormat(RequestPart):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(RequestPart):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    json_: dict[str, Any] | Source | None = Field(None, alias="json")
    regex: Source | None = None
    choice: list[Annotated[str, Field(max_length=MAX_SOURCE)]] | None = Field(
        None, min_length=1, max_length=4096)
    grammar: Source | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(
        False, description="JSON without whitespace between its tokens (the compact form).")


class StructuredFields(RequestPart):
    """The constraining fields of a completion or chat request (mixed into both)."""

    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's field: text, json_object or json_schema (the answer is "
        "valid under the schema).")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's structured outputs: json, regex, choice, grammar or "
        "json_object.")
    guided_json: dict[str, Any] | Source | None = Field(
        None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: Source | None = Field(
        None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: list[Annotated[str, Field(max_length=MAX_SOURCE)]] | None = Field(
        None, min_length=1, max_length=4096,
        description="vLLM's older name of structured_outputs.choice.")
    guided_grammar: Source | None = Field(
        None, description="vLLM's older name of structured_outputs.grammar.")

    def constrains(self) -> bool:
        """Whether any constraining field is set (``structured`` has work to do)."""
        return any(v is not None for v in (
            self.response_format, self.structured_outputs, self.guided_json, self.guided_regex,
            self.guided_choice, self.guided_grammar))

    def structured(self, tool_call: StructuredOutput | None = None) -> StructuredOutput | None:
        """The one constraint this request asks for, ``None`` for free text; ``tool_call``:
        the grammar of a required or named tool call (``ToolPlan.constraint``), one more
        constraint. ``ServingError`` 400 naming the field for two constraints, none inside
        ``structured_outputs`` where one is needed, or a malformed JSON schema."""
        found = [c for c in (*self._constraints(), tool_call) if c is not None]
        if len(found) > 1:
            raise ServingError(400, f"{found[1].field.split('.')[0]}: a request takes one "
                               f"constraint, it already has {found[0].field.split('.')[0]}")
        return found[0] if found else None

    def _constraints(self) -> list[StructuredOutput | None]:
        """Each constraining field's constraint (``None`` where absent)."""
        out: list[StructuredOutput | None] = [_vllm(self.structured_outputs)]
        out += [
            _json(self.guided_json, "guided_json") if self.guided_json is not None else None,
            _plain("regex", self.guided_regex, "guided_regex"),
            _choice(self.guided_choice, "guided_choice"),
            _plain("grammar", self.guided_grammar, "guided_grammar"),
        ]
        out.append(_openai(self.response_format) if self.response_format is not None else None)
        return out


def _openai(fmt: ResponseFormat) -> StructuredOutput | None:
    """``response_format``'s constraint (``None`` for text)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", field="response_format")
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise ServingError(400, "response_format.json_schema.schema: required with type "
                           "json_schema (the schema the answer must be valid under)")
    return _json(spec.schema_, "response_format.json_schema.schema")


def _vllm(so: StructuredOutputs | None) -> StructuredOutput | None:
    """``structured_outputs``' constraint; exactly one of its kinds."""
    if so is None:
        return None
    kinds = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None))
             if v is not None]
    if len(kinds) != 1:
        raise ServingError(400, "structured_outputs: exactly one of json, regex, choice, "
                           f"grammar, json_object is needed, got {', '.join(kinds) or 'none'}")
    whitespace = not so.disable_any_whitespace
    kind = kinds[0]
    if kind == "json":
        return _json(so.json_, "structured_outputs.json", whitespace)
    if kind == "json_object":
        return StructuredOutput("json_object", field="structured_outputs.json_object",
                                any_whitespace=whitespace)
    if kind == "choice":
        return _choice(so.choice, "structured_outputs.choice")
    return _plain(kind, so.regex if kind == "regex" else so.grammar, f"structured_outputs.{kind}")


def _plain(kind: str, source: str | None, field: str) -> StructuredOutput | None:
    return None if source is None else StructuredOutput(kind, source, field)


def _choice(choices: list[str] | None, field: str) -> StructuredOutput | None:
    if choices is None:
        return None
    source = json.dumps(choices)
    if len(source) > MAX_SOURCE:
        raise ServingError(400, f"{field}: {len(source)} characters as JSON, more than "
                           f"{MAX_SOURCE}")
    return StructuredOutput("choice", source, field)


def _json(schema: dict[str, Any] | str | None, field: str,
          any_whitespace: bool = True) -> StructuredOutput:
    """A JSON schema's constraint once the schema is checked against its metaschema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ServingError(400, f"{field}: not JSON (or nested too deep): {exc}") from exc
    if not isinstance(schema, dict):
        raise ServingError(400, f"{field}: a JSON schema is an object, got "
                           f"{type(schema).__name__}")
    check_schema(schema, field)
    return StructuredOutput("json", json.dumps(schema), field, any_whitespace)


def _depth(value: object) -> int:
    """The nesting depth of a JSON value (objects and lists), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


UNENFORCED: dict[str, object] = {
    "not": None, "if": None, "then": None, "else": None, "contains": None,
    "minContains": None, "maxContains": None, "propertyNames": None,
    "dependentRequired": None, "dependentSchemas": None, "dependencies": None,
    "uniqueItems": False, "unevaluatedProperties": True, "unevaluatedItems": True,
}
"""JSON Schema keywords the grammar engine (xgrammar 0.2) compiles without enforcing (measured:
the grammar is the same with and without them), each with the value that asks for nothing
(``None``: none does). A schema that uses one otherwise is refused: an answer that breaks it
would come back as if valid."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to subschemas (the names are not keywords)."""
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "contains",
               "unevaluatedItems", "unevaluatedProperties", "propertyNames", "not", "if", "then",
               "else", "allOf", "anyOf", "oneOf")
"""Keywords whose value is a subschema or a list of them; any other keyword's value is data
(``enum``, ``default``, an ``x-`` extension) and is not searched."""


def _subschemas(schema: dict[str, Any], path: str) -> list[tuple[object, str]]:
    """The subschemas of one schema object with their paths."""
    out: list[tuple[object, str]] = []
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out += [(sub, f"{path}.{key}.{name}") for name, sub in value.items()]
        elif key in _SUBSCHEMAS and isinstance(value, list):
            out += [(sub, f"{path}.{key}[{i}]") for i, sub in enumerate(value)]
        elif key in _SUBSCHEMAS:
            out.append((value, f"{path}.{key}"))
    return out


def _unsupported(schema: object, path: str) -> str | None:
    """A message naming the first place of ``schema`` the grammar engine would not enforce:
    a keyword of :data:`UNENFORCED` that asks for something, or a ``$ref`` outside the
    document (nothing is fetched)."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNENFORCED and value != UNENFORCED[key]:
            return (f"{path}.{key}: not enforced by this server's grammar engine, so an answer "
                    f"could break it; leave it out (the keywords refused: "
                    f"{', '.join(sorted(UNENFORCED))})")
        if key == "$ref" and not str(value).startswith("#"):
            return (f"{path}.$ref: {str(value)[:80]!r} is outside the schema; only references "
                    "within it (#/...) are resolved (nothing is fetched)")
    return next((found for sub, where in _subschemas(schema, path)
                 if (found := _unsupported(sub, where)) is not None), None)


def check_schema(schema: dict[str, Any], field: str) -> None:
    """``ServingError`` 400 naming the path inside ``schema`` where it breaks its metaschema
    (the draft its ``$schema`` names, else 2020-12), uses a keyword the grammar engine would
    not enforce (:data:`UNENFORCED`) or refers outside itself; or naming the bound the schema
    is over (:data:`MAX_SCHEMA_DEPTH`, :data:`MAX_SOURCE`)."""
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ServingError(400, f"{field}: nested {depth} levels deep, more than "
                           f"{MAX_SCHEMA_DEPTH}")
    size = len(json.dumps(schema))
    if size > MAX_SOURCE:
        raise ServingError(400, f"{field}: {size} characters as JSON, more than {MAX_SOURCE} "
                           "(its grammar's compile time grows with it)")
    from jsonschema import exceptions, validators

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    error = exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ServingError(400, f"{field}{path}: {error.message} (JSON Schema's rule for "
                           f"{cls.META_SCHEMA.get('$schema', 'this draft')})")
    unsupported = _unsupported(schema, field)
    if unsupported is not None:
        raise ServingError(400, unsupported)
