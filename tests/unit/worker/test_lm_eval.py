"""lm-eval (PyPI ``lm-eval``) scores a small multiple-choice task with its ``local-completions``
model against one rank and through the real vllm-router in front of a context and a
generation server (issue 34): every choice's loglikelihood and greedy flag equal the ones
computed from the model in this process, one forward per context + continuation.

The task is a YAML task over a JSON-lines file of hand-written items (no download); lm-eval
tokenizes with the checkpoint's tokenizer and sends token-id prompts with ``echo: true,
max_tokens: 1, logprobs: 1``, summing the prompt tokens' logprobs after the context.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytest.importorskip("lm_eval")

from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmRouter, wait_for  # noqa: E402

KEY = "lm-eval-key"
TASK = "dwdp_tiny_mc"
ITEMS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Fire feels", "choices": ["hot", "cold", "wet", "dry"], "answer": 0},
    {"question": "A cat says", "choices": ["meow", "moo"], "answer": 0},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("task")
    (d / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    (d / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {d / 'items.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return d


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(loglikelihood, greedy) of a context and continuation from the model's own forward,
    tokenized as lm-eval's causal models do (the whole text, then the context's tokens cut
    off; no special tokens)."""
    model, tok = load_checkpoint(checkpoint)

    def score(context: str, continuation: str) -> tuple[float, bool]:
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([whole])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        at = range(len(ctx) - 1, len(whole) - 1)
        total = sum(logp[t, whole[t + 1]].item() for t in at)
        greedy = all(int(logp[t].argmax()) == whole[t + 1] for t in at)
        return total, greedy

    return score


def _evaluate(base: str, checkpoint: Path, task_dir: Path) -> list[dict]:
    """lm-eval's ``simple_evaluate`` of the task against ``base``; its logged samples."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="local-completions",
        model_args={"base_url": base + "/v1/completions", "model": "m",
                    "tokenizer_backend": "huggingface", "tokenizer": str(checkpoint),
                    "num_concurrent": 1, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
    )
    assert out is not None
    return list(out["samples"][TASK])


def _check(samples: list[dict], reference) -> None:
    """Every choice of every item scored as the reference scores it; not all alike."""
    assert len(samples) == len(ITEMS)
    scores = []
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            ((loglikelihood, greedy),) = resp
            want, want_greedy = reference(context, continuation)
            assert loglikelihood == pytest.approx(want, abs=1e-4), (context, continuation)
            assert greedy == want_greedy
            scores.append(loglikelihood)
    assert len(set(scores)) == len(scores)  # the bug this guards: every choice scored alike


def test_lm_eval_against_a_rank(checkpoint, task_dir, reference, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as the bearer key
    with EngineServer(checkpoint, api_key=KEY, kv=False, max_model_len=128) as rank:
        _check(_evaluate(rank.base, checkpoint, task_dir), reference)


def test_lm_eval_through_the_router(checkpoint, task_dir, reference, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    def server() -> EngineServer:
        return EngineServer(checkpoint, api_key=KEY, max_model_len=128, block_size=4)

    with server() as ctx, server() as gen, VllmRouter([ctx.base], [gen.base], api_key=KEY) as url:
        _check(_evaluate(url, checkpoint, task_dir), reference)
        assert gen.engine.kv.blocks_received > 0  # the requests did take the PD path
        wait_for(lambda: ctx.engine.kv.leases == 0, "context leases not released")
