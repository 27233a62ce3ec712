"""Tool calls on chat completions, as OpenAI defines them: ``tools``, ``tool_choice``,
``parallel_tool_calls`` in; ``message.tool_calls`` and ``finish_reason: "tool_calls"`` out.

The tools reach the model through its chat template (``apply_chat_template(tools=...)``: the
template renders them as its family expects, and renders the conversation's assistant
``tool_calls`` and ``role: tool`` answers). The model writes calls in its family's format,
read from its chat template (``tool_calls.format_of``: ``hermes`` for Qwen3's, ``deepseek_v3``
for DeepSeek-V3's). ``tool_choice``:

- ``none``: the tools are shown, the answer is text (no parsing);
- ``auto`` (the default with tools): the answer is free; calls are parsed out of its text;
- ``required``: the answer must call at least one tool, ``{"type": "function", "function":
  {"name": ...}}`` must call that one: both are constrained by a grammar of the format's
  markers and each function's ``parameters`` schema (xgrammar's structural tag for the model
  family), so the arguments are valid JSON under their schema. The answer is calls only (no
  text before them, as OpenAI's ``required`` answers).

An answer with calls carries them as ``message.tool_calls`` (ids ``call_<hex>``, ``type:
function``, the arguments as JSON text), the rest of its text as ``content`` (``null`` when
none), and ``finish_reason: "tool_calls"`` (a named ``tool_choice`` keeps ``"stop"``, as
OpenAI answers). ``parallel_tool_calls: false`` keeps the first call. Streamed, the calls come
as OpenAI's ``delta.tool_calls`` entries (``index``, ``id``, ``type``, ``function.name`` and
the whole ``function.arguments`` once a call is complete).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from dwdp.worker.engine.grammar import MAX_JSON_WHITESPACE
from dwdp.worker.engine.protocol import StructuredOutput
from dwdp.worker.server import tool_calls
from dwdp.worker.server.errors import ServingError
from dwdp.worker.server.fields import RequestPart
from dwdp.worker.server.structured import check_schema

MAX_TOOLS = 128
"""The most tools one request may offer (OpenAI's bound)."""

XGRAMMAR_FORMATS = {"hermes": "qwen_3", "deepseek_v3": "deepseek_r1"}
"""Our tool-call format -> xgrammar's model family whose structural tag writes it."""

FunctionName = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class FunctionDefinition(RequestPart):
    """A tool's function: its name, what it does and its arguments' JSON schema."""

    name: str = FunctionName
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted either way: a constrained call's "
                                "arguments always follow the whole schema.")


class Tool(RequestPart):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestPart):
    name: str = FunctionName


class NamedToolChoice(RequestPart):
    """``tool_choice`` naming the function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


class ToolFields(RequestPart):
    """The tool fields of a chat request."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function.")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer.")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with tools, resolved once (``tool_plan``)."""

    mode: Literal["none", "auto", "required", "named"] = "none"
    fmt: str | None = None
    """The model's tool-call format (``tool_calls.FORMATS``); None without tools."""
    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template takes them."""
    constraint: StructuredOutput | None = None
    """The grammar of a required or named call."""
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer's text is read for calls."""
        return self.mode != "none"


def tool_plan(fields: ToolFields, chat_template: str | None) -> ToolPlan:
    """The request's ``ToolPlan``; ``ServingError`` 400 naming the field, the value and the
    rule for a choice without tools, a named function not among them, a malformed
    ``parameters`` schema, or tools the model's template gives no call format."""
    tools, choice = fields.tools, fields.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ServingError(400, f"tool_choice: {_shown(choice)} needs tools (none given)")
        return ToolPlan()
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ServingError(400, f"tools: the function name {twice!r} is given twice; names "
                           "tell calls apart, each must be unique")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ServingError(400, f"tool_choice.function.name: {choice.function.name!r} is not "
                           f"one of the tools ({', '.join(names)})")
    mode = "named" if isinstance(choice, NamedToolChoice) else (choice or "auto")
    fmt = tool_calls.format_of(chat_template, None)
    if mode != "none" and fmt is None:
        raise ServingError(400, f"tool_choice: {mode} needs a chat template that writes tool "
                           f"calls in a format this server reads ({', '.join(tool_calls.FORMATS)}"
                           "); this model's does not (tool_choice none only shows the tools)")
    listed = [t.model_dump(exclude_none=True) for t in tools]
    constraint = None
    if mode in ("required", "named") and fmt is not None:
        constraint = _call_grammar(fmt, listed, choice, fields.parallel_tool_calls)
    return ToolPlan(mode, fmt, listed, constraint, fields.parallel_tool_calls)


def _check_parameters(parameters: dict[str, Any] | None, field: str) -> None:
    """A function's ``parameters``: a JSON schema of an object (OpenAI's rule: the arguments
    are a JSON object), or none (no arguments)."""
    if parameters is None:
        return
    check_schema(parameters, field)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ServingError(400, f"{field}.type: {kind!r}; a function's arguments are a JSON "
                           "object, so its parameters schema has type 'object'")


def _shown(choice: object) -> str:
    return repr(choice.model_dump() if isinstance(choice, NamedToolChoice) else choice)


def _call_grammar(fmt: str, tools: list[dict[str, Any]], choice: Any,
                  parallel: bool) -> StructuredOutput:
    """The structural tag of a required or named call in ``fmt`` (xgrammar's builder)."""
    import xgrammar as xgr

    wanted = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    offered: list[Any] = [_with_parameters(t) for t in tools]
    tag = xgr.get_model_structural_tag(
        XGRAMMAR_FORMATS[fmt], tools=offered, tool_choice=wanted, reasoning="disabled",
        parallel_tool_calls=parallel, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    spec = tag.model_dump(mode="json")
    if spec["format"].get("type") == "triggered_tags":  # text, then calls: calls only
        spec["format"] = {"type": "tags_with_separator", "tags": spec["format"]["tags"],
                          "separator": "\n", "at_least_one": True,
                          "stop_after_first": not parallel}
    return StructuredOutput("structural_tag", json.dumps(spec), "tools")


def _with_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool whose function has no ``parameters`` takes no arguments: ``{}`` (OpenAI's empty
    parameter list; xgrammar would allow any JSON value)."""
    function = tool["function"]
    if "parameters" in function:
        return tool
    none = {"type": "object", "properties": {}, "additionalProperties": False}
    return {**tool, "function": {**function, "parameters": none}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_entry(call: tool_calls.ToolCall) -> dict[str, Any]:
    """One OpenAI ``message.tool_calls`` entry."""
    return {"id": _call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """The answer's finish reason: ``tool_calls`` when it ended calling (not for a named
    choice, which OpenAI answers with ``stop``)."""
    if called and reason == "stop" and plan.mode != "named":
        return "tool_calls"
    return reason


def answer(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content and ``tool_calls`` entries (none when ``plan`` parses not)."""
    if not plan.parses or plan.fmt is None:
        return text, []
    parsed = tool_calls.parse(text, plan.fmt)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    return parsed.content, [_call_entry(c) for c in calls]


@dataclass(slots=True)
class ToolStream:
    """The tool-call deltas of one streamed choice."""

    plan: ToolPlan
    parser: tool_calls.StreamParser | None = None
    calls: int = 0
    """Calls begun so far (``finish_reason`` is ``tool_calls`` once there is one)."""

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat ``delta`` of one update's ``text`` (``final``: the last update)."""
        if not self.plan.parses or self.plan.fmt is None:
            return {"content": text}
        if self.parser is None:
            self.parser = tool_calls.StreamParser(self.plan.fmt)
        content, pieces = self.parser.feed(text)
        if final:
            more, rest = self.parser.finish()
            content, pieces = content + more, pieces + rest
        entries = []
        for piece in pieces:
            if not self.plan.parallel and piece.index > 0:
                continue
            self.calls = max(self.calls, piece.index + 1)
            entry: dict[str, Any] = {"index": piece.index,
                                     "function": {"arguments": piece.arguments}}
            if piece.name is not None:  # a call's first delta carries its id and name
                entry.update(id=_call_id(), type="function")
                entry["function"]["name"] = piece.name
            entries.append(entry)
        out: dict[str, Any] = {"content": content}
        if entries:
            out["tool_calls"] = entries
        return out
