"""What both engines share: limits, counters, the request lifecycle and the ``EngineClient`` API.

An engine owns one background thread that runs the model (``_loop``, per engine); requests
reach it through ``generate`` (async, streaming) or ``run_batch`` (the calling thread waits;
tests and benches). Each request is a ``RequestState``; ``_deliver`` applies its chosen token
(stop rules, streaming) and ``_finish`` ends it. A forward that raises kills the engine: every
live request fails with ``EngineError``, ``check_health`` raises ``EngineDeadError`` and
``on_fatal`` tells the worker (DWDP state may be inconsistent, the rank must exit).

[Note: one forward at a time] Every forward runs under ``_forward_lock``: DWDP's hooks assume
one pass at a time per model (the prefetch schedule is a cycle over the MoE layers of
consecutive passes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dwdp.api.defaults import KV_BLOCK_SIZE, MAX_BATCH_SIZE, MAX_NUM_TOKENS
from dwdp.worker.engine.grammar import Constraint, Grammars
from dwdp.worker.engine.kv_connector import KvConnector, KvTransferParams
from dwdp.worker.engine.protocol import (
    CompletedRequest,
    EngineDeadError,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
    SharedPrefill,
    TokenLogprob,
)
from dwdp.worker.engine.requests import RequestState
from dwdp.worker.engine.sampler import Choice, prompt_logprobs
from dwdp.worker.engine.speculative import SpeculativeConfig
from dwdp.worker.engine.stats import EngineSnapshot, EngineStats, KvCacheShape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of an engine.

    ``max_batch_size`` requests and ``max_num_tokens`` tokens per forward (the continuous
    engine chunks longer prompts; the wave engine refuses them); ``max_model_len`` bounds
    prompt + generated tokens (default: the model's ``max_position_embeddings``);
    ``kv_capacity_tokens``: the KV cache pool (``dwdp.worker.engine.kv_pool``; ``None``: see
    ``continuous.DEFAULT_POOL_TOKENS``; no bound in the wave engine); ``block_size``: tokens
    per KV block (continuous engine); ``cuda_graphs``: decode-only steps replay CUDA graphs
    captured by ``ContinuousEngine.capture_cuda_graphs`` (CUDA only; the worker resolves the
    setting, ``engine.cudaGraphs``); ``prefix_caching``: keep computed full blocks cached by
    their tokens' chain hash and share them with later requests (``kvCache.prefixCaching``;
    ``dwdp.worker.engine.blocks``); ``speculative``: decoding requests propose draft tokens
    that one forward verifies (``dwdp.worker.engine.speculative``; the continuous engine;
    ``engine.speculative``); ``None``: off.
    """

    max_batch_size: int = MAX_BATCH_SIZE
    max_num_tokens: int = MAX_NUM_TOKENS
    max_model_len: int | None = None
    kv_capacity_tokens: int | None = None
    block_size: int = KV_BLOCK_SIZE
    cuda_graphs: bool = False
    prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None


class EngineBase:
    """The shared half of an engine (implements ``EngineClient``); subclasses run ``_loop``.

    Use as a context manager (``with engine:``) or call ``start()``/``stop()``; ``stop`` is safe
    to call twice and fails every queued or running request with ``finish_reason`` abort.
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
        self.vocab_size = int(text_config.vocab_size)
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
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._on_fatal = on_fatal
        self._queue: queue.Queue[RequestState | None] = queue.Queue()
        self._active: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.kv: KvConnector | None = None
        """The KV connector of a disaggregated server (``ContinuousEngine.attach_kv_transfer``);
        ``None``: this engine moves no KV and refuses a request that asks it to."""
        self._setup()

    def _setup(self) -> None:
        """What a subclass builds once the shared state exists (its constructor's rest)."""

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model."""
        return self._tokenizer

    def start(self) -> EngineBase:
        """Start the engine thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dwdp-engine", daemon=True)
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
        for state in left:
            self._finish(state, "abort")

    def __enter__(self) -> EngineBase:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the engine thread serves."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def snapshot(self) -> EngineSnapshot:
        """What this engine publishes about itself now (``EngineClient.snapshot``): a copy of
        ``stats``, its KV cache's shape (``_kv_cache_shape``) and the error that killed it."""
        dead = self._dead
        return EngineSnapshot(
            stats=dataclasses.replace(self.stats),
            prefix_caching=self.config.prefix_caching,
            kv_cache=self._kv_cache_shape(),
            failure=None if dead is None else f"{type(dead).__name__}: {dead}",
            speculative=self.config.speculative,
        )

    def _kv_cache_shape(self) -> KvCacheShape | None:
        """The paged KV cache's shape (``None``: this engine has none; a subclass that has one
        says so)."""
        return None

    # -- the EngineClient interface ----------------------------------------------------------
    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the loop died or was stopped."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopping.is_set() or not self.running:
            raise EngineDeadError("engine is not running")

    async def abort(self, request_id: str) -> None:
        """Mark the request aborted; the loop drops it at the next step."""
        with self._lock:
            state = self._active.get(request_id)
        if state is not None:
            state.aborted = True

    def held_back(self, params: SamplingParams) -> tuple[int, ...]:
        """The token ids a request may not choose before ``min_tokens`` tokens: the EOS
        tokens (unless ``ignore_eos``) and its ``stop_token_ids``; none without min_tokens."""
        if params.min_tokens <= 0:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return tuple(sorted({*eos, *params.stop_token_ids}))

    def constraint(self, params: SamplingParams) -> Constraint | None:
        """The grammar state of a new request asking for ``params.structured`` (compiled here,
        or taken from the compiler's cache), ``None`` for free text. Raises ``RequestError``
        naming the field for a grammar that does not compile. The compiler is made on the
        first constrained request (``Grammars``: the vocabulary's token table)."""
        if params.structured is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self._tokenizer, self.vocab_size,
                                          sorted(self.eos_token_ids))
        return self._grammars.constraint(params.structured)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` when the request cannot be served (names the field)."""
        params.check()
        for token, _bias in params.logit_bias:
            if not 0 <= token < self.vocab_size:
                raise RequestError(
                    f"logit_bias: token id {token} outside the vocabulary [0, {self.vocab_size})")
        if not prompt_token_ids:
            raise RequestError("prompt: empty after tokenization")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens, the model's context is "
                f"{self.max_model_len}"
            )
        if min(prompt_token_ids) >= 0 and max(prompt_token_ids) < self.vocab_size:
            return  # every id in range, found by two C loops (a third of the Python scan)
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"prompt: token id {bad} outside the vocabulary [0, {self.vocab_size})"
            )

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_transfer: KvTransferParams | None = None,
        *,
        shared: SharedPrefill | None = None,
        emit: Callable[[RequestOutput | BaseException], None],
    ) -> RequestState:
        """Check and queue a request whose updates go to ``emit``, called on the engine thread
        (or the thread that stops the engine): ``RequestOutput``s, the last with ``finished``,
        or one exception that ends it. Raises ``RequestError``, ``TransferError`` or
        ``EngineError`` before anything is queued. Returns the request's state (set its
        ``aborted`` to stop it, or call ``abort``)."""
        self.validate(prompt_token_ids, params)
        self.validate_kv_transfer(prompt_token_ids, kv_transfer)
        await self.check_health()
        constraint = None
        if params.structured is not None:  # compiling may take milliseconds: off the loop
            constraint = await asyncio.to_thread(self.constraint, params)
        state = RequestState(request_id, list(map(int, prompt_token_ids)), params, emit=emit,
                             held_back=self.held_back(params), constraint=constraint)
        state.kv_transfer = kv_transfer
        state.shared = shared
        await self._prepare(state)
        self._submit(state)
        return state

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_transfer: KvTransferParams | None = None,
        *,
        shared: SharedPrefill | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request and stream its updates (see ``EngineClient.generate``)."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def emit(out: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, out)

        state = await self.add_request(request_id, prompt_token_ids, params, kv_transfer,
                                       shared=shared, emit=emit)
        try:
            while True:
                out = await updates.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if not state.finished:
                state.aborted = True

    async def score_prompt(
        self, prompt_token_ids: Sequence[int], top: int
    ) -> list[TokenLogprob]:
        """``EngineClient.score_prompt``: one plain forward of the prompt (no KV cache kept),
        run off the event loop under the forward lock, between engine steps. A prompt longer
        than ``max_num_tokens`` is refused (``RequestError``): the logits of every position
        are held at once ([prompt, vocab] float32)."""
        self.validate(prompt_token_ids, SamplingParams(max_tokens=1))
        limit = self.config.max_num_tokens
        if len(prompt_token_ids) > limit:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens to score (echo with logprobs, or "
                f"prompt_logprobs), at most max_num_tokens ({limit})"
            )
        await self.check_health()
        return await asyncio.to_thread(self._score, [int(t) for t in prompt_token_ids], top)

    def _score(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        import torch

        ids = torch.tensor([prompt], dtype=torch.long, device=self.model.device)
        logits = self._timed(lambda: self.model(input_ids=ids, use_cache=False).logits[0])
        return prompt_logprobs(logits, prompt, top)

    def validate_kv_transfer(
        self, prompt_token_ids: Sequence[int], kv_transfer: KvTransferParams | None
    ) -> None:
        """Raise ``RequestError`` for a KV transfer this engine cannot do: any, without a KV
        connector (the params' own rules were checked where they were parsed)."""
        if kv_transfer is not None and kv_transfer.transfers and self.kv is None:
            raise RequestError(
                "kv_transfer_params: this server does no KV transfer "
                "(not a context or generation role)"
            )

    async def _prepare(self, state: RequestState) -> None:
        """Work a request needs before it is queued: a remote prefill's connector claims the
        remote blocks here (``KvConnector.prepare_load``), once for all the choices of one
        ``SharedPrefill``."""
        kv = state.kv_transfer
        if kv is None or not kv.do_remote_prefill or self.kv is None:
            return
        shared = state.shared
        if shared is None:
            await self.kv.prepare_load(kv)
            return
        if shared.claim is None:  # the first choice claims the lease for every sibling
            shared.claim = asyncio.ensure_future(self.kv.prepare_load(kv))
        await asyncio.shield(shared.claim)

    # -- the batch API (tests, bench) ----------------------------------------------------------
    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        keep_logits: bool = False,
    ) -> list[CompletedRequest]:
        """Run ``prompts`` to completion; returns them in order (``_run_states`` decides how).

        With ``keep_logits`` each result holds the [vocab] float32 logits of every step.
        Raises ``RequestError`` for a bad prompt or parameter, ``EngineError`` when the engine
        fails meanwhile.
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        states = []
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self.validate(prompt, p)
            states.append(
                RequestState(f"batch-{i}", [int(t) for t in prompt], p, keep_logits=keep_logits,
                             held_back=self.held_back(p), constraint=self.constraint(p))
            )
        self._run_states(states)
        return [
            CompletedRequest(
                s.request_id,
                s.prompt,
                s.tokens,
                s.text,
                s.finish_reason or "abort",
                s.logits,
                s.logprobs,
            )
            for s in states
        ]

    def _run_states(self, states: list[RequestState]) -> None:
        raise NotImplementedError

    def _submit(self, state: RequestState) -> None:
        with self._lock:
            if state.request_id in self._active:
                raise RequestError(f"request id {state.request_id!r} is already running")
            self._active[state.request_id] = state
        state.arrival = time.monotonic()
        self._queue.put(state)

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the model or DWDP failed: the engine is dead
            log.exception("engine forward failed; the engine stops")
            self._die(exc)

    def _loop(self) -> None:
        raise NotImplementedError

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        with self._lock:
            live = list(self._active.values())
            self._active.clear()
        for state in live + self._live_states():
            if state.finished:
                continue
            state.finished = True
            if state.emit is not None:
                state.emit(EngineError(f"engine forward failed: {exc!r}"))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _live_states(self) -> list[RequestState]:
        """Requests inside the loop that are not in ``_active`` (the batch API's)."""
        return []

    def _forward(self, **inputs: Any) -> Any:
        """One model forward under the forward lock (the KV cache under its kwarg name)."""
        cache = inputs.pop("cache", None)
        if cache is not None:
            inputs[self._cache_kwarg] = cache
        return self._timed(lambda: self.model(**inputs, use_cache=True))

    def _timed(self, run: Callable[[], Any]) -> Any:
        """``run()`` (a forward, or a graph replay) under the forward lock and inference mode,
        counted in ``stats``; returns what it returns."""
        import torch

        start = time.perf_counter()
        with self._forward_lock, torch.inference_mode():
            out = run()
        self.stats.forward_passes += 1
        self.stats.forward_seconds += time.perf_counter() - start
        return out

    def _deliver(self, state: RequestState, choice: Choice) -> bool:
        """Apply the chosen token; True when the request ended with it."""
        self.stats.generation_tokens += 1
        reason = state.accept(
            choice.token,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self._tokenizer,
            max_model_len=self.max_model_len,
            logprob=choice.logprob,
        )
        if reason is not None:
            self._finish(state, reason)
            return True
        self._send(state)
        return False

    def _send(self, state: RequestState, *, final: bool = False) -> None:
        if state.emit is None:
            return
        out = state.update(final=final)
        if out is not None:
            state.emit(out)

    def _finish(self, state: RequestState, reason: str) -> None:
        if state.finished:
            return
        state.finished = True
        state.finish_reason = reason
        if reason == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        self._send(state, final=True)
        with self._lock:
            if self._active.get(state.request_id) is state:
                del self._active[state.request_id]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids
