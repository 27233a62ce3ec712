"""Engine logprobs (``TokenLogprob``) in OpenAI's two response formats and vLLM's
``prompt_logprobs``; one home for all three.

A token's text is its own detokenisation (``tokenizer.decode([id])``); ``bytes`` its UTF-8
bytes. A logprob of minus infinity (a token the model cannot produce) is written as -9999.0,
as OpenAI does, since JSON has no infinities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dwdp.worker.engine.protocol import TokenLogprob
from dwdp.worker.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id])
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion (or of one streamed chunk)."""
    content = []
    for e in entries:
        top = _top(tokenizer, e.token_id, e.logprob)
        content.append(
            ChatTokenLogprob(
                **top.model_dump(), top_logprobs=[_top(tokenizer, t, lp) for t, lp in e.top]
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    """``choices[].logprobs`` of a completion (or of one streamed chunk); ``text_offset``: the
    position in the choice's text where the first token's text starts."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = text_offset
    for e in entries:
        text = tokenizer.decode([e.token_id])
        tokens.append(text)
        values.append(_finite(e.logprob))
        tops.append({tokenizer.decode([t]): _finite(lp) for t, lp in e.top})
        offsets.append(at)
        at += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )


def echoed_logprobs(
    tokenizer: Any,
    prompt: Sequence[int],
    scores: Sequence[TokenLogprob],
    generated: CompletionLogprobs,
) -> CompletionLogprobs:
    """``choices[].logprobs`` of an ``echo`` completion: the ``prompt``'s tokens first (the first
    with ``null`` logprob and alternatives, as OpenAI and vLLM answer; ``scores``: the entries
    of the others, ``EngineClient.score_prompt``), offsets from 0, then ``generated`` (whose
    offsets already count the echoed text)."""
    first = tokenizer.decode([prompt[0]])
    rest = completion_logprobs(tokenizer, scores, len(first))
    tail = generated
    return CompletionLogprobs(
        tokens=[first, *rest.tokens, *tail.tokens],
        token_logprobs=[None, *rest.token_logprobs, *tail.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs, *tail.top_logprobs],
        text_offset=[0, *rest.text_offset, *tail.text_offset],
    )


def vllm_prompt_logprobs(
    tokenizer: Any, scores: Sequence[TokenLogprob]
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: ``None`` for the first prompt token, then per
    token a map of token id (a string, as JSON keys are) to its ``PromptLogprob``: the prompt's
    own token (its rank) and the most likely alternatives (ranks 1, 2, ...)."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for e in scores:
        own = PromptLogprob(
            logprob=_finite(e.logprob), rank=e.rank, decoded_token=tokenizer.decode([e.token_id])
        )
        entry = {str(e.token_id): own}
        for rank, (t, lp) in enumerate(e.top, start=1):
            entry.setdefault(
                str(t),
                PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=tokenizer.decode([t])),
            )
        out.append(entry)
    return out
