"""Speculative decoding: draft tokens proposed without a forward, verified by the target model.

A decoding request proposes up to ``num_speculative_tokens`` draft tokens before a step
(``Drafter.propose``); the step feeds its last token and the drafts as one chunk, so one forward
computes the target model's logits at every draft position (``Chunk.draft``). The engine then
takes tokens position by position through the one sampler (``dwdp.worker.engine.sampler.choose``
on that position's row, with the request's grammar, ``logit_bias``, ``min_tokens`` and logprobs
as for any step) and stops at the first token that differs from the draft: the accepted drafts
and that token are the step's output, the cache keeps the accepted drafts' entries and gives
back the rejected tail's blocks (``Scheduler.accept``).

Taking each position's token from the target's own distribution makes the output exactly what
decoding without drafts gives: greedy token for token, and sampled by the same law (a draft
proposed without a distribution of its own is a point mass, whose rejection sampling is this
comparison: the draft is accepted with the target's probability of it, and a rejected position
draws from the target's distribution without it). A seeded request draws once per output token,
as without drafts, so its answer is the same too.

``ngram`` (vLLM's prompt lookup): the longest suffix of the request's tokens, between
``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long, that also occurs earlier in its
prompt and output; the tokens after its earliest occurrence are the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

SpeculativeMethod = Literal["ngram", "mtp"]


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``engine.speculative``: the draft ``method``, up to ``num_speculative_tokens`` drafts per
    step and request (fewer under load with ``per_batch_size``), and for ``ngram`` the lengths
    of the suffix it looks up."""

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    per_batch_size: tuple[tuple[int, int, int], ...] = ()
    """vLLM's ``num_speculative_tokens_per_batch_size``: ``(first, last, k)`` inclusive ranges
    of running requests, sorted, the first from 1: a step with that many requests drafts at
    most ``k`` tokens per request (0: none); a gap or the tail keeps the range before's ``k``;
    empty: ``num_speculative_tokens`` at every size (:meth:`drafts_at`)."""

    def drafts_at(self, batch: int) -> int:
        """The drafts per request of a step of ``batch`` running requests."""
        k = self.num_speculative_tokens
        for first, _, tokens in reversed(self.per_batch_size):
            if batch >= first:
                return min(k, tokens)
        return k


class DraftLayer(Protocol):
    """A draft model that continues the target's last hidden state (DeepSeek's MTP layer,
    ``dwdp.worker.loading.mtp.MtpLayer``): ``block`` (a causal LM run on ``inputs_embeds``,
    its output before the final norm), ``inputs`` (the block's input rows from the next
    tokens' ids and the hidden states before them) and ``logits`` (of output rows)."""

    block: Any

    def inputs(self, token_ids: Any, hidden: Any) -> Any: ...

    def logits(self, hidden: Any) -> Any: ...


class Drafter:
    """Proposes a request's draft tokens by ``config.method``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` n-gram draft tokens to follow
        ``tokens`` (the request's prompt and output); empty when none is found."""
        k = min(limit, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        cfg = self.config
        return ngram_drafts(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def ngram_drafts(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The ``k`` tokens (fewer at the end) after the earliest earlier occurrence of the longest
    suffix of ``tokens`` of ``n_min`` to ``n_max`` tokens; empty when no such suffix recurs."""
    import numpy as np

    total = len(tokens)
    if total < n_min + 1 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    best_n, best_at = 0, -1
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n :]
        # candidate starts: windows of n tokens ending before the last token
        windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            best_n, best_at = n, int(hits[0])
            break
    if best_n == 0:
        return []
    start = best_at + best_n
    return [int(t) for t in arr[start : start + k]]
