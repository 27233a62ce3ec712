"""The KV connector seam: ``kv_transfer_params`` is parsed and checked once, at the HTTP edge,
and reaches the engine typed; a bad one is a 400 naming the field that no engine call sees."""

from __future__ import annotations

import pytest

fastapi_testclient = pytest.importorskip("fastapi.testclient")

from dwdp.worker.engine.kv_connector import KvTransferParams  # noqa: E402
from dwdp.worker.engine.protocol import EngineClient, RequestOutput  # noqa: E402
from dwdp.worker.server.app import build_app  # noqa: E402


class _Tokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids):
        return "x" * len(ids)


class RecordingEngine:
    """An engine that records what reaches ``generate`` and answers one token (the test is
    about what the server hands over, not about decoding)."""

    model_name = "m"
    max_model_len = 64
    tokenizer = _Tokenizer()
    kv = None

    def __init__(self) -> None:
        self.calls: list[KvTransferParams | None] = []

    async def check_health(self):
        return None

    async def abort(self, request_id):
        return None

    async def generate(self, request_id, prompt, params, kv_transfer=None):
        self.calls.append(kv_transfer)
        yield RequestOutput(request_id, [5], "y", len(prompt), 1, True, "length")

    async def score_prompt(self, prompt, top):
        return []

    def snapshot(self):
        return None


@pytest.fixture
def edge():
    engine = RecordingEngine()
    assert isinstance(engine, EngineClient)
    with fastapi_testclient.TestClient(build_app(engine)) as client:
        yield client, engine


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"do_remote_prefill": True},
            "kv_transfer_params.remote_engine_id: required with do_remote_prefill",
        ),
        (
            {"do_remote_prefill": True, "do_remote_decode": True},
            "kv_transfer_params.do_remote_prefill: cannot be true with do_remote_decode",
        ),
        (
            {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
             "remote_block_ids": [0], "remote_host": "h"},
            "kv_transfer_params.remote_port: required with do_remote_prefill",
        ),
        (
            {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
             "remote_block_ids": [0], "remote_host": "h", "remote_port": 1},
            "kv_transfer_params.remote_lease_token: required with do_remote_prefill",
        ),
        (  # a misspelled flag beside a lease's fields: never a silent local prefill
            {"do_remote_prefil": True, "remote_engine_id": "e", "remote_request_id": "r"},
            "kv_transfer_params: unknown key 'do_remote_prefil' (did you mean "
            "'do_remote_prefill'?)",
        ),
        (  # a key no contract has: refused, not dropped (vllm-router adds none in here)
            {"do_remote_decode": True, "no_stop_trim": True},
            "kv_transfer_params: unknown key 'no_stop_trim'",
        ),
        (
            {"do_remote_decode": True, "remote_block_ids": [1]},
            "kv_transfer_params.remote_block_ids: only with do_remote_prefill: true",
        ),
        ({"do_remote_prefill": False, "remote_lease_token": "t"},
         "kv_transfer_params.remote_lease_token: only with do_remote_prefill: true"),
        ({"remote_port": "8001"}, "kv_transfer_params.remote_port: "),
        ({"remote_block_ids": [True]}, "kv_transfer_params.remote_block_ids.0: "),
        ({"tp_size": 2}, "kv_transfer_params.tp_size: "),
    ],
)
def test_bad_kv_transfer_params_are_a_400_naming_the_field_before_the_engine(
    edge, params, message
):
    client, engine = edge
    r = client.post("/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": params})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)
    assert engine.calls == []  # refused at the edge: the engine never saw it


def test_kv_transfer_params_reach_the_engine_typed(edge):
    client, engine = edge
    sent = {
        "do_remote_prefill": True,
        "remote_engine_id": "dwdp-e",
        "remote_request_id": "cmpl-1",
        "remote_block_ids": [3, 4],
        "remote_host": "10.0.0.1",
        "remote_port": 8001,
        "remote_lease_token": "t0k",
        "remote_prefill_cached_tokens": 0,  # vLLM 0.32.0's, known and unused
    }
    r = client.post("/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": sent})
    assert r.status_code == 200, r.text
    (got,) = engine.calls
    assert isinstance(got, KvTransferParams)
    assert got.block_ids == [3, 4] and got.remote_port == 8001 and got.do_remote_prefill
    assert got.remote_prefill_cached_tokens == 0


def test_a_prefill_answer_dumps_vllms_field_names():
    """What a context server answers is vLLM's object, every field present, and the lease's
    token beside them."""
    out = KvTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e",
        remote_request_id="r",
        remote_block_ids=[0, 1],
        remote_host="h",
        remote_port=1,
        remote_lease_token="t",
    ).model_dump(exclude_none=True)
    assert out == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": [0, 1],
        "remote_host": "h",
        "remote_port": 1,
        "remote_lease_token": "t",
        "tp_size": 1,
    }
