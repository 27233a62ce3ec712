"""DeepSeek's multi-token prediction (MTP) layer: its checkpoint form, the module, its loading.

DeepSeek-V3 checkpoints carry ``num_nextn_predict_layers`` (1) MTP layers after the last decoder
layer: layer ``N = num_hidden_layers`` holds, under ``model.layers.{N}.``,

- a decoder block as any MoE layer's (``self_attn.*``, ``mlp.*``, ``input_layernorm``,
  ``post_attention_layernorm``);
- ``enorm.weight`` and ``hnorm.weight``: RMSNorms of the next token's embedding and of the
  model's hidden state; ``eh_proj.weight`` [H, 2H]: the projection of their concatenation
  (embedding first) into the block's input;
- ``embed_tokens.weight``, ``shared_head.norm.weight`` and ``shared_head.head.weight``: the
  embedding, final norm and output head, stored again for the layer.

At position ``p`` the layer takes the model's last hidden state there (after its final norm)
and the embedding of token ``p + 1``, and its output (through the shared head) predicts token
``p + 2``: the draft after the token the model just chose (vLLM's ``deepseek_mtp``). For more
drafts the layer runs again one position on, its own output standing in for the model's hidden
state there. Its attention has a KV cache of its own, in the same blocks as the model's.

:func:`load_mtp` reads the layer into :class:`MtpLayer`: its block is a one-layer DeepSeek-V3
model (the checkpoint's names mapped to that model's, :func:`block_name`), read through
the sharded loader's reader (only the layer's tensors are read); its final norm is the shared
head's, applied by :meth:`MtpLayer.logits`, not by the block (the chain needs the hidden state
before it).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
"""The layer's own tensors beside its block's, under ``model.layers.{N}.``."""


def mtp_layers(config: Any) -> int:
    """How many MTP layers a config declares (``num_nextn_predict_layers``; 0: none)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def has_mtp_layer(path: str | Path, config: Any) -> bool:
    """Whether the checkpoint at ``path`` holds an MTP layer: its config declares one and its
    files hold the layer's ``eh_proj`` (DeepSeek-V3's config declares one by default, also for
    a checkpoint saved without it)."""
    from dwdp.worker.loading.validate import scan_checkpoint

    if mtp_layers(config) < 1:
        return False
    headers, _ = scan_checkpoint(Path(path))
    return f"model.layers.{config.num_hidden_layers}.eh_proj.weight" in headers


def block_config(config: Any) -> Any:
    """The config of the one-layer model that holds an MTP layer's block: one MoE layer and no
    MTP layer of its own."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    one.first_k_dense_replace = 0
    one.num_nextn_predict_layers = 0
    return one


SHARED = {"embed_tokens.weight": "model.embed_tokens.weight",
          "shared_head.norm.weight": "model.norm.weight",
          "shared_head.head.weight": "lm_head.weight"}
"""An MTP layer's copies of the model's embedding, final norm and head, and their names in the
one-layer block model."""


def block_name(key: str, layer: int) -> str | None:
    """The name in the one-layer block model of the stored tensor ``key`` of MTP layer
    ``layer`` (its index in the checkpoint, ``num_hidden_layers``); ``None`` for a key of
    another layer, or one of :data:`EXTRA`."""
    prefix = f"model.layers.{layer}."
    if not key.startswith(prefix):
        return None
    rest = key[len(prefix) :]
    if rest in SHARED:
        return SHARED[rest]
    return None if rest in EXTRA else "model.layers.0." + rest


def stored_key(name: str, layer: int) -> str:
    """The stored key of the one-layer block model's tensor ``name`` (or of one of
    :data:`EXTRA`) for MTP layer ``layer``: :func:`block_name`'s inverse."""
    prefix = f"model.layers.{layer}."
    if name.startswith("model.layers.0."):
        return prefix + name[len("model.layers.0.") :]
    for rest, shared in SHARED.items():
        if name == shared:
            return prefix + rest
    if name in EXTRA:
        return prefix + name
    raise KeyError(f"{name}: no tensor of an MTP layer")


def extra_name(key: str, layer: int) -> str | None:
    """The name in :class:`MtpLayer`'s own modules of the stored tensor ``key`` (one of
    :data:`EXTRA` of layer ``layer``), else ``None``."""
    rest = key.removeprefix(f"model.layers.{layer}.")
    return rest if rest in EXTRA and rest != key else None


class MtpLayer:
    """One MTP layer ready to run: ``block`` (a one-layer causal LM whose final norm is the
    identity), ``enorm``, ``hnorm``, ``eh_proj`` and ``norm`` (the shared head's)."""

    def __init__(self, block: Any, enorm: Any, hnorm: Any, eh_proj: Any, norm: Any) -> None:
        self.block, self.enorm, self.hnorm, self.eh_proj, self.norm = (
            block, enorm, hnorm, eh_proj, norm)

    def inputs(self, token_ids: Any, hidden: Any) -> Any:
        """The block's input rows [1, T, H] from the next tokens' ids [T] and the hidden
        states [T, H] at their positions' predecessors (the model's or the layer's own)."""
        import torch

        embeds = self.block.model.embed_tokens(token_ids)
        both = torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1)
        return self.eh_proj(both)[None]

    def logits(self, hidden: Any) -> Any:
        """Logits [R, vocab] of the layer's output rows [R, H] (the shared head)."""
        return self.block.lm_head(self.norm(hidden))


def load_mtp(path: str | Path, config: Any, *, dtype: Any, device: str) -> MtpLayer:
    """The first MTP layer of the checkpoint at ``path`` (``config`` its validated config) on
    ``device`` in ``dtype`` (a torch dtype). Raises ``CheckpointError`` (one line) when the
    config declares none or a tensor of it is missing."""
    import torch
    from torch import nn

    from dwdp.worker.loading.sharded import read_into
    from dwdp.worker.loading.validate import CheckpointError, meta_model
    from dwdp.worker.models import adapter_for

    path = Path(path)
    if not has_mtp_layer(path, config):
        raise CheckpointError(
            f"checkpoint {path}: holds no MTP layer (num_nextn_predict_layers in config.json "
            f"and model.layers.{config.num_hidden_layers}.* in its files)")
    layer = int(config.num_hidden_layers)
    one = block_config(config)
    block = meta_model(one, dtype)
    adapter = adapter_for(one)
    assert adapter is not None  # the generic adapter without a match
    hidden = int(config.hidden_size)
    eps = float(config.rms_norm_eps)
    norm_class = type(block.model.norm)
    with torch.device("meta"):
        extra = nn.ModuleDict({"enorm": norm_class(hidden, eps=eps),
                               "hnorm": norm_class(hidden, eps=eps),
                               "eh_proj": nn.Linear(2 * hidden, hidden, bias=False)}).to(dtype)
    read_into(path, block, adapter, lambda key: block_name(key, layer), device)
    read_into(path, extra, adapter, lambda key: extra_name(key, layer), device)
    norm = block.model.norm
    block.model.norm = nn.Identity()
    block.eval()
    return MtpLayer(block, extra["enorm"].eval(), extra["hnorm"].eval(),
                    extra["eh_proj"].eval(), norm.eval())
