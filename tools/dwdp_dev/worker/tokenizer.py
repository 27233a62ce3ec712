"""A small byte-level BPE tokenizer trained locally with the ``tokenizers`` library.

Byte-level, so every input string encodes (no unknown token) and decoding round-trips. The
training corpus is fixed text in this module and BPE training is deterministic, so the same
arguments give the same vocabulary on every machine; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools you may call, one JSON object each:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": NAME, \"arguments\": ARGUMENTS}\n</tool_call>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|tool|><tool_response>\n' + message['content'] + '\n</tool_response>\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|assistant|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}<tool_call>\n{\"name\": "
    "{{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""A Jinja chat template: one ``<|role|>content`` line per message. With ``tools``, a system
line lists them (one JSON object each) and says how to call one: the ``hermes`` format of
Qwen3's template (``<tool_call>`` blocks); an assistant message's ``tool_calls`` render in that
format and a ``tool`` message's answer in a ``<tool_response>`` block."""

_CORPUS = (
    "Distributed weight data parallelism lets every rank of a group serve its own requests "
    "while storing only a slice of the mixture of experts weights. Before a layer runs, the "
    "missing experts are copied from the peers into a prefetch slot. The quick brown fox "
    "jumps over the lazy dog. Hello world, hello model, hello expert. What is the capital "
    "of France? Paris is the capital of France. One two three four five six seven eight "
    "nine ten. The cat sat on the mat. A kubernetes operator reconciles a custom resource "
    "into pods, services and config maps. Tokens, logits, sampling, greedy decoding."
)


def build_tokenizer(vocab_size: int = 384, texts: Sequence[str] | None = None):
    """Train the tokenizer; returns a ``transformers.PreTrainedTokenizerFast``.

    ``vocab_size`` counts the 256 byte symbols, the special tokens and the merges; it must be
    at least 256 + len(SPECIAL_TOKENS). Raises ``ValueError`` otherwise. ``texts`` is the
    training text (default: this module's fixed corpus, four times); with a ``vocab_size``
    above what the text can merge, every word of it becomes one token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: {vocab_size} < {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts) if texts is not None else [_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def save_tokenizer(out: Path, vocab_size: int = 384) -> int:
    """Write the tokenizer files into ``out``; returns the vocabulary size (token count)."""
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save_pretrained(str(out))
    return len(tokenizer)
