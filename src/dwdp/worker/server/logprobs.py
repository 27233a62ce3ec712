"""Engine logprobs (``TokenLogprob``) in OpenAI's two response formats; one home for both.

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
    tokens, values, tops, offsets = [], [], [], []
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
