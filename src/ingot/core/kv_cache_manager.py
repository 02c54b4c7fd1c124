"""Block KV cache bookkeeping: a pool of fixed-size blocks, each request's block list, and
prefix caching.

Block 0 is the null block: never handed out, it is where padded block-table columns point, so a
padded read always lands on valid memory and a padded write never happens (slot -1).

Prefix caching: a full block is identified by a chained hash (parent block's hash + the block's
token ids + anything else that changes its KV). Blocks are reference counted; a block whose last
user finished stays cached (hash kept) in the free queue and is evicted least-recently-used only
when the pool must hand it out again. Blocks in use are never in the free queue, so they can
never be evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ingot.utils.math_utils import cdiv

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """sha256 over the parent's hash, the block's tokens and extra keys (LoRA, multimodal...):
    a collision would silently serve another prompt's KV, so no 64-bit hash."""
    h = hashlib.sha256(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        # Free blocks in eviction order (least recently freed first); O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a reference; unreferenced blocks join the free queue. Callers pass a request's
        blocks tail first, so a prompt's later blocks are evicted before its shared prefix."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None

    def cache_block(self, block: int, h: BlockHash) -> None:
        if self.block_hash[block] is None and h not in self.cached:
            self.block_hash[block] = h
            self.cached[h] = block

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use (else False)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates blocks to requests as their token count grows (actual tokens only: padding
    never allocates). Admission control lives in the scheduler."""

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool = False
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_salt: dict[str, bytes] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def admit(self, request_id: str, prompt_token_ids: Sequence[int] = (), salt: bytes = b"") -> int:
        """Start a request; returns how many prompt tokens the prefix cache already holds.
        ``salt`` roots the request's hash chain, so it is part of its first block's hash and,
        through the chain, of every later one: a prompt-embeds request's content hash (its
        placeholder token ids must never match another prompt's) and/or the request's
        ``cache_salt`` (only requests with the same salt share blocks)."""
        self.req_blocks[request_id] = []
        self.req_hashes[request_id] = []
        if salt:
            self.req_salt[request_id] = salt
        if not self.enable_prefix_caching or not prompt_token_ids:
            return 0
        bs = self.block_size
        # The model must compute at least the last prompt token, so a hit stops before it.
        max_blocks = (len(prompt_token_ids) - 1) // bs
        hits: list[int] = []
        parent: BlockHash | None = salt or None
        for i in range(max_blocks):
            h = hash_block(parent, prompt_token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
            self.req_hashes[request_id].append(h)
            parent = h
        self.pool.touch(hits)
        self.req_blocks[request_id] = hits
        self.stats.queries += len(prompt_token_ids)
        self.stats.hits += len(hits) * bs
        return len(hits) * bs

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Grow the request's blocks to hold ``num_total_tokens``; returns its block ids."""
        blocks = self.req_blocks[request_id]
        need = self.blocks_for(num_total_tokens) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return blocks

    def has_uncached_full_blocks(self, request_id: str, num_computed: int) -> bool:
        """Cheap check, so the per-step path builds token lists only at block boundaries."""
        return self.enable_prefix_caching and num_computed // self.block_size > len(
            self.req_hashes[request_id]
        )

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the request's blocks that are full and whose KV has been written."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes[request_id]
        blocks = self.req_blocks[request_id]
        bs = self.block_size
        for i in range(len(hashes), num_computed // bs):
            parent = hashes[-1] if hashes else self.req_salt.get(request_id)
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            self.pool.cache_block(blocks[i], h)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        self.req_salt.pop(request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def usage(self) -> float:
        return self.pool.usage()
