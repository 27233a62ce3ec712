"""The engine core's end of the link (``dwdp.worker.server.engine_core``), spoken to by a raw ZMQ
``DEALER`` as an API process would: every request it takes gets an answer, even one it refuses,
so no API process's stream waits forever. And the link's messages (``dwdp.worker.server.wire``):
the engine's values cross it whole, every field of them."""

from __future__ import annotations

import dataclasses
import types

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from dwdp.worker.engine.kv_connector import KvTransferParams, LeaseError  # noqa: E402
from dwdp.worker.engine.protocol import (  # noqa: E402
    EngineError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)
from dwdp.worker.server.engine_core import EngineCoreServer  # noqa: E402
from dwdp.worker.server.wire import (  # noqa: E402
    Failed,
    Generate,
    Out,
    Outs,
    Reply,
    Score,
    WireError,
    decode_answer,
    decode_request,
    encode,
    error_fields,
    error_of,
)


class _SilentEngine:
    """Takes every request and never answers (a long generation)."""

    kv = None

    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_request(self, request_id, prompt, params, kv=None, *, shared=None, emit):
        self.added.append(request_id)
        return types.SimpleNamespace(aborted=False)


def _exchange(tmp_path, frames: list[bytes], replies: int) -> tuple[list[Outs], list[str]]:
    engine = _SilentEngine()
    core = EngineCoreServer(engine, f"ipc://{tmp_path}/core").start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(core.address)
    try:
        for frame in frames:
            sock.send(frame)
        got = [decode_answer(sock.recv()) for _ in range(replies)]
        assert all(isinstance(message, Outs) for message in got)
        return got, engine.added
    finally:
        sock.close(0)
        context.term()
        core.stop()


def _generate(request_id: str, **params) -> Generate:
    return Generate(id=request_id, prompt=[1, 2, 3], params=SamplingParams(**params))


def _fields(message: Generate, **changed) -> bytes:
    """``message`` as a raw map with ``changed`` fields (a sender that is not this module)."""
    return msgspec.msgpack.encode({**msgspec.to_builtins(message), **changed})


def test_a_second_request_under_a_running_id_is_refused_not_dropped(tmp_path):
    first = encode(_generate("r1"))
    got, added = _exchange(tmp_path, [first, first], replies=1)
    assert added == ["r1"]
    (refusal,) = got[0].outs
    assert isinstance(refusal, Failed) and refusal.id == "r1"
    assert refusal.error.type == "RequestError"
    assert "already running" in refusal.error.message


@pytest.mark.parametrize(("changed", "named"), [
    ({"params": {"max_tokens": "four"}}, "$.params.max_tokens"),
    ({"kv": {"do_remote_prefill": "maybe"}}, "$.kv"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_a_malformed_request_is_refused_naming_the_field(tmp_path, changed, named):
    got, added = _exchange(tmp_path, [_fields(_generate("r2"), **changed)], replies=1)
    assert added == []
    (refusal,) = got[0].outs
    assert isinstance(refusal, Failed) and refusal.id == "r2"
    assert refusal.error.type == "RequestError"
    assert named in refusal.error.message


def test_a_message_of_the_wrong_shape_is_dropped_and_the_core_goes_on(tmp_path):
    good = encode(_generate("r3"))
    frames = [msgspec.msgpack.encode({"op": []}), b"\xc1", msgspec.msgpack.encode([1]),
              good, good]
    got, added = _exchange(tmp_path, frames, replies=1)
    assert added == ["r3"]  # the message after the bad ones was served
    (refusal,) = got[0].outs
    assert isinstance(refusal, Failed) and refusal.error.type == "RequestError"


def _every_field_set(cls: type, values: dict) -> None:
    """Guard: ``values`` sets every field of ``cls`` to a value other than its default, so a
    field added to it must be added here, and so crosses the link in this test."""
    for f in dataclasses.fields(cls):
        assert f.name in values, f"{cls.__name__}.{f.name}: give it a value in this test"
        assert values[f.name] != f.default, f"{cls.__name__}.{f.name}: not its default"


def test_a_generate_message_carries_every_sampling_field():
    values = dict(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("a", "b"),
        stop_token_ids=(4, 5), ignore_eos=True, logprobs=2, cache_salt="s",
        logit_bias=((3, -1.5), (9, 2.0)), min_tokens=2, include_stop_str_in_output=True,
        structured=StructuredOutput("regex", "a+", field="response_format",
                                    any_whitespace=False),
    )
    _every_field_set(SamplingParams, values)
    kv = KvTransferParams(do_remote_decode=True)
    sent = Generate(id="r", prompt=[1, 2], params=SamplingParams(**values), kv=kv, shared="c")
    assert decode_request(encode(sent)) == sent


def test_an_update_carries_every_output_field():
    values = dict(
        request_id="r", token_ids=[1, 2], text="hi", prompt_tokens=3, completion_tokens=2,
        finished=True, finish_reason="stop",
        logprobs=[TokenLogprob(1, -0.5, ((1, -0.5), (7, -1.25)), 3), TokenLogprob(2, -0.1)],
        kv_transfer_params=KvTransferParams(do_remote_decode=True), cached_tokens=2,
    )
    _every_field_set(RequestOutput, values)
    sent = Outs(outs=[Out(output=RequestOutput(**values), server={"role": "context"}),
                      Failed(id="q", error=error_fields(LeaseError(403, "not yours")))])
    got = decode_answer(encode(sent))
    assert got == sent
    failed = got.outs[1]
    assert isinstance(failed, Failed)
    lease = error_of(failed.error)
    assert isinstance(lease, LeaseError) and lease.status == 403


def test_a_reply_carries_scores_and_errors():
    scores = [TokenLogprob(5, -0.25, ((5, -0.25),), 1)]
    assert decode_answer(encode(Reply(call=4, value=scores))) == Reply(call=4, value=scores)
    failed = decode_answer(encode(Reply(call=5, error=error_fields(KeyError("x")))))
    assert isinstance(failed, Reply) and failed.error is not None
    error = error_of(failed.error)
    assert type(error) is EngineError and "KeyError" in str(error)
    with pytest.raises(WireError):
        decode_answer(encode(Score(call=1, prompt=[1], top=1)))  # a request is no answer
