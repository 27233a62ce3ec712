"""How many choices a request answers, how many engine streams compute them, and what is scored.

One pure function, ``choice_plan``, over the parsed request: the rules that tie ``n``,
``max_tokens: 0``, ``echo``/``logprobs``/``prompt_logprobs``, ``stream``, a batch of prompts and
``kv_transfer_params`` together live here only; a refusal is a ``ServingError`` 400 naming the
field the client sent.

- A prefill for a remote decode (``do_remote_decode``; a router's first call) answers one
  choice from one engine stream whatever ``n`` says: the generation server samples the ``n``
  choices, all from that one prefill (``SharedPrefill``), and it scores the prompt if asked to.
- ``max_tokens: 0`` scores the prompt without generating (it needs ``echo`` or
  ``prompt_logprobs``): no engine stream, except on a remote prefill, where one stream reads
  the leased KV (so the context server's lease ends) and its token is dropped.
- Prompt scoring (``echo`` with ``logprobs``, ``prompt_logprobs``) and a batch of prompts are
  answered whole, not streamed; a batch moves no KV (one lease is one prompt's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dwdp.worker.server.errors import ServingError


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """Per prompt: ``choices`` answered, ``engine_streams`` run, whether the answer carries
    generated tokens (``generates``), and the alternatives per prompt token to score
    (``prompt_top``; ``None``: no scoring)."""

    choices: int
    engine_streams: int
    generates: bool
    prompt_top: int | None


def choice_plan(req: Any, prompts: int) -> ChoicePlan:
    """The plan of ``req`` (a completion or chat request) over its ``prompts`` prompts;
    ``ServingError`` 400 for a combination the module docstring refuses."""
    kv = req.kv_transfer_params
    if prompts > 1 and kv is not None and kv.transfers:
        raise ServingError(
            400, f"prompt: a batch of {prompts} prompts with kv_transfer_params (disaggregated "
            "serving): one KV lease holds one prompt; send one prompt per request",
        )
    if prompts > 1 and req.stream:
        raise ServingError(400, f"prompt: a batch of {prompts} prompts with stream true: "
                           "send one prompt per streamed request")
    if kv is not None and kv.do_remote_decode:
        return ChoicePlan(choices=1, engine_streams=1, generates=True, prompt_top=None)
    top = req.prompt_top() if hasattr(req, "prompt_top") else None
    if req.max_tokens == 0:
        if top is None and getattr(req, "prompt_logprobs", None) is None and not req.echo:
            raise ServingError(400, "max_tokens: 0 needs echo true or prompt_logprobs (it "
                               "scores the prompt without generating)")
        if req.stream:
            raise ServingError(400, "max_tokens: 0 with stream true: a scored prompt is "
                               "answered whole; send stream false")
        reads = 1 if kv is not None and kv.do_remote_prefill else 0
        return ChoicePlan(choices=req.n, engine_streams=reads, generates=False, prompt_top=top)
    if top is not None and req.stream:
        raise ServingError(400, "prompt_logprobs (or echo with logprobs) with stream true: the "
                           "prompt's logprobs are answered whole; send stream false")
    return ChoicePlan(choices=req.n, engine_streams=req.n, generates=True, prompt_top=top)
