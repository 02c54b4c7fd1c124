"""Rank layouts and parallel-config validation as pure functions (no processes).

Conventions (spec §0): ``rank = dp_rank * TP + tp_rank``. TP groups are contiguous blocks of
``TP`` ranks; DP "column" groups are strided (the same TP position across the replicas). Expert
parallelism (§3) re-reads each TP group for the MoE layers: with ``ep_degree`` partitions, the
EP-TP groups are contiguous blocks of ``TP / ep_degree`` ranks inside it and the EP groups are
strided across those blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


def tp_group_ranks(world_size: int, tp: int) -> list[list[int]]:
    """Contiguous TP groups: world 16, TP 8 -> [[0..7], [8..15]]."""
    _check_divides("tensor_parallel_size", tp, world_size)
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def dp_column_group_ranks(world_size: int, tp: int, dp: int) -> list[list[int]]:
    """Strided DP groups, one per TP position: TP 8, DP 4 -> [[0,8,16,24], [1,9,17,25], ...]."""
    if tp * dp != world_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size {tp} x "
                         f"data_parallel_size {dp}")
    return [[dp_rank * tp + tp_rank for dp_rank in range(dp)] for tp_rank in range(tp)]


def ep_tp_group_ranks(tp_ranks: list[int], ep_degree: int) -> list[list[int]]:
    """The TP sub-groups inside each EP partition of one TP group (contiguous blocks of
    ``len(tp_ranks) / ep_degree``): 8 ranks, ep_degree 2 -> [[0,1,2,3], [4,5,6,7]]; full EP
    (ep_degree 8) -> single-rank groups."""
    _check_divides("ep_degree", ep_degree, len(tp_ranks))
    size = len(tp_ranks) // ep_degree
    return [tp_ranks[i : i + size] for i in range(0, len(tp_ranks), size)]


def ep_group_ranks(tp_ranks: list[int], ep_degree: int) -> list[list[int]]:
    """The EP groups of one TP group (the same position in each EP partition): 8 ranks,
    ep_degree 2 -> [[0,4], [1,5], [2,6], [3,7]]; full EP -> [[0..7]]."""
    blocks = ep_tp_group_ranks(tp_ranks, ep_degree)
    return [list(column) for column in zip(*blocks, strict=True)]


def ep_rank_of(tp_rank: int, tp: int, ep_degree: int) -> int:
    """Which EP partition a TP-local rank is in: ranks 0-3 -> 0, 4-7 -> 1 for TP 8, EP 2."""
    _check_divides("ep_degree", ep_degree, tp)
    return tp_rank // (tp // ep_degree)


def local_expert_range(num_experts: int, ep_degree: int, ep_rank: int) -> range:
    """Static contiguous placement: partition k holds experts [k * E_L, (k + 1) * E_L)."""
    _check_divides("ep_degree", ep_degree, num_experts, what="the number of experts")
    per = num_experts // ep_degree
    return range(ep_rank * per, (ep_rank + 1) * per)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads a rank holds: its share, or 1 (replicated) when TP > num_kv_heads."""
    return max(1, num_kv_heads // tp)


def kv_head_start(num_kv_heads: int, tp: int, tp_rank: int) -> int:
    """The first KV head of a rank. With TP > num_kv_heads each KV head is replicated on
    TP / num_kv_heads consecutive ranks (TP 16, 8 KV heads: ranks 0,1 hold head 0)."""
    if tp >= num_kv_heads:
        return tp_rank // (tp // num_kv_heads)
    return tp_rank * (num_kv_heads // tp)


def _check_divides(name: str, n: int, total: int, what: str = "the world size") -> None:
    if n <= 0 or total % n:
        raise ValueError(f"{name} {n} does not divide {what} ({total})")


@dataclass(frozen=True)
class ParallelSizes:
    """What the parallel flags asked for, before validation."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    ep_degree: int | None = None  # additional_config["ep_degree"]


def validate_parallel_sizes(sizes: ParallelSizes, hf_config: object) -> None:
    """Every §1-3 constraint, with a message that names the flag to change; then what is not
    built yet (PP > 1) is refused as such, never ignored."""
    tp, dp, pp = sizes.tensor_parallel_size, sizes.data_parallel_size, sizes.pipeline_parallel_size
    for name, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp),
                        ("pipeline_parallel_size", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    world = tp * dp
    heads = getattr(hf_config, "num_attention_heads", None)
    if tp > 1 and heads is not None:
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's num_attention_heads "
                f"({heads}); choose a --tensor-parallel-size that divides {heads}"
            )
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"tensor_parallel_size {tp} and num_key_value_heads {kv}: one must divide the "
                "other (KV heads are split, or replicated when TP > KV heads); choose another "
                "--tensor-parallel-size"
            )
        inter = getattr(hf_config, "intermediate_size", None)
        moe_name = "moe_intermediate_size"
        moe_inter = getattr(hf_config, moe_name, None)
        if _num_experts(hf_config) is not None and moe_inter is None:
            # Mixtral: intermediate_size is the experts' (there are no dense layers).
            moe_name, moe_inter, inter = "intermediate_size", inter, None
        if inter is not None and inter % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's intermediate_size "
                f"({inter}); choose another --tensor-parallel-size"
            )
        # The experts' intermediate dim splits over the ranks of one EP partition (all of
        # the TP group without EP; an ep_degree that does not divide TP is reported below).
        ep_deg = (sizes.ep_degree or tp) if sizes.enable_expert_parallel else 1
        shards = tp // ep_deg if isinstance(ep_deg, int) and ep_deg > 0 and tp % ep_deg == 0 \
            else 1
        if isinstance(moe_inter, int) and shards > 1 and moe_inter % shards:
            raise ValueError(
                f"the model's {moe_name} ({moe_inter}) does not split over {shards} ranks "
                "(tensor_parallel_size / ep_degree); choose another --tensor-parallel-size "
                "or ep_degree"
            )
    ep = sizes.ep_degree
    if ep is not None:
        if not sizes.enable_expert_parallel:
            raise ValueError(
                'additional_config "ep_degree" is set without --enable-expert-parallel; pass '
                "--enable-expert-parallel or drop ep_degree"
            )
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f'additional_config "ep_degree" must be a positive integer, got {ep!r}')
        if world % ep:
            raise ValueError(
                f"ep_degree {ep} does not divide the world size {world} (tensor_parallel_size "
                f"{tp} x data_parallel_size {dp}); change ep_degree or the parallel sizes"
            )
        if dp > 1 and ep != world:
            raise ValueError(
                f"with data_parallel_size {dp} and expert parallelism, ep_degree must equal "
                f"tensor_parallel_size x data_parallel_size ({world}), got {ep}; partial "
                "cross-DP expert parallelism is not supported"
            )
    if sizes.enable_expert_parallel:
        experts = _num_experts(hf_config)
        if experts is None:
            raise ValueError(
                "--enable-expert-parallel needs a mixture-of-experts model; this one has no "
                "experts: drop the flag"
            )
        degree = ep if ep is not None else world
        if experts % degree:
            raise ValueError(
                f"ep_degree {degree} does not divide the model's {experts} experts; change "
                'additional_config "ep_degree" (default: tensor_parallel_size x '
                "data_parallel_size)"
            )
    # Valid requests for what is not built yet.
    if pp > 1:
        raise ValueError("pipeline_parallel_size > 1 is not supported; use --tensor-parallel-size")


def _num_experts(hf_config: object) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
