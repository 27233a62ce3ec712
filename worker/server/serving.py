"""The serving class: OpenAI requests -> engine calls -> responses or server-sent events.

Routers stay short and call into ``OpenAIServing``; it depends on the engine interface
(``EngineClient``) and on the DWDP status protocol, never on their classes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from dwdp.worker.engine.protocol import (
    EngineClient,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from dwdp.worker.server.metrics import ServerMetrics
from dwdp.worker.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from dwdp.worker.server.status import DwdpStatusSource

DEFAULT_MAX_TOKENS = 16


class ServingError(Exception):
    """A request the server refuses; ``status_code`` is 4xx or 503, the message one line."""

    def __init__(self, status_code: int, message: str, *, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.kind = kind


class OpenAIServing:
    """Completions, chat completions, models, health and readiness over one engine."""

    def __init__(
        self,
        engine: EngineClient,
        dwdp: DwdpStatusSource,
        metrics: ServerMetrics,
        *,
        served_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.dwdp = dwdp
        self.metrics = metrics
        self.served_name = served_name or engine.model_name
        self.created = int(time.time())

    # -- plain endpoints ---------------------------------------------------------------------
    def models(self) -> ModelList:
        """The one served model."""
        card = ModelCard(
            id=self.served_name, created=self.created, max_model_len=self.engine.max_model_len
        )
        return ModelList(data=[card])

    async def health(self) -> None:
        """Raise ``ServingError`` 503 when the engine cannot serve."""
        try:
            await self.engine.check_health()
        except EngineError as exc:
            raise ServingError(503, str(exc), kind="service_unavailable") from exc

    async def ready(self) -> None:
        """Raise ``ServingError`` 503 unless DWDP committed and the engine is healthy."""
        if not self.dwdp.committed:
            phase = self.dwdp.status().get("phase", "unknown")
            raise ServingError(503, f"DWDP not committed (phase {phase})", kind="not_ready")
        await self.health()

    # -- generation --------------------------------------------------------------------------
    def _params(self, req: Any, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        try:
            stops = req.stop_list()
        except ValueError as exc:
            raise ServingError(400, str(exc)) from exc
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        limit = self.engine.max_model_len
        if prompt_len + max_tokens > limit:
            raise ServingError(
                400,
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context ({limit})",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=stops,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
        )

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise ServingError(404, f"model: {name!r} is not served here", kind="not_found_error")

    def _tokenize(self, text: str) -> list[int]:
        ids = self.engine.tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ServingError(400, "prompt: empty after tokenization")
        return list(ids)

    async def completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Run one completion; a response, or the SSE lines when ``req.stream``."""
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            prompt_ids = self._tokenize(req.prompt)
            prompt_text = req.prompt
        else:
            prompt_ids = list(req.prompt)
            prompt_text = None
        params = self._params(req, len(prompt_ids), req.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self._start(request_id, prompt_ids, params, "completions")
        if req.stream:
            return await self._sse(request_id, stream, chat=False)
        text, tokens, reason, last = await self._collect(stream)
        if req.echo:
            text = (prompt_text or self.engine.tokenizer.decode(prompt_ids)) + text
        return CompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.served_name,
            choices=[CompletionChoice(text=text, finish_reason=reason, token_ids=tokens)],
            usage=_usage(len(prompt_ids), last),
        )

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """Run one chat completion; a response, or the SSE lines when ``req.stream``."""
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template that refuses the conversation
            raise ServingError(400, f"messages: chat template failed: {exc}") from exc
        prompt_ids = list(self.engine.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if not prompt_ids:
            raise ServingError(400, "messages: empty after the chat template")
        params = self._params(req, len(prompt_ids), req.max_completion_tokens or req.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self._start(request_id, prompt_ids, params, "chat")
        if req.stream:
            return await self._sse(request_id, stream, chat=True)
        text, tokens, reason, last = await self._collect(stream)
        return ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.served_name,
            choices=[
                ChatChoice(
                    message=ChatResponseMessage(content=text),
                    finish_reason=reason,
                    token_ids=tokens,
                )
            ],
            usage=_usage(len(prompt_ids), last),
        )

    # -- plumbing ----------------------------------------------------------------------------
    async def _start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, endpoint: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream with latency and TTFT observed; engine errors mapped."""
        start = time.perf_counter()
        first = True
        try:
            async for out in self.engine.generate(request_id, prompt_ids, params):
                if first and (out.token_ids or out.finished):
                    self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - start)
                    first = False
                yield out
        except RequestError as exc:
            raise ServingError(400, str(exc)) from exc
        except EngineError as exc:
            raise ServingError(503, str(exc), kind="service_unavailable") from exc
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    @staticmethod
    async def _collect(
        stream: AsyncGenerator[RequestOutput, None],
    ) -> tuple[str, list[int], str | None, RequestOutput | None]:
        text, tokens, reason, last = [], [], None, None
        async for out in stream:
            text.append(out.text)
            tokens.extend(out.token_ids)
            reason, last = out.finish_reason, out
        return "".join(text), tokens, reason, last

    async def _sse(
        self, request_id: str, stream: AsyncGenerator[RequestOutput, None], *, chat: bool
    ) -> AsyncIterator[str]:
        """The SSE lines of a streaming request. The engine's first update is awaited before
        the first line, so a refusal is still a plain HTTP error (400/503), not a 200 stream."""
        first = await anext(stream)
        return self._sse_lines(request_id, first, stream, chat=chat)

    async def _sse_lines(
        self,
        request_id: str,
        first: RequestOutput,
        stream: AsyncGenerator[RequestOutput, None],
        *,
        chat: bool,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        model = self.served_name
        if chat:  # the role comes first, as in the OpenAI API
            yield _event(request_id, kind, created, model, {"role": "assistant"}, None)
        out: RequestOutput | None = first
        try:
            while out is not None:
                payload = {"content": out.text} if chat else out.text
                yield _event(
                    request_id,
                    kind,
                    created,
                    model,
                    payload,
                    out.finish_reason,
                    token_ids=out.token_ids,
                    chat=chat,
                )
                out = None if out.finished else await anext(stream, None)
        except ServingError as exc:  # the engine died mid-stream
            error = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status_code}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, last: RequestOutput | None) -> Usage:
    completion = last.completion_tokens if last is not None else 0
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


def _event(
    request_id: str,
    kind: str,
    created: int,
    model: str,
    payload: Any,
    finish_reason: str | None,
    *,
    token_ids: list[int] | None = None,
    chat: bool = True,
) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = payload
    else:
        choice["text"] = payload
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": kind, "created": created, "model": model}
    body["choices"] = [choice]
    return f"data: {json.dumps(body)}\n\n"
