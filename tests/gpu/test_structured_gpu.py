"""Structured outputs on cuda:0 (``dwdp.worker.engine.grammar``): a ``ContinuousEngine`` with
its CUDA graphs captured (the tiny bf16 Qwen3-MoE of ``test_decode_graphs_gpu.py``, the worker's
GPU kernels) serves one batch mixing requests constrained to a JSON schema, a regular expression
and a choice with free ones, greedy:

- every constrained answer ends because its grammar is complete (``"stop"``) and obeys its
  constraint: the JSON parses and is valid under its schema (``jsonschema``), the regex
  matches the whole answer (``re.fullmatch``), the choice is one of the strings;
- the free requests give the tokens (and logits) they give in the same batch where every
  neighbour is free: the constrained requests replaced by the same prompts unconstrained,
  each for the steps its constrained twin took (its tokens and the stop token's step), so
  every step has the same rows and shapes and only the mask differs. The mask touches its
  own rows only;
- decode-only steps replayed the captured graphs (``EngineStats.graph_replays``), as many in
  both runs: the mask is applied outside the graphs, to the logits they produce;
- ``grammar.masked`` on device logits leaves the rows without a constraint bit for bit as
  they were (as float32) and sets exactly the forbidden tokens of a constrained row to minus
  infinity.
"""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams, StructuredOutput  # noqa: E402

TINY = {"num_experts": 8, "seed": 9, "dtype": "bfloat16", "hidden_size": 128, "moe_width": 64}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe later"]
FREE_TOKENS = 24
CONSTRAINED_TOKENS = 96
"""Room for the longest document each grammar allows (the compact JSON of SCHEMA is under 50
bytes, one token a byte at worst): a constrained answer must end with its grammar."""

REQUESTS = [  # (prompt text, constraint or None)
    ("Tell me about the quick brown fox.", None),
    ("Answer in JSON: who sat on the mat?", StructuredOutput("json", json.dumps(SCHEMA),
                                                            any_whitespace=False)),
    ("One two three four five six", None),
    ("A product code:", StructuredOutput("regex", REGEX)),
    ("Is Paris the capital of France?", StructuredOutput("choice", json.dumps(CHOICES))),
    ("Hello world, hello model, hello expert.", None),
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The tiny bf16 Qwen3-MoE on cuda:0 with the worker's kernels."""
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "qwen3_moe", **TINY)
    model, tok = load_checkpoint(path)
    model.to("cuda:0")
    use_cuda_kernels(model)
    return model, tok


@pytest.fixture(scope="module")
def engine(loaded) -> ContinuousEngine:
    model, tok = loaded
    # no prefix caching: the second run repeats the prompts, and a prefill from cached blocks
    # would be a different step (the comparison is step for step)
    config = EngineConfig(max_batch_size=8, max_model_len=256, cuda_graphs=True,
                          prefix_caching=False)
    engine = ContinuousEngine(model, tok, model_name="tiny", config=config)
    assert engine.capture_cuda_graphs().buckets == (1, 2, 4, 8)
    return engine


def _run(engine: ContinuousEngine, params: list[SamplingParams]) -> tuple[list, int]:
    prompts = [engine.tokenizer.encode(text, add_special_tokens=False) for text, _ in REQUESTS]
    before = engine.stats.graph_replays
    done = engine.run_batch(prompts, params, keep_logits=True)
    return done, engine.stats.graph_replays - before


def _obeys(spec: StructuredOutput, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def test_a_batch_mixing_constrained_and_free_requests(engine):
    mixed = [SamplingParams(max_tokens=FREE_TOKENS, ignore_eos=True) if spec is None
             else SamplingParams(max_tokens=CONSTRAINED_TOKENS, structured=spec)
             for _, spec in REQUESTS]
    got, replays = _run(engine, mixed)
    for (_, spec), done in zip(REQUESTS, got, strict=True):
        if spec is None:
            assert done.finish_reason == "length" and len(done.token_ids) == FREE_TOKENS
            continue
        print(f"{spec.kind}: {done.text!r} ({len(done.token_ids)} tokens)")
        assert done.finish_reason == "stop", (spec.kind, done.text)
        _obeys(spec, done.text)
    assert replays > 0
    # the control: every request free, each constrained one's twin for the same steps (its
    # tokens, then the step that chose its grammar's stop token)
    free = [p if spec is None else SamplingParams(max_tokens=len(done.token_ids) + 1,
                                                  ignore_eos=True)
            for p, (_, spec), done in zip(mixed, REQUESTS, got, strict=True)]
    want, control_replays = _run(engine, free)
    assert control_replays == replays
    for i, (_, spec) in enumerate(REQUESTS):
        if spec is not None:
            assert len(want[i].token_ids) == len(got[i].token_ids) + 1, i
            continue
        assert got[i].token_ids == want[i].token_ids, f"free request {i}"
        diff = float((torch.stack(got[i].logits) - torch.stack(want[i].logits)).abs().max())
        print(f"free request {i}: largest logit difference beside constrained neighbours {diff}")
        torch.testing.assert_close(torch.stack(got[i].logits), torch.stack(want[i].logits),
                                   rtol=2e-2, atol=1e-1, msg=lambda m, i=i: f"request {i}: {m}")


def test_the_mask_touches_only_its_rows(engine):
    from dwdp.worker.engine.grammar import masked

    spec = StructuredOutput("choice", json.dumps(CHOICES))
    constraint = engine.constraint(SamplingParams(structured=spec))
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(3, engine.vocab_size, device="cuda", generator=g).to(torch.bfloat16)
    out = masked(logits, [None, constraint, None])
    assert out.dtype == torch.float32 and out.device == logits.device
    assert torch.equal(out[[0, 2]], logits[[0, 2]].float())
    first = {engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in CHOICES}
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    # the first token of a choice may be any token that begins one (a prefix of a choice)
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert allowed and first <= set(allowed), (texts, first)
    assert all(any(c.startswith(t) for c in CHOICES) for t in texts), texts
    assert torch.equal(out[1][allowed], logits[1][allowed].float())
