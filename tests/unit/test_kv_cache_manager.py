import random

import pytest
import torch

from ingot.core.kv_cache_manager import BlockPool, KVCacheManager, hash_block
from ingot.sched_output import NULL_BLOCK_ID
from ingot.worker.worker import allocate_kv_cache


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(8)
    blocks = pool.allocate(7)
    assert NULL_BLOCK_ID not in blocks and sorted(blocks) == list(range(1, 8))
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_free_blocks == 7


def test_blocks_grow_with_tokens_and_free_on_finish():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=32)
    kv.admit("a")
    assert len(kv.allocate_slots("a", 5)) == 2
    assert len(kv.allocate_slots("a", 8)) == 2
    assert len(kv.allocate_slots("a", 9)) == 3
    kv.free("a")
    assert kv.num_free_blocks == 9


def test_large_cpu_kv_cache_reads_as_zeros():
    cache = allocate_kv_cache((2, 1024, 32, 8, 64), torch.float32, torch.device("cpu"))
    assert cache.abs().max().item() == 0.0


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_cache_is_committed_as_written_on_huge_page_boundaries():
    from ingot.utils.hugepages import HUGE_PAGE

    before = _rss_bytes()
    cache = allocate_kv_cache((2, 2048, 32, 8, 64), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert _rss_bytes() - before < 64 << 20  # nothing touched yet
    cache[0, 5].fill_(1.0)  # one block written: its pages only
    assert _rss_bytes() - before < 64 << 20
    assert cache[0, 5].sum().item() == 32 * 8 * 64 and cache[1].abs().max().item() == 0.0


def _run_prefill(kv, rid, prompt):
    """Admit, allocate and 'compute' a whole prompt, then publish its full blocks."""
    cached = kv.admit(rid, prompt)
    kv.allocate_slots(rid, len(prompt))
    kv.cache_full_blocks(rid, prompt, len(prompt))
    return cached


def test_prefix_hits_share_physical_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=16, max_model_len=256, enable_prefix_caching=True)
    prefix = list(range(100, 148))  # 3 full blocks
    assert _run_prefill(kv, "a", prefix + [1, 2, 3]) == 0
    assert _run_prefill(kv, "b", prefix + [7, 8]) == 48
    assert kv.req_blocks["a"][:3] == kv.req_blocks["b"][:3]
    assert all(kv.pool.ref_cnt[b] == 2 for b in kv.req_blocks["a"][:3])
    # A prefix ending mid-block reuses only the full blocks before it.
    assert _run_prefill(kv, "c", prefix[:40] + [9]) == 32
    assert kv.stats.hits == 48 + 32


def test_whole_prompt_cached_still_computes_the_last_token():
    kv = KVCacheManager(num_blocks=32, block_size=16, max_model_len=256, enable_prefix_caching=True)
    prompt = list(range(64))  # exactly 4 blocks
    _run_prefill(kv, "a", prompt)
    kv.free("a")
    assert _run_prefill(kv, "b", prompt) == 48  # the 4th block is recomputed


def _salted_prefill(kv, rid, prompt, salt):
    cached = kv.admit(rid, prompt, salt)
    kv.allocate_slots(rid, len(prompt))
    kv.cache_full_blocks(rid, prompt, len(prompt))
    return cached


def test_cache_salt_isolates_prefixes_from_the_first_block_on():
    """cache_salt (issue #31): the salt roots the chain, so it is in the first block's hash and,
    through the chain, in every later one: the same salt hits, another salt or none misses."""
    kv = KVCacheManager(num_blocks=64, block_size=16, max_model_len=256, enable_prefix_caching=True)
    prompt = list(range(100, 165))  # 4 full blocks + 1 token
    assert _salted_prefill(kv, "a", prompt, b"tenant-a") == 0
    assert _salted_prefill(kv, "a2", prompt, b"tenant-a") == 64
    assert _salted_prefill(kv, "b", prompt, b"tenant-b") == 0
    assert _salted_prefill(kv, "none", prompt, b"") == 0
    assert _salted_prefill(kv, "none2", prompt, b"") == 64  # unsalted requests share theirs
    # Only the first block takes the salt: a later block's hash differs through its parent.
    first = kv.req_hashes["a"][0]
    assert first == hash_block(b"tenant-a", prompt[:16]) != hash_block(None, prompt[:16])
    assert kv.req_hashes["a"][1] == hash_block(first, prompt[16:32])


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block(None, [1, 2, 3])
    assert hash_block(a, [4, 5, 6]) != hash_block(hash_block(None, [9, 2, 3]), [4, 5, 6])
    assert hash_block(None, [1, 2, 3]) == a


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=16, enable_prefix_caching=True)
    _run_prefill(kv, "a", [1] * 9)  # 3 blocks, 2 full
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert _run_prefill(kv, "b", [1] * 9) == 8  # still cached after the free
    kv.free("b")
    kv.admit("c")
    kv.allocate_slots("c", 16)  # needs every block: evicts the cached ones
    assert kv.pool.cached == {}
    kv.free("c")
    assert _run_prefill(kv, "d", [1] * 9) == 0


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16, enable_prefix_caching=True)
    _run_prefill(kv, "a", [3] * 9)
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert _run_prefill(kv, "b", [3] * 9) == 0


def test_randomized_eviction_never_touches_blocks_in_use():
    """Thousands of steps on a tiny pool: a block in use is never handed out again, a hit never
    returns a block whose contents belong to another prefix, and the pool ends full."""
    rng = random.Random(0)
    bs = 4
    kv = KVCacheManager(num_blocks=24, block_size=bs, max_model_len=32, enable_prefix_caching=True)
    content: dict[int, tuple] = {}  # block -> the token ids whose KV it holds
    live: dict[str, list[int]] = {}
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(4)]
    for step in range(4000):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 8):
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
            continue
        prompt = rng.choice(prefixes)[: rng.randint(1, 16)] + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        rid = f"r{step}"
        cached = kv.admit(rid, prompt)
        in_use = {b for blocks in live.values() for b in blocks}
        hit_blocks = kv.req_blocks[rid][: cached // bs]
        for i, b in enumerate(hit_blocks):  # a hit returns exactly this prefix's KV
            assert content[b] == tuple(prompt[i * bs : (i + 1) * bs])
        blocks = kv.allocate_slots(rid, len(prompt))
        fresh = blocks[len(hit_blocks):]
        assert not set(fresh) & in_use, "a block in use was handed out"
        assert NULL_BLOCK_ID not in blocks
        for i, b in enumerate(blocks):
            if b in fresh:
                content[b] = tuple(prompt[i * bs : (i + 1) * bs])  # the "KV write"
        kv.cache_full_blocks(rid, prompt, len(prompt))
        live[rid] = blocks
    for rid in list(live):
        kv.free(rid)
    assert kv.num_free_blocks == 23
    assert all(c == 0 for c in kv.pool.ref_cnt)
