"""``dwdp testing make-checkpoint``: tiny seeded Hugging Face MoE checkpoints for tests and demos.

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (written by
``save_pretrained``, so in the usual on-disk layout of the architecture: one tensor per expert
matrix) and the files of a tokenizer trained locally (``dwdp_dev.worker.tokenizer``). It loads
through ``AutoModelForCausalLM.from_pretrained`` like any other checkpoint.

Every tensor is drawn from a generator seeded by (seed, tensor name), so a checkpoint depends only
on its arguments, not on module construction order or on the global torch seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCHS: tuple[str, ...] = ("deepseek_v3", "qwen3_moe", "mixtral")
"""Architectures the maker builds (short names, ``--arch``)."""


def tiny_config(
    arch: str,
    *,
    vocab_size: int,
    num_experts: int = 6,
    num_layers: int = 3,
    hidden_size: int = 32,
    dtype: str = "float32",
    special_ids: Mapping[str, int | None] | None = None,
    moe_width: int = 16,
    head_dim: int = 8,
) -> PretrainedConfig:
    """A tiny ``transformers`` config of ``arch``: ``num_layers`` decoder layers of width
    ``hidden_size``, ``num_experts`` routed experts (top-2) of width ``moe_width`` in every MoE
    layer; ``head_dim``: the attention heads' width (Qwen3-MoE and Mixtral; vLLM's CPU attention
    needs a multiple of 32).

    DeepSeek-V3 gets one first dense layer (``first_k_dense_replace=1``) and one shared expert;
    Qwen3-MoE gets ``mlp_only_layers=[0]``; every Mixtral layer is MoE. Raises ``ValueError``
    for an unknown ``arch`` or fewer than 2 experts.
    """
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    if num_experts < 2:
        raise ValueError(f"num_experts: {num_experts} < 2 (top-2 routing)")
    ids = special_ids or {}
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("pad"),
        "dtype": dtype,
    }
    # head_dim is no declared field of every config class (Qwen3-MoE takes it as an extra
    # attribute), so it travels in a plain dict
    head_dims: dict[str, Any] = {"head_dim": head_dim}
    config: PretrainedConfig
    if arch == "deepseek_v3":
        config = DeepseekV3Config(
            **common,
            intermediate_size=2 * hidden_size,
            moe_intermediate_size=moe_width,
            n_shared_experts=1,
            n_routed_experts=num_experts,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=1.0,
        )
        config.num_key_value_heads = config.num_attention_heads  # MLA: one KV head per head
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden_size,
            moe_intermediate_size=moe_width,
            **head_dims,
            num_experts=num_experts,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif arch == "mixtral":
        config = MixtralConfig(
            **common,
            intermediate_size=moe_width,
            **head_dims,
            num_local_experts=num_experts,
        )
    else:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return config


def _generator_for(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def fill_seeded(model: Any, seed: int) -> None:
    """Overwrite every parameter and persistent buffer of ``model`` in place with seeded values.

    Matrices get N(0, 1/fan_in); 1-D weights of norms get 1 + N(0, 0.1); other 1-D tensors
    (biases, the routing bias) N(0, 0.1). Values are drawn in float32, then cast.
    """
    import torch

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            gen = _generator_for(seed, name)
            values = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            if tensor.dim() >= 2:
                values = values / float(tensor.shape[-1]) ** 0.5
            elif "norm" in name:
                values = 1.0 + 0.1 * values
            else:
                values = 0.1 * values
            tensor.copy_(values.to(tensor.dtype))


def write_tokenizer(out: Path) -> tuple[Any, dict[str, int | None]]:
    """Write the test tokenizer's files into ``out`` (created); returns the tokenizer and
    its special token ids (``bos``, ``eos``, ``pad``) for the config."""
    from dwdp_dev.worker.tokenizer import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(out))
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    return tokenizer, ids


def make_checkpoint(
    arch: str,
    out: str | Path,
    *,
    seed: int = 0,
    num_experts: int = 6,
    num_layers: int = 3,
    hidden_size: int = 32,
    dtype: str = "float32",
    moe_width: int = 16,
    max_shard_size: str | None = None,
    head_dim: int = 8,
    mtp: bool = False,
) -> Path:
    """Write a tiny seeded checkpoint of ``arch`` into ``out`` (created; existing files of the
    same names are overwritten). Returns the directory. Raises ``ValueError`` for bad arguments.

    ``moe_width``: the routed experts' width; ``max_shard_size`` (``"50MB"``): split the
    weights into several safetensors files with ``model.safetensors.index.json``
    (``None``: ``save_pretrained``'s default). ``mtp`` (DeepSeek-V3 only): one seeded
    multi-token-prediction layer too (:func:`write_mtp_layer`).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    tokenizer, ids = write_tokenizer(out)
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        num_experts=num_experts,
        num_layers=num_layers,
        hidden_size=hidden_size,
        dtype=dtype,
        special_ids=ids,
        moe_width=moe_width,
        head_dim=head_dim,
    )
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    fill_seeded(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    )
    if max_shard_size is None:
        model.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
    if mtp:
        write_mtp_layer(out, config, seed + 1)
    (out / "dwdp_checkpoint.json").write_text(
        json.dumps({"arch": arch, "seed": seed, "num_experts": num_experts}, indent=2) + "\n"
    )
    return out


def write_mtp_layer(out: Path, config: Any, seed: int, block: Any = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Add a DeepSeek-V3 MTP layer to the checkpoint in ``out`` (``config`` its config): its
    tensors in ``mtp.safetensors`` under ``model.layers.{num_hidden_layers}.``
    (``dwdp.worker.loading.mtp``) and ``num_nextn_predict_layers: 1`` in config.json. The
    layer's block is ``block`` (a one-layer model of ``block_config(config)``) and its own
    tensors ``extra`` (``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``): a trained
    layer's; ``None``: seeded (:func:`fill_seeded`)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from dwdp.worker.loading.mtp import block_config, stored_key

    if config.model_type != "deepseek_v3":
        raise ValueError(f"mtp: DeepSeek-V3 checkpoints only, not {config.model_type}")
    layer = int(config.num_hidden_layers)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    if block is None:
        block = AutoModelForCausalLM.from_config(block_config(config), dtype=dtype)
        fill_seeded(block, seed)
    if extra is None:
        gen = torch.Generator().manual_seed(seed)
        hidden = int(config.hidden_size)
        extra = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                 "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.05}
    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)  # the stored form (per-expert matrices) of the block
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    stored = {stored_key(name, layer): t for name, t in tensors.items()}
    stored.update({stored_key(name, layer): t.to(dtype) for name, t in extra.items()})
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "mtp.safetensors"))
    config.num_nextn_predict_layers = 1
    config.save_pretrained(str(out))
