"""The continuous-batching engine: requests join and leave at every step, on a paged KV cache.

Three pieces, each in its own module: the scheduler (``scheduler``: who runs this step, how many
tokens, preemption), the block allocator (``blocks``) and the model runner (``ModelRunner``
here, over ``paged``: one packed forward per step). A step mixes decode tokens of running
requests with chunks of new prompts (``max_num_tokens`` per step, ``max_batch_size`` requests);
a request's first token comes from the step that prefilled its prompt's last chunk, its
following ones from one decode token per step. Finished and aborted requests give their blocks
back at once, so ``stats.kv_tokens_in_use`` is 0 at rest.

A forward's failure kills the engine (``EngineBase``): DWDP's state after a failed forward is not
known to be consistent, so the rank exits rather than serve from it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dwdp.worker.engine.base import EngineBase
from dwdp.worker.engine.blocks import BlockAllocator
from dwdp.worker.engine.graphs import CudaGraphError, DecodeGraphs, GraphStats
from dwdp.worker.engine.kv_connector import KvConnector, KvHoldFull, KvTransferParams
from dwdp.worker.engine.kv_events import KvEventPublisher
from dwdp.worker.engine.mtp_drafts import EarlyPass, MtpDrafts, hidden_rows
from dwdp.worker.engine.paged import (
    Chunk,
    KernelLayout,
    PagedKVCache,
    StepLayout,
    use_paged_attention,
)
from dwdp.worker.engine.piecewise import PiecewiseGraphs
from dwdp.worker.engine.protocol import EngineError, RequestError, SamplingParams
from dwdp.worker.engine.requests import RequestState
from dwdp.worker.engine.sampler import (
    Choice,
    choose,
    choose_each,
    greedy_tokens,
    plain_greedy,
)
from dwdp.worker.engine.scheduler import Scheduled, Scheduler
from dwdp.worker.engine.scheduler import Sequence as SchedSequence
from dwdp.worker.engine.speculative import Drafter, DraftLayer
from dwdp.worker.engine.stats import KvCacheShape

log = logging.getLogger(__name__)

KV_POLL_S = 0.001
"""Idle wait of an engine holding KV leases: NIXL progresses only when the engine polls it."""
LEASE_TICK_S = 0.2
"""Idle wait of a disaggregated engine without leases (a released notification may come)."""

DEFAULT_POOL_TOKENS = 65536
"""The pool without ``kv_capacity_tokens`` (tests, benches): ``max_batch_size`` requests of
``max_model_len`` tokens, at most this many tokens, at least one request of ``max_model_len``."""


class ModelRunner:
    """Runs one packed step of ``Chunk``s through the model and returns the logits of the
    chunks that sample: [number of sampling chunks, vocab] on the model's device. A decode-only
    step replays a captured CUDA graph when ``graphs`` holds one that fits, a verify step
    (decoding requests with draft tokens) one of ``verify``; another step replays the
    piecewise graphs (``pieces``) when it fits their largest bucket."""

    def __init__(self, engine: ContinuousEngine, cache: PagedKVCache) -> None:
        import torch

        self._engine = engine
        self.cache = cache
        self.device = engine.model.device
        self.graphs: DecodeGraphs | None = None
        self.verify: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        self.replayed: DecodeGraphs | None = None
        """The decode graphs the last step replayed (its token rows in slabs of their ``q``),
        or ``None`` (its rows one chunk after the other)."""
        # a prepared 4D mask makes transformers skip its own mask building: dwdp_paged needs none
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    def execute(self, chunks: Sequence[Chunk]) -> Any:
        pieces, stats = self.pieces, self._engine.stats
        self.replayed = None
        for graphs in (self.graphs, self.verify):
            if graphs is not None and graphs.fits(chunks):
                logits = self._engine._timed(functools.partial(graphs.replay, chunks))
                self.replayed = graphs
                stats.graph_replays += 1
                return logits
        if pieces is not None and pieces.fits(chunks):
            logits = self._engine._timed(lambda: pieces.replay(chunks))
            stats.piecewise_replays = pieces.replays
            return logits
        layout = self.cache.layout(chunks)
        return self._engine._timed(lambda: self.forward(layout))

    def synchronize(self) -> None:
        """Wait for the work queued on the model's device (nothing to wait for on the host)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def warm_up_kernels(self, max_model_len: int, max_num_tokens: int) -> int:
        """On the paged kernel's path, one forward per kernel variant a step can need
        (``dwdp.worker.gpu.paged_attention.warm_up_shapes``, chunks of at most
        ``max_num_tokens``), each one request on the scratch block, so that no step compiles a
        variant while requests wait; returns the forwards run (0 off the kernel's path)."""
        from dwdp.worker.gpu.paged_attention import warm_up_shapes

        cache = self.cache
        if not cache.kernel:
            return 0
        shapes = [(q, s) for q, s in warm_up_shapes(max_model_len, self.device)
                  if q <= max_num_tokens]
        for q_len, seq_len in shapes:
            blocks = [cache.scratch_block] * -(-seq_len // cache.block_size)
            layout = cache.layout([Chunk([0] * q_len, seq_len - q_len, blocks, True)])
            self._engine._timed(functools.partial(self.forward, layout))
        return len(shapes)

    def forward(self, layout: StepLayout | KernelLayout) -> Any:
        """The model over ``layout`` (the forward lock and inference mode are the caller's):
        logits [rows of ``layout.logits_index``, vocab]."""
        engine = self._engine
        with self.cache.step(layout):
            out = engine.model(
                input_ids=layout.input_ids,
                position_ids=layout.position_ids,
                attention_mask=self._no_mask,
                logits_to_keep=layout.logits_index,
                use_cache=True,
                **{engine._cache_kwarg: self.cache},
            )
        return out.logits[0]


class ContinuousEngine(EngineBase):
    """The engine of one rank (implements ``EngineClient``; see ``EngineBase`` for the
    lifecycle). ``config.kv_capacity_tokens`` becomes ``capacity // block_size`` blocks."""

    def _setup(self) -> None:
        """The pool's blocks, the scheduler, the paged cache and the runner."""
        cfg, model = self.config, self.model
        capacity = cfg.kv_capacity_tokens or max(
            self.max_model_len, min(cfg.max_batch_size * self.max_model_len, DEFAULT_POOL_TOKENS)
        )
        self.allocator = BlockAllocator(max(1, capacity // cfg.block_size), cfg.block_size,
                                        prefix_caching=cfg.prefix_caching)
        self.scheduler = Scheduler(
            self.allocator, max_num_seqs=cfg.max_batch_size, max_num_tokens=cfg.max_num_tokens
        )
        use_paged_attention(model)
        cache = PagedKVCache(
            self.allocator.num_blocks, cfg.block_size, dtype=model.dtype, device=model.device
        )
        self.runner = ModelRunner(self, cache)
        self._sequences: dict[int, SchedSequence] = {}
        self.kv_events: KvEventPublisher | None = None
        self._unsettled: list[SchedSequence] = []
        """Requests whose last token is taken, its text not yet (``_settle``)."""
        self._parked: list[tuple[SchedSequence, Any, float]] = []
        """Remote-decode prefills waiting for room to hold their KV: (request, its sampled
        choice, until when it may wait); see ``_remote_decode``."""
        self._step_lock = threading.Lock()
        self._warmed = False
        spec = cfg.speculative
        self.drafter = Drafter(spec) if spec is not None and spec.method == "ngram" else None
        """Proposes decoding requests' n-gram draft tokens (``engine.speculative``), or
        ``None``."""
        self.mtp: MtpDrafts | None = None
        """The MTP layer drafting for ``method: mtp`` (``attach_draft_layer``), or ``None``."""

    def _kv_cache_shape(self) -> KvCacheShape:
        """The block pool's shape (``EngineBase.snapshot``)."""
        return KvCacheShape(self.allocator.block_size, self.allocator.num_blocks)

    def attach_draft_layer(self, layer: DraftLayer) -> None:
        """The MTP layer that drafts for ``engine.speculative.method: mtp`` (``dwdp.worker
        .engine.mtp_drafts``), on the model's device; call before ``start``."""
        spec = self.config.speculative
        if spec is None or spec.method != "mtp":
            raise EngineError("attach_draft_layer: engine.speculative.method is not mtp")
        layers = int(self.model.config.get_text_config().num_hidden_layers)
        rows = hidden_rows(self.config.max_num_tokens, self.config.max_batch_size,
                           spec.num_speculative_tokens)
        self.mtp = MtpDrafts(layer, self.model, self.runner.cache, layer_index=layers,
                             cache_kwarg=self._cache_kwarg,
                             num_speculative_tokens=spec.num_speculative_tokens, max_tokens=rows)

    def capture_cuda_graphs(self) -> GraphStats:
        """Capture the piecewise graphs (``dwdp.worker.engine.piecewise``) and the decode
        graphs (``dwdp.worker.engine.graphs``), in one memory pool, after the KV pool exists
        (call after ``attach_kv_transfer``, before ``start``); returns what was captured.
        Raises ``CudaGraphError`` (one line, the reason) when the model is not on CUDA or
        the capture fails."""
        import torch

        cache, cfg = self.runner.cache, self.config
        if not str(cache.device).startswith("cuda") or not cache.kernel:
            raise CudaGraphError(
                f"engine.cudaGraphs: the model is on {cache.device}; CUDA graphs need a CUDA "
                "device"
            )
        self._warm_up()  # the pool's tensors first: they are not graph memory
        device = self.model.device
        torch.cuda.synchronize(device)  # the capture empties the allocator's cache: so first
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        spec = cfg.speculative
        pieces = PiecewiseGraphs.capture(
            cache, self.runner.forward, pool=pool,
            max_rows=cfg.max_batch_size * (1 + (spec.num_speculative_tokens if spec else 0)),
            max_num_tokens=min(cfg.max_num_tokens, self.max_model_len),
        )
        runner = self.runner
        graphs = DecodeGraphs.capture(
            cache, runner.forward, pool=pool, max_batch_size=cfg.max_batch_size,
            max_model_len=self.max_model_len,
        )
        if spec is not None:  # verify steps: a slab of 1 + numSpeculativeTokens a request
            runner.verify = DecodeGraphs.capture(
                cache, runner.forward, pool=pool, max_batch_size=cfg.max_batch_size,
                max_model_len=self.max_model_len, q=1 + spec.num_speculative_tokens,
                what="the verify step")
        if self.mtp is not None:
            self.mtp.capture(graphs, runner.verify, pool=pool)
        runner.graphs, runner.pieces = graphs, pieces
        return GraphStats(graphs.buckets, int(torch.cuda.memory_reserved(device)) - before,
                          token_buckets=pieces.buckets)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """``EngineBase.validate``, and the request must fit the KV cache pool alone: prompt
        plus ``max_tokens`` (at most ``max_model_len``) within the pool's tokens. A prompt
        that alone overflows the pool is refused naming the prompt only (a router's prefill
        carries its own ``max_tokens`` 1, not the client's)."""
        super().validate(prompt_token_ids, params)
        pool = (f"the KV cache pool's {self.allocator.capacity_tokens} tokens "
                f"({self.allocator.num_blocks} blocks of {self.allocator.block_size})")
        if self.allocator.blocks_for(len(prompt_token_ids)) > self.allocator.num_blocks:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens, more than {pool}; shorten the prompt"
            )
        need = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if self.allocator.blocks_for(need) > self.allocator.num_blocks:
            raise RequestError(
                f"prompt + max_tokens: {need} tokens, more than {pool}; lower max_tokens or "
                "shorten the prompt"
            )

    # -- disaggregation -------------------------------------------------------------------------
    def attach_kv_transfer(self, make: Callable[[PagedKVCache], KvConnector]) -> KvConnector:
        """Warm up (``_warm_up``: it allocates every layer's cache), then build the server's
        KV connector over the cache with ``make``; call before ``start``. Returns it."""
        self._warm_up()
        self.kv = make(self.runner.cache)
        return self.kv

    def attach_kv_events(self, publisher: KvEventPublisher) -> None:
        """Publish the prefix cache's events through ``publisher`` (``dwdp.worker.engine
        .kv_events``), starting with ``AllBlocksCleared``; call before ``start``. The owner
        closes the publisher after ``stop``."""
        self.kv_events = publisher
        self.allocator.events = []
        publisher.publish([])

    def start(self) -> ContinuousEngine:
        """``EngineBase.start``; on the paged kernel's path the engine warms up first
        (``_warm_up``), and with ``config.cuda_graphs`` the graphs are captured (``capture_cuda_
        graphs``, unless done already: its ``CudaGraphError`` is raised here, before the engine
        serves)."""
        spec = self.config.speculative
        if spec is not None and spec.method == "mtp" and self.mtp is None:
            raise EngineError("engine.speculative.method mtp: no MTP layer attached "
                              "(attach_draft_layer)")
        if self._thread is None:
            if self.runner.cache.kernel:
                self._warm_up()
            if self.config.cuda_graphs and self.runner.graphs is None:
                self.capture_cuda_graphs()
        super().start()
        return self

    def _warm_up(self) -> None:
        """Once, not counted in ``stats``: one step of one token (it allocates every layer's
        cache tensors), then ``ModelRunner.warm_up_kernels``."""
        if self._warmed:
            return
        # two tokens with an MTP layer: its pass after the first step allocates its layer
        self.run_batch([[0]], SamplingParams(max_tokens=1 if self.mtp is None else 2,
                                             ignore_eos=True))
        began = time.perf_counter()
        forwards = self.runner.warm_up_kernels(self.max_model_len, self.config.max_num_tokens)
        if forwards:
            log.info("engine: paged attention warmed up (%d forwards, one per kernel variant) "
                     "in %.1f s", forwards, time.perf_counter() - began)
        self.stats = type(self.stats)()
        self._warmed = True

    def validate_kv_transfer(
        self, prompt_token_ids: Sequence[int], kv_transfer: KvTransferParams | None
    ) -> None:
        """``EngineBase.validate_kv_transfer``, and remote blocks must fill the prompt in this
        engine's block size; a vLLM prefill answer's (in vLLM's block size, which its
        connector checks) must have prefilled every prompt token but the last
        (``remote_num_tokens``). ``RequestError`` naming the field."""
        super().validate_kv_transfer(prompt_token_ids, kv_transfer)
        if kv_transfer is not None and kv_transfer.do_remote_prefill and kv_transfer.from_vllm:
            done = kv_transfer.remote_num_tokens
            if done is not None and done < len(prompt_token_ids) - 1:
                raise RequestError(
                    f"kv_transfer_params.remote_num_tokens: {done} prefilled, the prompt of "
                    f"{len(prompt_token_ids)} tokens needs {len(prompt_token_ids) - 1}"
                )
        elif kv_transfer is not None and kv_transfer.do_remote_prefill:
            want = self.allocator.blocks_for(len(prompt_token_ids))
            got = len(kv_transfer.block_ids)
            if got != want:
                raise RequestError(
                    f"kv_transfer_params.remote_block_ids: {got} blocks, the prompt of "
                    f"{len(prompt_token_ids)} tokens fills {want} of {self.allocator.block_size}"
                )

    def _pull(self, seq: SchedSequence, kv: KvConnector) -> bool:
        """Read the remote prompt KV of a joining request; False (request failed) on error."""
        params, seq.pull = seq.pull, None
        if params is None:
            return True
        try:
            kv.load(params, seq.blocks[: self.allocator.blocks_for(len(seq.state.prompt))])
        except Exception as exc:
            log.warning("request %s: %s", seq.state.request_id, exc)
            seq.error = exc
            self._fail(seq, exc)
            return False
        seq.remote_prompt = True
        self.stats.remote_prefill_tokens += len(seq.state.prompt)
        return True

    def _copy_shared(self, seq: SchedSequence) -> bool:
        """A sequence joining on another's pulled prompt KV (``Scheduler._share``): copy the
        partly filled block it goes on writing; False (request failed) when that read failed."""
        if seq.copy is None:
            return True
        (first, block, slots), seq.copy = seq.copy, None
        if first.error is not None:
            self._fail(seq, first.error)
            return False
        own = seq.blocks[(len(seq.state.prompt) - 1) // self.allocator.block_size]
        self.runner.cache.copy_slots(block, own, slots)
        return True

    def _joins(self, seq: SchedSequence, kv: KvConnector | None) -> bool:
        """Whether a scheduled sequence runs this step: its remote prompt KV read, or its
        shared prompt's block copied (in plan order: a pull comes before its sharers)."""
        if seq.pull is not None:
            return kv is not None and self._pull(seq, kv)
        return self._copy_shared(seq)

    def _fail(self, seq: SchedSequence, exc: BaseException) -> None:
        state = seq.state
        state.finished, state.finish_reason = True, "error"
        if state.emit is not None:
            state.emit(exc)
        with self._lock:
            if self._active.get(state.request_id) is state:
                del self._active[state.request_id]
        self.scheduler.remove(seq)
        self._sequences.pop(id(state), None)

    def _remote_decode(self, seq: SchedSequence, kv: KvConnector, choice: Any,
                       deadline: float | None = None) -> None:
        """A remote-decode prefill sampled ``choice``: hold its KV for the decode side (the
        answer's ``kv_transfer_params``), then give it the token (``_take``). No room to hold
        it yet (``KvHoldFull``): a request this token ends waits out of the schedule, its
        blocks and token kept, until ``deadline`` (now plus the error's ``retry_s`` the first
        time), asked again by ``_unpark``; past it, or on another error, it fails. A request
        that goes on (``max_tokens`` > 1) needs no hold and takes its token."""
        state = seq.state
        try:
            state.kv_transfer_out = kv.request_finished(state.request_id, seq.blocks,
                                                        len(state.prompt))
        except KvHoldFull as full:
            if deadline is None and len(state.tokens) + 1 < state.params.max_tokens:
                self._take(seq, choice)
                return
            if deadline is None:
                self.scheduler.detach(seq)
                deadline = time.monotonic() + full.retry_s
            if time.monotonic() < deadline:
                self._parked.append((seq, choice, deadline))
                return
            self._fail(seq, full)
            return
        except Exception as exc:
            log.warning("request %s: %s", state.request_id, exc)
            self._fail(seq, exc)
            return
        self._take(seq, choice)

    def _unpark(self, kv: KvConnector) -> None:
        """Ask again to hold the KV of the prefills waiting for room (``_remote_decode``),
        oldest first; an aborted one ends and frees its blocks."""
        parked, self._parked = self._parked, []
        for seq, choice, deadline in parked:
            if seq.state.aborted:
                self._end(seq, "abort")
            else:
                self._remote_decode(seq, kv, choice, deadline)

    def _lease_or_end(self, seq: SchedSequence) -> None:
        """A finished request: a remote-decode prefill keeps its blocks under a lease."""
        if seq.state.kv_transfer_out is None:
            self._end(seq, None)
            return
        self.scheduler.detach(seq)  # its blocks now belong to the lease (made in _step)
        self._sequences.pop(id(seq.state), None)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            idle = not self.scheduler.has_work
            self._take_new(wait=idle, timeout=self._idle_poll_s())
            if self._stopping.is_set():
                break
            if self.kv is not None:
                self.allocator.free_many(self.kv.finished_blocks())
                self._unpark(self.kv)
            self._step()
        self._abort_all()

    def _run_states(self, states: list[RequestState]) -> None:
        """With the engine thread running, queue them and wait; otherwise drive steps here."""
        if self.running:
            done = threading.Event()
            left = [len(states)]

            def emit(out: Any) -> None:
                if isinstance(out, BaseException) or out.finished:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            for state in states:
                state.emit = emit
                state.request_id = f"{state.request_id}-{id(state)}"
                self._submit(state)
            done.wait()
            if self._dead is not None:
                raise EngineError(f"engine forward failed: {self._dead!r}")
            return
        with self._step_lock:
            for state in states:
                self._add(state)
            while any(not s.finished for s in states):
                self._step()

    def _idle_poll_s(self) -> float | None:
        """How long an idle loop waits for a request: briefly while KV leases are held (the
        agent must progress for the generation side's READ and its release), a lease tick
        otherwise with a KV transfer, forever without one."""
        if self.kv is None:
            return None
        return KV_POLL_S if self.kv.leases else LEASE_TICK_S

    def _take_new(self, *, wait: bool, timeout: float | None = None) -> None:
        """Move queued requests into the scheduler (blocking for the first when idle, at most
        ``timeout`` seconds)."""
        import queue

        while True:
            try:
                state = self._queue.get(timeout=timeout) if wait else self._queue.get_nowait()
            except queue.Empty:
                return
            wait = False
            if state is not None:
                self._add(state)

    def _add(self, state: RequestState) -> None:
        seq = SchedSequence(state)
        kv = state.kv_transfer
        if kv is not None and kv.do_remote_prefill:  # claimed in _prepare; read as it joins
            shared = state.shared
            if shared is not None and shared.first is not None:
                seq.fork = shared.first  # a sibling reads it: share (scheduler docstring)
            else:
                seq.pull = kv
                if shared is not None:
                    shared.first = seq
        self._sequences[id(state)] = seq
        self.scheduler.add(seq)

    def _step(self) -> None:
        """Schedule and launch one forward, settle the previous step's tokens while the GPU
        runs it, then take this step's tokens. A step that will not replay CUDA graphs (any
        step without graphs; one with a prompt chunk without the piecewise graphs) settles
        first: its launch takes the host milliseconds (every layer eagerly), and the tokens
        the last step took would wait for it before reaching their streams."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.state.aborted:
                self._end(seq, "abort")
        if not self._replays_next():
            self._settle()
        kv = self.kv
        self._propose()
        plan = [p for p in self.scheduler.schedule() if self._joins(p.seq, kv)]
        if not plan:
            self._settle()
            self._count_kv()  # aborts and releases may have emptied the engine
            self._publish_kv_events()
            return
        self.stats.waves += 1
        self.stats.preemptions = self.scheduler.preemptions
        self._count_kv()
        logits = self.runner.execute([p.chunk for p in plan])  # queued; the host goes on
        early = self._early_mtp(plan)  # queued behind it: the MTP layer's pass
        sampled = [p for p in plan if p.chunk.sample]
        for p in plan:
            seq, n = p.seq, len(p.chunk.token_ids) - p.chunk.draft  # drafts: once verified
            self.stats.prompt_tokens += max(
                0, min(seq.computed + n, len(seq.state.prompt)) - seq.computed
            )
            self.scheduler.commit(seq, n)
        # after the commits: a stop string found here ends a request of this step and frees
        # its blocks, which the commit (prefix caching: full blocks registered) still needed
        self._settle()
        states = [p.seq.state for p in sampled]
        # greedy requests: every row's token in one copy (drafts' rows, and with the MTP pass
        # queued behind the step, the next drafts too)
        if early is not None:
            greedy: list[int] | None = early.tokens([p.chunk for p in sampled])
        elif any(p.chunk.draft for p in sampled):
            greedy = greedy_tokens(logits, states)
        else:
            greedy = None
        if greedy is None:
            choices = choose(_first_rows(sampled, logits), states)
        else:
            choices = [Choice(greedy[r]) for r in _starts(sampled)]
        accepted: dict[int, int] = {}
        held: list[tuple[SchedSequence, Any]] = []
        row = 0
        for p, choice in zip(sampled, choices, strict=True):
            seq, state = p.seq, p.seq.state
            first, row = row, row + p.chunk.rows
            if state.finished:
                continue  # a stop string ended it while this step ran: its token is dropped
            if kv is not None and _decodes_remotely(seq):
                held.append((seq, choice))  # after the MTP pass, whose KV the hold carries
                continue
            self._take(seq, choice)
            if p.chunk.draft:
                accepted[id(seq)] = self._verify(seq, p.chunk, choice.token, logits, first,
                                                 greedy)
        if early is not None:
            assert self.mtp is not None
            self.mtp.finish(early, plan, accepted, self.scheduler, self._room)
        elif self.mtp is not None:
            self.mtp.after(plan, accepted, self.scheduler, self._room,
                           {id(seq): choice.token for seq, choice in held},
                           self.runner.replayed)
            if held:  # a generation server reads a hold's blocks once it is answered: the MTP
                self.runner.synchronize()  # pass's writes first (the model's were: logits read)
        for seq, choice in held:
            assert kv is not None
            self._remote_decode(seq, kv, choice)
        self._count_kv()
        self._publish_kv_events()

    # -- speculative decoding ----------------------------------------------------------------
    def _early_mtp(self, plan: list[Scheduled]) -> EarlyPass | None:
        """The MTP layer's pass queued right behind the step (``MtpDrafts.launch``) when the
        step replayed decode or verify graphs for plain greedy requests only, none of them
        held for a generation server; ``None`` otherwise (``MtpDrafts.after`` runs once the
        host has the step's tokens)."""
        replayed = self.runner.replayed
        if self.mtp is None or replayed is None or not plain_greedy(
                [p.seq.state for p in plan]):
            return None
        if self.kv is not None and any(_decodes_remotely(p.seq) for p in plan):
            return None
        return self.mtp.launch([p.chunk for p in plan], replayed)

    def _propose(self) -> None:
        """Before a step is scheduled: each running request with one pending token (it
        decodes) proposes its draft tokens (``Drafter``), as many as its ``max_tokens`` and
        the model's context leave room for after the token the step adds anyway."""
        if self.config.speculative is None:
            return
        drafter = self.drafter
        for seq in self.scheduler.running:
            # a prefill for a generation server that waits for room to hold its KV decodes
            # on without drafts (its steps' tokens go out as they come: ``_step``'s holds)
            room = self._room(seq) if seq.pending == 1 and not _decodes_remotely(seq) else 0
            if room <= 0:
                seq.draft = []
            elif drafter is not None:
                seq.draft = drafter.propose(seq.token_ids(), room)
            else:  # the MTP layer's, from the step before
                seq.draft = seq.draft[:room]

    def _room(self, seq: SchedSequence) -> int:
        """How many drafts a decoding request can use after its pending token: what its
        ``max_tokens`` and the model's context leave, at most the drafts of a step of this
        many running requests (``SpeculativeConfig.drafts_at``)."""
        state, spec = seq.state, self.config.speculative
        assert spec is not None
        return min(state.params.max_tokens - len(state.tokens) - 1,
                   self.max_model_len - state.length - 1,
                   spec.drafts_at(len(self.scheduler.running)))

    def _verify(self, seq: SchedSequence, chunk: Chunk, token: int, logits: Any,
                first: int, greedy: list[int] | None) -> int:
        """After a draft chunk's first token (``token``, from logits row ``first``) was taken:
        take the token of each next row while the one before it equals the draft there
        (module ``dwdp.worker.engine.speculative``), then keep the accepted drafts' KV and give
        back the rejected tail's blocks (``Scheduler.accept``); returns the drafts accepted.
        ``greedy``: every row's token when the step's requests are all plain greedy
        (``greedy_tokens``), else ``None`` (the rows are chosen here)."""
        state, draft = seq.state, chunk.token_ids[len(chunk.token_ids) - chunk.draft :]
        accepted = 0
        if token == draft[0] and not state.finished:
            at = slice(first + 1, first + 1 + len(draft))
            chosen = (map(Choice, greedy[at]) if greedy is not None
                      else choose_each(logits[at], state))
            for choice in chosen:
                accepted += 1
                self._take(seq, choice)
                token = choice.token
                if accepted == len(draft) or token != draft[accepted] or state.finished:
                    break
        self.stats.observe_draft(len(draft), accepted)
        if not state.finished:
            self.scheduler.accept(seq, accepted)
        seq.draft = []
        return accepted

    def _take(self, seq: SchedSequence, choice: Any) -> None:
        """Give a request the token it sampled (``choice``): it finishes (a remote-decode
        prefill keeps its blocks under the lease ``_remote_decode`` made) or goes on."""
        state, kv = seq.state, self.kv
        self.stats.generation_tokens += 1
        reason = state.take(choice.token, eos_token_ids=self.eos_token_ids,
                            max_model_len=self.max_model_len, logprob=choice.logprob)
        if reason is not None:
            # the tokens taken before this one (a verify step takes several) get their text;
            # a stop string among them ends the request there
            if state.settle(self._tokenizer):
                reason = "stop"
            self._finish(state, reason)
            self._lease_or_end(seq)
            return
        if kv is not None and state.kv_transfer_out is not None:
            kv.cancel_hold(state.request_id)  # it goes on (max_tokens > 1): no lease
            state.kv_transfer_out = None
        if not self._unsettled or self._unsettled[-1] is not seq:  # a draft's: once
            self._unsettled.append(seq)

    def _replays_next(self) -> bool:
        """Whether the next step is likely a graph replay (decided before it is scheduled:
        ``DecodeGraphs.fits`` and ``PiecewiseGraphs.fits`` decide on the step itself): the
        piecewise graphs captured (they take any step up to their largest bucket), or the
        decode graphs with no request waiting to join and none of the running ones still in
        its prompt."""
        sched, runner = self.scheduler, self.runner
        return runner.pieces is not None or (
            runner.graphs is not None and not sched.waiting
            and all(seq.pending <= 1 for seq in sched.running))

    def _settle(self) -> None:
        """Detokenise and stream the tokens the last step took (``RequestState.settle``); a
        stop string found here ends its request (the step just launched wasted one token)."""
        pending, self._unsettled = self._unsettled, []
        for seq in pending:
            if seq.state.finished:
                continue
            if seq.state.settle(self._tokenizer):
                self._finish(seq.state, "stop")
                self._lease_or_end(seq)
            else:
                self._send(seq.state)

    def _end(self, seq: SchedSequence, reason: str | None) -> None:
        """Take a finished (``reason`` None: ``_deliver`` finished it) or aborted request out."""
        if reason is not None:
            self._finish(seq.state, reason)
        self.scheduler.remove(seq)
        self._sequences.pop(id(seq.state), None)

    def _publish_kv_events(self) -> None:
        """With KV events attached: one batch of what the step cached and evicted."""
        if self.kv_events is not None:
            events = self.allocator.take_events()
            if events:
                self.kv_events.publish(events)

    def _count_kv(self) -> None:
        """The gauges: KV tokens held, requests running and waiting, leases."""
        if self.kv is not None:
            self.stats.kv_leases = self.kv.leases
        self.stats.kv_tokens_in_use = self.allocator.num_in_use * self.allocator.block_size
        self.stats.kv_blocks_cached = self.allocator.num_cached
        self.stats.prefix_cache_queries = self.scheduler.prefix_queries
        self.stats.prefix_cache_hits = self.scheduler.prefix_hits
        self.stats.requests_running = len(self.scheduler.running)
        self.stats.requests_waiting = len(self.scheduler.waiting) + self._queue.qsize()

    def _abort_all(self) -> None:
        for seq in list(self._sequences.values()):
            self._end(seq, "abort")
        self._count_kv()

    def _live_states(self) -> list[RequestState]:
        return [seq.state for seq in self._sequences.values()]


def _decodes_remotely(seq: SchedSequence) -> bool:
    """Whether ``seq`` is a prefill whose KV a generation server decodes from
    (``kv_transfer_params.do_remote_decode``)."""
    params = seq.state.kv_transfer
    return params is not None and params.do_remote_decode


def _starts(sampled: list[Scheduled]) -> list[int]:
    """Each sampling chunk's first logits row."""
    starts, row = [], 0
    for p in sampled:
        starts.append(row)
        row += p.chunk.rows
    return starts


def _first_rows(sampled: list[Scheduled], logits: Any) -> Any:
    """Each sampling chunk's first logits row: ``logits`` itself unless a draft chunk keeps
    more than one."""
    if all(p.chunk.rows == 1 for p in sampled):
        return logits
    import torch

    return logits[torch.tensor(_starts(sampled), device=logits.device)]
