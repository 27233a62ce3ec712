"""Large seeded Qwen3-MoE checkpoints, written fast and layer by layer (GPU memory tests, bench).

``make_checkpoint`` (``dwdp_dev.worker.checkpoint``) builds the whole model in memory and
calls ``save_pretrained``: fine at a few MiB, not at 20 GB. ``write_qwen3_moe_checkpoint``
writes the same on-disk layout without ever holding the model: the tensor names and shapes come
from the model built on the meta device, the values are drawn on ``device`` (a GPU draws 1 GB
in milliseconds) from a generator seeded by (seed, tensor name), and every decoder layer goes
to its own safetensors file (``safetensors.torch.save_file``) listed in
``model.safetensors.index.json``, as ``save_pretrained`` shards a large model. The fused
expert tables of transformers 5 (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) are written as ``save_pretrained`` writes them: one tensor per expert matrix
(``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]).

Values: matrices N(0, std^2) (std 0.02, a usual initializer range, so the forward stays finite
through many layers), norm weights 1, other vectors 0. The tokenizer is the small local one of
``dwdp_dev.worker.tokenizer``, so the vocabulary (and the embeddings) stay small.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Qwen3MoeShape:
    """The shape of a Qwen3-MoE checkpoint (the defaults: Qwen3-30B-A3B's layer, 17 layers,
    about 21 GB in bfloat16, almost all routed experts: 3 * 2048 * 768 * 2 bytes = 9.4 MB an
    expert, 1.2 GB an MoE layer of 128)."""

    num_layers: int = 17
    hidden_size: int = 2048
    num_experts: int = 128
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    dtype: str = "bfloat16"

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up and down matrices)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    if dtype not in sizes:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(sizes)}")
    return sizes[dtype]


def qwen3_moe_config(
    shape: Qwen3MoeShape, *, vocab_size: int, special_ids: Mapping[str, int | None]
) -> PretrainedConfig:
    """The ``Qwen3MoeConfig`` of ``shape``: every decoder layer an MoE layer
    (``mlp_only_layers`` empty, ``decoder_sparse_step`` 1), top-k of ``num_experts_per_tok``
    with normalised routing weights, untied output embedding."""
    from transformers import Qwen3MoeConfig

    _itemsize(shape.dtype)
    # head_dim is no declared field of Qwen3MoeConfig (an extra attribute it takes)
    extra: dict[str, Any] = {"head_dim": shape.head_dim}
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=3 * shape.hidden_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        **extra,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=special_ids.get("bos"),
        eos_token_id=special_ids.get("eos"),
        pad_token_id=special_ids.get("pad"),
        dtype=shape.dtype,
    )


def write_qwen3_moe_checkpoint(
    out: str | Path,
    shape: Qwen3MoeShape | None = None,
    *,
    seed: int = 0,
    device: str = "cpu",
    std: float = 0.02,
    workers: int = 4,
) -> Path:
    """Write a seeded Qwen3-MoE checkpoint of ``shape`` (default ``Qwen3MoeShape()``) into
    ``out`` (created); returns the directory.

    Files: ``config.json``, ``generation_config.json``, the tokenizer's files,
    ``model-0000i-of-0000n.safetensors`` (one per decoder layer, plus one for the embeddings,
    the final norm and the output head) and ``model.safetensors.index.json``. ``device``:
    where values are drawn (``"cuda:0"`` for a large checkpoint; the bytes on disk depend on
    the device's random generator, not only on ``seed``); ``workers``: shard files written
    at once (host memory: about 3 x one layer's bytes each). Peak memory is a few layers,
    never the model. Raises ``ValueError`` for an unknown dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from dwdp_dev.worker.checkpoint import write_tokenizer

    shape = shape if shape is not None else Qwen3MoeShape()
    out = Path(out)
    tokenizer, ids = write_tokenizer(out)
    config = qwen3_moe_config(shape, vocab_size=len(tokenizer), special_ids=ids)
    config.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    ).save_pretrained(str(out))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype))
    groups = _shard_groups(model)
    writer = _ShardWriter(out, model, seed=seed, device=device, std=std, total=len(groups))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        written = list(pool.map(writer.write, range(len(groups)), groups))
    weight_map = {key: file for keys, file, _size in written for key in keys}
    total = sum(size for _keys, _file, size in written)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / "dwdp_checkpoint.json").write_text(
        json.dumps({"arch": "qwen3_moe", "seed": seed, "writer": "large", **asdict(shape)},
                   indent=2) + "\n"
    )
    return out


def _shard_groups(model: Any) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's state-dict tensors (meta) grouped into shard files: one per decoder layer,
    then one with every other tensor (embeddings, final norm, output head)."""
    layers: dict[int, list[tuple[str, torch.Tensor]]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layers.setdefault(int(parts[2]), []).append((name, tensor))
        else:
            rest.append((name, tensor))
    return [layers[i] for i in sorted(layers)] + [rest]


class _ShardWriter:
    """Draws and writes one shard file of :func:`write_qwen3_moe_checkpoint`."""

    def __init__(
        self, out: Path, model: Any, *, seed: int, device: str, std: float, total: int
    ) -> None:
        from dwdp.worker.models import require_adapter

        self.out = out
        self.adapter = require_adapter(model, dense=False)
        self.seed = seed
        self.device = device
        self.std = std
        self.total = total

    def write(
        self, index: int, group: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[str], str, int]:
        """Write shard ``index``; returns (its tensor names, its file name, its bytes)."""
        from safetensors.torch import save_file

        tensors = dict(item for name, meta in group for item in self._on_disk(name, meta))
        file = f"model-{index + 1:05d}-of-{self.total:05d}.safetensors"
        save_file(tensors, str(self.out / file), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return list(tensors), file, size

    def _on_disk(self, name: str, meta: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The on-disk tensors (host, contiguous, each its own storage) behind model tensor
        ``name``: itself, or one per expert matrix for a fused expert table."""
        values = self._draw(name, meta).cpu()
        head = name.rpartition(".")[0]
        if not (head.endswith(".experts") and values.dim() == 3):
            yield name, values.contiguous()
            return
        for expert in range(values.shape[0]):
            names = self.adapter.expert_matrix_names(name, expert)[0]  # save_pretrained's
            rows = values.shape[1] // len(names)  # gate then up along the rows; down alone
            for part, key in enumerate(names):
                yield key, values[expert, part * rows : (part + 1) * rows].clone()

    def _draw(self, name: str, meta: torch.Tensor) -> torch.Tensor:
        import torch

        if meta.dim() == 1:
            fill = 1.0 if "norm" in name else 0.0
            return torch.full(meta.shape, fill, dtype=meta.dtype, device=self.device)
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        values = torch.randn(meta.shape, generator=gen, dtype=meta.dtype, device=self.device)
        return values.mul_(self.std)


def checkpoint_sizes(path: str | Path) -> dict[str, int]:
    """Bytes on disk of the checkpoint's tensors: ``full``, ``experts`` (the routed experts'
    matrices, per-expert or fused) and ``replicated`` (the rest), from the safetensors
    headers."""
    import torch

    from dwdp.worker.loading.validate import read_headers

    sizes = {"full": 0, "experts": 0}
    for name, (dims, dtype) in read_headers(Path(path)).items():
        nbytes = int(torch.Size(dims).numel()) * getattr(torch, dtype).itemsize
        sizes["full"] += nbytes
        if ".experts." in name:
            sizes["experts"] += nbytes
    sizes["replicated"] = sizes["full"] - sizes["experts"]
    return sizes
