"""Sequence-parallel (SP) prefill under tensor parallelism (spec §1).

In a prefill step the residual stream lives in SP layout: rank r holds rows
``[r*T/TP, (r+1)*T/TP)`` of ``[T, H]``. The embedding's partial rows are reduce-scattered into
it; each layer's norms and residual adds run on the rank's rows only, the layer all-gathers
``[T, H]`` before attention and before the MLP (or MoE, whose routing needs every token), and
the row-parallel outputs are reduce-scattered back, one collective that both sums the partials
and returns to SP. The final norm runs on ``[T/TP, H]`` and an all-gather gives the full rows
before the logits. Decode steps keep the all-reduce.

The model enters :func:`sequence_parallel` for a prefill step; the layers that end in a partial
sum (row-parallel linears, the vocab-parallel embedding, the MoE block) reduce through
:func:`reduce_partial`, which reads that per-thread state, so the same modules serve both
layouts (and the simulated group's rank threads each have their own).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ingot.distributed.group import GroupCoordinator

_state = threading.local()

#: additional_config key; off by default (docs/parallelism.md: on this project's 2-core CPU the
#: extra all-gathers cost more than the rows the norms skip).
CONFIG_KEY = "sequence_parallel_prefill"


def sequence_parallel_prefill(additional_config: dict[str, Any], tp: int, buckets: Any,
                              replicas_synchronise: bool = False) -> bool:
    """Whether prefill steps run sequence-parallel, validated at start-up: a boolean; with
    TP > 1 it needs bucketing (every prefill step then has a bucket's token count) and every
    prefill bucket above TP and divisible by it. ``buckets``: the engine's core.buckets.BucketGrid;
    ``replicas_synchronise``: expert parallelism across data-parallel replicas (refused)."""
    value = additional_config.get(CONFIG_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(f"additional_config.{CONFIG_KEY} must be true or false, got {value!r}")
    if not value or tp == 1:
        return False
    if replicas_synchronise:
        # An idle replica's dummy batch is decode-shaped, so its collectives could not pair
        # with a replica's sequence-parallel prefill.
        raise ValueError(f"additional_config.{CONFIG_KEY} is not supported yet with "
                         "--enable-expert-parallel across data-parallel replicas; drop one")
    if not buckets.enabled:
        raise ValueError(
            f"additional_config.{CONFIG_KEY} needs enable_bucketing (each prefill step's token "
            f"count must split over the {tp} TP ranks); turn bucketing on or drop "
            f"{CONFIG_KEY}"
        )
    bad = [b for b in buckets.num_batched_tokens_buckets if b <= tp or b % tp]
    if bad:
        raise ValueError(
            f"additional_config.{CONFIG_KEY}: prefill buckets {bad} do not split over "
            f"tensor_parallel_size {tp} (each must be a multiple of it, and larger); change "
            "additional_config.num_batched_tokens_buckets (its last entry is "
            "min(max_num_batched_tokens, max_model_len)) or drop the key"
        )
    return True


def check_sp_tokens(num_tokens: int, world_size: int) -> None:
    """The spec's constraint on an SP prefill of ``num_tokens`` rows: more rows than ranks,
    and a whole number of rows per rank."""
    if num_tokens <= world_size or num_tokens % world_size:
        raise ValueError(
            f"sequence-parallel prefill needs more tokens than TP ranks and a multiple of them: "
            f"{num_tokens} tokens over {world_size} ranks (prefill buckets, "
            "additional_config.num_batched_tokens_buckets, must be divisible by "
            "tensor_parallel_size)"
        )


@contextmanager
def sequence_parallel(group: GroupCoordinator, num_tokens: int) -> Iterator[None]:
    """Run a prefill of ``num_tokens`` rows in SP layout over ``group`` on this thread."""
    check_sp_tokens(num_tokens, group.world_size)
    previous = getattr(_state, "group", None)
    _state.group = group
    try:
        yield
    finally:
        _state.group = previous


def sp_group() -> GroupCoordinator | None:
    """The group of the SP step running on this thread (None: not in SP)."""
    return getattr(_state, "group", None)


def reduce_partial(x: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """A partial sum over ``group`` (row-parallel output, vocab-sharded rows): all-reduced to
    the full ``[T, ...]`` (in place), or in an SP step reduce-scattered to this rank's rows."""
    if group.world_size == 1:
        return x
    if sp_group() is group:
        return group.reduce_scatter(x, dim=0)
    return group.all_reduce(x)


def gather_tokens(x: torch.Tensor) -> torch.Tensor:
    """The full ``[T, ...]`` from this rank's SP rows (outside SP: ``x`` itself)."""
    group = sp_group()
    return x if group is None else group.all_gather(x, dim=0)


def local_tokens(x: torch.Tensor) -> torch.Tensor:
    """This rank's SP rows of a full ``[T, ...]`` every rank holds (outside SP: ``x``)."""
    group = sp_group()
    if group is None:
        return x
    rows = x.shape[0] // group.world_size
    return x.narrow(0, group.rank_in_group * rows, rows)
