"""The block allocator of the paged KV cache: fixed-size blocks, handed out, shared and taken
back, and the prefix cache over them.

The pool (``dwdp.worker.engine.kv_pool``) gives the budget in tokens; the allocator cuts it
into ``num_blocks`` blocks of ``block_size`` tokens (vLLM's ``--block-size``, default 16). A
request holds a block table: the ids of the blocks its KV cache fills, in token order; token
``t`` of the request lives in slot ``table[t // block_size] * block_size + t % block_size`` of
every layer's cache (``dwdp.worker.engine.paged``).

Prefix caching (vLLM's automatic prefix caching): a block whose ``block_size`` tokens are all
computed is keyed by a chain hash (``block_hashes``: its parent block's hash and its token ids;
the first block's parent is the request's ``cache_salt``, so salted prompts never meet unsalted
or differently salted ones). Blocks are reference-counted: a request that joins takes the
longest run of cached blocks its tokens hash to (``cached_prefix``, ``acquire``) and computes
only the rest. A block whose last holder lets go stays cached while free; the allocator hands
out never-cached blocks first, then evicts cached ones least recently freed first (a request's
blocks are freed tail first, so a prefix's head outlives its tail). A cached block is only read
by the requests that share it: a request writes only the blocks after its cached run, which it
allocated itself.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from dwdp.api.defaults import KV_BLOCK_SIZE
from dwdp.worker.engine.kv_events import BlockRemoved, BlockStored

BlockHash = bytes
"""A block's chain hash: SHA-256 (32 bytes) of its parent's hash and its token ids."""


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a request's first block: of its ``cache_salt`` (empty without)."""
    return hashlib.sha256(b"dwdp-prefix\0" + (cache_salt or "").encode()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: BlockHash,
                 *, start: int = 0, count: int | None = None) -> list[BlockHash]:
    """The chain hashes of the full blocks ``start, start + 1, ...`` of ``token_ids``
    (``count`` of them, default every full block from ``start``); ``parent`` is block
    ``start - 1``'s hash (``root_hash`` for block 0)."""
    full = len(token_ids) // block_size
    end = full if count is None else min(full, start + count)
    out: list[BlockHash] = []
    for b in range(start, end):
        ids = array("q", token_ids[b * block_size : (b + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + ids).digest()
        out.append(parent)
    return out


class NoFreeBlocks(RuntimeError):
    """More blocks were asked for than are free (the scheduler checks ``can_allocate`` first)."""


class BlockAllocator:
    """Reference-counted blocks: ``num_blocks`` blocks of ``block_size`` tokens, and with
    ``prefix_caching`` the cache of full blocks by hash (module docstring).

    Raises ``ValueError`` for a non-positive size or count.
    """

    def __init__(self, num_blocks: int, block_size: int = KV_BLOCK_SIZE, *,
                 prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._by_hash: dict[BlockHash, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request holds, least recently freed first."""
        self.events: list[BlockStored | BlockRemoved] | None = None
        """With KV events on (a list): what the cache stored and evicted since it was taken
        (``take_events``)."""

    @property
    def num_free(self) -> int:
        """Blocks not held by any request (cached ones included: they are evicted on need)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks held by requests (0 at rest: a leak shows here)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache holds (in use or free)."""
        return len(self._by_hash)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds: ``num_blocks x block_size``."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        """True when ``n`` blocks are free."""
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids, each held once; never-cached blocks first, then cached ones
        evicted least recently freed first. Raises ``NoFreeBlocks`` when fewer are free."""
        if n > self.num_free:
            raise NoFreeBlocks(f"{n} KV blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                evicted = self._hash_of.pop(block)
                del self._by_hash[evicted]
                if self.events is not None:
                    self.events.append(BlockRemoved((evicted,)))
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Let go of ``blocks`` (the caller forgets them): each loses one holder; one no
        request holds becomes free (cached ones stay cached until evicted)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free_many(self, tables: list[list[int]]) -> None:
        """Let go of every block table of ``tables``."""
        for blocks in tables:
            self.free(blocks)

    # -- the prefix cache -----------------------------------------------------------------------
    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest run ``hashes[:k]`` that is cached (not yet held: see
        ``acquire``); empty without prefix caching."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are free now (acquiring them takes them from the free)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Hold cached ``blocks`` once more (a request that shares them)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, block_hash: BlockHash, *, parent: BlockHash | None = None,
                 token_ids: Sequence[int] = ()) -> None:
        """Cache held ``block`` under ``block_hash`` (its tokens, ``token_ids``, are all
        computed; ``parent``: the previous block's hash, for the events). A hash already
        cached keeps its block (two requests computed the same prefix at once)."""
        if self.prefix_caching and block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
            if self.events is not None:
                self.events.append(BlockStored((block_hash,), parent, tuple(token_ids)))

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The events since the last call (empty without KV events)."""
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events
