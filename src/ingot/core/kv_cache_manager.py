"""Block KV cache bookkeeping: a pool of fixed-size blocks and each request's block list.

Block 0 is the null block: never handed out, it is where padded block-table columns point, so a
padded read always lands on valid memory and a padded write never happens (slot -1).
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks


class KVCacheManager:
    """Allocates blocks to requests as their token count grows (actual tokens only: padding
    never allocates). Admission control lives in the scheduler."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def admit(self, request_id: str) -> None:
        self.req_blocks[request_id] = []

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Grow the request's blocks to hold ``num_total_tokens``; returns its block ids."""
        blocks = self.req_blocks[request_id]
        need = self.blocks_for(num_total_tokens) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return blocks

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)

    def usage(self) -> float:
        return self.pool.usage()
