"""The HTTP server through a real uvicorn on 127.0.0.1 (random free port), over real HTTP."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from _http_helpers import UvicornThread, schemathesis_run  # noqa: E402

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.server.app import build_app  # noqa: E402
from dwdp.worker.status_source import NoDwdp  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

MAX_LEN = 96
POOL = 80  # KV cache tokens: a request of prompt + max_tokens over it is refused


class FakeDwdp:
    """A status source whose commit the test flips."""

    def __init__(self) -> None:
        self.committed = False

    def status(self):
        return {
            **NoDwdp().status(),
            "phase": "committed" if self.committed else "setup",
            "rank": 1,
            "dwdp_size": 4,
            "layout_digest": "abc123",
            "partition": {"kind": "balanced", "ranks": [{"rank": r} for r in range(4)]},
            "bytes_stored": 1000,
            "bytes_moved": 123456,
            "bytes_freed": 3000,
            "slot_waits": 7,
        }


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ck") / "ds", num_experts=5)
    model, tok = load_checkpoint(path)
    engine = ContinuousEngine(
        model,
        tok,
        model_name="tiny-ds",
        config=EngineConfig(max_model_len=MAX_LEN, kv_capacity_tokens=POOL),
    ).start()
    dwdp = FakeDwdp()
    stopped = []
    app = build_app(engine, dwdp=dwdp, on_shutdown=lambda: stopped.append(engine.stop()))
    with (
        UvicornThread(app, graceful_shutdown_timeout_s=None) as base,
        httpx.Client(base_url=base, timeout=60) as client,
    ):
        yield client, engine, dwdp, base, app
    assert stopped, "the lifespan shutdown did not stop the engine"


def test_models_health_ready(served):
    client, _engine, dwdp, _base, _app = served
    r = client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == "tiny-ds" and card["max_model_len"] == MAX_LEN
    assert client.get("/health").json() == {"status": "ok"}
    dwdp.committed = False
    r = client.get("/ready")
    assert r.status_code == 503
    assert "not committed" in r.json()["error"]["message"]
    dwdp.committed = True
    assert client.get("/ready").status_code == 200


def _complete(client, **body):
    body = {"prompt": "Hello world, the", "max_tokens": 6, "ignore_eos": True, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_greedy_matches_engine(served):
    client, engine, *_ = served
    out = _complete(client)
    (choice,) = out["choices"]
    ids = engine.tokenizer("Hello world, the")["input_ids"]
    want = engine.run_batch(
        [ids],
        __import__("dwdp.worker.engine.protocol", fromlist=["x"]).SamplingParams(
            max_tokens=6, ignore_eos=True
        ),
    )[0]
    assert choice["token_ids"] == want.token_ids
    assert choice["text"] == want.text
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 6,
        "total_tokens": len(ids) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert out["model"] == "tiny-ds" and out["object"] == "text_completion"
    # token-id prompts and echo
    again = _complete(client, prompt=ids)
    assert again["choices"][0]["token_ids"] == want.token_ids
    echoed = _complete(client, echo=True)
    assert echoed["choices"][0]["text"] == "Hello world, the" + want.text


def test_completion_sampled_seeded(served):
    client, *_ = served
    a = _complete(client, temperature=1.0, seed=5, top_p=0.9, max_tokens=8)
    b = _complete(client, temperature=1.0, seed=5, top_p=0.9, max_tokens=8)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def _sse(client, path, body):
    events = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_equals_non_streaming(served):
    client, *_ = served
    body = {"prompt": "What is the capital", "max_tokens": 10, "ignore_eos": True}
    plain = _complete(client, **body)["choices"][0]
    chunks = _sse(client, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == plain["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    chat = {"messages": messages, "max_tokens": 7, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "chat.completion"
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant"
    chunks = _sse(client, "/v1/chat/completions", {**chat, "stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    )
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == answer["choices"][0][
        "token_ids"
    ]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_content_parts_and_stop(served):
    client, *_ = served
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
            }
        ],
        "max_tokens": 7,
        "ignore_eos": True,
    }
    text = {
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 7,
        "ignore_eos": True,
    }
    a = client.post("/v1/chat/completions", json=parts).json()
    b = client.post("/v1/chat/completions", json=text).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    full = b["choices"][0]["message"]["content"]
    needle = next(
        full[i : i + 2]
        for i in range(1, len(full) - 1)
        if full[i : i + 2].isascii() and full[i : i + 2].strip()
    )
    cut = client.post("/v1/chat/completions", json={**text, "stop": needle}).json()
    assert cut["choices"][0]["message"]["content"] == full[: full.find(needle)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 85}, 400, "KV cache pool's 80"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": []}, 400, "prompt: List should have at least 1 item"),
        ("/v1/completions", {"prompt": [10**6]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": "x " * 200}, 400, "context"),
        ("/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "not served"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/completions", {"prompt": "x " * 200, "stream": True}, 400, "context"),
    ],
)
def test_bad_requests_are_4xx_with_a_message(served, path, body, status, needle):
    client, *_ = served
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status


def test_malformed_json_and_unknown_paths(served):
    client, *_ = served
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("body: not valid JSON ("), r.text
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/completions").status_code == 405


def test_metrics_and_dwdp_status(served):
    client, *_ = served
    _complete(client)
    text = client.get("/metrics").text
    for name in (
        "dwdp_requests_total",
        "dwdp_request_latency_seconds_bucket",
        "dwdp_time_to_first_token_seconds_bucket",
        "dwdp_prompt_tokens_total",
        "dwdp_generation_tokens_total",
        "dwdp_bytes_moved_total 123456.0",
        "dwdp_slot_waits_total 7.0",
        "dwdp_bytes_stored 1000.0",
        "dwdp_num_preemptions_total 0.0",
    ):
        assert name in text, name
    # at rest: the answer can reach the client a moment before its request leaves the
    # engine's running set, so the gauges are read until they settle
    rest = ("dwdp_num_requests_running 0.0", "dwdp_num_requests_waiting 0.0")
    _until(lambda: all(g in client.get("/metrics").text for g in rest), "gauges at rest")
    from prometheus_client.parser import text_string_to_metric_families

    itl = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "dwdp_inter_token_latency_seconds_count"
        and s.labels.get("endpoint") == "completions"
    }
    assert itl["dwdp_inter_token_latency_seconds_count"] >= 5  # 6 tokens: 5 gaps at least
    assert 'dwdp_requests_total{endpoint="/v1/completions",status="200"}' in text
    status = client.get("/dwdp/status").json()
    assert status["layout_digest"] == "abc123"
    assert status["partition"]["kind"] == "balanced"
    for key in ("phase", "bytes_stored", "bytes_moved", "bytes_freed", "leaks", "slots"):
        assert key in status


def _until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_client_disconnect_aborts(served, caplog):
    """A client that leaves mid-stream (n 3 too) or before a plain answer aborts its engine
    requests; the server logs no traceback; the gauges return to 0 (no request left)."""
    client, engine, _dwdp, base, _app = served
    before = engine.stats.requests_aborted
    for extra in ({}, {"n": 3, "logprobs": 1}):
        body = {"prompt": "Hello", "max_tokens": 70, "ignore_eos": True, "stream": True, **extra}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # close after the first event
    _until(lambda: engine.stats.requests_aborted >= before + 4, "streams not aborted")
    # a plain request whose client gives up while the engine is held in a forward
    with engine._forward_lock, pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", timeout=0.5,
                   json={"prompt": "Hello", "max_tokens": 70, "ignore_eos": True})
    _until(lambda: engine.stats.requests_aborted >= before + 5, "plain request not aborted")
    _until(lambda: engine.stats.requests_running == 0 and engine.stats.kv_tokens_in_use == 0,
           "gauges left stale")
    assert "dwdp_num_requests_running 0.0" in client.get("/metrics").text
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text[-2000:]


def test_validation_messages_name_the_right_field(served):
    client, *_ = served
    for prompt in ([-1], [2**40]):
        r = client.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt.0: ")
    r = client.post("/v1/completions", json={"prompt": "x", "stream_options": {
        "include_usage": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "max_completion_tokens: ")
    # no max_tokens: the default (16) shrinks to what the context leaves (the endpoint's
    # own parameter step; this fixture's pool is below the context, so not over HTTP)
    from dwdp.worker.server.protocol import CompletionRequest

    serving = served[4].state.serving
    assert serving._params(CompletionRequest(prompt="x"), MAX_LEN - 3, None).max_tokens == 3
    assert serving._params(CompletionRequest(prompt="x"), 5, None).max_tokens == 16


def test_health_503_when_engine_dead(tmp_path):
    class Dead:
        model_name = "dead"
        max_model_len = 8
        tokenizer = None
        kv = None

        async def check_health(self):
            from dwdp.worker.engine.protocol import EngineDeadError

            raise EngineDeadError("engine loop died: boom")

        async def abort(self, request_id):
            return None

        def generate(self, *a):
            raise AssertionError

        def snapshot(self):
            return None

    with UvicornThread(build_app(Dead()), graceful_shutdown_timeout_s=None) as base:
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert httpx.get(base + "/ready").status_code == 503


def test_schemathesis_finds_no_server_error(served):
    client, _engine, dwdp, base, _app = served
    dwdp.committed = True
    statuses, failures = schemathesis_run(base)
    assert set(statuses) >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/dwdp/status",
    }
    assert not failures, failures[:5]
    assert client.get("/health").status_code == 200


def test_n_choices_logprobs_and_stream_usage(served):
    """``n`` choices (seeded ``seed + i``), logprobs in OpenAI's two formats (the chosen token is
    the top alternative when greedy) and ``stream_options.include_usage``."""
    client, *_ = served
    many = _complete(client, n=3, temperature=1.0, seed=11, max_tokens=5)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 15
    one = _complete(client, temperature=1.0, seed=12, max_tokens=5)
    assert many["choices"][1]["token_ids"] == one["choices"][0]["token_ids"]

    out = _complete(client, logprobs=2, max_tokens=4)["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == out["text"]
    assert lp["text_offset"][0] == 0 and all(v <= 0 for v in lp["token_logprobs"])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                 strict=True):
        assert len(top) <= 2 and top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    answer = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = answer["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]

    chunks = _sse(client, "/v1/chat/completions",
                  {**chat, "stream": True, "n": 2, "stream_options": {"include_usage": True}})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in body)
    for i in (0, 1):
        streamed = [e for c in body for ch in c["choices"] if ch["index"] == i
                    for e in (ch.get("logprobs") or {}).get("content", [])]
        assert [e["token"] for e in streamed] == [e["token"] for e in content]
    streamed = [ch["logprobs"] for c in _sse(client, "/v1/completions",
                                             {"prompt": "hi", "logprobs": 2, "max_tokens": 4,
                                              "ignore_eos": True, "stream": True})
                for ch in c["choices"] if ch.get("logprobs")]
    whole = _complete(client, prompt="hi", logprobs=2, max_tokens=4)["choices"][0]["logprobs"]
    assert [o for lp in streamed for o in lp["text_offset"]] == whole["text_offset"]
    plain = _sse(client, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})
    assert all("usage" not in c for c in plain)
