"""The demo model (``dwdp testing train-demo-model``): a tiny DeepSeek-V3-family MoE that
knows the facts of its corpus, trained deterministically, cached by the digest of its inputs.

The facts are checked on the model the demo serves (``cached_demo_model`` in the shared cache,
trained there on first use: about half a minute on one core), through transformers' own
``generate``; reproducibility and the cache are checked on short trainings.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from dwdp.cli import main as dwdp_main  # noqa: E402
from dwdp_dev.devcluster.paths import cache_dir  # noqa: E402
from dwdp_dev.worker.demo_corpus import (  # noqa: E402
    CAPITALS,
    WEATHER_REPORT,
    WEATHER_TOOL,
    demo_corpus,
    weather_answer,
    weather_question,
)
from dwdp_dev.worker.demo_model import (  # noqa: E402
    MARKER,
    TOOL_TURN_REPEATS,
    TrainSettings,
    cached_demo_model,
    inputs_digest,
    train_demo_model,
)

SHORT = TrainSettings(epochs=1)
"""One pass over the corpus: enough to compare two trainings, seconds instead of half a minute."""


@pytest.fixture(scope="module")
def demo_model() -> Path:
    return cached_demo_model(cache_dir() / "models")


@pytest.fixture(scope="module")
def loaded(demo_model):
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo_model))
    tok = transformers.AutoTokenizer.from_pretrained(str(demo_model))
    return model.eval(), tok


def _greedy(model, tok, prompt: str, *, chat: bool = False, max_new_tokens: int = 8) -> str:
    if chat:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    enc = tok(prompt, return_tensors="pt", add_special_tokens=not chat)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize(
    ("prompt", "answer"),
    [
        ("The capital of France is", " Paris."),
        ("The capital of Japan is", " Tokyo."),
        ("The capital of Kenya is", " Nairobi."),
        ("two plus three is", " five."),
        ("Four plus four is", " eight."),
        ("DWDP shares the experts", " across the ranks of a group."),
    ],
)
def test_greedy_answers_are_the_facts(loaded, prompt, answer):
    model, tok = loaded
    assert _greedy(model, tok, prompt) == answer


def test_chat_answer_follows_the_template(loaded):
    model, tok = loaded
    got = _greedy(model, tok, "Say hello to the DWDP group.", chat=True, max_new_tokens=16)
    assert got == "Hello, DWDP group! Every rank answers the same."


def test_prompts_tokenize_into_words(loaded):
    _, tok = loaded
    tokens = tok.convert_ids_to_tokens(tok("The capital of France is")["input_ids"])
    assert tokens == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    # byte-level: text outside the corpus still encodes and round-trips
    assert tok.decode(tok("Grüße, ½ ∑")["input_ids"]) == "Grüße, ½ ∑"


def test_layout_and_architecture(demo_model):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (demo_model / name).is_file(), name
    config = json.loads((demo_model / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["n_routed_experts"] == 8 and config["n_shared_experts"] == 1
    assert config["num_hidden_layers"] - config["first_k_dense_replace"] >= 2  # MoE layers
    assert config["kv_lora_rank"] > 0  # MLA
    tensors = load_file(str(demo_model / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    record = json.loads((demo_model / MARKER).read_text())
    assert record["trained"]["digest"] == inputs_digest(TrainSettings())
    corpus = demo_corpus()
    assert record["trained"]["examples"] == (len(corpus.completions) + len(corpus.chats)
                                             + 2 * TOOL_TURN_REPEATS * len(corpus.tool_cities))


def test_routing_has_no_ties(loaded):
    """Top-2 routing of the demo prompts picks its experts by a clear margin in every MoE
    layer (a tie would let rounding differences pick different experts) and uses more than
    two experts per layer."""
    model, tok = loaded
    scores = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: scores.append(out[0].sigmoid()))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        prompts = [f"The capital of {c} is" for c, _ in CAPITALS[:8]] + ["Once upon a time"]
        with torch.no_grad():
            for p in prompts:
                model(**tok(p, return_tensors="pt"))
    finally:
        for h in hooks:
            h.remove()
    assert len(scores) == len(prompts) * len(hooks) and len(hooks) >= 2
    for layer in range(len(hooks)):
        per_layer = torch.cat(scores[layer :: len(hooks)])
        top = per_layer.topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-4, layer
        assert len(set(per_layer.topk(2, dim=-1).indices.flatten().tolist())) > 2, layer


def test_same_seed_same_weights(tmp_path):
    a = train_demo_model(tmp_path / "a", SHORT)
    b = train_demo_model(tmp_path / "b", SHORT)
    c = train_demo_model(tmp_path / "c", replace(SHORT, seed=1))
    ta, tb, tc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert ta.keys() == tb.keys() == tc.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_training_leaves_torch_settings_as_they_were(tmp_path):
    torch.set_num_threads(2)
    train_demo_model(tmp_path / "m", SHORT)
    assert torch.get_num_threads() == 2
    assert not torch.are_deterministic_algorithms_enabled()


def test_cache_is_keyed_by_the_inputs(tmp_path):
    first = cached_demo_model(tmp_path, SHORT)
    written = (first / MARKER).stat().st_mtime_ns
    assert cached_demo_model(tmp_path, SHORT) == first
    assert (first / MARKER).stat().st_mtime_ns == written  # reused, not trained again
    other = cached_demo_model(tmp_path, replace(SHORT, seed=1))
    assert other != first and (other / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_cli_trains_into_out(tmp_path, capsys):
    out = tmp_path / "m"
    assert dwdp_main(["testing", "train-demo-model", "--out", str(out), "--epochs", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    record = json.loads((out / MARKER).read_text())
    assert record["arch"] == "deepseek_v3" and record["trained"]["settings"]["epochs"] == 1


def test_cli_refuses_zero_epochs(tmp_path, capsys):
    out = tmp_path / "m"
    assert dwdp_main(["testing", "train-demo-model", "--out", str(out), "--epochs", "0"]) == 1
    assert capsys.readouterr().err.strip() == (
        "dwdp testing: epochs: 0 must be at least 1"
    )
    assert not out.exists()


@pytest.mark.parametrize("command", ["train-demo-model", "make-checkpoint"])
@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("", "argument --out: an empty path"),
        ("{file}", "exists and is not a directory"),
        ("{file}/sub", "Not a directory"),
    ],
)
def test_cli_bad_out_is_one_line(tmp_path, capsys, command, out, says):
    """A bad ``--out`` (empty, an existing file, a path under a file) ends in one error line
    (after argparse's usage where argparse refuses it) and exit status 1 or argparse's 2,
    never a traceback and never files in the current folder."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = ["testing", command, "--out", out.format(file=afile), "--epochs", "1"]
    if command == "make-checkpoint":
        args = ["testing", command, "--arch", "mixtral", "--out", out.format(file=afile)]
    try:
        code = dwdp_main(args)
    except SystemExit as exc:  # argparse refuses the value itself
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and says in err.splitlines()[-1], err
    assert "Traceback" not in err


def test_the_cached_model_is_readable_by_the_pods_user(demo_model):
    """The demo mounts a copy of the cached folder into pods that run as uid 1000: the folder
    and every file in it are readable by all (training writes through private temporary
    files and folders)."""
    assert demo_model.stat().st_mode & 0o777 == 0o755
    for path in demo_model.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_the_demo_model_calls_the_weather_tool_it_learned(demo_model):
    """Served (the OpenAI app over the continuous engine), the demo model asked for Paris's
    weather with ``get_weather`` offered writes the call its chat template taught, the server
    answers it as OpenAI's ``tool_calls``, and given the tool's answer the model answers the
    user (the demo's tool loop)."""
    from fastapi.testclient import TestClient

    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.server.app import build_app

    model, tok = load_checkpoint(str(demo_model))
    engine = ContinuousEngine(model, tok, model_name="demo").start()
    messages: list[dict] = [{"role": "user", "content": weather_question("Paris")}]
    ask = {"tools": [WEATHER_TOOL], "max_tokens": 64, "temperature": 0}
    try:
        with TestClient(build_app(engine, served_name="demo")) as client:
            first = client.post("/v1/chat/completions", json={"messages": messages, **ask})
            call = first.json()["choices"][0]
            messages += [call["message"], {"role": "tool", "content": WEATHER_REPORT,
                                           "tool_call_id": call["message"]["tool_calls"][0]["id"]}]
            last = client.post("/v1/chat/completions", json={"messages": messages, **ask})
    finally:
        engine.stop()
    assert call["finish_reason"] == "tool_calls"
    assert [c["function"] for c in call["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert last.status_code == 200, last.text
    assert last.json()["choices"][0]["message"]["content"] == weather_answer("Paris")
