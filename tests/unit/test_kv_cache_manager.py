import pytest
import torch

from ingot.core.kv_cache_manager import NULL_BLOCK_ID, BlockPool, KVCacheManager
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
    kv.admit("a", num_prompt_tokens=5, max_tokens=3)
    assert len(kv.allocate_slots("a", 5)) == 2
    assert len(kv.allocate_slots("a", 8)) == 2
    assert len(kv.allocate_slots("a", 9)) == 3
    kv.free("a")
    assert kv.num_free_blocks == 9


def test_admission_reserves_the_worst_case():
    kv = KVCacheManager(num_blocks=9, block_size=4, max_model_len=32)  # 8 usable
    assert kv.worst_case_blocks(5, 3) == 2
    assert kv.worst_case_blocks(5, None) == 8  # unbounded: up to max_model_len
    kv.admit("a", 5, 11)  # 16 tokens -> 4 blocks reserved
    assert kv.can_admit(5, 11)  # 4 more fit
    kv.admit("b", 5, 11)
    assert not kv.can_admit(1, 1)  # everything is spoken for, though nothing is allocated


def test_large_cpu_kv_cache_reads_as_zeros():
    cache = allocate_kv_cache((2, 1024, 32, 8, 64), torch.float32, torch.device("cpu"))
    assert cache.abs().max().item() == 0.0
