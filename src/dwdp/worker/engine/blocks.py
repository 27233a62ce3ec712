"""The block allocator of the paged KV cache: fixed-size blocks, handed out and taken back.

The pool (``dwdp.worker.engine.kv_pool``) gives the budget in tokens; the allocator cuts it
into ``num_blocks`` blocks of ``block_size`` tokens (vLLM's ``--block-size``, default 16). A
request holds a block table: the ids of the blocks its KV cache fills, in token order; token
``t`` of the request lives in slot ``table[t // block_size] * block_size + t % block_size`` of
every layer's cache (``dwdp.worker.engine.paged``).
"""

from __future__ import annotations

from dwdp.api.defaults import KV_BLOCK_SIZE


class NoFreeBlocks(RuntimeError):
    """More blocks were asked for than are free (the scheduler checks ``can_allocate`` first)."""


class BlockAllocator:
    """Free list of ``num_blocks`` blocks of ``block_size`` tokens.

    Raises ``ValueError`` for a non-positive size or count.
    """

    def __init__(self, num_blocks: int, block_size: int = KV_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        """Blocks held by requests (0 at rest: a leak shows here)."""
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds: ``num_blocks x block_size``."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        """True when ``n`` blocks are free."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids; raises ``NoFreeBlocks`` when fewer are free."""
        if n > len(self._free):
            raise NoFreeBlocks(f"{n} KV blocks asked for, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Take ``blocks`` back (the caller forgets them)."""
        self._free.extend(reversed(blocks))

    def free_many(self, tables: list[list[int]]) -> None:
        """Take back every block table of ``tables``."""
        for blocks in tables:
            self.free(blocks)
