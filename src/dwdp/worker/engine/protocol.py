"""The engine interface the HTTP server depends on, and the values that cross it.

The server never imports the engine class: it holds an ``EngineClient`` (generate, abort,
check_health, plus the tokenizer and the model limits), so tests can serve a stub engine and
the real engine can change without touching a router.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dwdp.worker.engine.kv_connector import KvServerSide, KvTransferParams
from dwdp.worker.engine.stats import EngineSnapshot


class EngineError(RuntimeError):
    """The engine cannot serve (stopped, or its loop died); the server answers 503."""


class EngineDeadError(EngineError):
    """The engine loop died; ``check_health`` raises it with the cause."""


class RequestError(ValueError):
    """A request the engine refuses (prompt too long, bad parameter); the server answers 400."""


MAX_LOGPROBS = 20
"""The most alternatives per token ``logprobs`` may ask for (OpenAI's ``top_logprobs`` bound)."""

GREEDY_BELOW = 1e-5
"""A temperature under this decodes greedily (as vLLM does): dividing the logits by a
smaller one overflows them to infinities, whose softmax is not a distribution."""


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""What a request's answer may be constrained to (``StructuredOutput.kind``)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The grammar a request's answer must follow (structured outputs, constrained tool calls).

    ``kind`` (one of ``CONSTRAINT_KINDS``) says how to read ``source``: ``json`` a JSON schema
    (its JSON text), ``json_object`` any JSON object (no source), ``regex`` a regular
    expression, ``choice`` a JSON list of the strings allowed, ``grammar`` an EBNF grammar,
    ``structural_tag`` xgrammar's structural tag (its JSON text: tool calls in a model's
    format). ``field``: the request field it came from, named in errors. ``any_whitespace``
    (json): whitespace between JSON tokens is free (vLLM's default); off, the compact form.
    """

    kind: str
    source: str = ""
    field: str = "structured_outputs"
    any_whitespace: bool = True


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` 0 (or any value under ``GREEDY_BELOW``) is greedy (argmax); otherwise
    tokens are drawn after temperature, ``top_k`` (0: off) and ``top_p`` (1.0: off), from a
    generator seeded by ``seed`` when set.
    A request stops at ``max_tokens`` new tokens, at the tokenizer's EOS token (unless
    ``ignore_eos``), at any of ``stop_token_ids``, or when its text contains one of ``stop``
    (the text is cut before it). ``cache_salt`` (vLLM's field) keys the request's prefix in
    the prefix cache: requests share cached blocks only with requests of the same salt.
    ``logit_bias``: (token id, bias) pairs added to the logits before the token is chosen
    (greedy or sampled), biases in [-100, 100] as OpenAI's field; logprobs stay the raw
    model's, as vLLM's default. ``min_tokens`` (vLLM's field): the EOS token and
    ``stop_token_ids`` cannot be chosen before that many tokens were generated (0: off).
    ``include_stop_str_in_output`` (vLLM's field): the text ends after the stop string that
    ended it, not before. ``structured``: the grammar the answer must follow (every token the
    grammar forbids is masked before the choice; the request stops when the grammar is
    complete), ``None`` for free text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature < GREEDY_BELOW

    def check(self) -> None:
        """Raise ``RequestError`` naming the first out-of-range field."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens: {self.max_tokens} < 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature: {self.temperature} outside [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p: {self.top_p} outside (0, 1]")
        if self.top_k < 0:
            raise RequestError(f"top_k: {self.top_k} < 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens: {self.min_tokens} outside [0, max_tokens ({self.max_tokens})]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs: {self.logprobs} outside [0, {MAX_LOGPROBS}]")
        if self.structured is not None and self.structured.kind not in CONSTRAINT_KINDS:
            kinds = ", ".join(CONSTRAINT_KINDS)
            raise RequestError(f"{self.structured.field}: unknown constraint kind "
                               f"{self.structured.kind!r}, not one of {kinds}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise RequestError(f"logit_bias: {bias} for token {token} outside [-100, 100]")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probability of one generated token and of its most likely alternatives.

    ``logprob``: natural log of the token's probability; ``top``: (token id, logprob) pairs,
    most likely first, ``SamplingParams.logprobs`` of them; ``rank``: the token's place among
    the vocabulary (1: the most likely), where computed (a prompt token's).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(slots=True)
class RequestOutput:
    """One update of a request: the tokens and text produced since the previous update.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or string), ``"length"``
    (max_tokens or the model's context) or ``"abort"``, and set only on the last update.
    """

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One entry per token of ``token_ids`` when the request asked for logprobs."""
    kv_transfer_params: KvTransferParams | None = None
    """On the last update of a remote-decode prefill: where its KV blocks wait
    (``KvConnector.request_finished``)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""


@dataclass(slots=True)
class CompletedRequest:
    """A finished request as the batch API returns it (tests and the bench).

    ``logits`` holds, when asked for, one float32 tensor of shape [vocab] per generated
    token: the logits the token was chosen from (before sampling processors).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logits: list[Any] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class SharedPrefill:
    """The choices of one parallel-sampling request (``n`` > 1) whose prompt KV comes from one
    remote prefill: pass the same object to each choice's ``generate``. The engine claims the
    lease once (``claim``), reads the blocks once, into the first choice to join (``first``),
    and the others share them (``dwdp.worker.engine.scheduler``). Both fields are the engine's."""

    claim: Any = None
    """The claim of the remote lease (an ``asyncio`` task every choice awaits)."""
    first: Any = None
    """The engine's sequence that reads the remote blocks."""


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine."""

    model_name: str
    max_model_len: int
    @property
    def kv(self) -> KvServerSide | None:
        """The KV connector (prefill/decode disaggregation; in an API server process only its
        ``KvServerSide``), ``None`` when the server moves no KV."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_transfer: KvTransferParams | None = None,
        *,
        shared: SharedPrefill | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's updates; the last one has ``finished``. ``kv_transfer``: the
        request's ``KvTransferParams`` (prefill/decode disaggregation), if any; ``shared``: the
        choices of one request that read one remote prefill (``SharedPrefill``). Raises
        ``RequestError`` (bad request), ``TransferError`` (the KV transfer failed) or
        ``EngineError`` (cannot serve). Closing the iterator early aborts the request."""

    async def score_prompt(
        self, prompt_token_ids: Sequence[int], top: int
    ) -> list[TokenLogprob]:
        """The logprob, rank and ``top`` most likely alternatives of every prompt token after
        the first (``len(prompt) - 1`` entries: token ``t`` scored by the logits of position
        ``t - 1``), from one forward of the whole prompt. Raises ``RequestError`` (a prompt the
        engine refuses or longer than one step's tokens) or ``EngineError``."""

    async def abort(self, request_id: str) -> None:
        """Stop the request if it is queued or running; unknown ids are ignored."""

    async def check_health(self) -> None:
        """Return if the engine can serve; raise ``EngineDeadError`` otherwise."""

    def snapshot(self) -> EngineSnapshot | None:
        """What the engine publishes about itself now (``dwdp.worker.engine.stats``: a copy of
        its counters, its KV cache's shape, the error that killed it), what ``/dwdp/status``
        and ``/metrics`` read; ``None`` where it publishes nothing (an API server process's
        client: the rank's own app reports its engine)."""
