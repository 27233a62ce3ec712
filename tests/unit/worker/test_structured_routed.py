"""Structured outputs and tool calls through the real vllm-router in PD mode answer what the
generation server answers alone: the router sends the client's request (its
``response_format``, ``structured_outputs``, ``tools``) to the context server for one token and
then to the generation server with the prefill's ``kv_transfer_params``; the generation server
constrains the whole answer (the prefill's token is not part of it), so no field crosses
between the two servers beyond the KV blocks' lease.

Two real servers (uvicorn on 127.0.0.1, KV over real NIXL READs) behind the vllm-router binary,
the ``openai`` package as the client of both.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmRouter, wait_for  # noqa: E402

KEY = "structured-routed-key"
ASK = [{"role": "user", "content": "Who is it?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
                   "member": {"type": "boolean"}},
    "required": ["name", "member"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """(generation server's client, router's client, context server, generation server)."""
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4)

    def server():
        return EngineServer(path, api_key=KEY, max_model_len=2048, block_size=16)

    with server() as ctx, server() as gen, VllmRouter([ctx.base], [gen.base], api_key=KEY) as url:
        yield (openai.OpenAI(base_url=f"{gen.base}/v1", api_key=KEY, max_retries=0),
               openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0), ctx, gen)


def _both(routed, **body):
    direct, router, ctx, _gen = routed
    alone = direct.chat.completions.create(model="m", messages=ASK, **body).choices[0]
    through = router.chat.completions.create(model="m", messages=ASK, **body).choices[0]
    wait_for(lambda: ctx.engine.kv.leases == 0, "context leases not released")
    return alone, through


def test_a_json_schema_answer_through_the_router_is_the_generation_servers(routed):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    alone, through = _both(routed, max_tokens=300, response_format=fmt)
    assert through.finish_reason == alone.finish_reason == "stop"
    assert through.message.content == alone.message.content
    jsonschema.validate(json.loads(through.message.content), PERSON)


def test_a_required_tool_call_through_the_router_is_the_generation_servers(routed):
    alone, through = _both(routed, max_tokens=300, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False)
    assert through.finish_reason == alone.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in through.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in alone.message.tool_calls]
    jsonschema.validate(json.loads(through.message.tool_calls[0].function.arguments), ZONE)


def test_a_streamed_choice_through_the_router_obeys_it(routed):
    _direct, router, ctx, _gen = routed
    text = "".join(
        e.choices[0].delta.content or ""
        for e in router.chat.completions.create(
            model="m", messages=ASK, max_tokens=50, stream=True,
            extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
        if e.choices
    )
    assert text in ("Paris", "Rome")
    wait_for(lambda: ctx.engine.kv.leases == 0, "context leases not released")


def test_a_bad_schema_through_the_router_is_the_context_servers_400(routed):
    _direct, router, _ctx, _gen = routed
    bad = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        router.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                       response_format=bad)
    assert "response_format.json_schema.schema.type" in str(refused.value)
