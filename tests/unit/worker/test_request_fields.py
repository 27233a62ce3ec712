"""No request field is dropped without a word (``dwdp.worker.server.fields``): over real HTTP
(uvicorn on 127.0.0.1, a real engine) with the ``openai`` package as the client, a field this
server does not implement is a 400 naming it, in OpenAI's error shape, on completions and chat
and inside a message; the fields that change no answer are accepted with any value, and the
ones that ask for nothing (``frequency_penalty: 0``, ``null``) are accepted as clients send
them. Checked against OpenAI's published request types, so a field OpenAI adds is refused
until this server declares it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

from dwdp.worker.server.fields import IGNORED_FIELDS, NEUTRAL_VALUES  # noqa: E402
from dwdp.worker.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer  # noqa: E402

KEY = "request-fields-test-key"
MESSAGES = [{"role": "user", "content": "Say yes."}]
PROBE = {"probe": 1}
"""A value that asks for something of any field (no field's neutral value)."""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4)
    with EngineServer(path, api_key=KEY, kv=False) as running:
        yield openai.OpenAI(base_url=f"{running.base}/v1", api_key=KEY, max_retries=0)


def _keys(typed_dict: type) -> set[str]:
    return set(typed_dict.__required_keys__) | set(typed_dict.__optional_keys__)


def _declared(model: type) -> set[str]:
    return set(model.model_fields)


CHAT_FIELDS = _keys(chat_create_params.CompletionCreateParamsBase)
COMPLETION_FIELDS = _keys(completion_create_params.CompletionCreateParamsBase)


def _refused(error: openai.BadRequestError, field: str) -> None:
    assert error.status_code == 400
    body = error.body if isinstance(error.body, dict) else {}
    message = str(body.get("message", ""))
    assert message.startswith(f"{field}: not implemented by this server"), message
    assert body.get("type") == "invalid_request_error"


@pytest.mark.parametrize(
    "field", sorted(CHAT_FIELDS - _declared(ChatCompletionRequest) - IGNORED_FIELDS)
)
def test_an_openai_chat_field_not_implemented_is_a_400_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=2, extra_body={field: PROBE}
        )
    _refused(refused.value, field)


@pytest.mark.parametrize(
    "field", sorted(COMPLETION_FIELDS - _declared(CompletionRequest) - IGNORED_FIELDS)
)
def test_an_openai_completion_field_not_implemented_is_a_400_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="m", prompt="Say", max_tokens=2, extra_body={field: PROBE})
    _refused(refused.value, field)


def test_what_this_server_does_not_implement_is_refused_not_ignored(client):
    """Fields that change the answer and are not implemented here (OpenAI's deprecated
    ``functions``, vLLM's ``repetition_penalty`` other than 1) are 400s naming them; structured
    outputs and tool calls are honoured (tests/unit/worker/test_structured_outputs.py)."""
    function = {"name": "f", "parameters": {"type": "object"}}
    asks = {"functions": [function], "function_call": {"name": "f"}, "repetition_penalty": 1.3}
    for field, value in asks.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=2, extra_body={field: value}
            )
        _refused(refused.value, field)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="m", prompt="Say", max_tokens=2, extra_body={"repetition_penalty": 0.8}
        )
    _refused(refused.value, "repetition_penalty")


def test_a_message_field_not_implemented_is_a_400_naming_its_path(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi", "name": "ann"}],  # type: ignore[list-item]
            max_tokens=2,
        )
    _refused(refused.value, "messages.0.name")


def test_fields_that_change_no_answer_or_ask_for_nothing_are_accepted(client):
    """What clients send on every call: bookkeeping fields with any value, and the fields this
    server does not implement at the value that asks for nothing (LangChain sends
    ``frequency_penalty: 0``; the SDK's defaults are left out)."""
    ignored = {field: PROBE for field in IGNORED_FIELDS}
    answer = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=2,
        frequency_penalty=0,
        presence_penalty=0.0,
        extra_body={**ignored, "tools": None, "response_format": None,
                    "repetition_penalty": 1.0, "skip_special_tokens": True},
    )
    assert answer.choices[0].message.content is not None
    done = client.completions.create(
        model="m", prompt="Say", max_tokens=2, best_of=1, extra_body={"min_tokens": 0}
    )
    assert done.choices[0].text is not None
    # a neutral value of another kind asks for something: true is not 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="m", prompt="Say", max_tokens=2, extra_body={"best_of": True}
        )
    _refused(refused.value, "best_of")
    assert set(NEUTRAL_VALUES).isdisjoint(IGNORED_FIELDS)


def test_the_stop_string_is_kept_with_include_stop_str_in_output_or_no_stop_trim(client):
    """vLLM's ``include_stop_str_in_output`` and SGLang's ``no_stop_trim`` (which vllm-router
    sends on every prefill it forwards): the text ends after the stop string, not before."""
    free = client.completions.create(
        model="m", prompt="Say", max_tokens=12, extra_body={"ignore_eos": True}
    ).choices[0].text
    stop = free.strip()[3:5]
    assert len(stop) == 2, free  # the tiny model's text is long enough to cut in its middle
    cut = free.find(stop)
    for extra, kept in (({}, ""), ({"include_stop_str_in_output": True}, stop),
                        ({"no_stop_trim": True}, stop)):
        text = client.completions.create(
            model="m", prompt="Say", max_tokens=12, stop=[stop],
            extra_body={"ignore_eos": True, **extra},
        ).choices[0].text
        assert text == free[:cut] + kept, (extra, free, text)
