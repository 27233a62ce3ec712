"""The engine core's end of the link (``dwdp.worker.server.engine_core``), spoken to by a raw ZMQ
``DEALER`` as an API process would: every request it takes gets an answer, even one it refuses,
so no API process's stream waits forever."""

from __future__ import annotations

import types

import pytest

zmq = pytest.importorskip("zmq")

from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.server.engine_core import EngineCoreServer  # noqa: E402
from dwdp.worker.server.wire import generate_message, pack, unpack  # noqa: E402


class _SilentEngine:
    """Takes every request and never answers (a long generation)."""

    kv = None

    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_request(self, request_id, prompt, params, kv=None, *, shared=None, emit):
        self.added.append(request_id)
        return types.SimpleNamespace(aborted=False)


def _exchange(tmp_path, messages: list[dict], replies: int) -> tuple[list[dict], list[str]]:
    engine = _SilentEngine()
    core = EngineCoreServer(engine, f"ipc://{tmp_path}/core").start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(core.address)
    try:
        for message in messages:
            sock.send(pack(message))
        return [unpack(sock.recv()) for _ in range(replies)], engine.added
    finally:
        sock.close(0)
        context.term()
        core.stop()


def test_a_second_request_under_a_running_id_is_refused_not_dropped(tmp_path):
    first = generate_message("r1", [1, 2, 3], SamplingParams(), None, None)
    got, added = _exchange(tmp_path, [first, first], replies=1)
    assert added == ["r1"]
    (refusal,) = got[0]["outs"]
    assert refusal["id"] == "r1" and refusal["kind"] == "error"
    assert refusal["error"]["type"] == "RequestError"
    assert "already running" in refusal["error"]["message"]


def test_a_malformed_request_is_refused_naming_the_field(tmp_path):
    bad = {**generate_message("r2", [1], SamplingParams(), None, None),
           "params": {"max_tokens": 4, "no_such_field": 1}}
    got, added = _exchange(tmp_path, [bad], replies=1)
    assert added == []
    (refusal,) = got[0]["outs"]
    assert refusal["error"]["type"] == "RequestError"
    assert "params" in refusal["error"]["message"]


def test_a_message_of_the_wrong_shape_is_dropped_and_the_core_goes_on(tmp_path):
    good = generate_message("r3", [1], SamplingParams(), None, None)
    again = {**good}
    got, added = _exchange(tmp_path, [{"op": []}, good, again], replies=1)
    assert added == ["r3"]  # the message after the bad one was served
    assert got[0]["outs"][0]["error"]["type"] == "RequestError"
