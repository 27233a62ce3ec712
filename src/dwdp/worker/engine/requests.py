"""One request as an engine sees it: its tokens, its text, when it stops, what it streams.

Both engines (``continuous`` and the ``batching`` wave engine) hold a ``RequestState`` per
request and call ``accept`` once per chosen token and ``update`` to build what the client
receives; the stop rules and the streaming rules live here only.

Stop rules: a constrained request (``params.structured``) ends with ``"stop"`` when its grammar
takes its stop token (the token is not part of the output); the tokenizer's EOS (unless
``ignore_eos``) or one of ``stop_token_ids`` ends the request with ``"stop"`` and is not part
of the output (but of the logprobs, when asked for, as in vLLM: a harness summing the logprobs
of ``max_tokens: 1`` counts on one generated entry); a ``stop`` string ends it with ``"stop"``
and the text is cut before it; ``max_tokens`` new tokens or the model's context
(``max_model_len``) end it with ``"length"``.

Streaming rules: text that ends in an incomplete UTF-8 sequence (U+FFFD) and text that may
still become a stop string are held back until the next token decides them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dwdp.worker.engine.grammar import Constraint
from dwdp.worker.engine.kv_connector import KvTransferParams
from dwdp.worker.engine.protocol import (
    RequestOutput,
    SamplingParams,
    SharedPrefill,
    TokenLogprob,
)

_log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class RequestState:
    """The mutable state of one request inside an engine.

    ``prompt``: token ids; ``tokens``: generated ids (stop tokens excluded); ``text``: their
    detokenised text (cut at a stop string); ``emit``: where updates go (``None`` for the
    batch API); ``keep_logits``: keep the [vocab] float32 logits of every step (tests).
    ``logprobs``: one ``TokenLogprob`` per generated token when ``params.logprobs`` is set (and
    one more for the stop token that ended the request).
    ``processors``/``generator``: the sampler's per-request state (``dwdp.worker.engine.sampler``).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput | BaseException], None] | None = None
    keep_logits: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    settled: int = 0
    """Tokens detokenised so far (``settle``); the others are taken, their text pending."""
    sent_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    aborted: bool = False
    logits: list[Any] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    processors: Any = None
    generator: Any = None
    arrival: float = 0.0
    kv_transfer: KvTransferParams | None = None
    """The request's ``kv_transfer_params`` (disaggregation), or ``None``."""
    shared: SharedPrefill | None = None
    """The request's siblings reading one remote prefill (``n`` > 1), or ``None``."""
    kv_transfer_out: KvTransferParams | None = None
    """What the last update answers as ``kv_transfer_params`` (a remote-decode prefill)."""
    detok: Any = None
    """The incremental detokeniser (``tokenizers.decoders.DecodeStream``) of a fast tokenizer."""
    cached_tokens: int = 0
    """Prompt tokens its first step found in the prefix cache."""
    held_back: tuple[int, ...] = ()
    """Token ids the sampler cannot choose while fewer than ``params.min_tokens`` tokens are
    generated: the EOS tokens (unless ``ignore_eos``) and ``stop_token_ids`` (the engine sets
    them when the request enters; empty without ``min_tokens``)."""

    constraint: Constraint | None = None
    """The request's grammar state (``dwdp.worker.engine.grammar.Constraint``) when its
    ``params.structured`` constrains the answer; the sampler masks by it, ``take`` feeds it."""

    def holding(self) -> bool:
        """Whether the sampler must keep ``held_back`` out of this step's choice: under
        ``min_tokens``, unless a grammar is complete (its answer ends whatever the count)."""
        if not self.held_back or len(self.tokens) >= self.params.min_tokens:
            return False
        return self.constraint is None or not self.constraint.complete

    @property
    def length(self) -> int:
        """Prompt plus generated tokens (the KV cache this request fills)."""
        return len(self.prompt) + len(self.tokens)

    def accept(
        self,
        token: int,
        *,
        eos_token_ids: set[int],
        tokenizer: Any,
        max_model_len: int,
        logprob: TokenLogprob | None = None,
    ) -> str | None:
        """Take one chosen token and detokenise it (``take`` then ``settle``); returns the
        finish reason when the request ends with it (``"stop"`` or ``"length"``), else
        ``None`` (module docstring gives the rules)."""
        reason = self.take(token, eos_token_ids=eos_token_ids, max_model_len=max_model_len,
                           logprob=logprob)
        if reason == "stop":
            return reason  # a stop token: nothing new to detokenise
        return "stop" if self.settle(tokenizer) else reason

    def take(
        self,
        token: int,
        *,
        eos_token_ids: set[int],
        max_model_len: int,
        logprob: TokenLogprob | None = None,
    ) -> str | None:
        """The rules that need no text: a stop token ends the request (``"stop"``, not kept),
        else the token is kept and ``max_tokens`` or the model's context may end it
        (``"length"``). Its text comes with ``settle`` (the engine runs the next step first)."""
        p = self.params
        if self.constraint is not None and _grammar_ends(self.constraint, token,
                                                         self.request_id):
            if logprob is not None:
                self.logprobs.append(logprob)
            return "stop"  # the grammar's stop token (or one it forbids): not part of the output
        if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            if logprob is not None:  # its logprob is reported (as vLLM does), its text not
                self.logprobs.append(logprob)
            return "stop"  # the stop token is not part of the output
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if len(self.tokens) >= p.max_tokens or self.length >= max_model_len:
            return "length"
        return None

    def settle(self, tokenizer: Any) -> bool:
        """Detokenise the tokens taken since the last call, one by one; True when a stop
        string ended the request (the text is cut before it, or after it with
        ``include_stop_str_in_output``; later tokens dropped)."""
        while self.settled < len(self.tokens):
            self.settled += 1
            self.text = self._detokenize(tokenizer)
            stable = self.text.rstrip("\ufffd")  # an incomplete UTF-8 tail may still change
            for s in self.params.stop:
                cut = stable.find(s)
                if cut >= 0:
                    keep = len(s) if self.params.include_stop_str_in_output else 0
                    self.text = self.text[: cut + keep]
                    del self.tokens[self.settled :]
                    del self.logprobs[self.settled :]
                    return True
        return False

    def _detokenize(self, tokenizer: Any) -> str:
        """The text of the first ``settled`` tokens, given that of one fewer: incrementally
        with a fast tokenizer (O(1) per token, held back while a UTF-8 sequence is
        incomplete), else decoded whole."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            return str(tokenizer.decode(self.tokens[: self.settled], skip_special_tokens=True))
        if self.detok is None:
            from tokenizers.decoders import DecodeStream

            self.detok = DecodeStream(skip_special_tokens=True)
        return self.text + (self.detok.step(backend, self.tokens[self.settled - 1]) or "")

    def update(self, *, final: bool) -> RequestOutput | None:
        """What the client has not yet received, or ``None`` when nothing new can be sent.

        The final update (``final``) carries ``finish_reason`` and everything held back.
        """
        text = self.text
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its rest
            hold = max((len(s) for s in self.params.stop), default=1) - 1
            if hold:  # text that may still become a stop string is not sent yet
                text = text[: max(0, len(text) - hold)]
        delta = text[self.sent_text :]
        new_tokens = self.tokens[self.sent_tokens :]
        if not delta and not new_tokens and not final:
            return None
        out = RequestOutput(
            request_id=self.request_id,
            token_ids=new_tokens,
            text=delta,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.tokens),
            finished=final,
            finish_reason=self.finish_reason if final else None,
            logprobs=self.logprobs[self.sent_tokens :]
            if self.params.logprobs is not None
            else None,
            kv_transfer_params=self.kv_transfer_out if final else None,
            cached_tokens=self.cached_tokens,
        )
        self.sent_text = max(self.sent_text, len(text))
        self.sent_tokens = len(self.tokens)
        return out


def _grammar_ends(constraint: Constraint, token: int, request_id: str) -> bool:
    """Feed a chosen token to a request's grammar; True when the answer ends here: the grammar
    took its stop token (it was complete), or forbids the token (``Constraint.accept``)."""
    if not constraint.accept(token):
        _log.warning("request %s: its grammar (%s) forbids token %d; the answer ends there",
                     request_id, constraint.field, token)
        return True
    return constraint.terminated
