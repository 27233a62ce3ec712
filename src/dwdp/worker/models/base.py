"""What DWDP needs to know about a model architecture, declared once per architecture.

An *architecture adapter* names, for a loaded Hugging Face causal LM, its decoder layers,
the MoE layers among them (with their fused expert tables), and for each MoE layer the
*dense roots*: the attention root whose tensors form blob A(l), the roots whose tensors form
blob D(l) (router, shared expert, latent projections, norms) and the tensors that never move
(routing bias, scratch). The runtime walks these declarations; it never guesses module names.

Invariant: an adapter only reads the model; it never changes a tensor or a module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from torch import nn


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter for the DWDP feature that was asked for."""


SCALE_SUFFIX = "_scale_inv"
"""A block-scaled FP8 weight's scale: its name plus this (``weight_scale_inv``,
``gate_up_proj_scale_inv``; ``dwdp.worker.quant.fp8``)."""

EXPERT_PARAMS: tuple[str, str] = ("gate_up_proj", "down_proj")
"""The fused expert tables of a transformers 5 experts module: ``gate_up_proj`` of shape
[E, 2*I, H] and ``down_proj`` of shape [E, H, I] (E experts, H hidden, I expert width)."""


@dataclass(frozen=True, slots=True)
class DenseTensor:
    """One tensor of a dense blob: where it lives and what it is.

    ``name`` is the fully qualified state-dict style name (``model.layers.3.self_attn.o_proj
    .weight``); ``module`` and ``attr`` locate it (``getattr(module, attr)``); ``kind`` is
    ``"parameter"`` or ``"buffer"``.
    """

    name: str
    module: Any
    attr: str
    kind: str

    def get(self) -> torch.Tensor:
        """The tensor as the module holds it now."""
        return getattr(self.module, self.attr)


@dataclass(frozen=True, slots=True)
class MoeLayer:
    """One MoE decoder layer as DWDP sees it.

    ``layer_index`` is the index among all decoder layers; ``moe_index`` the order among MoE
    layers (the expert prefetch ring cycles over it). Root and never-move names are relative
    to ``decoder_layer`` (``"mlp.gate"``); ``prefix`` makes them fully qualified.
    """

    layer_index: int
    moe_index: int
    prefix: str
    decoder_layer: Any
    moe_block: Any
    experts: Any
    attention_roots: tuple[str, ...] = ()
    moe_dense_roots: tuple[str, ...] = ()
    never_move: frozenset[str] = field(default_factory=frozenset)

    @property
    def num_experts(self) -> int:
        """E, the number of routed experts of this layer."""
        return int(self.experts.gate_up_proj.shape[0])

    @property
    def attention(self) -> Any:
        """The attention module (the module H2 hooks after)."""
        return self.decoder_layer.get_submodule(self.attention_roots[0])

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """The fused expert tables by parameter name (``gate_up_proj``, ``down_proj``), and
        for FP8 experts their block scales (``gate_up_proj_scale_inv``, ``down_proj_scale_inv``:
        every table DWDP stores and gathers)."""
        return {name: getattr(self.experts, name) for name in expert_param_names(self.experts)}

    def blob_tensors(self, blob: str) -> list[DenseTensor]:
        """The tensors of blob ``"A"`` (attention roots) or ``"D"`` (MoE-dense roots).

        Parameters and persistent-or-not buffers under the roots, in module registration
        order, without the never-move names and without expert tables. Raises ``ValueError``
        for another blob name.
        """
        if blob == "A":
            roots = self.attention_roots
        elif blob == "D":
            roots = self.moe_dense_roots
        else:
            raise ValueError(f"unknown dense blob {blob!r}; expected 'A' or 'D'")
        out: list[DenseTensor] = []
        seen: set[int] = set()
        for root in roots:
            root_module = self.decoder_layer.get_submodule(root)
            for rel, module in root_module.named_modules(prefix=root):
                if module is self.experts:
                    continue
                for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                    for attr, tensor in table.items():
                        if tensor is None or id(tensor) in seen:
                            continue
                        local = f"{rel}.{attr}"
                        if local in self.never_move:
                            continue
                        seen.add(id(tensor))
                        out.append(DenseTensor(f"{self.prefix}.{local}", module, attr, kind))
        return out


class ArchitectureAdapter:
    """Declarations of one architecture family (subclass per family).

    Subclasses set ``name``, ``architectures`` (the Hugging Face ``config.architectures``
    class names they serve), and override ``is_moe_layer``/roots as needed. ``has_dense_roots``
    is False for an adapter that supports expert DWDP only.
    """

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    has_dense_roots: bool = True
    attention_roots: tuple[str, ...] = ("self_attn",)
    moe_dense_roots: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm", "mlp.gate")
    never_move: tuple[str, ...] = ()
    moe_block_attr: str = "mlp"
    # On-disk names of one expert's matrices: (gate, up, down) suffixes under ``experts.{e}.``
    checkpoint_expert_suffixes: tuple[str, str, str] = (
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    )
    # (model name part, on-disk name part) pairs that a checkpoint may use instead.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    # -- structure ---------------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        """The decoder layers in execution order (``model.model.layers``)."""
        return list(_decoder(model).layers)

    def layers_prefix(self, model: nn.Module) -> str:
        """The qualified name of the decoder layer list (``"model.layers"``)."""
        layers = _decoder(model).layers
        for name, module in model.named_modules():
            if module is layers:
                return name
        raise UnsupportedArchitectureError(f"{type(model).__name__}: decoder layers not found")

    def is_moe_layer(self, layer: nn.Module) -> bool:
        """True when the decoder layer's MLP is a fused-experts MoE block."""
        block = getattr(layer, self.moe_block_attr, None)
        return is_fused_experts(getattr(block, "experts", None))

    def moe_layers(self, model: nn.Module) -> list[MoeLayer]:
        """Every MoE decoder layer of ``model``, in execution order (first dense layers and
        other non-MoE layers are skipped: they stay replicated)."""
        prefix = self.layers_prefix(model)
        out: list[MoeLayer] = []
        for index, layer in enumerate(self.decoder_layers(model)):
            if not self.is_moe_layer(layer):
                continue
            block = getattr(layer, self.moe_block_attr)
            out.append(
                MoeLayer(
                    layer_index=index,
                    moe_index=len(out),
                    prefix=f"{prefix}.{index}",
                    decoder_layer=layer,
                    moe_block=block,
                    experts=block.experts,
                    attention_roots=self.attention_roots if self.has_dense_roots else (),
                    moe_dense_roots=self._dense_roots_of(layer) if self.has_dense_roots else (),
                    never_move=frozenset(self.never_move),
                )
            )
        return out

    def unfused_moe_layers(self, model: nn.Module) -> list[tuple[int, str]]:
        """``(decoder layer index, prefix)`` of every decoder layer whose MoE block has an
        ``experts`` module that is not the fused ``[E, ...]`` tables (``gate_up_proj``,
        ``down_proj``), e.g. a list of per-expert MLPs: DWDP cannot manage it and it keeps
        its full expert table (docs/design.md §6.4)."""
        prefix = self.layers_prefix(model)
        out = []
        for index, layer in enumerate(self.decoder_layers(model)):
            block = getattr(layer, self.moe_block_attr, None)
            if getattr(block, "experts", None) is not None and not self.is_moe_layer(layer):
                out.append((index, f"{prefix}.{index}"))
        return out

    def repeated_layers(self, model: nn.Module) -> frozenset[int]:
        """Decoder-layer indices of the MoE layers that run several times in a row within a
        forward (a draft layer reused for every draft step): each keeps its expert prefetch
        slot across its repeats instead of gathering its experts again (docs/design.md §6.4).

        The declaration: the model config's ``dwdp_repeated_layers`` (a list of decoder
        layer indices, in ``config.json``), or an adapter subclass overriding this method.
        Default: none.
        """
        config = getattr(model, "config", None)
        declared = getattr(config, "dwdp_repeated_layers", None) or ()
        return frozenset(int(i) for i in declared)

    def _dense_roots_of(self, layer: nn.Module) -> tuple[str, ...]:
        roots = []
        for root in self.moe_dense_roots:
            try:
                layer.get_submodule(root)
            except AttributeError:
                continue  # an optional root (a shared expert some configs leave out)
            roots.append(root)
        return tuple(roots)

    def never_move_names(self, model: nn.Module) -> list[str]:
        """Fully qualified names that never move, over every MoE layer."""
        return [f"{m.prefix}.{n}" for m in self.moe_layers(model) for n in sorted(m.never_move)]

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_forms(
        self, name: str, shape: tuple[int, ...]
    ) -> list[dict[str, tuple[int, ...]]]:
        """The on-disk forms a model tensor may take: a list of alternatives, each mapping
        checkpoint tensor names to their expected shapes. The fused form comes first."""
        alternatives: list[dict[str, tuple[int, ...]]] = [
            {n: shape} for n in self._renamed(name)
        ]
        head, _, last = name.rpartition(".")
        if _table_of(last) in EXPERT_PARAMS and head.endswith(".experts") and len(shape) == 3:
            num, rows, cols = shape
            part = (rows // 2, cols) if _table_of(last) == "gate_up_proj" else (rows, cols)
            for alternative in range(len(self._renamed(head))):
                alternatives.append({
                    n: part
                    for e in range(num)
                    for n in self.expert_matrix_names(name, e)[alternative]
                })
        return alternatives

    def expert_matrix_names(self, name: str, expert: int) -> list[tuple[str, ...]]:
        """The on-disk names of expert ``expert``'s matrices behind the fused table ``name``
        (``...experts.gate_up_proj``: ``(gate, up)``, stacked along rows in that order;
        ``...experts.down_proj``: ``(down,)``; a table's FP8 scales ``..._scale_inv``: the
        matrices' ``weight_scale_inv``), one tuple per naming alternative, in the order of
        :meth:`checkpoint_forms`' per-expert forms."""
        head, _, last = name.rpartition(".")
        gate, up, down = self.checkpoint_expert_suffixes
        suffixes: tuple[str, ...] = (gate, up) if _table_of(last) == "gate_up_proj" else (down,)
        if last != _table_of(last):
            suffixes = tuple(s + SCALE_SUFFIX for s in suffixes)
        return [tuple(f"{base}.{expert}.{s}" for s in suffixes) for base in self._renamed(head)]

    def _renamed(self, name: str) -> list[str]:
        names = [name]
        for model_part, disk_part in self.checkpoint_renames:
            if model_part in name:
                names.append(name.replace(model_part, disk_part))
        return names

    def describe(self, model: nn.Module) -> dict[str, Any]:
        """A JSON-able summary: adapter name, decoder and MoE layer indices, expert count."""
        moe = self.moe_layers(model)
        return {
            "adapter": self.name,
            "decoder_layers": len(self.decoder_layers(model)),
            "moe_layers": [m.layer_index for m in moe],
            "num_experts": moe[0].num_experts if moe else 0,
            "dense_roots": self.has_dense_roots,
        }


def is_fused_experts(module: Any) -> bool:
    """True for a transformers 5 fused experts module: every :data:`EXPERT_PARAMS` table is
    3-D ([E, ...])."""
    return all(getattr(getattr(module, p, None), "dim", lambda: 0)() == 3 for p in EXPERT_PARAMS)


def expert_param_names(experts: Any) -> tuple[str, ...]:
    """The tables of a fused experts module that DWDP moves: :data:`EXPERT_PARAMS`, then the
    FP8 scales of those that have one (``dwdp.worker.quant.fp8``)."""
    scales = tuple(p + SCALE_SUFFIX for p in EXPERT_PARAMS if hasattr(experts, p + SCALE_SUFFIX))
    return EXPERT_PARAMS + scales


def _table_of(param: str) -> str:
    """The fused table a parameter name belongs to (a scale's table: its name without
    ``_scale_inv``)."""
    return param.removesuffix(SCALE_SUFFIX)


def iter_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` by qualified name (shared tensors once)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                yield (f"{prefix}.{attr}" if prefix else attr), tensor


def _decoder(model: nn.Module) -> Any:
    """``model.get_decoder()``: the decoder stack of a transformers causal LM (torch's
    ``nn.Module`` typing does not know the method)."""
    return cast(Any, model).get_decoder()
