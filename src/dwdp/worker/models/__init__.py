"""Architecture adapters: what DWDP moves in each supported model family.

See docs/design.md §6.5 (dense DWDP) and §6.7 (the engine and its adapters).

``adapter_for(config_or_model)`` returns the adapter of a Hugging Face model or config, a
generic expert-only adapter for another fused-experts MoE model, or ``None`` for a model DWDP
cannot manage. ``require_adapter(..., dense=...)`` raises ``UnsupportedArchitectureError``
with the fix when the asked-for DWDP feature is not available. Nothing here imports torch at
module import time.
"""

from __future__ import annotations

from typing import Any

from dwdp.worker.models.base import (
    EXPERT_PARAMS,
    ArchitectureAdapter,
    DenseTensor,
    MoeLayer,
    UnsupportedArchitectureError,
    expert_param_names,
    iter_named_tensors,
)
from dwdp.worker.models.deepseek_v3 import DeepseekV3Adapter
from dwdp.worker.models.mixtral import MixtralAdapter
from dwdp.worker.models.qwen3_moe import Qwen3MoeAdapter

__all__ = [
    "ADAPTERS",
    "EXPERT_PARAMS",
    "ArchitectureAdapter",
    "DenseTensor",
    "GenericFusedExpertsAdapter",
    "MoeLayer",
    "UnsupportedArchitectureError",
    "adapter_for",
    "expert_param_names",
    "iter_named_tensors",
    "require_adapter",
]


class GenericFusedExpertsAdapter(ArchitectureAdapter):
    """Any other model whose MoE blocks are transformers 5 fused experts: expert DWDP only.

    It declares no dense roots, so ``enable_dense`` is refused for it.
    """

    name = "generic_fused_experts"
    has_dense_roots = False


GENERIC = GenericFusedExpertsAdapter()
"""The one expert-only adapter instance."""

ADAPTERS: tuple[ArchitectureAdapter, ...] = (
    DeepseekV3Adapter(),
    Qwen3MoeAdapter(),
    MixtralAdapter(),
)
"""The architecture adapters with dense roots, by family."""

ARCH_ALIASES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
"""Short architecture names (``--arch``) to Hugging Face class names."""


def _config_of(obj: Any) -> Any:
    return getattr(obj, "config", obj)


def adapter_for(obj: Any, *, allow_generic: bool = True) -> ArchitectureAdapter | None:
    """The adapter for a Hugging Face config or model.

    Matches ``config.architectures`` first, then ``config.model_type``. Without a match,
    returns the generic expert-only adapter when ``allow_generic`` (its MoE layers are found
    at run time; a model with none gets no DWDP), else ``None``.
    """
    config = _config_of(obj)
    archs = tuple(getattr(config, "architectures", None) or ())
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS:
        if any(a in adapter.architectures for a in archs):
            return adapter
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    return GENERIC if allow_generic else None


def require_adapter(obj: Any, *, dense: bool) -> ArchitectureAdapter:
    """The adapter for ``obj``; with ``dense`` it must declare dense roots.

    Raises ``UnsupportedArchitectureError`` naming the architecture and the supported ones
    (fix: turn enable_dense off, or use a supported architecture).
    """
    adapter = adapter_for(obj)
    assert adapter is not None
    if dense and not adapter.has_dense_roots:
        config = _config_of(obj)
        arch = ",".join(getattr(config, "architectures", None) or ()) or getattr(
            config, "model_type", "unknown"
        )
        supported = ", ".join(a for ad in ADAPTERS for a in ad.architectures)
        raise UnsupportedArchitectureError(
            f"enable_dense: architecture {arch} declares no dense roots; dense DWDP supports "
            f"{supported}. Set dwdp.enable_dense to false to serve this model."
        )
    return adapter
