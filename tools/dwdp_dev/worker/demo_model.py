"""``dwdp testing train-demo-model``: the demo's tiny DeepSeek-V3-family model that knows facts.

A seeded training run on the corpus of ``dwdp_dev.worker.demo_corpus`` (capitals, small
sums, what DWDP does): a byte-level BPE tokenizer trained on that corpus, the architecture of
``tiny_config("deepseek_v3")`` (MLA attention, one first dense layer, then MoE layers with one
shared expert and 8 routed experts, top-2), weights drawn by ``fill_seeded`` and trained with
AdamW on every text (minibatches of similar length), in float32, with deterministic
algorithms and a fixed thread count (one: on 2 shared cores two threads ran 5 times slower).
Saved like ``make_checkpoint`` (``save_pretrained``: config.json, generation_config.json,
model.safetensors, tokenizer files) plus ``dwdp_checkpoint.json`` naming the digest of the
training inputs.

The model is trained when needed rather than committed: the repository then holds text only
(the corpus and this script are the whole source of the weights), and ``cached_demo_model``
keeps one trained copy per digest of the inputs (corpus, settings, the source of these modules,
the torch and transformers versions), so a changed input trains anew and an unchanged one
never does. The same inputs give bit-identical weights on one machine; another CPU or library
build may differ in the last bits. That leaves the facts alone (with torch 2.11 and two
threads, seeds 0, 1 and 2 each answered all 30 capitals) and never touches the demo's
comparison (the reference reads the same files as the ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dwdp_dev.worker.demo_corpus import (
    WEATHER_REPORT,
    WEATHER_TOOL,
    Corpus,
    demo_corpus,
    weather_answer,
    weather_call,
    weather_question,
)

ARCH = "deepseek_v3"
TOOL_TURN_REPEATS = 4
"""How often each tool turn is trained on per epoch: a long prompt and one answer among
hundreds of short texts; fewer repeats leave the model unable to copy the city."""
MARKER = "dwdp_checkpoint.json"
"""The file naming how a checkpoint was made (written last: its presence means complete)."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything the weights depend on besides the corpus and the library versions.

    ``hidden_size``/``num_layers``/``num_experts``/``moe_width``: the model shape (layer 0 is
    dense, the others MoE); ``epochs`` passes of AdamW over the corpus in minibatches of
    ``batch_size`` sentences at learning rate ``lr`` (cosine decay to a tenth) and
    ``weight_decay``; ``threads`` torch threads during
    training; ``vocab_size`` the tokenizer's upper bound (the corpus merges to fewer).
    """

    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 3
    num_experts: int = 8
    moe_width: int = 32
    epochs: int = 40
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    threads: int = 1
    vocab_size: int = 1024

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        rules = (
            ("num_layers", self.num_layers >= 2, "at least 2 (one dense, then MoE)"),
            ("num_experts", self.num_experts >= 2, "at least 2 (top-2 routing)"),
            ("epochs", self.epochs >= 1, "at least 1"),
            ("batch_size", self.batch_size >= 1, "at least 1"),
            ("threads", self.threads >= 1, "at least 1"),
            ("lr", self.lr > 0, "positive"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} must be {rule}")


def inputs_digest(settings: TrainSettings, corpus: Corpus | None = None) -> str:
    """sha256 (hex, 16 characters) of the training inputs: the corpus, ``settings``, the
    source of this module and of the corpus and tokenizer modules, the torch and transformers
    versions."""
    import torch
    import transformers

    from dwdp_dev.worker import checkpoint, tokenizer
    from dwdp_dev.worker import demo_corpus as corpus_module

    h = hashlib.sha256()
    parts = [
        json.dumps(asdict(corpus or demo_corpus()), sort_keys=True),
        json.dumps(asdict(settings), sort_keys=True),
        torch.__version__,
        transformers.__version__,
    ]
    for module in (checkpoint, corpus_module, tokenizer):
        parts.append(Path(module.__file__ or "").read_text())
    parts.append(Path(__file__).read_text())
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextmanager
def _deterministic(threads: int, seed: int) -> Iterator[None]:
    """Deterministic algorithms, ``threads`` torch threads and the global seed for the block;
    the previous settings come back afterwards."""
    import torch

    was_det = torch.are_deterministic_algorithms_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_det)
        torch.set_num_threads(was_threads)


def _examples(tokenizer: Any, corpus: Corpus) -> list[list[int]]:
    """Token ids of every training text as the server tokenizes them, EOS appended: a
    sentence as a completion prompt; a chat as the rendered prompt plus the answer."""
    eos = int(tokenizer.eos_token_id)
    out = [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in corpus.completions]
    for user, answer in corpus.chats:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out.append(ids + list(tokenizer(answer, add_special_tokens=False)["input_ids"]))
    turns = [t for city in corpus.tool_cities for t in _tool_turns(tokenizer, city)]
    out += turns * TOOL_TURN_REPEATS
    return [[*ids, eos] for ids in out]


def _tool_turns(tokenizer: Any, city: str) -> list[list[int]]:
    """A city's two tool turns' ids, each its prompt (the tool offered) then the assistant's
    part as the chat template renders it: the call (an assistant's ``tool_calls``, what the
    server parses back into a call), and the answer once the tool answered."""
    asked: list[dict[str, Any]] = [{"role": "user", "content": weather_question(city)}]
    called = [*asked, {"role": "assistant", "content": "", "tool_calls": [weather_call(city)]}]
    answered = [*called, {"role": "tool", "tool_call_id": "call_0", "content": WEATHER_REPORT}]
    replied = [*answered, {"role": "assistant", "content": weather_answer(city)}]
    return [_turn(tokenizer, asked, called), _turn(tokenizer, answered, replied)]


def _turn(tokenizer: Any, before: list[dict], after: list[dict]) -> list[int]:
    """The ids of ``before`` rendered with the generation prompt, then what ``after`` adds."""
    prompt = tokenizer.apply_chat_template(before, tools=[WEATHER_TOOL],
                                           add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(after, tools=[WEATHER_TOOL], tokenize=False)
    if not whole.startswith(prompt):
        raise ValueError("the chat template renders a tool turn's prompt differently alone")
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return ids + list(tokenizer(whole[len(prompt):].rstrip("\n"),
                                add_special_tokens=False)["input_ids"])


def _batches(examples: list[list[int]], pad: int, size: int) -> list[tuple[Any, Any, Any]]:
    """(input_ids, attention_mask, labels) minibatches of ``size`` examples of similar length
    (sorted by length, so little padding), right-padded; padding is masked out of the loss."""
    import torch

    ordered = sorted(examples, key=len)
    out = []
    for start in range(0, len(ordered), size):
        chunk = ordered[start : start + size]
        width = max(len(ids) for ids in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, example in enumerate(chunk):
            ids[row, : len(example)] = torch.tensor(example)
            mask[row, : len(example)] = 1
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def _new_model(settings: TrainSettings, tokenizer: Any) -> Any:
    """The untrained model: ``tiny_config`` of the settings' shape, ``fill_seeded`` weights,
    the routing bias at zero (DeepSeek-V3 starts it there; only load balancing moves it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dwdp_dev.worker.checkpoint import fill_seeded, tiny_config

    config = tiny_config(
        ARCH,
        vocab_size=len(tokenizer),
        num_experts=settings.num_experts,
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        special_ids={
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
        },
    )
    config.moe_intermediate_size = settings.moe_width
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_seeded(model, settings.seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    return model


def _train(model: Any, batches: list[tuple[Any, Any, Any]], settings: TrainSettings) -> float:
    """The model's own loss over ``batches`` (``fit``); returns the last pass's mean loss."""

    def loss(index: int) -> Any:
        ids, mask, labels = batches[index]
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    model.train()
    last = fit(list(model.parameters()), len(batches), loss, epochs=settings.epochs,
               lr=settings.lr, weight_decay=settings.weight_decay, seed=settings.seed)
    model.eval()
    return last


def fit(params: list[Any], batches: int, loss: Callable[[int], Any], *, epochs: int,
        lr: float, weight_decay: float, seed: int) -> float:
    """AdamW over ``params`` for ``epochs`` passes over ``batches`` minibatches (a seeded
    order each pass, cosine learning rate down to a tenth), ``loss(index)`` the loss of one;
    returns the mean loss of the last pass."""
    import torch

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * batches,
                                                       eta_min=lr / 10)
    order = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for _ in range(epochs):
        losses = []
        for index in torch.randperm(batches, generator=order).tolist():
            opt.zero_grad(set_to_none=True)
            value = loss(index)
            value.backward()
            opt.step()
            sched.step()
            losses.append(float(value.detach()))
    return sum(losses) / len(losses)


def train_demo_model(
    out: str | Path, settings: TrainSettings | None = None, corpus: Corpus | None = None
) -> Path:
    """Train the demo model and write its checkpoint directory ``out`` (created; files of the
    same names are overwritten). Returns ``out``. Raises ``ValueError`` for bad settings.

    Takes about half a minute on one CPU core with the default settings.
    """
    from transformers import GenerationConfig

    from dwdp_dev.worker.tokenizer import build_tokenizer

    settings = settings or TrainSettings()
    settings.check()
    corpus = corpus or demo_corpus()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tokenizer = build_tokenizer(settings.vocab_size, texts=corpus.all_text())
    with _deterministic(settings.threads, settings.seed):
        model = _new_model(settings, tokenizer)
        examples = _examples(tokenizer, corpus)
        batches = _batches(examples, int(tokenizer.pad_token_id), settings.batch_size)
        loss = _train(model, batches, settings)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.save_pretrained(str(out))
    model.save_pretrained(str(out))
    record = {
        "arch": ARCH,
        "seed": settings.seed,
        "num_experts": settings.num_experts,
        "trained": {
            "digest": inputs_digest(settings, corpus),
            "settings": asdict(settings),
            "examples": len(examples),
            "final_loss": round(loss, 4),
            "seconds": round(time.monotonic() - started, 1),
        },
    }
    (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return out


def cached_demo_model(cache: str | Path, settings: TrainSettings | None = None) -> Path:
    """The trained demo model under ``cache/demo-<digest>``: trained there on first use
    (``trained_once``); returns the folder, readable by every user (pods that mount a copy
    of it run as uid 1000)."""
    settings = settings or TrainSettings()
    return trained_once(Path(cache) / f"demo-{inputs_digest(settings)}",
                        lambda tmp: train_demo_model(tmp, settings))


def trained_once(final: Path, train: Callable[[Path], object]) -> Path:
    """``final`` when it holds a complete checkpoint (its :data:`MARKER`), else ``train``-ed
    into a temporary sibling folder, renamed to ``final`` when complete, so an interrupted run
    leaves nothing half-written behind; the folder and its files readable by every user."""
    if (final / MARKER).is_file():
        _readable_by_all(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".train-", dir=final.parent))
    try:
        train(tmp)
        _readable_by_all(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another run finished first: its copy is equally good
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _readable_by_all(folder: Path) -> None:
    """Make ``folder`` (0o755) and its files (0o644) readable by every user: a temporary
    folder and the files written through temporary files are the owner's alone."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)
