"""``dwdp testing make-checkpoint`` and the checkpoint checks that run before loading."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from dwdp.cli import main as dwdp_main  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.validate import (  # noqa: E402
    CheckpointError,
    expert_count,
    validate_checkpoint,
)
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.tokenizer import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        a: make_checkpoint(a, root / a, num_experts=5)
        for a in ("deepseek_v3", "qwen3_moe", "mixtral")
    }


def test_cli_writes_a_loadable_directory(tmp_path, capsys):
    out = tmp_path / "ck"
    assert (
        dwdp_main(
            [
                "testing",
                "make-checkpoint",
                "--arch",
                "qwen3_moe",
                "--out",
                str(out),
                "--num-experts",
                "7",
                "--head-dim",
                "32",
                "--moe-width",
                "24",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert json.loads((out / "dwdp_checkpoint.json").read_text())["num_experts"] == 7
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 7
    assert config["head_dim"] == 32 and config["moe_intermediate_size"] == 24
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"


def test_cli_refuses_unknown_arch(tmp_path):
    with pytest.raises(SystemExit):
        dwdp_main(["testing", "make-checkpoint", "--arch", "llama", "--out", str(tmp_path)])


def test_cli_import_is_light():
    code = (
        "import sys, dwdp.cli; dwdp.cli.build_parser(); assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_loads_and_validates(checkpoints, arch):
    config = validate_checkpoint(checkpoints[arch])
    assert expert_count(config) == 5
    model, tok = load_checkpoint(checkpoints[arch])
    assert not model.training
    ids = torch.tensor([tok("Hello world")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_seeded_and_reproducible(tmp_path):
    a = make_checkpoint("mixtral", tmp_path / "a", seed=3)
    b = make_checkpoint("mixtral", tmp_path / "b", seed=3)
    c = make_checkpoint("mixtral", tmp_path / "c", seed=4)
    ta, tb, tc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert ta.keys() == tb.keys() == tc.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def _broken(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("case", "mutate", "message"),
    [
        (
            "missing",
            lambda t: t.pop("model.layers.1.mlp.gate.weight"),
            "tensor model.layers.1.mlp.gate.weight is missing",
        ),
        (
            "missing-expert",
            lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
            "tensor model.layers.2.mlp.experts.3.up_proj.weight is missing",
        ),
        (
            "shape",
            lambda t: t.__setitem__("model.layers.2.self_attn.o_proj.weight", torch.zeros(32, 31)),
            "tensor model.layers.2.self_attn.o_proj.weight has shape [32, 31], expected [32, 32]",
        ),
        (
            "expert-shape",
            lambda t: t.__setitem__(
                "model.layers.1.mlp.experts.0.down_proj.weight", torch.zeros(32, 15)
            ),
            "tensor model.layers.1.mlp.experts.0.down_proj.weight has shape [32, 15], "
            "expected [32, 16]",
        ),
        (
            "dtype",
            lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].half()),
            "tensor model.norm.weight has dtype float16, expected float32",
        ),
    ],
)
def test_bad_checkpoint_one_line(checkpoints, tmp_path, case, mutate, message):
    path = _broken(checkpoints["deepseek_v3"], tmp_path / case, mutate)
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="tensor"):
        load_checkpoint(path)  # the loader checks first, before reading any weight


def test_fused_on_disk_form_accepted(checkpoints, tmp_path):
    """A checkpoint written with the fused expert tables (model names) validates too."""
    src = checkpoints["qwen3_moe"]
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    validate_checkpoint(dst)
    fused, _tok = load_checkpoint(dst)
    for (ka, va), (kb, vb) in zip(
        model.state_dict().items(), fused.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)


def test_missing_config_and_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        validate_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        validate_checkpoint(tmp_path)


def test_tokenizer_chat_template():
    tok = build_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|><|user|>hi\n<|assistant|>"
    assert tok.decode(tok("héllo ✓")["input_ids"]) == "héllo ✓"
