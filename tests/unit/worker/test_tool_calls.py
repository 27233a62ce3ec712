"""The tool calls in generated text (``dwdp.worker.server.tool_calls``): the hermes and
deepseek_v3 formats read whole, with zero, one and two calls and content around them; blocks
that are not valid calls stay content; the format a model writes, from its chat template or its
model type; and a streamed answer, split anywhere (one character at a time, random chunks),
reassembles to what the whole text parses to."""

from __future__ import annotations

import random

import pytest

from dwdp.worker.server.tool_calls import (
    FORMATS,
    CallDelta,
    Parsed,
    StreamParser,
    ToolCall,
    format_of,
    parse,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

WEATHER = ToolCall(name="get_weather", arguments='{"city":"Paris","unit":"c"}')
TIME = ToolCall(name="get_time", arguments='{"zone":"Europe/Zürich"}')


def _hermes(name: str, args_json: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args_json}}}\n</tool_call>'


def _v3(name: str, args_json: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args_json}\n```{CALL_END}"


def _v31(name: str, args_json: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args_json}{CALL_END}"


W_ARGS = '{"city": "Paris", "unit": "c"}'
T_ARGS = '{"zone": "Europe/Zürich"}'

STREAM_CASES = [
    ("hermes", "Just text, no call: a < b and <tool but not a marker <tool_cal"),
    ("hermes", "Let me check.\n" + _hermes("get_weather", W_ARGS)),
    ("hermes", f"Two.\n{_hermes('get_weather', W_ARGS)}\n{_hermes('get_time', T_ARGS)}\n"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> then " + _hermes("get_time", T_ARGS)),
    ("hermes", "Cut short " + _hermes("get_weather", W_ARGS)[:-12]),
    ("hermes", "Cut inside the JSON " + _hermes("get_weather", W_ARGS)[:30]),
    ("deepseek_v3", "Plain text with <｜tool▁ but no calls <｜tool▁calls▁beg"),
    ("deepseek_v3", f"Checking.{CALLS_BEGIN}{_v3('get_weather', W_ARGS)}{CALLS_END}"),
    (
        "deepseek_v3",
        f"Two.{CALLS_BEGIN}{_v3('get_weather', W_ARGS)}\n{_v3('get_time', T_ARGS)}{CALLS_END}",
    ),
    ("deepseek_v3", f"{CALLS_BEGIN}{_v31('get_weather', W_ARGS)}{_v31('get_time', T_ARGS)}"),
    ("deepseek_v3", f"Bad.{CALLS_BEGIN}{CALL_BEGIN}oops{CALL_END}{_v31('get_time', T_ARGS)}"),
]


def _streamed(fmt: str, pieces: list[str]) -> Parsed:
    """The answer a stream of ``pieces`` reassembles to (content deltas joined; per call index,
    the name of its first delta and its argument pieces joined)."""
    parser = StreamParser(fmt)
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for text, deltas in outputs:
        content.append(text)
        for delta in deltas:
            if delta.index not in names:
                assert delta.name is not None, "a call's first delta names it"
                names[delta.index] = delta.name
            else:
                assert delta.name is None, "only a call's first delta names it"
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    assert sorted(names) == list(range(len(names))), "call indexes are 0, 1, ... in order"
    calls = tuple(ToolCall(names[i], arguments[i]) for i in range(len(names)))
    return Parsed(content="".join(content) or None, calls=calls)


def _chunks(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 12)
        pieces.append(text[at : at + size])
        at += size
    return pieces


def test_hermes_text_without_calls_is_all_content() -> None:
    assert parse("  Hello there.\n", "hermes") == Parsed(content="Hello there.", calls=())
    assert parse("", "hermes") == Parsed(content=None, calls=())


def test_hermes_one_call_with_content_before() -> None:
    text = "Let me check the weather.\n" + _hermes("get_weather", W_ARGS)
    assert parse(text, "hermes") == Parsed(content="Let me check the weather.", calls=(WEATHER,))


def test_hermes_two_calls_without_content() -> None:
    text = _hermes("get_weather", W_ARGS) + "\n" + _hermes("get_time", T_ARGS) + "\n"
    assert parse(text, "hermes") == Parsed(content=None, calls=(WEATHER, TIME))


def test_hermes_parameters_is_accepted_for_arguments() -> None:
    text = _hermes("get_weather", W_ARGS, key="parameters")
    assert parse(text, "hermes").calls == (WEATHER,)


def test_hermes_call_without_arguments_has_empty_object() -> None:
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert parse(text, "hermes").calls == (ToolCall(name="now", arguments="{}"),)


def test_hermes_arguments_as_json_text_are_decoded() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Zürich\\"}"}'
    assert parse(text + "</tool_call>", "hermes").calls == (TIME,)


def test_hermes_arguments_are_compact_json_with_non_ascii_kept() -> None:
    (call,) = parse(_hermes("get_time", '{ "zone" :  "Europe/Zürich" }'), "hermes").calls
    assert call.arguments == '{"zone":"Europe/Zürich"}'


def test_hermes_malformed_json_stays_content() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    text = "Before. " + bad + " " + _hermes("get_time", T_ARGS)
    assert parse(text, "hermes") == Parsed(content="Before. " + bad, calls=(TIME,))


def test_hermes_block_without_string_name_stays_content() -> None:
    for bad in (
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
        '<tool_call>["f", {}]</tool_call>',
    ):
        assert parse(bad, "hermes") == Parsed(content=bad, calls=()), bad


def test_hermes_block_cut_short_is_a_call_when_its_json_is_whole() -> None:
    whole = _hermes("get_weather", W_ARGS)[: -len("</tool_call>")]
    assert parse(whole, "hermes").calls == (WEATHER,)
    cut = whole[:30]
    assert parse(cut, "hermes") == Parsed(content=cut, calls=())


def test_deepseek_text_without_calls_is_all_content() -> None:
    assert parse("Just prose.", "deepseek_v3") == Parsed(content="Just prose.", calls=())


def test_deepseek_v3_one_call_with_content_before() -> None:
    text = f"Checking the weather.{CALLS_BEGIN}{_v3('get_weather', W_ARGS)}{CALLS_END}"
    want = Parsed(content="Checking the weather.", calls=(WEATHER,))
    assert parse(text, "deepseek_v3") == want


def test_deepseek_v3_two_calls() -> None:
    text = f"{CALLS_BEGIN}{_v3('get_weather', W_ARGS)}\n{_v3('get_time', T_ARGS)}{CALLS_END}"
    assert parse(text, "deepseek_v3") == Parsed(content=None, calls=(WEATHER, TIME))


def test_deepseek_v31_calls_without_type_and_fence() -> None:
    text = f"Two calls.{CALLS_BEGIN}{_v31('get_weather', W_ARGS)}{_v31('get_time', T_ARGS)}"
    want = Parsed(content="Two calls.", calls=(WEATHER, TIME))
    assert parse(text + CALLS_END, "deepseek_v3") == want


def test_deepseek_v31_function_named_function() -> None:
    text = f"{CALLS_BEGIN}{_v31('function', W_ARGS)}{CALLS_END}"
    want = ToolCall(name="function", arguments=WEATHER.arguments)
    assert parse(text, "deepseek_v3").calls == (want,)


def test_deepseek_malformed_call_stays_content() -> None:
    bad = f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": \n```{CALL_END}'
    text = f"Before.{CALLS_BEGIN}{bad}{_v3('get_time', T_ARGS)}{CALLS_END}"
    assert parse(text, "deepseek_v3") == Parsed(content="Before." + bad, calls=(TIME,))


def test_deepseek_call_without_separator_stays_content() -> None:
    bad = f"{CALL_BEGIN}get_weather {W_ARGS}{CALL_END}"
    assert parse(CALLS_BEGIN + bad + CALLS_END, "deepseek_v3") == Parsed(content=bad, calls=())


def test_deepseek_text_after_the_calls_is_content() -> None:
    text = f"Before.{CALLS_BEGIN}{_v31('get_time', T_ARGS)}{CALLS_END} After."
    assert parse(text, "deepseek_v3") == Parsed(content="Before. After.", calls=(TIME,))


def test_format_of_reads_the_chat_template_first() -> None:
    qwen = '{%- if tools %}...<tool_call>\\n{"name": ...}</tool_call>{%- endif %}'
    deepseek = "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}"
    assert format_of(qwen, None) == "hermes"
    assert format_of(deepseek, None) == "deepseek_v3"
    assert format_of(qwen, "deepseek_v3") == "hermes"
    assert format_of(deepseek, "qwen3") == "deepseek_v3"


def test_format_of_falls_back_to_the_model_type() -> None:
    for model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        assert format_of(None, model_type) == "hermes"
    for model_type in ("deepseek_v2", "deepseek_v3"):
        assert format_of("{{ messages }}", model_type) == "deepseek_v3"


def test_format_of_is_none_when_unknown() -> None:
    assert format_of(None, None) is None
    assert format_of("{{ messages }}", "llama") is None
    assert format_of("", "") is None


def test_unknown_format_is_refused() -> None:
    message = "tool call format: 'mistral' is not one of hermes, deepseek_v3"
    with pytest.raises(ValueError, match=message):
        parse("text", "mistral")
    with pytest.raises(ValueError, match=message):
        StreamParser("mistral")
    assert FORMATS == ("hermes", "deepseek_v3")


@pytest.mark.parametrize(("fmt", "text"), STREAM_CASES)
def test_stream_one_character_at_a_time_matches_parse(fmt: str, text: str) -> None:
    assert _streamed(fmt, list(text)) == parse(text, fmt)


@pytest.mark.parametrize(("fmt", "text"), STREAM_CASES)
def test_stream_random_chunks_match_parse(fmt: str, text: str) -> None:
    rng = random.Random(1234)
    for _ in range(50):
        assert _streamed(fmt, _chunks(text, rng)) == parse(text, fmt)


@pytest.mark.parametrize(("fmt", "text"), STREAM_CASES)
def test_stream_whole_text_matches_parse(fmt: str, text: str) -> None:
    assert _streamed(fmt, [text]) == parse(text, fmt)


def test_stream_sends_content_before_a_call_completes() -> None:
    parser = StreamParser("hermes")
    assert parser.feed("Let me look") == ("Let me look", [])
    assert parser.feed(" that up <tool") == (" that up", [])
    assert parser.feed('_call>\n{"name": "get_weather", ') == ("", [])
    assert parser.feed(f'"arguments": {W_ARGS}}}\n</tool_call>') == (
        "",
        [CallDelta(index=0, name="get_weather", arguments=WEATHER.arguments)],
    )
    assert parser.finish() == ("", [])


def test_stream_releases_text_that_turns_out_not_to_be_a_marker() -> None:
    parser = StreamParser("hermes")
    assert parser.feed("x <tool_c") == ("x", [])
    assert parser.feed("ar") == (" <tool_car", [])
    assert parser.finish() == ("", [])


def test_stream_gives_a_held_back_prefix_at_finish() -> None:
    parser = StreamParser("deepseek_v3")
    assert parser.feed("Done <｜tool▁") == ("Done", [])
    assert parser.finish() == (" <｜tool▁", [])
