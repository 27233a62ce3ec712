"""Request and response schemas of the OpenAI-compatible endpoints.

Out-of-range values are refused by the schemas themselves (the server answers 400 with the
field's path), so every bound is visible in the OpenAPI document. A field the schemas do not
declare is refused with a 400 naming it, unless it changes no answer or asks for nothing
(:mod:`dwdp.worker.server.fields`, the one home of that rule).
``n`` choices run as ``n`` engine requests (choice ``i`` seeded ``seed + i`` when a seed is
set); a completion's ``prompt`` may be a batch (strings or token-id lists): prompt ``p``'s
choice ``j`` has index ``p * n + j``, as in the OpenAI API. Logprobs follow OpenAI's two
formats: ``logprobs: k`` on completions (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; with ``echo`` the prompt's tokens come first, the first one's logprob
``null``), ``logprobs: true`` with ``top_logprobs: k`` on chat (``content`` entries with
``token``, ``logprob``, ``bytes``); and vLLM's ``prompt_logprobs: k``
(``choices[].prompt_logprobs``: ``null`` for the first prompt token, then per token a map of
token id to ``logprob``, ``rank`` and ``decoded_token``, the prompt's token and the ``k`` most
likely). ``max_tokens: 0`` (with
``echo`` or ``prompt_logprobs``) scores the prompt without generating.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from dwdp.worker.engine.kv_connector import KvTransferParams
from dwdp.worker.engine.protocol import MAX_LOGPROBS
from dwdp.worker.server.fields import RequestPart
from dwdp.worker.server.structured import StructuredFields
from dwdp.worker.server.tools import ToolFields

MAX_SEED = 2**63 - 1
MAX_STOP = 4
MAX_N = 16
MAX_LOGIT_BIAS = 1024
"""The most tokens one request's ``logit_bias`` may name."""

StopText = Annotated[str, Field(min_length=1, max_length=256)]


class StreamOptions(RequestPart):
    """``stream_options`` of a streaming request."""

    include_usage: bool = Field(False, description="Send the usage in a last chunk.")


class _Request(StructuredFields):

    model: str | None = Field(None, max_length=256, description="Served model name (optional).")
    max_tokens: int | None = Field(
        None, ge=1, le=1_000_000, description="New tokens at most (default 16)."
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0: off.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Sampling seed.")
    stop: StopText | list[StopText] | None = Field(
        None, description="Stop strings (at most 4); the text is cut before the first."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None, max_length=64, description="Token ids that stop the request."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    min_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="vLLM's field: the EOS token and stop_token_ids cannot end the answer "
        "before this many tokens (at most max_tokens).",
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's field: the text ends after the stop string, not before."
    )
    no_stop_trim: bool = Field(
        False,
        description="SGLang's name of include_stop_str_in_output (vllm-router sends it); "
        "either being true keeps the stop string.",
    )
    stream: bool = Field(False, description="Stream server-sent events.")
    n: int = Field(1, ge=1, le=MAX_N, description="Choices per request.")
    stream_options: StreamOptions | None = Field(
        None, description="With stream: include_usage adds a last chunk with the usage."
    )
    user: str | None = Field(None, max_length=256)
    kv_transfer_params: KvTransferParams | None = Field(
        None, description="Prefill/decode disaggregation (vLLM's NIXL connector contract)."
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="vLLM's field: requests share prefix-cached KV blocks only with requests "
        "of the same salt (keeps tenants' prefixes apart).",
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="OpenAI's field: token id (a decimal string) -> bias in [-100, 100], "
        "added to the logits before each token is chosen.",
    )

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, by token id; raises ``ValueError`` naming
        a key that is not a token id."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            pairs[int(key)] = float(bias)
        return tuple(sorted(pairs.items()))

    def stop_list(self) -> tuple[str, ...]:
        """``stop`` as a tuple; raises ``ValueError`` for more than 4 strings."""
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: {len(stops)} strings, at most {MAX_STOP}")
        return stops


PromptText = Annotated[str, Field(max_length=1_000_000)]
PromptIds = Annotated[
    list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=1_000_000)
]
MAX_PROMPTS = 64
"""The most prompts one completion request may batch."""


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt (text or token ids), or a batch of them."""

    prompt: (
        PromptText
        | PromptIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="The prompt: text or token ids; or a list of either (a batch).")
    max_tokens: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="New tokens at most (default 16); 0 (with echo or prompt_logprobs) scores "
        "the prompt without generating.",
    )
    echo: bool = Field(
        False, description="Prepend the prompt to the text (and its tokens to the logprobs)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Logprobs of each token and of the k most likely alternatives.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="vLLM's field: each prompt token's logprob, rank and the k most likely.",
    )

    def logprobs_k(self) -> int | None:
        """Alternatives per token asked for; ``None``: no logprobs."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one, or the batch), each text or token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return [q for q in p if not isinstance(q, int)]

    def prompt_top(self) -> int | None:
        """Alternatives per prompt token the answer needs (``echo`` with ``logprobs``, or
        ``prompt_logprobs``); ``None``: no prompt logprobs."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if k is not None]
        return max(wanted) if wanted else None


class TextPart(RequestPart):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class CalledFunction(RequestPart):
    """The function of an assistant message's tool call: its name and JSON arguments."""

    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1_000_000, description="The arguments as JSON text.")


class MessageToolCall(RequestPart):
    """One tool call of an assistant message in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestPart):
    """One chat message: a system, user or assistant turn, or a tool's answer (``role: tool``
    with the ``tool_call_id`` it answers)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=1_000_000)] | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = Field(
        None, max_length=128, description="An assistant message's calls.")
    tool_call_id: str | None = Field(
        None, max_length=256, description="A tool message: the call it answers.")

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's
        arguments as a mapping); ``ValueError`` naming the path of arguments that are not a
        JSON object, or of a message without content where one is needed."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.content is None and not self.tool_calls:
            raise ValueError(f"messages[{index}].content: required (null only for an assistant "
                             "message with tool_calls)")
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments,
                                                      f"messages[{index}].tool_calls[{j}]")}}
                for j, c in enumerate(self.tool_calls)
            ]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError(f"messages[{index}].tool_call_id: required in a tool message")
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str, path: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{path}.function.arguments: {text[:60]!r} is not a JSON object")
    return value


class ChatCompletionRequest(_Request, ToolFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool = Field(False, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Most likely alternatives per token (needs logprobs).",
    )

    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="vLLM's field: each prompt token's logprob, rank and the k most likely "
        "(the rendered conversation's tokens).",
    )

    def prompt_top(self) -> int | None:
        """Alternatives per prompt token the answer needs; ``None``: no prompt logprobs."""
        return self.prompt_logprobs

    def logprobs_k(self) -> int | None:
        """Alternatives per token asked for; ``None``: no logprobs. Raises ``ValueError`` for
        ``top_logprobs`` without ``logprobs``."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs true")
            return None
        return self.top_logprobs or 0


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens."""

    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        """The usage of a request: ``cached_tokens`` of its prompt came from the cache."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion choice (one entry per token; with ``echo`` the
    prompt's first, whose first token has ``null`` logprob and alternatives)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's logprob of one candidate token of a prompt position: its ``logprob``, ``rank``
    (1: the most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    token_ids: list[int] | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's prompt_logprobs (the request's prompt_logprobs)."
    )


class ServerRef(BaseModel):
    """One server of the deployment as the ``dwdp`` response field names it (absent parts are
    unknown: a server outside the operator has no group or rank)."""

    role: str | None = Field(None, description="context or generation (the launch's role).")
    group: str | None = Field(None, description="The DWDP group or generation server name.")
    rank: int | None = Field(None, description="Rank within the group (DWDP_RANK).")
    incarnation: int | str | None = Field(None, description="The group's incarnation.")
    pod: str | None = Field(None, description="The pod's name (its hostname).")
    engine_id: str | None = Field(None, description="The NIXL engine id (remote_engine_id).")
    host: str | None = Field(None, description="The server's advertised address.")
    port: int | None = Field(None, description="The server's HTTP port.")


class ServedBy(BaseModel):
    """The extension field ``dwdp`` of a completion or chat answer (the first event of a
    stream): which server computed the prompt's KV cache (``prefill``: the context rank that
    leased the blocks for a remote prefill, else this server) and which one generated the
    tokens (``decode``: this server; absent on a prefill-only answer, ``do_remote_decode``).
    OpenAI clients ignore it."""

    prefill: ServerRef | None = None
    decode: ServerRef | None = None


class CompletionResponse(BaseModel):
    """The answer of ``/v1/completions`` (non-streaming)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_transfer_params: KvTransferParams | None = None
    dwdp: ServedBy | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _content_always(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        out.setdefault("content", None)  # OpenAI's message: null when it only calls tools
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's logprobs of a chat choice."""

    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None
    token_ids: list[int] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    """The answer of ``/v1/chat/completions`` (non-streaming)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's prompt_logprobs (the request's prompt_logprobs)."
    )
    kv_transfer_params: KvTransferParams | None = None
    dwdp: ServedBy | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dwdp"
    max_model_len: int


class ModelList(BaseModel):
    """The answer of ``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorInfo
