"""A worker owns one device: it loads the model, sizes and allocates the KV cache, and runs
steps through its ModelRunner."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ingot.config import EngineConfig
from ingot.core.kv_cache_manager import cdiv
from ingot.core.sched_output import SchedulerOutput
from ingot.model_executor.loader.model_loader import load_model
from ingot.model_executor.models.llama import head_dim_of
from ingot.platforms import resolve_platform
from ingot.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger("ingot")

# Without an explicit budget the KV cache takes at most this much (vLLM's CPU backend default
# KV space is 4 GiB too) and at most this fraction of the memory still available.
DEFAULT_KV_CACHE_BYTES_CAP = 4 * 2**30
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.3


def kv_bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    hf = config.model_config.hf_config
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * config.cache_config.block_size * num_kv_heads * head_dim_of(hf) * elem
    return per_layer * hf.num_hidden_layers


def plan_num_blocks(config: EngineConfig, available_bytes: int, dtype: torch.dtype) -> int:
    cache = config.cache_config
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    sched = config.scheduler_config
    # +1: block 0 is the null block.
    worst_case = sched.max_num_seqs * cdiv(sched.max_model_len, cache.block_size) + 1
    per_block = kv_bytes_per_block(config, dtype)
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    else:
        budget = min(DEFAULT_KV_CACHE_BYTES_CAP, int(available_bytes * DEFAULT_KV_CACHE_MEMORY_FRACTION))
    num_blocks = min(worst_case, budget // per_block)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {per_block} bytes; "
            "raise kv_cache_memory_bytes or lower --block-size"
        )
    return num_blocks


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache: masked-out reads must never meet NaN garbage (0 * NaN = NaN).

    On CPU the memory comes from calloc (through numpy): large blocks are fresh zero pages
    from the kernel, committed only when first written, so a 4 GiB cache costs no start-up
    time and RSS grows only as blocks fill up. torch.zeros would touch every page up front.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config.device)
        self.device = self.platform.device()
        torch.manual_seed(config.model_config.seed)
        self.model = load_model(config.model_config, self.device)

        dtype = config.model_config.dtype
        num_blocks = plan_num_blocks(
            config, self.platform.available_memory_bytes(self.device), dtype
        )
        config.cache_config.num_blocks = num_blocks
        hf = config.model_config.hf_config
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        shape = (2, num_blocks, config.cache_config.block_size, num_kv_heads, head_dim_of(hf))
        self.kv_caches = [allocate_kv_cache(shape, dtype, self.device) for _ in range(hf.num_hidden_layers)]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MB)",
            num_blocks,
            config.cache_config.block_size,
            num_blocks * kv_bytes_per_block(config, dtype) / 2**20,
        )
        self.model_runner = ModelRunner(config, self.model, self.kv_caches, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
