"""Structured outputs and tool calls over real HTTP (uvicorn on 127.0.0.1, a real engine, the
``openai`` package as the client), on three architectures.

Each answer obeys its constraint: ``response_format`` json_schema (validated with
``jsonschema``) and json_object, the OpenAI SDK's ``parse`` into a Pydantic model, vLLM's
``structured_outputs`` (json, regex, choice, grammar) and its ``guided_*`` names, greedy and
sampled, streamed and not. Tool calls: ``required`` and a named ``tool_choice`` answer calls
whose arguments validate against the function's parameters, in the format the model's chat
template writes (``hermes`` for the test tokenizer's template, ``deepseek_v3`` for a DeepSeek
style template); ``auto`` parses calls out of free text; streamed deltas reassemble to the
whole answer; a conversation with an assistant's calls and the tools' answers is accepted.
Bad input is a 400 naming the field, the value and the rule: a malformed schema (the path
inside it), a schema or regex the grammar engine refuses, two constraints, ``tool_choice``
without tools, a named function not among them."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from dwdp.worker.engine.protocol import SamplingParams, StructuredOutput  # noqa: E402
from dwdp.worker.server import wire  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer  # noqa: E402

KEY = "structured-outputs-test-key"
ASK = [{"role": "user", "content": "Who is it?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                      "parameters": ZONE}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": ZONE}
LONG = 600
"""max_tokens of a constrained answer: room for a random model's whitespace (a strings is
bounded by its schema's pattern: a random model may not end one by itself)."""

DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call one as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""A DeepSeek-V3 style chat template: tools shown, calls in DeepSeek's markers."""


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3"])
def client(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ck") / request.param,
                           num_experts=4)
    if request.param == "deepseek_v3":
        (path / "chat_template.jinja").write_text(DEEPSEEK_TEMPLATE)
    with EngineServer(path, api_key=KEY, kv=False, max_model_len=2048) as running:
        yield openai.OpenAI(base_url=f"{running.base}/v1", api_key=KEY, max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model="m", messages=kw.pop("messages", ASK), **kw)


def _streamed_text(client, **kw) -> tuple[str, str | None]:
    text, reason = [], None
    for event in _chat(client, stream=True, **kw):
        for choice in event.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason


def _refused(error, *starts: str) -> str:
    assert error.status_code == 400
    message = str(error.body.get("message", ""))
    assert message.startswith(starts), message
    return message


# -- structured outputs ---------------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_json_schema_answer_is_valid_under_the_schema_streamed_or_not(client, sampled):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    extra = {"temperature": 1.0, "seed": 11} if sampled else {}
    whole = _chat(client, max_tokens=LONG, response_format=fmt, **extra).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    text, reason = _streamed_text(client, max_tokens=LONG, response_format=fmt, **extra)
    assert (text, reason) == (whole.message.content, "stop")


def test_json_mode_answers_a_json_object(client):
    answer = _chat(client, max_tokens=LONG, temperature=1.0, seed=5,
                   response_format={"type": "json_object"}).choices[0]
    assert answer.finish_reason == "stop"
    assert isinstance(json.loads(answer.message.content), dict)


def test_the_sdks_parse_returns_the_pydantic_object(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(pattern="^[A-Za-z]{1,12}$")  # a random model's strings end
        member: bool

    got = client.chat.completions.parse(model="m", messages=ASK, max_tokens=LONG,
                                        response_format=Person)
    assert isinstance(got.choices[0].message.parsed, Person)


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("structured_outputs", {"choice": ["Paris", "Rome", 'say "no"']},
         lambda t: t in ("Paris", "Rome", 'say "no"')),
        ("structured_outputs", {"regex": r"[0-9]{3}-[a-z]{2,4}"},
         lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        ("structured_outputs", {"grammar": 'root ::= ("yes" | "no") "!"'},
         lambda t: t in ("yes!", "no!")),
        ("structured_outputs", {"json": json.dumps(PERSON), "disable_any_whitespace": True},
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None and "\n" not in t),
        ("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
        ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ],
    ids=["choice", "regex", "grammar", "json-compact", "guided_choice", "guided_json"],
)
def test_vllms_structured_outputs_constrain_completions_and_chat(client, field, value, check):
    done = client.completions.create(model="m", prompt="Say", max_tokens=LONG,
                                     extra_body={field: value}).choices[0]
    assert done.finish_reason == "stop" and check(done.text), done.text
    chat = _chat(client, max_tokens=LONG, temperature=0.8, seed=2,
                 extra_body={field: value}).choices[0]
    assert chat.finish_reason == "stop" and check(chat.message.content), chat.message.content


def test_a_constraint_crosses_the_engine_core_link_whole():
    """The API server process sends a request's constraint to the engine core in msgpack."""
    params = SamplingParams(structured=StructuredOutput("json", json.dumps(PERSON),
                                                        "response_format.json_schema.schema",
                                                        any_whitespace=False))
    sent = wire.Generate(id="r", prompt=[1, 2], params=params)
    got = wire.decode_request(wire.encode(sent))
    assert isinstance(got, wire.Generate) and got.params == params


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_min_tokens_does_not_hold_back_the_end_of_a_complete_grammar(client, caplog):
    done = client.completions.create(model="m", prompt="Say", max_tokens=60, extra_body={
        "structured_outputs": {"choice": ["Paris", "Rome"]}, "min_tokens": 30}).choices[0]
    assert (done.finish_reason, done.text in ("Paris", "Rome")) == ("stop", True)
    assert "forbids token" not in caplog.text  # the stop token was allowed, not forced


@pytest.mark.parametrize(
    ("body", "starts"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         ("response_format.json_schema.schema.properties.a.type: 'nonsense' is not valid",)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
         ("response_format.json_schema.schema: required",)),
        ({"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
         ("structured_outputs.json: the grammar engine refused it",)),
        ({"structured_outputs": {"regex": "a(b"}},
         ("structured_outputs.regex: the grammar engine refused it",)),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}},
         ("structured_outputs.grammar: the grammar engine refused it",)),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
         ("structured_outputs: exactly one of json, regex, choice, grammar, json_object",)),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}},
         ("guided_regex: a request takes one constraint", "response_format: a request takes")),
        ({"structured_outputs": {"json": "{not json"}}, ("structured_outputs.json: not JSON",)),
        ({"structured_outputs": {"json": {"type": "object", "properties": {"not": {
            "type": "array", "uniqueItems": True}}}}},
         ("structured_outputs.json.properties.not.uniqueItems: not enforced",)),
        ({"structured_outputs": {"json": {"type": "object", "x-note": {"not": 1},
                                          "properties": {"a": {"$ref": "https://x/s.json"}}}}},
         ("structured_outputs.json.properties.a.$ref: 'https://x/s.json' is outside",)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": _nested(
            40)}}}, ("response_format.json_schema.schema: nested 81 levels deep, more than 64",)),
        ({"guided_json": "[" * 5000 + "]" * 5000}, ("guided_json: not JSON (or nested too deep)",)),
        ({"structured_outputs": {"json": {"enum": [f"v{i}" for i in range(20000)]}}},
         ("structured_outputs.json: 188900 characters as JSON, more than 131072",)),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         ("structured_outputs.whitespace_pattern: not implemented by this server",)),
    ],
    ids=["metaschema", "no-schema", "unresolvable-ref", "regex", "ebnf", "two-kinds",
         "two-fields", "not-json", "unenforced-keyword", "remote-ref", "too-deep", "too-deep-text",
         "too-large", "unhonoured-option"],
)
def test_a_constraint_that_cannot_be_honoured_is_a_400_naming_it(client, body, starts):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, max_tokens=4, extra_body=body)
    _refused(refused.value, *starts)


# -- tool calls -----------------------------------------------------------------------------
def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


ONE_CALL = {"parallel_tool_calls": False}
"""A random model offered another call takes it, again and again (to max_tokens)."""


def test_a_required_tool_call_answers_valid_calls_only(client):
    answer = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=LONG,
                   **ONE_CALL).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    assert "content" in answer.message.model_dump(exclude_unset=True)  # sent as null
    _check_calls(answer.message, set(PARAMETERS))
    assert len(answer.message.tool_calls) == 1


def test_a_named_tool_call_calls_that_function_and_finishes_with_stop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = _chat(client, tools=TOOLS, tool_choice=named, max_tokens=LONG,
                   temperature=1.0, seed=9).choices[0]
    assert answer.finish_reason == "stop"  # OpenAI's answer to a named choice
    _check_calls(answer.message, {"get_weather"})
    assert len(answer.message.tool_calls) == 1


def test_a_required_call_of_a_function_without_parameters_has_object_arguments(client):
    ping = {"type": "function", "function": {"name": "ping"}}
    answer = _chat(client, tools=[ping], tool_choice="required", max_tokens=LONG,
                   **ONE_CALL).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert [c.function.name for c in answer.message.tool_calls] == ["ping"]
    assert json.loads(answer.message.tool_calls[0].function.arguments) == {}


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client):
    whole = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=LONG,
                  **ONE_CALL).choices[0]
    calls: dict[int, dict] = {}
    reason = None
    for event in _chat(client, tools=TOOLS, tool_choice="required", max_tokens=LONG,
                       stream=True, **ONE_CALL):
        for choice in event.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "ids": set()})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                call["ids"].add(delta.id) if delta.id else None
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(len(c["ids"]) == 1 for c in calls.values())


def _written_call_for(request) -> str:
    """A call as the model's template says to write one (forced by a regex: a random model
    writes no call of its own)."""
    arch = request.node.callspec.params["client"]
    if arch == "deepseek_v3":
        return ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                '```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    return 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_auto_parses_the_calls_a_model_writes_in_its_format(client, request):
    written = _written_call_for(request)
    answer = _chat(client, tools=TOOLS, max_tokens=LONG,
                   extra_body={"structured_outputs": {"regex": re.escape(written)}}).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in answer.message.tool_calls] == [("get_time", {"zone": "UTC"})]
    text, reason = _streamed_text(client, tools=TOOLS, tool_choice="none", max_tokens=LONG,
                                  extra_body={"structured_outputs": {"regex": re.escape(written)}})
    assert (text, reason) == (written, "stop")  # none: the text as written, nothing parsed


def test_a_conversation_with_calls_and_tool_answers_is_accepted(client):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = _chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "starts"),
    [
        ({"tool_choice": "required"}, ("tool_choice: 'required' needs tools",)),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         ("tool_choice.function.name: 'nope' is not one of the tools (get_weather, get_time)",)),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 1}}}}}]},
         ("tools[0].function.parameters.properties.a.type: 1 is not valid",)),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         ("tools: a request takes one constraint, it already has response_format",)),
        ({"messages": [{"role": "tool", "content": "x"}]},
         ("messages[0].tool_call_id: required",)),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, ("tools[0].function.parameters.type: 'string'",)),
        ({"tools": [TOOLS[0], TOOLS[0]]}, ("tools: the function name 'get_weather' is given",)),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         ("messages[0].tool_calls[0].function.arguments: '[1]' is not a JSON object",)),
    ],
    ids=["choice-without-tools", "unknown-name", "bad-parameters", "two-constraints",
         "tool-message-without-id", "parameters-not-an-object", "same-name-twice",
         "arguments-not-an-object"],
)
def test_bad_tool_input_is_a_400_naming_the_field(client, body, starts):
    body = dict(body)
    messages = body.pop("messages", ASK)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                       extra_body=body)
    _refused(refused.value, *starts)
