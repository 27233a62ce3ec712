"""Checkpoint checks that run before any weight is loaded: names, shapes and dtypes.

transformers re-initializes a missing tensor with a warning and silently casts a tensor of
another dtype; a DWDP group must instead fail before setup, on every rank, with one line that
names the tensor. ``validate_checkpoint`` reads only the safetensors headers and compares them
with the tensors of the model built on the meta device (no memory, no weights read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dwdp.worker.models import adapter_for

if TYPE_CHECKING:
    from dwdp.worker.models.base import ArchitectureAdapter


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


INDEX_FILE = "model.safetensors.index.json"
"""The index of a checkpoint sharded into several safetensors files (``weight_map``: tensor
name -> file name)."""

Headers = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, torch dtype name), from the safetensors headers."""


def read_headers(path: Path) -> Headers:
    """Every tensor of the checkpoint's safetensors files: name -> (shape, torch dtype name).

    Raises ``CheckpointError`` (one line naming the file and tensor) when there is no
    safetensors file, a file is unreadable, a shard file the index names is missing, or a
    file does not hold a tensor the index says it does.
    """
    return scan_checkpoint(path)[0]


def read_index(path: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> file name), ``None`` without an index.
    Raises ``CheckpointError`` for an unreadable index."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
        return {str(k): str(v) for k, v in weight_map.items()}
    except Exception as exc:
        raise CheckpointError(f"checkpoint {index}: unreadable index ({exc})") from exc


def scan_checkpoint(path: Path) -> tuple[Headers, dict[str, Path]]:
    """The headers of every tensor and the file that holds it (tensor name -> file path).

    With ``model.safetensors.index.json`` the files are the ones its ``weight_map`` names
    (every one must exist and hold the tensors the index gives it); without, every
    ``*.safetensors`` file of ``path``. Raises ``CheckpointError`` as :func:`read_headers`.
    """
    weight_map = read_index(path)
    if weight_map is None:
        files = sorted(path.glob("*.safetensors"))
    else:
        files = []
        for name, file_name in weight_map.items():
            file = path / file_name
            if file not in files:
                if not file.is_file():
                    raise CheckpointError(
                        f"checkpoint {path}: shard file {file_name} named by {INDEX_FILE} "
                        f"(tensor {name}) is missing"
                    )
                files.append(file)
    if not files:
        raise CheckpointError(f"checkpoint {path}: no *.safetensors file")
    headers: Headers = {}
    where: dict[str, Path] = {}
    for file in files:
        _read_file_headers(file, headers, where)
    for name, file_name in (weight_map or {}).items():
        if where.get(name) != path / file_name:
            raise CheckpointError(
                f"checkpoint {path}: shard file {file_name} does not hold tensor {name} "
                f"that {INDEX_FILE} names"
            )
    return headers, where


def _read_file_headers(file: Path, headers: Headers, where: dict[str, Path]) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = handle.get_slice(key)
                dtype = piece.get_dtype()
                headers[key] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype))
                where[key] = file
    except Exception as exc:
        raise CheckpointError(f"checkpoint {file}: unreadable safetensors file ({exc})") from exc


def load_config(path: str | Path) -> Any:
    """The checkpoint's ``transformers`` config. Raises ``CheckpointError`` (missing or bad
    ``config.json``, unknown model type)."""
    from transformers import AutoConfig

    from dwdp.worker.quant.fp8 import QuantizationError, config_fields

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path}: config.json not found")
    try:
        raw = json.loads((path / "config.json").read_text())
        if isinstance(raw, dict) and raw.get("quantization_config") is not None:
            config_fields(raw["quantization_config"])  # transformers' own error names nothing
        return AutoConfig.from_pretrained(str(path))
    except QuantizationError as exc:
        raise CheckpointError(f"checkpoint {path / 'config.json'}: {exc}") from exc
    except Exception as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: config.json: {line}") from exc


def meta_model(config: Any, dtype: Any = None) -> Any:
    """The causal LM of ``config`` on the meta device (no memory), in ``dtype`` (``None``: the
    config's), in its stored form: an FP8 checkpoint's linear layers and experts hold FP8
    weights and their scales (``dwdp.worker.quant.fp8``). Raises ``QuantizationError`` for a
    ``quantization_config`` the worker does not run."""
    import torch
    from transformers import AutoModelForCausalLM

    from dwdp.worker.quant.fp8 import quantize_meta_model, scheme_of

    scheme = scheme_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(config, "dtype", None) if dtype is None else dtype)
    if scheme is not None:
        quantize_meta_model(model, scheme)
    return model


def expected_tensors(config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's state-dict tensors (name -> (shape, dtype name)), from a meta-device model.

    Tied weights (``tie_word_embeddings``) are left out: the checkpoint need not hold them.
    """
    model = meta_model(config)
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
    and dtype, and the experts on disk must be config.json's count (checked first: a count that
    differs is named as such, not as the shapes or tensors it throws off). Raises
    ``CheckpointError`` naming the file (or the directory, for a missing tensor) and the first
    offending tensor.
    """
    from dwdp.worker.quant.fp8 import QuantizationError

    path = Path(path)
    config = load_config(path)
    headers, where = scan_checkpoint(path)
    adapter = adapter_for(config)
    assert adapter is not None
    try:
        expected = expected_tensors(config)
    except QuantizationError as exc:
        raise CheckpointError(f"checkpoint {path / 'config.json'}: {exc}") from exc
    field = _expert_field(path)
    for name, (shape, _dtype) in expected.items():
        if _is_expert_table(name, shape):
            _check_expert_count(path, adapter, name, shape, headers, where, field)
    for name, (shape, dtype) in expected.items():
        forms = adapter.checkpoint_forms(name, shape)
        form = next((f for f in forms if all(k in headers for k in f)), None)
        if form is None:
            # Name the first missing tensor of the form the checkpoint started to use.
            best = max(forms, key=lambda f: sum(k in headers for k in f))
            missing = next(k for k in best if k not in headers)
            raise CheckpointError(
                f"checkpoint {path}: tensor {missing} is missing (searched {_files_of(where)})"
            )
        for key, want_shape in form.items():
            got_shape, got_dtype = headers[key]
            file = where[key]
            if got_shape != want_shape:
                raise CheckpointError(
                    f"checkpoint {file}: tensor {key} has shape {list(got_shape)}, "
                    f"expected {list(want_shape)}"
                )
            if got_dtype != dtype:
                raise CheckpointError(
                    f"checkpoint {file}: tensor {key} has dtype {got_dtype}, expected {dtype}"
                )
    return config


_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")
"""config.json's routed-expert count of Qwen3-MoE, DeepSeek-V3 and Mixtral."""


def _expert_field(path: Path) -> str | None:
    """The routed-expert field as ``path``'s config.json spells it (transformers aliases
    them), ``None`` without one."""
    raw = json.loads((path / "config.json").read_text())
    fields = {**raw, **(raw.get("text_config") or {})}
    return next((f for f in _EXPERT_FIELDS if isinstance(fields.get(f), int)), None)


def _is_expert_table(name: str, shape: tuple[int, ...]) -> bool:
    head, _, last = name.rpartition(".")
    return last in ("gate_up_proj", "down_proj") and head.endswith(".experts") and len(shape) == 3


def _check_expert_count(
    path: Path,
    adapter: ArchitectureAdapter,
    name: str,
    shape: tuple[int, ...],
    headers: Headers,
    where: dict[str, Path],
    field: str | None,
) -> None:
    """Refuse a checkpoint whose expert count for the fused table ``name`` ([E, ...]) is not
    config.json's E: a fused table on disk with another first dimension, or one tensor per
    expert matrix with an expert E present, or only experts 0..k-1 (0 < k < E)."""
    num = shape[0]
    config_says = f"config.json gives {num}" + (f" ({field})" if field else "")
    forms = adapter.checkpoint_forms(name, shape)
    for key in (next(iter(f)) for f in forms if list(f.values()) == [shape]):  # fused forms
        got = headers[key][0] if key in headers else ()
        if len(got) == 3 and got[0] != num and got[1:] == shape[1:]:
            raise CheckpointError(
                f"checkpoint {where[key]}: tensor {key} has shape {list(got)}: {got[0]} "
                f"experts where {config_says}"
            )
    per_expert = sum(list(f.values()) != [shape] for f in forms)
    for alternative in range(per_expert):  # the naming alternatives of expert_matrix_names
        names = [adapter.expert_matrix_names(name, e)[alternative] for e in range(num + 1)]
        extra = next((k for k in names[num] if k in headers), None)
        if extra is not None:
            raise CheckpointError(
                f"checkpoint {where[extra]}: tensor {extra} is expert {num} (counting from 0) "
                f"where {config_says}"
            )
        held = next(e for e in range(num + 1) if not all(k in headers for k in names[e]))
        if 0 < held < num and not any(k in headers for e in names[held:num] for k in e):
            last = names[held - 1][-1]
            raise CheckpointError(
                f"checkpoint {path}: tensor {names[held][0]} is missing: the checkpoint holds "
                f"{held} experts (the last, {last}, in {where[last].name}) where {config_says}"
            )


def _files_of(where: dict[str, Path]) -> str:
    names = sorted({file.name for file in where.values()})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def expert_count(config: Any) -> int:
    """E, the routed experts of the model's MoE layers (0 for a model without fused
    experts); from the meta-device model's ``*.experts.gate_up_proj`` [E, 2I, H]."""
    for name, (shape, _dtype) in expected_tensors(config).items():
        if name.endswith(".experts.gate_up_proj") and len(shape) == 3:
            return int(shape[0])
    return 0
