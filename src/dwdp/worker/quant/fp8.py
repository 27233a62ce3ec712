"""Block-scaled FP8 checkpoints, the format DeepSeek-V3, Kimi-K2 and Qwen3-FP8 ship in.

The format (``config.json``'s ``quantization_config``): ``quant_method: fp8``,
``weight_block_size: [128, 128]``, ``activation_scheme: dynamic``, ``fmt: e4m3``, and
``modules_to_not_convert``. Every linear layer but the output head (and the modules that list
names) stores its weight as ``float8_e4m3fn`` [N, K] beside ``weight_scale_inv``, float32
[ceil(N / 128), ceil(K / 128)]: element (n, k) is worth ``weight[n, k] *
weight_scale_inv[n // 128, k // 128]``. A MoE layer's experts store one such pair per expert
matrix (``experts.{e}.gate_proj.weight`` and ``...weight_scale_inv``); in the model they are
the fused tables ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (FP8) with
``gate_up_proj_scale_inv`` [E, 2I / 128, H / 128] and ``down_proj_scale_inv`` [E, H / 128,
I / 128]. Norms, routers, embeddings and the output head keep their stored dtype.

The model keeps its own modules (transformers' linear and experts classes); this module turns
their weights into FP8 tensors plus scale parameters on the meta device before the load
(:func:`quantize_meta_model`) and gives each converted module a forward that reads the FP8
weights: on a GPU FP8 GEMMs with block scales (``dwdp.worker.gpu.fp8_gemm``: activations
quantized per 128-column group at run time, as DeepSeek-V3's reference inference does); on the
CPU the weights are dequantized into the activations' dtype at each call (so the answers equal
those of the checkpoint dequantized to that dtype), the expert tables after DWDP's gather,
never kept dequantized. transformers' own FP8 modules are not
used: they fetch their kernels from the Hugging Face Hub at the first forward, which a serving
node without Internet access cannot.

Nothing here imports torch at module import time.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dwdp.worker.models.base import EXPERT_PARAMS, SCALE_SUFFIX, is_fused_experts

METHOD = "fp8"
"""The ``quant_method`` this module runs."""
BLOCK = (128, 128)
"""The weight block (rows, columns) one scale covers: the one the kernels run."""
WEIGHT_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"


class QuantizationError(ValueError):
    """A ``quantization_config`` the worker does not run: one line naming the field, the value
    and what runs."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """A checkpoint's FP8 settings: the weight ``block`` (rows, columns) and the module names
    (or name suffixes) left unconverted."""

    block: tuple[int, int]
    not_convert: tuple[str, ...]

    def converts(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` stores FP8 weights: every one but the
        output head and those ``modules_to_not_convert`` names (exactly, or as the tail of
        the name after a dot)."""
        if module_name == "lm_head" or module_name.endswith(".lm_head"):
            return False
        return not any(
            module_name == n or module_name.endswith("." + n) or module_name.startswith(n + ".")
            for n in self.not_convert
        )


def scheme_of(config: Any) -> Fp8Scheme | None:
    """The FP8 scheme of a transformers config, ``None`` for an unquantized checkpoint.

    Raises :class:`QuantizationError` for a quantization the worker does not run: another
    ``quant_method`` (GPTQ, AWQ, compressed-tensors, MXFP4, ...), another
    ``weight_block_size``, a static ``activation_scheme`` or another ``fmt``.
    """
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    fields = config_fields(raw)
    if "quant_method" not in fields:
        raise QuantizationError(
            f"quantization_config.quant_method: missing; the worker runs {METHOD!r} with "
            f"weight_block_size {list(BLOCK)} (DeepSeek-V3's block-scaled FP8)"
        )
    method = fields.get("quant_method")
    if method != METHOD:
        raise QuantizationError(
            f"quantization_config.quant_method: {method!r} is not run by the worker; it runs "
            f"unquantized checkpoints (bfloat16, float16, float32) and {METHOD!r} with "
            f"weight_block_size {list(BLOCK)} (DeepSeek-V3's block-scaled FP8)"
        )
    block = fields.get("weight_block_size")
    if block is None or [int(b) for b in block] != list(BLOCK):
        raise QuantizationError(
            f"quantization_config.weight_block_size: {block!r} is not run; the FP8 kernels "
            f"take {list(BLOCK)} (one float32 scale per 128x128 block)"
        )
    scheme = fields.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(
            f"quantization_config.activation_scheme: {scheme!r} is not run; the worker scales "
            "activations per token group at run time ('dynamic')"
        )
    fmt = fields.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(
            f"quantization_config.fmt: {fmt!r} is not run; FP8 weights are float8_e4m3fn ('e4m3')"
        )
    return Fp8Scheme(BLOCK, tuple(fields.get("modules_to_not_convert") or ()))


def config_fields(raw: Any) -> Mapping[str, Any]:
    """``quantization_config`` (config.json's object, or transformers' config of it) as a
    mapping. Raises :class:`QuantizationError` when it is not one."""
    fields = raw if isinstance(raw, Mapping) else getattr(raw, "to_dict", lambda: None)()
    if not isinstance(fields, Mapping):
        raise QuantizationError(
            f"quantization_config: {raw!r} is not a mapping (expected an object with "
            f"quant_method: {METHOD!r} and weight_block_size {list(BLOCK)})"
        )
    return fields


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scale's shape for a weight of ``shape`` ([..., N, K]): [..., ceil(N / rows),
    ceil(K / columns)]."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def scale_problem(scale: Any, first_row: int = 0) -> str | None:
    """Why the block scales ``scale`` (a ``..._scale_inv`` tensor, whose first dimension
    starts at row ``first_row`` of the checkpoint's) cannot serve, or None: every scale must
    be finite and positive (a NaN, an infinity, a zero or a negative scale makes its block's
    products garbage). Names the first bad index, in the checkpoint's rows, and its value."""
    import torch

    values = scale.detach().to(torch.float32)
    bad = ~(torch.isfinite(values) & (values > 0))
    if not bool(bad.any()):
        return None
    index = [int(i) for i in bad.nonzero()[0]]
    value = float(values[tuple(index)])
    if index:
        index[0] += first_row
    return (f"scale {value} at index {tuple(index)}: every FP8 block scale must be finite "
            f"and positive")


def dequantize(weight: Any, scale_inv: Any, dtype: Any, block: tuple[int, int] = BLOCK) -> Any:
    """``weight`` (FP8, [..., N, K]) times its block scales ``scale_inv`` ([..., ceil(N/128),
    ceil(K/128)], float32), computed in float32 and returned in ``dtype``: a new tensor of
    ``weight``'s shape on its device."""
    import torch

    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def linear_weight(module: Any, dtype: Any) -> Any:
    """The weight ``module`` (a linear layer) multiplies by, in ``dtype``: an FP8 weight
    dequantized with its block scales into a new tensor (read at the call, so after DWDP's
    gather when the layer is sharded), any other weight as it is. For code that uses a
    linear layer's matrix directly (MLA's absorbed attention) rather than calling the layer."""
    scale = getattr(module, "weight" + SCALE_SUFFIX, None)
    if scale is None:
        return module.weight
    return dequantize(module.weight, scale, dtype, getattr(module, "dwdp_fp8_block", BLOCK))


def is_quantized(name: str, tensor: Any) -> bool:
    """Whether ``tensor`` (named ``name``) is an FP8 weight or a block scale: tensors that keep
    their stored dtype whatever dtype the model computes in."""
    return str(tensor.dtype).removeprefix("torch.") == WEIGHT_DTYPE or name.endswith(SCALE_SUFFIX)


def quantize_meta_model(model: Any, scheme: Fp8Scheme) -> int:
    """Turn ``model`` (built on the meta device) into its FP8 form before the load: each
    converted linear layer's ``weight`` becomes FP8 and gains ``weight_scale_inv``, each fused
    experts module's tables (``EXPERT_PARAMS``) likewise (``gate_up_proj_scale_inv``, ...), and
    each gets the FP8 forward. Returns the number of modules converted.

    Raises :class:`QuantizationError` for an experts module whose expert width is not a
    multiple of the block (gate and up share the fused table's scale rows).
    """
    from torch import nn

    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and scheme.converts(name):
            _convert(module, ("weight",), scheme.block)
            module.forward = types.MethodType(_linear_forward, module)  # type: ignore[method-assign]
            count += 1
        elif is_fused_experts(module) and scheme.converts(name):
            width = module.down_proj.shape[-1]
            if width % scheme.block[0]:
                raise QuantizationError(
                    f"{name}: the experts' width (moe_intermediate_size) {width} is not a "
                    f"multiple of the FP8 block {scheme.block[0]}"
                )
            _convert(module, EXPERT_PARAMS, scheme.block)
            module.forward = types.MethodType(_experts_forward, module)
            count += 1
    return count


def _convert(module: Any, params: tuple[str, ...], block: tuple[int, int]) -> None:
    import torch
    from torch import nn

    for p in params:
        weight = getattr(module, p)
        setattr(module, p, nn.Parameter(
            torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device="meta"),
            requires_grad=False))
        setattr(module, p + SCALE_SUFFIX, nn.Parameter(
            torch.empty(scale_shape(tuple(weight.shape), block), dtype=torch.float32,
                        device="meta"),
            requires_grad=False))
    module.dwdp_fp8_params = params
    module.dwdp_fp8_block = block


def _linear_forward(self: Any, input: Any) -> Any:
    """An FP8 linear layer: ``input`` [..., K] -> [..., N] in ``input``'s dtype; on a GPU
    through the FP8 GEMM (``dwdp.worker.gpu.fp8_gemm``) when K is whole 128-column groups."""
    from torch.nn import functional

    if input.is_cuda and input.shape[-1] % self.dwdp_fp8_block[1] == 0:
        from dwdp.worker.gpu import fp8_gemm

        return fp8_gemm.linear(input, self.weight, self.weight_scale_inv, self.bias)
    weight = dequantize(self.weight, self.weight_scale_inv, input.dtype, self.dwdp_fp8_block)
    return functional.linear(input, weight, self.bias)


def _experts_forward(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """An FP8 experts module: its class's forward over the tables dequantized into
    ``hidden_states``' dtype for this call (read at the call, after DWDP's gather); on a GPU
    whose experts implementation takes FP8 tables (``dwdp_fp8_native``, set by
    ``dwdp.worker.gpu.cuda_path``) the class's forward over the FP8 tables themselves."""
    if getattr(self, "dwdp_fp8_native", False):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    fp8 = {p: self._parameters[p] for p in self.dwdp_fp8_params}
    for p, weight in fp8.items():
        self._parameters[p] = dequantize(
            weight, self._parameters[p + SCALE_SUFFIX], hidden_states.dtype, self.dwdp_fp8_block)
    try:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    finally:
        self._parameters.update(fp8)
