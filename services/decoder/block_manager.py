"""Fixed pool of KV blocks: a free list and one block table per request.

Layout (block_size = 4, block table [7, 2]):

    token position:  0 1 2 3 | 4 5 6 7
    block:           7 7 7 7 | 2 2 2 2
    slot:           28 ...31 | 8 ... 11

    slot_mapping[pos] = block_table[pos // block_size] * block_size + pos % block_size

Running out of blocks is an ordinary outcome (`None` / `False`), never an exception.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockManager:
    """Allocates KV blocks to requests by id.

    Blocks come off the front of the free list and are returned to its back, so allocation
    order is deterministic (block ids 0, 1, 2, ... on a fresh pool).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow (or create) the request's table to cover `num_tokens` tokens.

        Returns the newly allocated block ids, or None (allocating nothing) when the pool
        cannot supply them.
        """
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed > len(self._free):
            return None
        new_blocks = [self._free.popleft() for _ in range(needed)]
        self._tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` total tokens of a running request; False if out of blocks."""
        return self.allocate(request_id, num_tokens) is not None

    def free(self, request_id: str) -> list[int]:
        """Return every block of the request to the free list; returns the freed ids."""
        blocks = self._tables.pop(request_id, [])
        self._free.extend(blocks)
        return blocks

    def slot_mapping(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) as int64 [end - start].

        Raises:
            ValueError: the table does not cover `end` tokens.
        """
        table = self._tables.get(request_id, [])
        if self.blocks_for(end) > len(table):
            raise ValueError(f"request {request_id!r} holds {len(table)} blocks; positions up to {end} "
                             f"need {self.blocks_for(end)}")
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size
