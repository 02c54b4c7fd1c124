"""How much memory the KV cache gets, and how many blocks that is.

The original's formula (integration-a §6), on host memory for the CPU and on device memory for
CUDA:

    total_budget  = int(total * gpu_memory_utilization)
    user_budget   = max(total_budget - bytes_used, 0)          # bytes_used = the weights
    heuristic_cap = int(total_budget * cap_fraction)          # INGOT_KV_BUDGET_CAP_FRACTION
    available     = max(min(user_budget, heuristic_cap), 0)
    available < INGOT_MIN_KV_BUDGET_GIB GiB (and the minimum > 0) -> error
"""

from __future__ import annotations

import os

GiB = 2**30
DEFAULT_CAP_FRACTION = 0.30
DEFAULT_MIN_KV_BUDGET_GIB = 1.0


def cap_fraction_from_env() -> float:
    return float(os.environ.get("INGOT_KV_BUDGET_CAP_FRACTION", DEFAULT_CAP_FRACTION))


def min_budget_gib_from_env() -> float:
    return float(os.environ.get("INGOT_MIN_KV_BUDGET_GIB", DEFAULT_MIN_KV_BUDGET_GIB))


def compute_kv_budget(
    total_bytes: int,
    bytes_used: int,
    gpu_memory_utilization: float,
    cap_fraction: float = DEFAULT_CAP_FRACTION,
    min_budget_gib: float = DEFAULT_MIN_KV_BUDGET_GIB,
) -> int:
    """Bytes available to the KV cache. Pure function of its inputs."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not 0.0 < cap_fraction <= 1.0:
        raise ValueError(f"INGOT_KV_BUDGET_CAP_FRACTION must be in (0, 1], got {cap_fraction}")
    total_budget = int(total_bytes * gpu_memory_utilization)
    user_budget = max(total_budget - bytes_used, 0)
    heuristic_cap = int(total_budget * cap_fraction)
    available = max(min(user_budget, heuristic_cap), 0)
    if min_budget_gib > 0 and available < min_budget_gib * GiB:
        raise ValueError(
            f"the KV cache budget is {available / GiB:.2f} GiB, below the minimum of "
            f"{min_budget_gib} GiB (memory {total_bytes / GiB:.1f} GiB, weights "
            f"{bytes_used / GiB:.2f} GiB, gpu_memory_utilization {gpu_memory_utilization}, cap "
            f"{cap_fraction}); raise --gpu-memory-utilization or INGOT_KV_BUDGET_CAP_FRACTION, "
            "set --kv-cache-memory-bytes, or set INGOT_MIN_KV_BUDGET_GIB=0 to allow it"
        )
    return available


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int, max_blocks: int) -> int:
    """Blocks that fit the budget, never more than the engine could ever use."""
    return min(budget_bytes // bytes_per_block, max_blocks)
