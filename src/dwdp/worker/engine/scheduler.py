"""The continuous-batching scheduler: which requests run in the next step, and how many tokens.

Every step (vLLM's policy, first come first served):

1. each running request, oldest first, gets its pending tokens: one for a decoding request,
   the rest of its prompt (chunked to what is left of ``max_num_tokens``) for one still in
   prefill. A request that needs a new KV block when none is free preempts the newest running
   request (its blocks are freed, it goes back to the front of the queue and later recomputes
   its prompt and the tokens it already produced); if it is itself the newest, it waits;
2. then waiting requests join, oldest first, while the step has tokens left, fewer than
   ``max_num_seqs`` requests run and the blocks of their first chunk are free (beyond a
   watermark of 1% of the pool, so a join does not force a preemption at once).

A request whose prompt's KV comes from a context server (``Sequence.pull``) joins with every
prompt token but the last counted as computed: its first step recomputes that token, which gives
the logits of its first output token (vLLM's NIXL connector does the same).

The sequences of one parallel-sampling request (``n`` > 1) over a remote prefill read that KV
once (``Sequence.fork``): the first pulls it; each other one, when it joins while the first still
holds the pulled prompt, shares the first's full blocks before the prompt's last token (never
written again) and takes its own copy of the partly filled block (``Sequence.copy``, done by the
engine after the pull), then goes on like the first. Joining later (the first finished, was
preempted or failed its read), it computes its prompt itself.

With prefix caching (``BlockAllocator.prefix_caching``), a joining request first takes the
longest run of cached full blocks its known tokens hash to (never its last token, whose logits
it needs; never for a request that pulls its prompt, whose blocks the transfer writes) and
counts those tokens as computed; ``commit`` caches each block a step fills.

With speculative decoding (``dwdp.worker.engine.speculative``) a decoding request's chunk is
its pending token and the draft tokens the engine proposed (``Sequence.draft``), cut to the
step's budget and dropped when their blocks are not free (a draft never preempts); the step
commits the pending token, and ``accept`` the drafts the target model confirmed, giving back the
blocks of the rejected tail.

A request never holds more than one request of ``max_model_len`` tokens of blocks, and the
engine refuses one that could not fit the pool alone, so the oldest request always progresses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dwdp.worker.engine.blocks import BlockAllocator, BlockHash, block_hashes, root_hash
from dwdp.worker.engine.kv_connector import KvTransferParams
from dwdp.worker.engine.paged import Chunk
from dwdp.worker.engine.requests import RequestState


@dataclass(eq=False, slots=True)
class Sequence:
    """A request in the scheduler: its state, its block table and ``computed``, the tokens whose
    KV is in the cache."""

    state: RequestState
    blocks: list[int] = field(default_factory=list)
    """Its KV blocks in position order. Grown in place; never cut in place (a cut is a new
    list): the decode graphs keep a request's table row while its list is the same object
    (``DecodeGraphs._fill_table``)."""
    computed: int = 0
    pull: KvTransferParams | None = None
    """The remote prompt KV to read before its first step (a remote prefill): the engine's
    business (``KvConnector.load``); the scheduler only treats every prompt token but the last
    as computed when it joins."""
    fork: Sequence | None = None
    """The sequence whose pulled prompt KV this one shares when it joins (module docstring)."""
    remote_prompt: bool = False
    """The prompt's KV in ``blocks`` was read from a context server (until a preemption)."""
    error: BaseException | None = None
    """Why reading its remote prompt KV failed (its sharers fail with it)."""
    copy: tuple[Sequence, int, int] | None = None
    """(sequence shared from, its block, slots): the engine copies those first slots into this
    sequence's own block at the same index before the step that joins it."""
    hashes: list[BlockHash] = field(default_factory=list)
    """Chain hashes of the request's full blocks of known tokens (as far as hashed so far)."""
    registered: int = 0
    """Its first blocks known to the prefix cache (shared at its join, or cached by ``commit``)."""
    looked_up: bool = False
    """Its first join looked its prompt up in the prefix cache (``state.cached_tokens``
    holds what it found; a rejoin after a preemption is not counted again)."""
    draft: list[int] = field(default_factory=list)
    """Draft tokens to verify after its pending token in the next step (speculative decoding:
    the engine proposes them before ``schedule``; dropped where the step has no room)."""

    @property
    def pending(self) -> int:
        """Known tokens (prompt and generated) not yet in the cache."""
        return self.state.length - self.computed

    def token_ids(self) -> list[int]:
        """Prompt and generated tokens."""
        return self.state.prompt + self.state.tokens

    def extend_hashes(self, upto_tokens: int, block_size: int) -> None:
        """Hash the full blocks of the first ``upto_tokens`` known tokens not hashed yet."""
        want = min(upto_tokens, self.state.length) // block_size - len(self.hashes)
        if want > 0:
            parent = self.hashes[-1] if self.hashes else root_hash(self.state.params.cache_salt)
            self.hashes += block_hashes(self.token_ids(), block_size, parent,
                                        start=len(self.hashes), count=want)

    def chunk(self, n: int, draft: list[int] | None = None) -> Chunk:
        """The next ``n`` pending tokens as a step chunk, followed by ``draft`` tokens (the
        last pending token's chunk only)."""
        prompt, tokens = self.state.prompt, self.state.tokens
        start, end, cut = self.computed, self.computed + n, len(prompt)
        if start >= cut:  # decoding: no copy of the whole context per step
            ids = tokens[start - cut : end - cut]
        else:
            ids = prompt[start:end] + tokens[: max(0, end - cut)]
        if draft:
            return Chunk(ids + draft, start, self.blocks, True, len(draft))
        return Chunk(ids, start, self.blocks, end == cut + len(tokens))


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request's share of a step: ``n`` tokens as ``chunk``."""

    seq: Sequence
    chunk: Chunk


class Scheduler:
    """Waiting queue and running set over one ``BlockAllocator``."""

    def __init__(self, allocator: BlockAllocator, *, max_num_seqs: int, max_num_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.watermark = allocator.num_blocks // 100
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
        self.prefix_hits = 0
        """Of those, tokens found cached (vLLM's ``prefix_cache_hits``)."""

    @property
    def has_work(self) -> bool:
        """True while a request waits or runs."""
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (it joins at a later step)."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a running request out of the schedule, its blocks still held (a lease, or a
        prefill waiting for room to hold its KV); a no-op for one already out."""
        if seq in self.running:
            self.running.remove(seq)

    def schedule(self) -> list[Scheduled]:
        """The next step's chunks (empty when nothing can run); see the module docstring."""
        budget = self.max_num_tokens
        plan: list[Scheduled] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted by an older request in this step
            n = min(seq.pending, budget)
            draft = self._room_for_draft(seq, n, budget)
            if n and self._grow(seq, seq.computed + n + len(draft)):
                plan.append(Scheduled(seq, seq.chunk(n, draft)))
                budget -= n + len(draft)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            shared = self._shareable(seq)
            if seq.pull is not None or shared is not None:
                # its prompt's KV arrives (or is shared); only the last token runs
                seq.computed = max(0, len(seq.state.prompt) - 1)
            hits = shared if shared is not None else self._cached_prefix(seq)
            start = max(seq.computed, len(hits) * self.allocator.block_size)
            n = min(seq.state.length - start, budget)
            new = self.allocator.blocks_for(start + n) - len(hits)
            need = new + self.allocator.evictable(hits)  # shared free blocks stop being free
            if not self.allocator.can_allocate(need + (self.watermark if self.running else 0)):
                if shared is not None:
                    seq.computed = 0  # decided again when it can join
                break
            if shared is not None:
                self._share(seq, shared)
            else:
                self._take_prefix(seq, hits)
            seq.fork = None
            seq.blocks.extend(self.allocator.allocate(new))
            self.running.append(self.waiting.popleft())
            plan.append(Scheduled(seq, seq.chunk(n)))
            budget -= n
        return plan

    def commit(self, seq: Sequence, n: int) -> None:
        """A step computed ``seq``'s next ``n`` tokens: count them and cache the blocks they
        filled (with prefix caching)."""
        seq.computed += n
        if not self.allocator.prefix_caching:
            return
        size = self.allocator.block_size
        full = seq.computed // size
        if full <= seq.registered:
            return
        seq.extend_hashes(seq.computed, size)
        ids = seq.token_ids() if self.allocator.events is not None else None
        for b in range(seq.registered, full):
            self.allocator.register(
                seq.blocks[b], seq.hashes[b], parent=seq.hashes[b - 1] if b else None,
                token_ids=ids[b * size : (b + 1) * size] if ids is not None else ())
        seq.registered = full

    def accept(self, seq: Sequence, accepted: int) -> None:
        """A step verified ``seq``'s draft and kept its first ``accepted`` tokens (their KV is
        in the cache): count and cache them as ``commit`` does, and give back the blocks of
        the rejected tail beyond what its pending token needs."""
        self.commit(seq, accepted)
        keep = self.allocator.blocks_for(seq.computed + 1)
        if len(seq.blocks) > keep:
            self.allocator.free(seq.blocks[keep:])
            # a new list, not one cut in place: the decode graphs rewrite a request's table
            # row only past what they wrote for the same list (DecodeGraphs._fill_table), and
            # the blocks that later take these places may be other blocks
            seq.blocks = seq.blocks[:keep]

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` the blocks for ``tokens`` tokens if they are free (never preempting);
        False when they are not."""
        need = self.allocator.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        seq.blocks.extend(self.allocator.allocate(need))
        return True

    def _room_for_draft(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The part of ``seq.draft`` this step runs after its ``n`` tokens: none unless ``n``
        is its last pending token, at most what is left of the budget, and none when its blocks
        are not free (a draft never preempts)."""
        if not seq.draft or n != seq.pending:
            return []
        draft = seq.draft[: max(0, budget - n)]
        need = self.allocator.blocks_for(seq.computed + n + len(draft)) - len(seq.blocks)
        return draft if draft and self.allocator.can_allocate(need) else []

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a joining ``seq`` can share: its known tokens but the last, in
        full blocks (none for a pulled prompt or without prefix caching)."""
        if seq.pull is not None or not self.allocator.prefix_caching or seq.blocks:
            return []
        seq.extend_hashes(seq.state.length - 1, self.allocator.block_size)
        usable = (seq.state.length - 1) // self.allocator.block_size
        return self.allocator.cached_prefix(seq.hashes[:usable])

    def _take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Share ``hits`` (from ``_cached_prefix``) as ``seq``'s first blocks; the first join
        counts the lookup (vLLM's queries and hits, in prompt tokens)."""
        if seq.pull is not None or not self.allocator.prefix_caching:
            return
        self.allocator.acquire(hits)
        seq.blocks, seq.registered = list(hits), len(hits)
        seq.computed = len(hits) * self.allocator.block_size
        if not seq.looked_up:
            seq.looked_up = True
            seq.state.cached_tokens = min(seq.computed, len(seq.state.prompt))
            self.prefix_queries += len(seq.state.prompt)
            self.prefix_hits += seq.state.cached_tokens

    def _shareable(self, seq: Sequence) -> list[int] | None:
        """The full blocks of ``seq.fork``'s pulled prompt before the prompt's last token, when
        ``seq`` can share them now (the first still runs with that KV: its read is due this step
        or done); ``None`` otherwise."""
        first = seq.fork
        if first is None or first not in self.running:
            return None
        if first.pull is None and not first.remote_prompt:
            return None
        return first.blocks[: (len(seq.state.prompt) - 1) // self.allocator.block_size]

    def _share(self, seq: Sequence, shared: list[int]) -> None:
        """Give ``seq`` the shared blocks (held once more) and note the copy of the partly
        filled one."""
        assert seq.fork is not None and not seq.blocks
        self.allocator.acquire(shared)
        seq.blocks, seq.registered = list(shared), len(shared)
        tail = (len(seq.state.prompt) - 1) % self.allocator.block_size
        if tail:
            seq.copy = (seq.fork, seq.fork.blocks[len(shared)], tail)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` the blocks for ``tokens`` tokens, preempting newer requests as needed;
        False when ``seq`` itself had to be preempted."""
        need = self.allocator.blocks_for(tokens) - len(seq.blocks)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.blocks.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        seq.remote_prompt = False
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _free(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []
