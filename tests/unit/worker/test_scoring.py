"""Prompt scoring on one rank over real HTTP (issue 34): ``echo`` with ``logprobs`` returns the
prompt tokens' logprobs (the first ``null``), ``max_tokens: 0`` scores without generating,
vLLM's ``prompt_logprobs``, a batch of prompts, and the rules that tie them; every value is
checked against the model's own forward in this process (no server)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer  # noqa: E402

KEY = "scoring-key"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)


@pytest.fixture(scope="module")
def rank(checkpoint):
    with EngineServer(checkpoint, api_key=KEY, kv=False, max_model_len=64,
                      max_num_tokens=32) as server:
        yield server


@pytest.fixture(scope="module")
def reference(checkpoint):
    """log_softmax of the model's logits over a prompt, [len - 1, vocab]: row t scores token
    t + 1 (transformers' own attention, one forward, this process)."""
    model, _tok = load_checkpoint(checkpoint)

    def logp(prompt: list[int]):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1)

    return logp


def _complete(rank: EngineServer, **body) -> httpx.Response:
    return rank.client.post("/v1/completions", json={"model": "m", **body})


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(rank, reference):
    """lm-eval's request (a batch of one token-id prompt, echo, max_tokens 1, logprobs 1):
    one entry per prompt token (the first null) equal to the model's, then the generated one."""
    r = _complete(rank, prompt=[PROMPT], echo=True, max_tokens=1, logprobs=1, temperature=0,
                  seed=1234)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    want = reference(PROMPT)
    assert len(lp["token_logprobs"]) == len(PROMPT) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1 : len(PROMPT)]
    expected = want.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    assert got == pytest.approx(expected, abs=1e-5)
    for t, top in enumerate(lp["top_logprobs"][1 : len(PROMPT)]):
        (value,) = top.values()
        assert value == pytest.approx(want[t].max().item(), abs=1e-5)
    assert choice["text"].startswith(rank.engine.tokenizer.decode(PROMPT))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_max_tokens_0_scores_without_generating(rank, reference):
    before = rank.engine.stats.generation_tokens
    r = _complete(rank, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert choice["text"] == rank.engine.tokenizer.decode(PROMPT)
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT)
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(PROMPT), 0, len(PROMPT))
    assert rank.engine.stats.generation_tokens == before  # no engine request ran
    r = _complete(rank, prompt=PROMPT, max_tokens=0, logprobs=1, prompt_logprobs=0)
    (choice,) = r.json()["choices"]  # no echo: no prompt entries, and nothing generated
    assert choice["logprobs"]["tokens"] == [] and choice["text"] == ""
    assert len(choice["prompt_logprobs"]) == len(PROMPT)


def test_vllm_prompt_logprobs_carry_rank_and_alternatives(rank, reference):
    r = _complete(rank, prompt=PROMPT, max_tokens=0, prompt_logprobs=3)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    want = reference(PROMPT)
    for t, entry in enumerate(entries[1:]):
        token = PROMPT[t + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(want[t, token].item(), abs=1e-5)
        assert own["rank"] == int((want[t] > want[t, token]).sum()) + 1
        top = torch.topk(want[t], 3)
        for rank_, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                           strict=True), start=1):
            assert entry[str(i)]["rank"] == (own["rank"] if i == token else rank_)
            assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-5)
        assert entry[str(token)]["decoded_token"] == rank.engine.tokenizer.decode([token])
    assert "logprobs" not in choice  # not asked for


def test_chat_prompt_logprobs_score_the_rendered_conversation(rank, reference):
    messages = [{"role": "user", "content": "score this"}]
    r = rank.client.post("/v1/chat/completions", json={
        "model": "m", "messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    tok = rank.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) == r.json()["usage"]["prompt_tokens"]
    want = reference(ids)
    got = [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], entries[1:], strict=True)]
    assert got == pytest.approx([want[t, ids[t + 1]].item() for t in range(len(ids) - 1)],
                                abs=1e-5)


def test_a_batch_of_prompts_answers_each_with_openai_indices(rank):
    """Two prompts with n 2: indices p * n + j; each equals the prompt sent alone."""
    other = [21, 22, 23, 24]
    body = {"max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    r = _complete(rank, prompt=[PROMPT, other], **body)
    assert r.status_code == 200, r.text
    got = {c["index"]: c["token_ids"] for c in r.json()["choices"]}
    for p, prompt in enumerate((PROMPT, other)):
        alone = _complete(rank, prompt=prompt, **body).json()["choices"]
        assert [got[p * 2 + j] for j in range(2)] == [c["token_ids"] for c in alone]
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT) + len(other)


def test_a_streamed_echo_sends_the_prompt_first(rank):
    body = {"model": "m", "prompt": "an echoed prompt", "max_tokens": 4, "echo": True,
            "logprobs": None, "ignore_eos": True}
    whole = _complete(rank, **body).json()["choices"][0]["text"]
    with rank.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                 if line.startswith("data: {")]
    assert texts[0] == "an echoed prompt" and "".join(texts) == whole


def test_a_stop_token_keeps_its_logprob(rank):
    """max_tokens 1 ending on a stop token still returns one generated entry (as vLLM does):
    a harness dropping the last entry of echo + logprobs must not lose a prompt token."""
    first = _complete(rank, prompt=PROMPT, max_tokens=1).json()["choices"][0]["token_ids"][0]
    r = _complete(rank, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True,
                  stop_token_ids=[first])
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == []
    assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPT) + 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: 0 needs echo true or prompt_logprobs"),
        ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens: 0 with stream true"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs (or echo with logprobs) with "
                                                 "stream true"),
        ({"prompt": [PROMPT, PROMPT], "stream": True}, "prompt: a batch of 2 prompts with stream"),
        ({"prompt_logprobs": 21}, "prompt_logprobs: "),
        ({"prompt": [1] * 40, "echo": True, "logprobs": 1},
         "prompt: 40 tokens to score (echo with logprobs, or prompt_logprobs), at most "
         "max_num_tokens (32)"),
    ],
)
def test_scoring_rules_are_400_naming_the_field(rank, body, message):
    r = _complete(rank, **{"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()
