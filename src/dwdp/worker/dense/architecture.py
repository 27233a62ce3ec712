"""The dense roots of an architecture: which tensors of each MoE decoder layer move.

Model adapters (``dwdp.worker.models``) fill these declarations; the collector in
``dwdp.worker.dense.layout`` only reads them. Names are relative to the decoder layer
(``"self_attn"``, ``"mlp.gate.e_score_correction_bias"``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


class DenseLayerLike(Protocol):
    """What the collector needs of one MoE decoder layer (``MoeLayer`` of the model
    adapters satisfies it; :class:`DenseLayerSpec` is the plain form)."""

    @property
    def prefix(self) -> str: ...
    @property
    def decoder_layer(self) -> Any: ...
    @property
    def attention_roots(self) -> tuple[str, ...]: ...
    @property
    def moe_dense_roots(self) -> tuple[str, ...]: ...
    @property
    def never_move(self) -> Collection[str]: ...


@dataclass(frozen=True, slots=True)
class DenseLayerSpec:
    """One MoE decoder layer's dense roots and name tables.

    ``prefix`` is the layer's qualified module name (``"model.layers.3"``);
    ``attention_roots`` feed blob A(l), ``moe_dense_roots`` blob D(l) (router, shared
    expert, latent projections, norms). Under the roots, every parameter and buffer moves
    except the ``never_move`` names (scratch, routing bias); ``movable`` adds plain tensor
    attributes (not registered) that move too, such as a second copy of a weight scale.
    ``skip`` names submodules under a root that belong to someone else (routed experts).
    """

    prefix: str
    decoder_layer: Any
    attention_roots: tuple[str, ...]
    moe_dense_roots: tuple[str, ...]
    never_move: frozenset[str] = frozenset()
    movable: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DenseArchitecture:
    """The dense roots and name tables of one architecture family.

    Example (DeepSeek-V3): ``attention_roots=("self_attn",)``, ``moe_dense_roots=
    ("input_layernorm", "post_attention_layernorm", "mlp.gate", "mlp.shared_experts")``,
    ``never_move=("mlp.gate.e_score_correction_bias",)``. A decoder layer is an MoE layer
    when ``<moe_block>.<experts>`` exists under it.
    """

    name: str
    attention_roots: tuple[str, ...]
    moe_dense_roots: tuple[str, ...]
    never_move: tuple[str, ...] = ()
    movable: tuple[str, ...] = ()
    layers_path: str = "model.layers"
    moe_block: str = "mlp"
    experts: str = "experts"
    extra: dict[str, Any] = field(default_factory=dict)

    def moe_layers(self, model: Any) -> list[DenseLayerSpec]:
        """The MoE decoder layers of ``model`` in execution order, as specs. Layers without
        ``<moe_block>.<experts>`` (a first dense MLP) stay replicated and are skipped."""
        layers = model.get_submodule(self.layers_path)
        out = []
        for index, layer in enumerate(layers):
            block = getattr(layer, self.moe_block, None)
            if block is None or getattr(block, self.experts, None) is None:
                continue
            roots = tuple(r for r in self.moe_dense_roots if _has_submodule(layer, r))
            out.append(DenseLayerSpec(
                prefix=f"{self.layers_path}.{index}",
                decoder_layer=layer,
                attention_roots=self.attention_roots,
                moe_dense_roots=roots,
                never_move=frozenset(self.never_move),
                movable=self.movable,
                skip=(f"{self.moe_block}.{self.experts}",),
            ))
        return out


def _has_submodule(module: Any, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
