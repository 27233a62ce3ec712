"""The tool calls in a model's generated text, as OpenAI's ``tool_calls``: the one home of the
formats a model writes them in, whole (``parse``) or streamed (``StreamParser``).

Two formats, the ones vLLM's ``hermes`` and ``deepseek_v3`` tool parsers read:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): a call is a ``<tool_call>`` ... ``</tool_call>`` block
  around a JSON object ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is accepted for
  ``"arguments"``; a call without either has no arguments, ``{}``).
- ``deepseek_v3`` (DeepSeek-V3, V3.1, R1): the calls sit in a ``<｜tool▁calls▁begin｜>`` ...
  ``<｜tool▁calls▁end｜>`` section, each in a ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>``
  block that reads ``function<｜tool▁sep｜>NAME`` then the arguments in a fenced ```` ```json ````
  block (V3), or ``NAME<｜tool▁sep｜>`` then the bare arguments (V3.1); either form's arguments
  are read fenced or bare. The section's own markers
  are framing: they are never content.

The rules, the same for both formats and for both ways of reading:

- The text outside call blocks is the answer's content, joined in order and stripped of
  surrounding whitespace (``None`` when nothing is left).
- A block is a call when its arguments are a JSON object (or a JSON text of one) and its name is
  a non-empty string; any other block is left in the content as written, markers included (as
  vLLM does: text that is not a valid call stays text).
- A block the text ends inside (no end marker: the answer was cut short) is read the same way.
- A call's arguments are re-written as compact JSON (``json.dumps`` with ``","``/``":"``
  separators, non-ASCII kept), the same text whole or streamed.

A stream holds back what it cannot decide yet: a piece of text that may be the start of a
marker, a block until its end marker, and whitespace until more content follows it. So any split
of a text into deltas reassembles to what ``parse`` reads from the whole text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

FORMATS: tuple[str, ...] = ("hermes", "deepseek_v3")
"""The tool-call formats this module reads."""

HERMES_BEGIN = "<tool_call>"
HERMES_END = "</tool_call>"
DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"

_MODEL_TYPES: dict[str, str] = {
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
}
"""``config.model_type`` -> the format its chat template makes the model write."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as a compact JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """A whole answer: its ``content`` (the text outside calls, stripped; ``None`` when empty)
    and its ``calls`` in the order written."""

    content: str | None
    calls: tuple[ToolCall, ...]


@dataclass(slots=True)
class CallDelta:
    """A piece of a streamed call: its ``index`` among the answer's calls, its ``name`` (on the
    call's first delta only) and the next piece of its ``arguments`` text."""

    index: int
    name: str | None = None
    arguments: str = ""


def format_of(chat_template: str | None, model_type: str | None) -> str | None:
    """The tool-call format a model writes: from its chat template's markers first
    (``<tool_call>``: hermes; ``tool▁calls▁begin``: deepseek_v3), else from its
    ``config.model_type`` (deepseek_v2/v3: deepseek_v3; qwen2, qwen2_moe, qwen3, qwen3_moe:
    hermes); ``None`` when neither tells."""
    if chat_template:
        if HERMES_BEGIN in chat_template:
            return "hermes"
        if "tool▁calls▁begin" in chat_template:
            return "deepseek_v3"
    return _MODEL_TYPES.get(model_type or "")


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call(name: object, arguments: object) -> ToolCall | None:
    """The call of ``name`` with ``arguments`` (a JSON object, or a JSON text of one); ``None``
    when either is not what a call needs."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name.strip(), arguments=_compact(arguments))


def _hermes_call(body: str) -> ToolCall | None:
    """The call a ``<tool_call>`` block's ``body`` writes; ``None`` when it writes none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj.get("name"), arguments)


def _unfenced(text: str) -> str:
    """``text`` without a surrounding ```` ``` ```` fence (its opening line, ```` ```json ````,
    and its closing ```` ``` ````), stripped."""
    text = text.strip()
    if text.startswith("```"):
        _, _, text = text.partition("\n")
        text = text.rstrip()
        if text.endswith("```"):
            text = text[:-3]
    return text.strip()


def _deepseek_call(body: str) -> ToolCall | None:
    """The call a ``<｜tool▁call▁begin｜>`` block's ``body`` writes, in the V3 form
    (``function<｜tool▁sep｜>NAME``, a new line, then the arguments) or the V3.1 form
    (``NAME<｜tool▁sep｜>`` then the arguments), the arguments in a ```` ``` ```` fence or bare;
    ``None`` when it writes none."""
    head, sep, tail = body.partition(DEEPSEEK_SEP)
    if not sep:
        return None
    name, arguments = head.strip(), tail
    if name == "function":
        first, newline, rest = tail.partition("\n")
        if newline and not first.lstrip().startswith("{"):
            name, arguments = first.strip(), rest
    try:
        return _call(name, json.loads(_unfenced(arguments)))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class _Grammar:
    """A format's framing. ``scopes``: per scope, the markers read there and the scope each one
    leads to (``"call"``: a call block, read until ``call_end``, after which the scope that
    opened it goes on); the first scope is where an answer starts. ``call``: the call a block's
    body writes."""

    scopes: dict[str, dict[str, str]]
    call_end: str
    call: Callable[[str], ToolCall | None]


_GRAMMARS: dict[str, _Grammar] = {
    "hermes": _Grammar(
        scopes={"text": {HERMES_BEGIN: "call"}},
        call_end=HERMES_END,
        call=_hermes_call,
    ),
    "deepseek_v3": _Grammar(
        scopes={
            "text": {DEEPSEEK_CALLS_BEGIN: "calls"},
            "calls": {DEEPSEEK_CALL_BEGIN: "call", DEEPSEEK_CALLS_END: "text"},
        },
        call_end=DEEPSEEK_CALL_END,
        call=_deepseek_call,
    ),
}


def _grammar(fmt: str) -> _Grammar:
    if fmt not in _GRAMMARS:
        raise ValueError(f"tool call format: {fmt!r} is not one of {', '.join(FORMATS)}")
    return _GRAMMARS[fmt]


def _undecided(text: str, markers: dict[str, str]) -> int:
    """The length of the longest end of ``text`` that may be the start of one of ``markers``
    (a proper prefix: a whole marker is found, not held)."""
    longest = max(len(m) for m in markers) - 1
    for size in range(min(longest, len(text)), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def _first_marker(text: str, markers: dict[str, str]) -> tuple[int, str] | None:
    """Where the first of ``markers`` in ``text`` starts, and which it is; ``None``: none is."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


_Event = str | ToolCall
"""What the scanner reads: a piece of content (unstripped) or a call."""


class _Scanner:
    """The framing of a format over text that arrives in pieces: ``push`` returns the events
    decided so far, ``end`` those of the text held back at the end."""

    def __init__(self, grammar: _Grammar) -> None:
        self._grammar = grammar
        self._scope = next(iter(grammar.scopes))
        self._block: str | None = None  # the begin marker of the open call block, if any
        self._held = ""
        self._searched = 0  # how much of an open block's text holds no end marker

    def push(self, text: str) -> list[_Event]:
        self._held += text
        events: list[_Event] = []
        while self._held and self._step(events):
            pass
        return events

    def _step(self, events: list[_Event]) -> bool:
        """Decide what can be decided of the held text; whether a marker was passed (so more
        may be decidable)."""
        return self._step_block(events) if self._block is not None else self._step_scope(events)

    def _step_scope(self, events: list[_Event]) -> bool:
        markers = self._grammar.scopes[self._scope]
        found = _first_marker(self._held, markers)
        if found is None:
            keep = _undecided(self._held, markers)
            events.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        at, marker = found
        events.append(self._held[:at])
        self._held = self._held[at + len(marker) :]
        if markers[marker] == "call":
            self._block, self._searched = marker, 0
        else:
            self._scope = markers[marker]
        return True

    def _step_block(self, events: list[_Event]) -> bool:
        end = self._grammar.call_end
        at = self._held.find(end, self._searched)
        if at < 0:
            self._searched = max(0, len(self._held) - len(end) + 1)
            return False
        events.append(self._close(self._held[:at], end))
        self._held = self._held[at + len(end) :]
        return True

    def _close(self, body: str, end: str) -> _Event:
        """The event of the open block with ``body`` (``end``: its end marker, or "" when the
        text ended inside it): its call, or its text as written."""
        begin, self._block = self._block or "", None
        call = self._grammar.call(body)
        return call if call is not None else begin + body + end

    def end(self) -> list[_Event]:
        held, self._held = self._held, ""
        return [self._close(held, "")] if self._block is not None else [held]


class _Content:
    """The content of a stream, stripped as it goes: leading whitespace is dropped, other
    whitespace held until more content follows it (and dropped if none does)."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept) :]
        return kept


class StreamParser:
    """The tool calls of a streamed answer, read as it arrives: ``feed(delta)`` returns
    ``(content_delta, calls)`` for each new piece of text, ``finish()`` the same for what was
    held back at the end (the module docstring says what is held, and why).

    Reassembled, the content deltas equal ``parse``'s content (``""`` for ``None``), and per
    index the name plus the concatenated argument pieces equal its calls, whatever the split:
    a call is sent whole, as one delta, once its block is complete."""

    def __init__(self, fmt: str) -> None:
        self._scanner = _Scanner(_grammar(fmt))
        self._content = _Content()
        self._calls = 0

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        return self._emit(self._scanner.push(delta))

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._emit(self._scanner.end())

    def _emit(self, events: list[_Event]) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        calls: list[CallDelta] = []
        for event in events:
            if isinstance(event, ToolCall):
                calls.append(CallDelta(self._calls, event.name, event.arguments))
                self._calls += 1
            else:
                content.append(self._content.push(event))
        return "".join(content), calls


def parse(text: str, fmt: str) -> Parsed:
    """The content and calls of a whole answer ``text`` written in format ``fmt`` (one of
    :data:`FORMATS`; ``ValueError`` otherwise), by the module docstring's rules."""
    scanner = _Scanner(_grammar(fmt))
    events = scanner.push(text) + scanner.end()
    content = "".join(e for e in events if isinstance(e, str)).strip()
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    return Parsed(content=content or None, calls=calls)
