"""FP8 on trained weights: the demo model at block-aligned sizes (``dwdp_dev.worker.
fp8_accuracy``, cached), written in bfloat16, converted to DeepSeek-V3's block-scaled FP8 by
the project's converter and loaded by the worker, against the same bfloat16 checkpoint loaded by
the worker.

On the CPU the worker computes an FP8 checkpoint's layers from its dequantized weights, so this
measures what the weights' quantization costs; the GPU's FP8 kernels quantize the activations
too (1 x 128 blocks), which a GPU bench must measure there. The bars: top-1 agreement of at
least 99% at the corpus's next-token positions the bf16 model decides, and the greedy answers
to the demo's questions equal. Over all positions no bar is set: the corpus's coin tosses
(``dwdp_dev.worker.fp8_accuracy``) flip with any rounding, and how many a training leaves
depends on the machine that trained it (the model is trained where the tests run).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.devcluster.paths import cache_dir  # noqa: E402
from dwdp_dev.worker.demo_corpus import CAPITALS  # noqa: E402
from dwdp_dev.worker.fp8_accuracy import (  # noqa: E402
    aligned_demo_model,
    corpus_texts,
    next_token_agreement,
)
from dwdp_dev.worker.fp8_checkpoint import quantize_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(bf16 model, FP8 model, tokenizer): the aligned demo model saved in bfloat16, and that
    checkpoint converted to FP8, each loaded by the worker."""
    torch.set_num_threads(1)
    trained = aligned_demo_model(cache_dir() / "models")
    model, tok = load_checkpoint(trained, dtype="bfloat16")
    bf16 = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(str(bf16))
    tok.save_pretrained(str(bf16))
    fp8 = quantize_checkpoint(bf16, tmp_path_factory.mktemp("fp8") / "m")
    reference, _ = load_checkpoint(bf16)
    candidate, _ = load_checkpoint(fp8)
    experts = next(m for m in candidate.modules() if hasattr(m, "gate_up_proj_scale_inv"))
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn  # the worker reads FP8 weights
    return reference, candidate, tok


def test_fp8_picks_the_bf16_models_next_token_where_bf16_decides(pair):
    """Where the bf16 model decides (its top two probabilities at least 0.1 apart), FP8 picks
    its token at 99% of the positions or more."""
    reference, candidate, tok = pair
    texts = corpus_texts(tok)
    fp8 = next_token_agreement(reference, candidate, texts)
    assert fp8.decided > 1000
    assert fp8.decided_rate >= 0.99, fp8


def test_fp8_answers_the_demo_questions_as_bf16(pair):
    reference, candidate, tok = pair
    prompts = [tok(f"What is the capital of {country}?")["input_ids"]
               for country, _ in CAPITALS]
    params = SamplingParams(max_tokens=16)

    def answers(model):
        engine = ContinuousEngine(model, tok, model_name="demo",
                                  config=EngineConfig(max_batch_size=16, max_model_len=128))
        return [o.token_ids for o in engine.run_batch(prompts, params)]

    want = answers(reference)
    assert answers(candidate) == want
    # the trained model answers: its first answer names the capital
    assert CAPITALS[0][1] in tok.decode(want[0])
