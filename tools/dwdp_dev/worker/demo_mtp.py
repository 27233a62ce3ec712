"""The demo model with a trained DeepSeek MTP layer: drafts for ``engine.speculative.method: mtp``.

The trained demo model (``dwdp_dev.worker.demo_model``) stays as it is, frozen; an MTP layer
(``dwdp.worker.loading.mtp``) is trained on the same corpus to predict token ``p + 2`` from the
model's last hidden state at ``p`` and the embedding of token ``p + 1``, as DeepSeek-V3's is
used at inference. Its block starts as a copy of the model's last decoder layer, its
embedding, final norm and head are the model's (copies, kept frozen, as DeepSeek's release
stores them again for the layer), ``enorm``/``hnorm`` start at ones and ``eh_proj`` seeded.
AdamW, deterministic, one thread, about as long as the model's own training.

``cached_demo_mtp_model`` keeps the result next to the demo model, in ``demo-<digest>-mtp``
(the demo model's files, ``mtp.safetensors`` and ``num_nextn_predict_layers: 1`` in
config.json), trained on first use, by the digest of the demo model's inputs and this module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dwdp_dev.worker.demo_corpus import demo_corpus
from dwdp_dev.worker.demo_model import (
    MARKER,
    TrainSettings,
    _batches,
    _deterministic,
    _examples,
    cached_demo_model,
    fit,
    inputs_digest,
    trained_once,
)


@dataclass(frozen=True)
class MtpSettings:
    """What the MTP layer's weights depend on besides the demo model: ``epochs`` passes of
    AdamW at ``lr`` (cosine decay to a tenth) in minibatches of ``batch_size``."""

    seed: int = 0
    epochs: int = 30
    batch_size: int = 32
    lr: float = 3e-3
    threads: int = 1


def mtp_digest(demo: TrainSettings, settings: MtpSettings) -> str:
    """sha256 (hex, 16) of the demo model's inputs, ``settings`` and this module's source."""
    h = hashlib.sha256()
    for part in (inputs_digest(demo), json.dumps(asdict(settings), sort_keys=True),
                 Path(__file__).read_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _new_layer(model: Any, seed: int) -> tuple[Any, Any]:
    """(block, extra): the one-layer block model initialised from ``model`` (its last decoder
    layer, embedding, final norm and head) and ``enorm``, ``hnorm``, ``eh_proj``."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from dwdp.worker.loading.mtp import block_config

    config = model.config
    block = AutoModelForCausalLM.from_config(block_config(config), dtype=torch.float32)
    block.model.layers[0].load_state_dict(model.model.layers[-1].state_dict())
    block.model.embed_tokens.load_state_dict(model.model.embed_tokens.state_dict())
    block.model.norm.load_state_dict(model.model.norm.state_dict())
    block.lm_head.load_state_dict(model.lm_head.state_dict())
    for frozen in (block.model.embed_tokens, block.model.norm, block.lm_head):
        frozen.requires_grad_(False)
    hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
    norm = type(model.model.norm)
    proj = nn.Linear(2 * hidden, hidden, bias=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(hidden, 2 * hidden, generator=gen) * 0.05)
    extra = nn.ModuleDict({"enorm": norm(hidden, eps=eps), "hnorm": norm(hidden, eps=eps),
                           "eh_proj": proj})
    return block, extra


def _train(model: Any, block: Any, extra: Any, batches: list, settings: MtpSettings) -> float:
    """AdamW over the block and ``extra``: the block's input at ``p`` is ``eh_proj`` of the
    normed embedding of token ``p + 1`` and the normed model hidden state at ``p``; its
    output there is scored against token ``p + 2``. Returns the last pass's mean loss."""
    import torch

    with torch.no_grad():
        hidden = [model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                  for ids, mask, _ in batches]

    def loss(index: int) -> Any:
        ids, mask, labels = batches[index]
        embeds = block.model.embed_tokens(ids[:, 1:])
        x = extra["eh_proj"](torch.cat(
            [extra["enorm"](embeds), extra["hnorm"](hidden[index][:, :-1])], dim=-1))
        return block(inputs_embeds=x, attention_mask=mask[:, 1:], labels=labels[:, 1:]).loss

    params = [p for p in [*block.parameters(), *extra.parameters()] if p.requires_grad]
    block.train()
    last = fit(params, len(batches), loss, epochs=settings.epochs, lr=settings.lr,
               weight_decay=0.0, seed=settings.seed)
    block.eval()
    return last


def train_demo_mtp_model(out: str | Path, demo: TrainSettings | None = None,
                         settings: MtpSettings | None = None) -> Path:
    """Write the demo model with a trained MTP layer into ``out`` (created). Returns ``out``."""
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import write_mtp_layer

    demo = demo or TrainSettings()
    settings = settings or MtpSettings()
    out = Path(out)
    source = cached_demo_model(out.parent, demo)
    shutil.copytree(source, out, dirs_exist_ok=True)
    started = time.monotonic()
    model, tokenizer = load_checkpoint(out)
    model.requires_grad_(False)
    with _deterministic(settings.threads, settings.seed):
        block, extra = _new_layer(model, settings.seed)
        batches = _batches(_examples(tokenizer, demo_corpus()), int(tokenizer.pad_token_id),
                           settings.batch_size)
        loss = _train(model, block, extra, batches, settings)
    write_mtp_layer(out, model.config, settings.seed, block=block,
                    extra={f"{name}.weight": m.weight.detach() for name, m in extra.items()})
    record = json.loads((out / MARKER).read_text())
    record["mtp"] = {"digest": mtp_digest(demo, settings), "settings": asdict(settings),
                     "final_loss": round(loss, 4),
                     "seconds": round(time.monotonic() - started, 1)}
    (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return out


def cached_demo_mtp_model(cache: str | Path, demo: TrainSettings | None = None,
                          settings: MtpSettings | None = None) -> Path:
    """The demo model with its trained MTP layer under ``cache/demo-<digest>-mtp``, trained
    there on first use (``trained_once``)."""
    demo = demo or TrainSettings()
    settings = settings or MtpSettings()
    return trained_once(Path(cache) / f"demo-{mtp_digest(demo, settings)}-mtp",
                        lambda tmp: train_demo_mtp_model(tmp, demo, settings))
