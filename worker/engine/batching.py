"""The batching engine: waves of requests, prefill then decode, on a transformers causal LM.

A background thread takes up to ``max_batch_size`` queued requests (and at most
``max_num_tokens`` prompt tokens), left-pads them into one prefill forward, then runs one decode
forward per step until every request of the wave has stopped. Token choice uses transformers'
logits processors (temperature, top-k, top-p) per request; greedy requests take the argmax.
Requests that arrive during a wave wait for the next one. A wave also fits the KV cache pool
(``EngineConfig.kv_capacity_tokens``): each request reserves the tokens it may fill.

[Note: one forward at a time] Every forward of the model goes through ``_forward`` under
``_forward_lock``: DWDP's hooks assume one pass at a time per model (the prefetch schedule is a
cycle over the MoE layers of consecutive passes), and the batch API used by tests and the bench
shares the same lock with the serving thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dwdp.worker.engine.protocol import (
    CompletedRequest,
    EngineDeadError,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of the batching loop.

    ``max_batch_size`` requests and ``max_num_tokens`` prompt tokens per wave;
    ``max_model_len`` bounds prompt + generated tokens (default: the model's
    ``max_position_embeddings``); ``kv_capacity_tokens``, the KV cache pool
    (``dwdp.worker.engine.kv_pool``), bounds the tokens a wave may reserve: each request
    reserves ``min(prompt + max_tokens, max_model_len)`` (``None``: no bound).
    """

    max_batch_size: int = 8
    max_num_tokens: int = 8192
    max_model_len: int | None = None
    kv_capacity_tokens: int | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters since start; read by the metrics collector at scrape time."""

    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    forward_passes: int = 0
    forward_seconds: float = 0.0
    waves: int = 0
    kv_tokens_in_use: int = 0
    """KV cache tokens the running wave reserves (a gauge, not a counter)."""


@dataclass(eq=False, slots=True)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput | BaseException], None] | None = None
    keep_logits: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    sent_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    aborted: bool = False
    logits: list[Any] = field(default_factory=list)
    processors: Any = None
    generator: Any = None


class BatchingEngine:
    """The engine of one rank (implements ``EngineClient``).

    Use as a context manager (``with engine:``) or call ``start()``/``stop()``; ``stop`` is safe
    to call twice and fails every queued or running request with ``EngineError``.
    ``on_fatal(exc)`` is called from the engine thread when a forward raises (the engine is then
    dead: DWDP state may be inconsistent and the process should exit).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        config: EngineConfig | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.config = config or EngineConfig()
        text_config = model.config.get_text_config()
        self.max_model_len = int(
            self.config.max_model_len
            or getattr(text_config, "max_position_embeddings", None)
            or 2048
        )
        self.eos_token_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (sorted(self.eos_token_ids) or [0])[0])
        self.stats = EngineStats()
        # transformers renamed ``past_key_values`` to ``cache`` (the old name is deprecated
        # where the new one exists); pass the KV cache under the name this version takes.
        import inspect

        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._on_fatal = on_fatal
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._active: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model."""
        return self._tokenizer

    def start(self) -> BatchingEngine:
        """Start the engine thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dwdp-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current forward; fail what is left. Safe to repeat."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            left = list(self._active.values())
            self._active.clear()
        for req in left:
            self._finish(req, "abort")

    def __enter__(self) -> BatchingEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the engine thread serves."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # -- the EngineClient interface -----------------------------------------------------------
    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the loop died or was stopped."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopping.is_set() or not self.running:
            raise EngineDeadError("engine is not running")

    async def abort(self, request_id: str) -> None:
        """Mark the request aborted; the loop drops it at the next step."""
        with self._lock:
            req = self._active.get(request_id)
        if req is not None:
            req.aborted = True

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` when the request cannot be served (names the field)."""
        params.check()
        if not prompt_token_ids:
            raise RequestError("prompt: empty after tokenization")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens, the model's context is "
                f"{self.max_model_len}"
            )
        if len(prompt_token_ids) > self.config.max_num_tokens:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens > max_num_tokens "
                f"{self.config.max_num_tokens}"
            )
        vocab = self.model.config.get_text_config().vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt: token id {bad} outside the vocabulary [0, {vocab})")

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request and stream its updates (see ``EngineClient.generate``)."""
        self.validate(prompt_token_ids, params)
        await self.check_health()
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def emit(out: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, out)

        req = _Request(request_id, [int(t) for t in prompt_token_ids], params, emit=emit)
        with self._lock:
            if request_id in self._active:
                raise RequestError(f"request id {request_id!r} is already running")
            self._active[request_id] = req
        self._queue.put(req)
        try:
            while True:
                out = await updates.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:
                req.aborted = True

    # -- the batch API (tests, bench) ----------------------------------------------------------
    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        keep_logits: bool = False,
    ) -> list[CompletedRequest]:
        """Run ``prompts`` as one wave on the calling thread; returns them in order.

        With ``keep_logits`` each result holds the [vocab] float32 logits of every step.
        Raises ``RequestError`` for a bad prompt or parameter.
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self.validate(prompt, p)
            reqs.append(
                _Request(f"batch-{i}", [int(t) for t in prompt], p, keep_logits=keep_logits)
            )
        self._run_wave(reqs)
        return [
            CompletedRequest(
                r.request_id, r.prompt, r.tokens, r.text, r.finish_reason or "abort", r.logits
            )
            for r in reqs
        ]

    # -- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                continue
            wave = [r for r in self._take_wave(first) if not self._drop_if_aborted(r)]
            if not wave:
                continue
            self.stats.kv_tokens_in_use = sum(self._kv_tokens(r) for r in wave)
            try:
                self._run_wave(wave)
                self.stats.kv_tokens_in_use = 0
            except BaseException as exc:  # the model or DWDP failed: the engine is dead
                log.exception("engine forward failed; the engine stops")
                self._dead = exc
                for req in wave:
                    if req.emit is not None:
                        req.emit(EngineError(f"engine forward failed: {exc!r}"))
                    req.finished = True
                    self._forget(req)
                if self._on_fatal is not None:
                    self._on_fatal(exc)
                return

    def _kv_tokens(self, req: _Request) -> int:
        """The KV cache tokens ``req`` may fill: its prompt and every token it may
        generate, at most the model's context."""
        return min(len(req.prompt) + req.params.max_tokens, self.max_model_len)

    def _take_wave(self, first: _Request) -> list[_Request]:
        """``first`` and the queued requests that fit beside it: at most ``max_batch_size``
        requests, ``max_num_tokens`` prompt tokens and ``kv_capacity_tokens`` reserved KV
        tokens; the first that does not fit waits for the next wave."""
        wave = [first]
        tokens, reserved = len(first.prompt), self._kv_tokens(first)
        capacity = self.config.kv_capacity_tokens
        while len(wave) < self.config.max_batch_size:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                continue
            need = self._kv_tokens(nxt)
            if tokens + len(nxt.prompt) > self.config.max_num_tokens or (
                capacity is not None and reserved + need > capacity
            ):
                self._queue.put(nxt)  # next wave; order within a wave does not matter
                break
            wave.append(nxt)
            tokens += len(nxt.prompt)
            reserved += need
        return wave

    def _drop_if_aborted(self, req: _Request) -> bool:
        if req.aborted:
            self._finish(req, "abort")
            return True
        return False

    def _forward(self, **inputs: Any) -> Any:
        import torch

        device = self.model.device  # inputs are built on the host; the model may not be
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        start = time.perf_counter()
        with self._forward_lock, torch.inference_mode():
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        self.stats.forward_passes += 1
        self.stats.forward_seconds += time.perf_counter() - start
        return out

    def _run_wave(self, wave: list[_Request]) -> None:
        import torch
        from transformers import DynamicCache

        self.stats.waves += 1
        for req in wave:
            self._prepare_sampling(req)
        width = max(len(r.prompt) for r in wave)
        ids = torch.full((len(wave), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(wave), width), dtype=torch.long)
        for i, req in enumerate(wave):
            ids[i, width - len(req.prompt) :] = torch.tensor(req.prompt, dtype=torch.long)
            mask[i, width - len(req.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in wave)
        out = self._forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kwarg: cache},
        )
        step = 0
        while True:
            logits = out.logits[:, -1, :].float().cpu()  # token choice runs on the host
            next_ids = torch.full((len(wave), 1), self.pad_token_id, dtype=torch.long)
            for i, req in enumerate(wave):
                if req.finished:
                    continue
                if req.aborted:
                    self._finish(req, "abort")
                    continue
                token = self._choose(req, logits[i])
                next_ids[i, 0] = token
                self._append(req, token, len(req.prompt) + step + 1)
            if all(r.finished for r in wave) or self._stopping.is_set():
                for req in wave:
                    if not req.finished:
                        self._finish(req, "abort")
                return
            step += 1
            mask = torch.cat([mask, torch.ones((len(wave), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = self._forward(
                input_ids=next_ids,
                attention_mask=mask,
                position_ids=positions,
                **{self._cache_kwarg: cache},
            )

    def _prepare_sampling(self, req: _Request) -> None:
        import torch
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        p = req.params
        if p.greedy:
            return
        procs = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        req.processors = procs
        req.generator = torch.Generator()
        if p.seed is not None:
            req.generator.manual_seed(p.seed)
        else:
            req.generator.seed()

    def _choose(self, req: _Request, logits: Any) -> int:
        import torch

        if req.keep_logits:
            req.logits.append(logits.clone())
        if req.params.greedy:
            return int(torch.argmax(logits).item())
        history = torch.tensor([req.prompt + req.tokens], dtype=torch.long)
        scores = req.processors(history, logits.unsqueeze(0))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=req.generator).item())

    def _append(self, req: _Request, token: int, length: int) -> None:
        p = req.params
        self.stats.generation_tokens += 1
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"  # the stop token is not part of the text
        else:
            req.tokens.append(token)
            req.text = self._tokenizer.decode(req.tokens, skip_special_tokens=True)
            stable = req.text.rstrip("\ufffd")  # an incomplete UTF-8 tail may still change
            for s in p.stop:
                cut = stable.find(s)
                if cut >= 0:
                    req.text = req.text[:cut]
                    reason = "stop"
                    break
            if reason is None and (len(req.tokens) >= p.max_tokens or length >= self.max_model_len):
                reason = "length"
        if reason is not None:
            self._finish(req, reason)
        else:
            self._send(req)

    def _send(self, req: _Request, *, final: bool = False) -> None:
        if req.emit is None:
            return
        text = req.text
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its rest
            hold = max((len(s) for s in req.params.stop), default=1) - 1
            if hold:  # text that may still become a stop string is not sent yet
                text = text[: max(0, len(text) - hold)]
        delta = text[req.sent_text :]
        new_tokens = req.tokens[req.sent_tokens :]
        if not delta and not new_tokens and not final:
            return
        req.sent_text = max(req.sent_text, len(text))
        req.sent_tokens = len(req.tokens)
        req.emit(
            RequestOutput(
                request_id=req.request_id,
                token_ids=new_tokens,
                text=delta,
                prompt_tokens=len(req.prompt),
                completion_tokens=len(req.tokens),
                finished=final,
                finish_reason=req.finish_reason if final else None,
            )
        )

    def _finish(self, req: _Request, reason: str) -> None:
        if req.finished:
            return
        req.finished = True
        req.finish_reason = reason
        if reason == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        self._send(req, final=True)
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        with self._lock:
            if self._active.get(req.request_id) is req:
                del self._active[req.request_id]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids
