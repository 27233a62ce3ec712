"""Which request fields the OpenAI-compatible endpoints honour, ignore or refuse: the one home
of that rule.

A request part (:class:`RequestPart`: the request, a chat message, its content parts,
``stream_options``) takes the fields its model declares. Any other field is refused with a 400
that names it, unless

- :data:`IGNORED_FIELDS` lists it: it changes no answer (bookkeeping, billing, caching hints),
  so it is accepted with any value; or
- it carries ``null`` or :data:`NEUTRAL_VALUES`'s value for it: the value that asks for
  nothing (OpenAI's and vLLM's defaults, which clients such as LangChain send on every call).

So a field this server does not implement (OpenAI's deprecated ``functions``,
``repetition_penalty``, a field OpenAI adds tomorrow) is never dropped without a word: a client
that asked for something never gets an answer made without it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

NOT_HONOURED = "field_not_honoured"
"""The pydantic error type of a refused field (its ``ctx`` names the field)."""

IGNORED_FIELDS: frozenset[str] = frozenset(
    {
        "metadata",  # OpenAI: the caller's key-value tags (stored completions)
        "store",  # OpenAI: keep the completion for distillation/evals (nothing is stored)
        "service_tier",  # OpenAI: the billing and latency tier
        "prompt_cache_key",  # OpenAI: a hint for its prompt cache (the prefix cache needs none)
        "prompt_cache_retention",  # OpenAI: how long its prompt cache keeps a prefix
        "safety_identifier",  # OpenAI: the end user's id for abuse detection
        "include_obfuscation",  # OpenAI stream_options: padding of stream events
        "request_id",  # vLLM: the caller's request id (the answer's id is this server's)
        "priority",  # vLLM: the scheduler's priority (one queue here, first come first served)
    }
)
"""Fields accepted with any value and ignored: none of them changes an answer."""

NEUTRAL_VALUES: dict[str, object] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "best_of": 1,
    "repetition_penalty": 1,
    "min_p": 0,
    "length_penalty": 1,
    "use_beam_search": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "echo": False,
    "return_tokens_as_token_ids": False,
    # SGLang's fields at their defaults, which vllm-router sends on every request it forwards
    "return_hidden_states": False,
    "include_reasoning": True,  # vLLM's too: a model without a reasoning parser has none
    "separate_reasoning": True,
    "stream_reasoning": True,
}
"""Fields not implemented here, accepted at the value that asks for nothing (their default in
OpenAI's or vLLM's API); any other value is refused."""


def _neutral(key: str, value: object) -> bool:
    """Whether ``value`` asks for nothing: ``null``, or the field's neutral value (of the same
    kind: ``true`` is not ``1``)."""
    if value is None:
        return True
    if key not in NEUTRAL_VALUES:
        return False
    neutral = NEUTRAL_VALUES[key]
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return isinstance(value, int | float) and value == neutral


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refused_fields(model: type[BaseModel], data: dict[str, Any]) -> list[str]:
    """The fields of ``data`` that ``model`` refuses: not its own, not ignored, not neutral."""
    own = set(model.model_fields) | {
        f.alias for f in model.model_fields.values() if f.alias is not None
    }
    return [
        key
        for key, value in data.items()
        if key not in own and key not in IGNORED_FIELDS and not _neutral(key, value)
    ]


class RequestPart(BaseModel):
    """A part of a request whose unknown fields follow this module's rule."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, data: Any) -> Any:
        refused = _refused_fields(cls, data) if isinstance(data, dict) else []
        if refused:
            key = refused[0]
            raise PydanticCustomError(
                NOT_HONOURED,
                "not implemented by this server (got {value}): a request that carries it "
                "is refused rather than answered without it; the fields ignored with any "
                "value are {ignored}",
                {
                    "field": key,
                    "value": _shown(data[key]),
                    "ignored": ", ".join(sorted(IGNORED_FIELDS)),
                },
            )
        return data
