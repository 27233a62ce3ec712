"""The serving class: OpenAI requests -> engine calls -> responses or server-sent events.

Routers stay short and call into ``OpenAIServing``; it depends on the engine interface
(``EngineClient``) and on the DWDP status protocol, never on their classes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dwdp.worker.engine.kv_connector import KvTransferParams, LeaseError, StagingFull, TransferError
from dwdp.worker.engine.protocol import (
    EngineClient,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
    SharedPrefill,
    StructuredOutput,
    TokenLogprob,
)
from dwdp.worker.server.choices import ChoicePlan, choice_plan
from dwdp.worker.server.errors import ServingError
from dwdp.worker.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    vllm_prompt_logprobs,
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
    ResponseToolCall,
    ServedBy,
    ServerRef,
    Usage,
)
from dwdp.worker.server.tools import ToolPlan, ToolStream, answer, finish_reason, tool_plan
from dwdp.worker.status_source import DwdpStatusSource

DEFAULT_MAX_TOKENS = 16


LEASE_ERROR_KINDS = {400: "invalid_request_error", 403: "permission_error", 410: "gone"}


def lease_refusal(exc: LeaseError) -> ServingError:
    """The answer to params that name no lease this server may read (``LeaseError``)."""
    return ServingError(exc.status, str(exc), kind=LEASE_ERROR_KINDS.get(exc.status, "gone"))


class OpenAIServing:
    """Completions, chat completions, models, health and readiness over one engine."""

    def __init__(
        self,
        engine: EngineClient,
        dwdp: DwdpStatusSource,
        metrics: ServerMetrics,
        *,
        served_name: str | None = None,
        server: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.dwdp = dwdp
        self.metrics = metrics
        self.served_name = served_name or engine.model_name
        self.server = dict(server or {})
        """This server's identity (``status.server_identity``): the ``dwdp`` field's parts."""
        self.created = int(time.time())

    def me(self) -> dict[str, Any]:
        """This server as a ``ServerRef``: its identity, and with a KV transfer its NIXL
        engine id and the advertised address of its side channel."""
        kv = self.engine.kv
        if kv is None:
            return dict(self.server)
        return {**self.server, **asdict(kv.endpoint)}

    def served_by(self, kv: KvTransferParams | None) -> ServedBy:
        """The ``dwdp`` field of an answer to a request with these ``kv_transfer_params``: a
        remote prefill names the context server of the params (the engine id the side channel
        confirmed, and its identity as that server described itself); a prefill-only answer
        names no decode server."""
        me = ServerRef(**self.me())
        prefill = me
        if kv is not None and kv.do_remote_prefill:
            transfer = self.engine.kv
            told = transfer.server_of(str(kv.remote_engine_id)) if transfer is not None else {}
            prefill = ServerRef(
                **{
                    **(told or {}),
                    "engine_id": kv.remote_engine_id,
                    "host": kv.remote_host,
                    "port": kv.remote_port,
                }
            )
        decode = None if kv is not None and kv.do_remote_decode else me
        return ServedBy(prefill=prefill, decode=decode)

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
    def _params(
        self, req: Any, prompt_len: int, max_tokens: int | None, field: str = "max_tokens",
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` of one prompt of ``req``; ``ServingError`` 400
        naming the field the client sent. A prefill for a remote decode
        (``kv_transfer_params.do_remote_decode``) runs one token whatever ``max_tokens`` says
        (a router sends 1 in place of the client's value, which only the generation server
        sees): its refusals name the prompt alone. ``max_tokens`` 0 (a scoring request) runs
        one token where the engine runs at all (``_engine_runs``). ``structured``: the
        request's one constraint (``_structured``)."""
        try:
            stops = req.stop_list()
            logprobs = req.logprobs_k()
            logit_bias = req.logit_bias_pairs()
        except ValueError as exc:
            raise ServingError(400, str(exc)) from exc
        if req.stream_options is not None and not req.stream:
            raise ServingError(400, "stream_options: only with stream true")
        kv = req.kv_transfer_params
        limit = self.engine.max_model_len
        if kv is not None and kv.do_remote_decode:
            if req.stream:
                raise ServingError(
                    400, "stream: true with kv_transfer_params.do_remote_decode: the prefill "
                    "for a remote decode answers once; send stream false",
                )
            if prompt_len >= limit:
                raise ServingError(
                    400, f"prompt: {prompt_len} tokens leave no room in the model's context "
                    f"({limit}) for the tokens to generate",
                )
            max_tokens = 1  # prefill only: the generation server decodes (as vLLM does)
        if max_tokens is None:  # the default shrinks to what the context leaves
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, limit - prompt_len))
        if prompt_len + max_tokens > limit:
            what = "prompt" if prompt_len >= limit else field
            raise ServingError(
                400,
                f"{what}: prompt ({prompt_len} tokens) + {field} ({max_tokens}) exceeds "
                f"the model's context ({limit})",
            )
        max_tokens = max(1, max_tokens)
        min_tokens = req.min_tokens
        if min_tokens > max_tokens:
            if kv is None or not kv.do_remote_decode:
                raise ServingError(
                    400, f"min_tokens: {min_tokens} exceeds {field} ({max_tokens})")
            min_tokens = max_tokens  # the prefill's one token; the decode side sees the rest
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=stops,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            cache_salt=req.cache_salt,
            logit_bias=logit_bias,
            min_tokens=min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,
            structured=structured,
        )

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise ServingError(404, f"model: {name!r} is not served here", kind="not_found_error")

    def _tokenize(self, text: str) -> list[int]:
        ids = self.engine.tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ServingError(400, "prompt: empty after tokenization")
        return list(ids)

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """One prompt's token ids and, for a text prompt, its text."""
        if isinstance(prompt, str):
            return self._tokenize(prompt), prompt
        return list(prompt), None

    async def completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Run one completion (each prompt's ``n`` choices, ``choice_plan``); a response, or
        the SSE lines when ``req.stream``."""
        self._check_model(req.model)
        prompts = [self._prompt_ids(p) for p in req.prompts()]
        plan = choice_plan(req, len(prompts))
        structured = await _structured(req)
        params = [self._params(req, len(ids), req.max_tokens, structured=structured)
                  for ids, _ in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            ids, text = prompts[0]  # one prompt: choice_plan refuses a streamed batch
            streams = self._start(request_id, ids, params[0], req, "completions")
            return await self._sse(request_id, streams, len(ids), req, chat=False,
                                   echo=self._echo(req, ids, text))
        scores = [
            await self._score(ids, plan.prompt_top) if plan.prompt_top is not None else None
            for ids, _ in prompts
        ]
        runs = [
            self._start(
                request_id if len(prompts) == 1 else f"{request_id}-p{i}",
                ids, p, req, "completions", streams=plan.engine_streams,
            )
            for i, ((ids, _), p) in enumerate(zip(prompts, params, strict=True))
        ]
        results = await asyncio.gather(*(_collect(s) for run in runs for s in run))
        per_prompt = [results[i * plan.engine_streams : (i + 1) * plan.engine_streams]
                      for i in range(len(prompts))]
        choices = [
            self._completion_choice(req, plan, i * plan.choices + j, prompt, score, got, j)
            for i, (prompt, score, got) in enumerate(zip(prompts, scores, per_prompt, strict=True))
            for j in range(plan.choices)
        ]
        generated = [r for got in per_prompt for r in got] if plan.generates else []
        return CompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.served_name,
            choices=choices,
            usage=Usage.of(
                sum(len(ids) for ids, _ in prompts),
                sum(r.completion_tokens for r in generated),
                sum(got[0].cached_tokens for got in per_prompt if got),  # one prefill each
            ),
            kv_transfer_params=results[0].kv_transfer_params if results else None,
            dwdp=self.served_by(req.kv_transfer_params),
        )

    def _completion_choice(
        self,
        req: CompletionRequest,
        plan: ChoicePlan,
        index: int,
        prompt: tuple[list[int], str | None],
        scores: list[TokenLogprob] | None,
        results: list[_Result],
        j: int,
    ) -> CompletionChoice:
        """Choice ``j`` of one prompt: the echo (text, and the prompt's logprobs before the
        generated ones), the generated part unless ``max_tokens`` is 0, vLLM's
        ``prompt_logprobs`` when asked for."""
        tok = self.engine.tokenizer
        ids, text = prompt
        echo = self._echo(req, ids, text)
        r = results[j] if plan.generates else _Result("", [], "length", 0, [])
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(tok, r.logprobs, len(echo))
            if req.echo and scores is not None:  # scored (not a prefill for a remote decode)
                logprobs = echoed_logprobs(tok, ids, scores, logprobs)
        return CompletionChoice(
            index=index,
            text=echo + r.text,
            finish_reason=r.reason,
            token_ids=r.tokens,
            logprobs=logprobs,
            prompt_logprobs=vllm_prompt_logprobs(tok, scores or [])
            if req.prompt_logprobs is not None and scores is not None
            else None,
        )

    def _echo(self, req: CompletionRequest, ids: list[int], text: str | None) -> str:
        """What ``echo`` prepends: the prompt as sent (text), or its ids' decoded text."""
        if not req.echo:
            return ""
        return text if text is not None else str(self.engine.tokenizer.decode(ids))

    async def _score(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """``EngineClient.score_prompt``, its errors mapped as ``_choice`` maps a stream's."""
        try:
            return await self.engine.score_prompt(prompt_ids, top)
        except RequestError as exc:
            raise ServingError(400, str(exc)) from exc
        except EngineError as exc:
            raise ServingError(503, str(exc), kind="service_unavailable") from exc

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """Run one chat completion (``n`` choices); a response, or the SSE lines when
        ``req.stream``. Tools: ``dwdp.worker.server.tools``."""
        self._check_model(req.model)
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None)
        tools = await asyncio.to_thread(tool_plan, req, template) if req.tools else tool_plan(
            req, template)  # parameters' schemas are checked off the event loop
        prompt_ids = self._chat_prompt(req, tools)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(req, len(prompt_ids), req.max_completion_tokens or req.max_tokens,
                              field, await _structured(req, tools.constraint))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        plan = choice_plan(req, 1)
        streams = self._start(request_id, prompt_ids, params, req, "chat")
        if req.stream:
            return await self._sse(request_id, streams, len(prompt_ids), req, chat=True,
                                   tools=tools)
        scored = None
        if plan.prompt_top is not None:
            scores = await self._score(prompt_ids, plan.prompt_top)
            scored = vllm_prompt_logprobs(tok, scores)
        results = await asyncio.gather(*(_collect(s) for s in streams))
        return ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.served_name,
            choices=[self._chat_choice(i, r, tools, params) for i, r in enumerate(results)],
            usage=_usage(len(prompt_ids), results),
            prompt_logprobs=scored,
            kv_transfer_params=results[0].kv_transfer_params,
            dwdp=self.served_by(req.kv_transfer_params),
        )

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan) -> list[int]:
        """The token ids of the conversation (and the tools) rendered by the chat template."""
        tok = self.engine.tokenizer
        try:
            messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        except ValueError as exc:
            raise ServingError(400, str(exc)) from exc
        try:
            rendered = tok.apply_chat_template(
                messages, tools=tools.tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template that refuses the conversation
            raise ServingError(400, f"messages: chat template failed: {exc}") from exc
        prompt_ids = list(tok(rendered, add_special_tokens=False)["input_ids"])
        if not prompt_ids:
            raise ServingError(400, "messages: empty after the chat template")
        return prompt_ids

    def _chat_choice(self, index: int, r: _Result, tools: ToolPlan,
                     params: SamplingParams) -> ChatChoice:
        """Choice ``index`` of a whole chat answer: its text, or its content and tool calls."""
        content, calls = answer(tools, r.text)
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(
                content=content, tool_calls=[ResponseToolCall.model_validate(c) for c in calls]),
            finish_reason=finish_reason(tools, r.reason, bool(calls)),
            token_ids=r.tokens,
            logprobs=chat_logprobs(self.engine.tokenizer, r.logprobs)
            if params.logprobs is not None else None,
        )

    # -- plumbing ----------------------------------------------------------------------------
    def _start(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        req: Any,
        endpoint: str,
        *,
        streams: int | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """The engine streams of one prompt's choices (choice ``i`` seeded ``seed + i``):
        ``streams`` of them (default: ``choice_plan``'s, for a chat or stream). The choices
        of a remote prefill read its KV once (``SharedPrefill``)."""
        n = choice_plan(req, 1).engine_streams if streams is None else streams
        kv = req.kv_transfer_params
        shared = SharedPrefill() if n > 1 and kv is not None and kv.do_remote_prefill else None
        return [
            self._choice(
                request_id if n == 1 else f"{request_id}-{i}",
                prompt_ids,
                params if params.seed is None else replace(params, seed=params.seed + i),
                endpoint,
                kv,
                shared,
            )
            for i in range(n)
        ]

    async def _choice(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        endpoint: str,
        kv_transfer: KvTransferParams | None = None,
        shared: SharedPrefill | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One engine stream with latency and TTFT observed; engine errors mapped."""
        start = time.perf_counter()
        last: float | None = None
        extra = {"shared": shared} if shared is not None else {}  # n > 1 on a remote prefill
        try:
            async for out in self.engine.generate(
                request_id, prompt_ids, params, kv_transfer, **extra
            ):
                now = time.perf_counter()
                if last is None and (out.token_ids or out.finished):
                    self.metrics.ttft.labels(endpoint).observe(now - start)
                    last = now
                elif last is not None and out.token_ids:
                    per_token = (now - last) / len(out.token_ids)
                    for _ in out.token_ids:
                        self.metrics.itl.labels(endpoint).observe(per_token)
                    last = now
                yield out
        except RequestError as exc:
            raise ServingError(400, str(exc)) from exc
        except LeaseError as exc:  # the params name no lease this server may read
            raise lease_refusal(exc) from exc
        except StagingFull as exc:  # busy, not broken (vllm-router 0.1.17 does not retry it)
            raise ServingError(503, str(exc), kind="service_unavailable") from exc
        except TransferError as exc:
            raise ServingError(502, str(exc), kind="kv_transfer_error") from exc
        except EngineError as exc:
            raise ServingError(503, str(exc), kind="service_unavailable") from exc
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def _sse(
        self,
        request_id: str,
        streams: list[AsyncGenerator[RequestOutput, None]],
        prompt_tokens: int,
        req: Any,
        *,
        chat: bool,
        echo: str = "",
        tools: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streaming request. Every choice's first update is awaited before
        the first line, so a refusal is still a plain HTTP error (400/503), not a 200 stream.
        ``echo``: a completion's echoed prompt, each choice's first event."""
        try:
            firsts = list(await asyncio.gather(*(anext(s) for s in streams)))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        options = req.stream_options
        usage = bool(options and options.include_usage)
        return self._sse_lines(
            _SseFormat(
                request_id,
                self.served_name,
                chat,
                usage,
                self.engine.tokenizer,
                self.served_by(req.kv_transfer_params).model_dump(exclude_none=True),
                tools=tools or ToolPlan(),
            ),
            firsts,
            streams,
            prompt_tokens,
            echo,
        )

    async def _sse_lines(
        self,
        fmt: _SseFormat,
        firsts: list[RequestOutput],
        streams: list[AsyncGenerator[RequestOutput, None]],
        prompt_tokens: int,
        echo: str = "",
    ) -> AsyncIterator[str]:
        last: list[RequestOutput] = list(firsts)
        if fmt.chat:  # the role comes first, as in the OpenAI API
            for i in range(len(streams)):
                yield fmt.event(i, {"role": "assistant"}, None)
        elif echo:  # so does the echoed prompt; the generated text's offsets count it
            for i in range(len(streams)):
                yield fmt.event(i, echo, None)
                fmt.text_at[i] = len(echo)
        try:
            async for i, out in _merge(firsts, streams):
                last[i] = out
                yield fmt.chunk(i, out)
        except ServingError as exc:  # the engine died mid-stream
            error = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status_code}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            for s in streams:
                await s.aclose()
        if fmt.include_usage:
            completion = sum(o.completion_tokens for o in last)
            yield fmt.usage_event(Usage.of(prompt_tokens, completion, last[0].cached_tokens))
        yield "data: [DONE]\n\n"


@dataclass(slots=True)
class _Result:
    text: str
    tokens: list[int]
    reason: str | None
    completion_tokens: int
    logprobs: list[TokenLogprob]
    kv_transfer_params: KvTransferParams | None = None
    cached_tokens: int = 0


async def _collect(stream: AsyncGenerator[RequestOutput, None]) -> _Result:
    text: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    reason, completion, kv, cached = None, 0, None, 0
    async for out in stream:
        text.append(out.text)
        tokens.extend(out.token_ids)
        logprobs.extend(out.logprobs or ())
        reason, completion = out.finish_reason, out.completion_tokens
        kv, cached = out.kv_transfer_params or kv, out.cached_tokens
    return _Result("".join(text), tokens, reason, completion, logprobs, kv, cached)


async def _merge(
    firsts: list[RequestOutput], streams: list[AsyncGenerator[RequestOutput, None]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, update) of every stream in arrival order, the ``firsts`` first. One
    stream (``n`` = 1, nearly every request) is read in place: no task and no wait per token."""
    if len(streams) == 1:
        yield 0, firsts[0]
        if not firsts[0].finished:
            async for update in streams[0]:
                yield 0, update
        return
    pending: dict[asyncio.Task[RequestOutput | None], int] = {}
    for i, (first, stream) in enumerate(zip(firsts, streams, strict=True)):
        yield i, first
        if not first.finished:
            pending[asyncio.ensure_future(anext(stream, None))] = i
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i], None))] = i
    finally:  # the client went away: stop the reads before the streams are closed
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _structured(req: Any, tool_call: StructuredOutput | None = None
                      ) -> StructuredOutput | None:
    """The request's one constraint (``StructuredFields.structured``); its JSON schema is
    checked off the event loop (a schema at the size limit takes about a second to check)."""
    if not req.constrains():
        return req.structured(tool_call)
    return await asyncio.to_thread(req.structured, tool_call)


def _usage(prompt_tokens: int, results: list[_Result]) -> Usage:
    """The usage of a request of ``results`` (its choices); the cached tokens are the first
    choice's (one prefill's, as vLLM reports them)."""
    completion = sum(r.completion_tokens for r in results)
    return Usage.of(prompt_tokens, completion, results[0].cached_tokens)


@dataclass(slots=True)
class _SseFormat:
    """How one streaming request's chunks look (OpenAI's chunk objects); the first carries
    ``served_by`` as its ``dwdp`` field."""

    request_id: str
    model: str
    chat: bool
    include_usage: bool
    tokenizer: Any
    served_by: dict[str, Any] | None = None
    tools: ToolPlan = field(default_factory=ToolPlan)
    created: int = field(default_factory=lambda: int(time.time()))
    text_at: dict[int, int] = field(default_factory=dict)  # choice -> its next text_offset
    calls: dict[int, ToolStream] = field(default_factory=dict)  # chat choice -> its calls

    def chunk(self, index: int, out: RequestOutput) -> str:
        """The chunk of one engine update of choice ``index``; a completion's ``text_offset``
        counts from the choice's first chunk on, as in the whole answer."""
        payload: Any = out.text
        reason = out.finish_reason
        if self.chat:
            stream = self.calls.setdefault(index, ToolStream(self.tools))
            payload = stream.delta(out.text, out.finished)
            reason = finish_reason(self.tools, reason, stream.calls > 0)
        extra: dict[str, Any] = {"token_ids": out.token_ids}
        if out.logprobs is not None and self.chat:
            extra["logprobs"] = chat_logprobs(self.tokenizer, out.logprobs).model_dump()
        elif out.logprobs is not None:
            lp = completion_logprobs(self.tokenizer, out.logprobs, self.text_at.get(index, 0))
            self.text_at[index] = self.text_at.get(index, 0) + sum(len(t) for t in lp.tokens)
            extra["logprobs"] = lp.model_dump()
        return self.event(index, payload, reason, **extra)

    def event(self, index: int, payload: Any, finish_reason: str | None, **extra: Any) -> str:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = payload
        choice.update(extra)
        return self._line([choice], None)

    def usage_event(self, usage: Usage) -> str:
        return self._line([], usage.model_dump())

    def _line(self, choices: list[dict[str, Any]], usage: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        if self.served_by is not None:  # the first event only
            body["dwdp"], self.served_by = self.served_by, None
        return f"data: {json.dumps(body)}\n\n"
