"""Checkpoint checks that run before any weight is loaded: names, shapes and dtypes.

transformers re-initializes a missing tensor with a warning and silently casts a tensor of
another dtype; a DWDP group must instead fail before setup, on every rank, with one line that
names the tensor. ``validate_checkpoint`` reads only the safetensors headers and compares them
with the tensors of the model built on the meta device (no memory, no weights read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dwdp.worker.models import adapter_for


class CheckpointError(ValueError):
    """The checkpoint directory cannot serve: the message is one line naming the tensor, the
    field or the file."""


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def read_headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the checkpoint's safetensors files: name -> (shape, torch dtype name).

    Raises ``CheckpointError`` when there is no safetensors file or a file is unreadable.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {path}: no *.safetensors file")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = handle.get_slice(key)
                    dtype = piece.get_dtype()
                    out[key] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype))
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {file}: unreadable safetensors file ({exc})"
            ) from exc
    return out


def load_config(path: str | Path) -> Any:
    """The checkpoint's ``transformers`` config. Raises ``CheckpointError`` (missing or bad
    ``config.json``, unknown model type)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path}: config.json not found")
    try:
        json.loads((path / "config.json").read_text())
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: config.json: {line}") from exc


def expected_tensors(config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's state-dict tensors (name -> (shape, dtype name)), from a meta-device model.

    Tied weights (``tie_word_embeddings``) are left out: the checkpoint need not hold them.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None))
    out = {
        name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in model.state_dict().items()
    }
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def validate_checkpoint(path: str | Path) -> Any:
    """Check the checkpoint at ``path`` against its own config; returns the config.

    Every model tensor must be present in one of its on-disk forms (fused, or one tensor per
    expert matrix as the architecture's original checkpoints store it), with the expected shape
    and dtype. Raises ``CheckpointError`` naming the first offending tensor.
    """
    path = Path(path)
    config = load_config(path)
    headers = read_headers(path)
    adapter = adapter_for(config)
    assert adapter is not None
    for name, (shape, dtype) in expected_tensors(config).items():
        forms = adapter.checkpoint_forms(name, shape)
        form = next((f for f in forms if all(k in headers for k in f)), None)
        if form is None:
            # Name the first missing tensor of the form the checkpoint started to use.
            best = max(forms, key=lambda f: sum(k in headers for k in f))
            missing = next(k for k in best if k not in headers)
            raise CheckpointError(f"checkpoint {path}: tensor {missing} is missing")
        for key, want_shape in form.items():
            got_shape, got_dtype = headers[key]
            if got_shape != want_shape:
                raise CheckpointError(
                    f"checkpoint {path}: tensor {key} has shape {list(got_shape)}, "
                    f"expected {list(want_shape)}"
                )
            if got_dtype != dtype:
                raise CheckpointError(
                    f"checkpoint {path}: tensor {key} has dtype {got_dtype}, expected {dtype}"
                )
    return config


def expert_count(config: Any) -> int:
    """E, the routed experts of the model's MoE layers (0 for a model without fused
    experts); from the meta-device model's ``*.experts.gate_up_proj`` [E, 2I, H]."""
    for name, (shape, _dtype) in expected_tensors(config).items():
        if name.endswith(".experts.gate_up_proj") and len(shape) == 3:
            return int(shape[0])
    return 0
