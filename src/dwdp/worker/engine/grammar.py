"""Structured outputs in the engine: a request's constraint compiled to a grammar, its token
mask applied to the logits before the sampler chooses, its matcher fed every chosen token.

The grammar engine is xgrammar (vLLM's and SGLang's default; ``bench/grammar_engines.py``
measures it against llguidance). One :class:`Grammars` per engine holds xgrammar's
``TokenizerInfo`` (the tokenizer's vocabulary over the model's logits width, the engine's EOS
ids as the grammar's stop tokens) and its ``GrammarCompiler``, whose cache keeps every compiled
grammar by its source (a schema sent twice compiles once). A request's
:class:`~dwdp.worker.engine.protocol.StructuredOutput` becomes a :class:`Constraint` when it
enters (``Grammars.constraint``, off the engine's loop: a large schema compiles in tens of
milliseconds); a source the engine cannot compile is a ``RequestError`` naming the field.

Per step (:func:`masked`), the sampler asks for the logits of the constrained rows with every token
the grammar forbids at minus infinity: the masks are filled on the host first (row by
row), while the device still runs the step's forward or graph
replay that produced the logits, then copied to the device and applied there (xgrammar's
kernel) to a float32 copy; the rows of other requests are untouched. The forward, CUDA graphs
included, never sees a mask. When the grammar is complete it allows only the stop tokens: the
request ends with ``"stop"`` (``RequestState.take``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dwdp.worker.engine.protocol import RequestError, StructuredOutput

_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \([^)]*\) is false:\s*)?")
"""The log prefix (time, C++ source and line, failed check) of xgrammar's error messages."""


MAX_JSON_WHITESPACE = 16
"""The longest run of whitespace between two JSON tokens (``any_whitespace``): a newline and
the indentation of a pretty-printed document 7 levels deep (2 spaces a level), and a bound on
a model that would emit whitespace forever (an undertrained one does)."""

GRAMMAR_CACHE_BYTES = 256 << 20
"""The most memory xgrammar's cache of compiled grammars keeps (least recently used first
out): a stream of distinct schemas does not grow a rank's memory without bound."""

_ANY_OBJECT = '{"type": "object"}'
"""``json_object``'s schema: any JSON object (OpenAI's JSON mode answers an object)."""


def _cause(exc: BaseException) -> str:
    """xgrammar's error message without its C++ log prefix, on one line."""
    text = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
    return " ".join(text.split())


@dataclass(eq=False, slots=True)
class Constraint:
    """The grammar state of one request: xgrammar's ``GrammarMatcher``."""

    matcher: Any
    field: str
    """The request field the grammar came from (in messages about it)."""

    def accept(self, token: int) -> bool:
        """Advance over a chosen token; False when the grammar forbids it (the mask was not
        applied to its choice: a bug, or a step where every token was forbidden)."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (it may still go on)."""
        return bool(self.matcher.is_completed())

    @property
    def terminated(self) -> bool:
        """Whether the grammar ended (its stop token accepted): nothing more may follow."""
        return bool(self.matcher.is_terminated())


class Grammars:
    """The grammar compiler of one engine: a tokenizer's vocabulary over ``vocab_size``
    logits, ``stop_token_ids`` ending every grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 threads: int = 2) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                             cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compiled(self, spec: StructuredOutput) -> Any:
        """xgrammar's ``CompiledGrammar`` of ``spec`` (cached by its source); ``RequestError``
        naming ``spec.field`` when the source does not compile."""
        try:
            return self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) with a reason
            raise RequestError(f"{spec.field}: the grammar engine refused it: {_cause(exc)}"
                               ) from exc

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        if spec.kind in ("json", "json_object"):
            return c.compile_json_schema(
                spec.source if spec.kind == "json" else _ANY_OBJECT,
                any_whitespace=spec.any_whitespace, strict_mode=True,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "grammar":
            return c.compile_grammar(spec.source)
        if spec.kind == "choice":
            return c.compile_grammar(choice_grammar(json.loads(spec.source)))
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.source)
        raise ValueError(f"unknown constraint kind {spec.kind!r}")  # SamplingParams.check

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A new request's :class:`Constraint` (compiles, or takes the cached grammar)."""
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(self.compiled(spec)), spec.field)


def masked(logits: Any, constraints: list[Constraint | None]) -> Any:
    """A float32 copy of one step's ``logits`` ([rows, vocab]) where row ``i``'s forbidden
    tokens are minus infinity when ``constraints[i]`` is set (the other rows unchanged). The
    rows' masks are filled one after the other on this thread: a few microseconds each, where
    xgrammar's threaded batch fill spent a quarter of a millisecond handing them out
    (``bench/results/gpu_structured-h100.txt``)."""
    import torch
    import xgrammar as xgr

    rows = [i for i, c in enumerate(constraints) if c is not None]
    vocab = int(logits.shape[-1])
    bitmask = xgr.allocate_token_bitmask(len(constraints), vocab)
    for i in rows:
        constraints[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    every = len(rows) == len(constraints)
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                    vocab_size=vocab, indices=None if every else rows)
    return out


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices`` (vLLM's ``choice``)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
