"""Block-scaled FP8 checkpoints for tests and benches, in the format DeepSeek-V3 ships.

``quantize_checkpoint(src, out)`` rewrites a checkpoint directory (``make_checkpoint``'s, or
any unquantized one in safetensors): every linear layer's 2-D weight (the attention's and the
MLPs', one tensor per expert matrix; not the embeddings, routers or output head) becomes
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128x128 block (the block's largest
magnitude over 448, the format's largest value), other tensors stay as stored, and
``config.json`` gains the ``quantization_config`` DeepSeek-V3 declares.
``dequantize_checkpoint(fp8, out)`` writes the reference the FP8 worker is compared with: the
same checkpoint with every FP8 weight times its scales, in ``dtype`` (the model's compute
dtype), and no ``quantization_config``.

Both are written here independently of the worker's FP8 code (``dwdp.worker.quant.fp8``), so a
test comparing the two checks the worker's reading of the format, not the format's reading of
itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BLOCK = 128
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""


def quantize_checkpoint(src: str | Path, out: str | Path, *, not_convert: Iterable[str] = (),
                        device: str = "cpu") -> Path:
    """Write ``src`` as a block-scaled FP8 checkpoint into ``out`` (module docstring), file by
    file (a sharded checkpoint keeps its files and index); a weight whose name starts with one
    of ``not_convert`` stays as stored and the config lists it under
    ``modules_to_not_convert``; ``device``: where the blocks are quantized. Returns ``out``."""
    keep = tuple(not_convert)

    def convert(name: str, tensor: Any, _file: dict[str, Any]) -> dict[str, Any]:
        if not _quantized(name, tensor) or name.startswith(keep):
            return {name: tensor}
        weight, scale = quantize_blocks(tensor.to(device))
        return {name: weight.cpu(), name + "_scale_inv": scale.cpu()}

    def configure(config: dict[str, Any]) -> None:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
            **({"modules_to_not_convert": [k.removesuffix(".weight") for k in keep]}
               if keep else {}),
        }

    return _rewrite(Path(src), Path(out), convert, configure)


def dequantize_checkpoint(src: str | Path, out: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write the FP8 checkpoint ``src`` with its FP8 weights dequantized into ``dtype`` (its
    other tensors as stored) into ``out``. Returns ``out``."""
    import torch

    def convert(name: str, tensor: Any, file: dict[str, Any]) -> dict[str, Any]:
        if name.endswith("_scale_inv"):
            return {}
        if tensor.dtype == torch.float8_e4m3fn:
            value = dequantize_blocks(tensor, file[name + "_scale_inv"])
            return {name: value.to(getattr(torch, dtype))}
        return {name: tensor}

    return _rewrite(Path(src), Path(out), convert, lambda c: c.pop("quantization_config", None))


def quantize_blocks(weight: Any) -> tuple[Any, Any]:
    """``(fp8 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)])`` of ``weight`` [N, K]."""
    import torch

    rows, cols = weight.shape
    blocks = _padded(weight.to(torch.float32))  # [R, 128, C, 128]
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [R, C]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_blocks(weight: Any, scale_inv: Any) -> Any:
    """``weight`` (FP8 [N, K]) times its block scales, float32 [N, K]."""
    import torch

    rows, cols = weight.shape
    blocks = _padded(weight.to(torch.float32)) * scale_inv.to(torch.float32)[:, None, :, None]
    return blocks.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :cols]


def _padded(matrix: Any) -> Any:
    """``matrix`` [N, K] zero-padded to whole blocks, viewed [N/128, 128, K/128, 128]."""
    from torch.nn import functional

    rows, cols = matrix.shape
    padded = functional.pad(matrix, (0, -cols % BLOCK, 0, -rows % BLOCK))
    return padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)


def _quantized(name: str, tensor: Any) -> bool:
    """The tensors DeepSeek-V3's FP8 release stores in FP8: the linear layers' 2-D weights
    (not the embeddings, the routers' gates or the output head)."""
    skip = ("embed_tokens.weight", ".gate.weight", "lm_head.weight")
    return tensor.dim() == 2 and name.endswith(".weight") and not name.endswith(skip)


def _rewrite(src: Path, out: Path, convert: Any, configure: Any) -> Path:
    """Copy ``src`` into ``out`` with every safetensors file's tensors through ``convert(name,
    tensor, file's tensors) -> {name: tensor}``, the index (if any) following the new names,
    and config.json through ``configure(config)``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    weight_map: dict[str, str] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        written: dict[str, Any] = {}
        for name, tensor in tensors.items():
            written.update(convert(name, tensor, tensors))
        save_file({k: v.contiguous() for k, v in written.items()}, str(out / file.name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(written, file.name))
    for file in src.iterdir():
        if file.is_file() and not file.name.startswith("model"):  # config.json: below
            shutil.copy2(file, out / file.name)
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    config: dict[str, Any] = json.loads((src / "config.json").read_text())
    configure(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
