"""OpenAI's ``logit_bias`` through the OpenAI server (uvicorn on 127.0.0.1, real HTTP, a real
engine): a bias of +100 makes its token the answer, greedy or sampled; -100 keeps the model's
own choice out; logprobs stay the raw model's (vLLM's default); a key that is not a token id,
a bias outside [-100, 100] and a token outside the vocabulary are 400s naming the field."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer  # noqa: E402

PROMPT = [5, 17, 42, 9, 33, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4)
    with EngineServer(path, api_key="logit-bias-test-key", kv=False) as running:
        yield running


def _complete(server, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **extra}
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_positive_bias_makes_its_token_the_answer_greedy_and_sampled(server):
    plain = _complete(server)["token_ids"]
    forced = next(t for t in range(3, 200) if t not in plain)
    greedy = _complete(server, logit_bias={str(forced): 100})
    assert greedy["token_ids"] == [forced] * 4
    sampled = _complete(server, logit_bias={str(forced): 100}, temperature=1.0, seed=3)
    assert sampled["token_ids"] == [forced] * 4


def test_a_negative_bias_keeps_the_models_choice_out(server):
    plain = _complete(server, max_tokens=1)["token_ids"]
    other = _complete(server, max_tokens=1, logit_bias={str(plain[0]): -100})["token_ids"]
    assert other != plain
    # a bias of 0 changes nothing
    assert _complete(server, max_tokens=1, logit_bias={str(plain[0]): 0})["token_ids"] == plain


def test_logprobs_under_a_bias_are_the_raw_models(server):
    plain = _complete(server, max_tokens=1, logprobs=5)
    forced = next(t for t in range(3, 200) if t not in plain["token_ids"])
    biased = _complete(server, max_tokens=1, logprobs=5, logit_bias={str(forced): 100})
    assert biased["token_ids"] == [forced]
    # the raw distribution: the forced token was not the model's choice, so it is less likely
    # than the unbiased answer's token, whose logprob is unchanged
    (raw_forced,) = biased["logprobs"]["token_logprobs"]
    (raw_top,) = plain["logprobs"]["token_logprobs"]
    assert raw_forced < raw_top
    assert biased["logprobs"]["top_logprobs"] == plain["logprobs"]["top_logprobs"]


@pytest.mark.parametrize("bias, words", [
    ({"abc": 5}, "key 'abc' is not a token id"),
    ({"7": 101}, "logit_bias"),
    ({"7": "up"}, "logit_bias"),
    ({"1000000000": 1}, "token id 1000000000 outside the vocabulary"),
])
def test_a_bad_logit_bias_is_a_400_naming_it(server, bias, words):
    r = server.client.post("/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "logit_bias" in message and words in message, message


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached(server):
    """vLLM's ``min_tokens``: with EOS forced by a +100 bias the answer ends at once; with
    ``min_tokens: 3`` EOS is held back for three tokens, then ends it; a stop token id is held
    back the same way; more than max_tokens is a 400 naming the field."""
    (eos, *_) = sorted(server.engine.eos_token_ids)
    forced = {str(eos): 100}
    at_once = _complete(server, logit_bias=forced, ignore_eos=False)
    assert at_once["token_ids"] == [] and at_once["finish_reason"] == "stop"
    held = _complete(server, logit_bias=forced, ignore_eos=False, min_tokens=3, max_tokens=8)
    assert len(held["token_ids"]) == 3 and eos not in held["token_ids"]
    assert held["finish_reason"] == "stop"
    stop = next(t for t in range(3, 200) if t != eos)
    by_stop = _complete(server, logit_bias={str(stop): 100}, stop_token_ids=[stop],
                        min_tokens=2, max_tokens=8)
    assert len(by_stop["token_ids"]) == 2 and stop not in by_stop["token_ids"]
    r = server.client.post("/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("min_tokens: 3")
