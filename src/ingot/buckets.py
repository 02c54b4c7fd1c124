"""Static-shape buckets: generation, validation and selection.

The model only runs at a few known shapes: prefill token counts pad up to a
``num_batched_tokens_buckets`` entry, decode batches pad up to a ``num_seqs_buckets`` entry, and
(optionally) decode reads KV up to a ``decode_context_length_buckets`` entry. Each shape can then
be compiled once and reused forever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ingot")

MIN_PREFILL_BUCKET = 128
# Context buckets must be multiples of this (the original's NKI tile width; kept so bucket
# lists move between the two systems unchanged).
CTX_BUCKET_MULTIPLE = 128


def _powers_of_two(start: int, maximum: int) -> list[int]:
    buckets, b = [], start
    while b < maximum:
        buckets.append(b)
        b *= 2
    return [*buckets, maximum]


def default_num_batched_tokens_buckets(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Powers of two from 128 while below the maximum, then the maximum itself."""
    return _powers_of_two(MIN_PREFILL_BUCKET, min(max_num_batched_tokens, max_model_len))


def default_num_seqs_buckets(max_num_seqs: int) -> list[int]:
    return _powers_of_two(1, max_num_seqs)


def _check_int_list(name: str, buckets: Any) -> list[int]:
    if not isinstance(buckets, list | tuple) or not buckets:
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {buckets!r}")
    for b in buckets:
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ValueError(f"{name} must hold positive integers; {b!r} is not one")
    if any(b >= c for b, c in zip(buckets, buckets[1:], strict=False)):
        raise ValueError(f"{name} must be strictly ascending, got {list(buckets)}")
    return list(buckets)


def validate_buckets(name: str, buckets: Any, maximum: int, max_name: str) -> list[int]:
    """Non-empty, positive ints (not bools), strictly ascending, ending exactly at the maximum."""
    buckets = _check_int_list(name, buckets)
    if buckets[-1] != maximum:
        raise ValueError(
            f"{name} must end exactly at {max_name} ({maximum}), got {buckets}; "
            f"add {maximum} as the last bucket or change {max_name}"
        )
    return buckets


def validate_ctx_buckets(buckets: Any, max_model_len: int) -> list[int]:
    buckets = _check_int_list("decode_context_length_buckets", buckets)
    for b in buckets:
        if b >= max_model_len:
            raise ValueError(
                f"decode_context_length_buckets values must be < max_model_len ({max_model_len}); "
                f"{b} is not (max_model_len itself is always the last bucket)"
            )
        if b % CTX_BUCKET_MULTIPLE:
            raise ValueError(
                f"decode_context_length_buckets values must be multiples of {CTX_BUCKET_MULTIPLE}; "
                f"{b} is not"
            )
    return buckets


def default_ctx_buckets(max_model_len: int) -> list[int]:
    """Powers of two from 256 below ``max_model_len``: a decode step then reads at most twice the
    KV its longest context needs, instead of all ``max_model_len`` positions."""
    buckets, b = [], 256
    while b < max_model_len:
        buckets.append(b)
        b *= 2
    return buckets


def get_bucket_for_count(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; n <= 0 gives the first; past the last gives the last (warned)."""
    if n <= 0:
        return buckets[0]
    for b in buckets:
        if b >= n:
            return b
    logger.warning("count %d exceeds every bucket %s; using %d", n, list(buckets), buckets[-1])
    return buckets[-1]


def select_ctx_bucket(needed: int, buckets: Sequence[int] | None, max_model_len: int) -> int:
    """Smallest context bucket >= needed among the buckets plus max_model_len."""
    for b in buckets or ():
        if b >= needed:
            return b
    return max_model_len


@dataclass(frozen=True)
class BucketGrid:
    """The shapes the model runs at. ``enabled=False`` runs every batch at its actual shape."""

    enabled: bool
    num_batched_tokens_buckets: tuple[int, ...]
    num_seqs_buckets: tuple[int, ...]
    decode_context_length_buckets: tuple[int, ...] | None
    max_model_len: int
    block_size: int

    @classmethod
    def from_config(
        cls,
        additional_config: dict[str, Any],
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        default_enabled: bool = True,
    ) -> BucketGrid:
        """``default_enabled``: bucketing when ``enable_bucketing`` is not set."""
        enabled = additional_config.get("enable_bucketing", default_enabled)
        if not isinstance(enabled, bool):
            raise ValueError(f"enable_bucketing must be true or false, got {enabled!r}")
        prefill_max = min(max_num_batched_tokens, max_model_len)
        prefill = additional_config.get("num_batched_tokens_buckets")
        if prefill is None:
            prefill = default_num_batched_tokens_buckets(max_num_batched_tokens, max_model_len)
        else:
            prefill = validate_buckets(
                "num_batched_tokens_buckets", prefill, prefill_max,
                "min(max_num_batched_tokens, max_model_len)",
            )
        seqs = additional_config.get("num_seqs_buckets")
        if seqs is None:
            seqs = default_num_seqs_buckets(max_num_seqs)
        else:
            seqs = validate_buckets("num_seqs_buckets", seqs, max_num_seqs, "max_num_seqs")
        # Unset: the default ladder (a deliberate change from the original's "off": on CPU the
        # full-width read made decode 2.8x (batch 1) to 16.7x (batch 8) slower at max_model_len
        # 8192, PERFORMANCE.md). An explicit null turns context bucketing off.
        if "decode_context_length_buckets" not in additional_config:
            ctx = tuple(default_ctx_buckets(max_model_len)) or None
        else:
            ctx = additional_config["decode_context_length_buckets"]
            if ctx is not None:
                ctx = tuple(validate_ctx_buckets(ctx, max_model_len))
        return cls(enabled, tuple(prefill), tuple(seqs), ctx, max_model_len, block_size)

    def prefill_bucket(self, num_tokens: int) -> int:
        return get_bucket_for_count(num_tokens, self.num_batched_tokens_buckets) if self.enabled else num_tokens

    def decode_bucket(self, num_seqs: int) -> int:
        return get_bucket_for_count(num_seqs, self.num_seqs_buckets) if self.enabled else num_seqs

    def decode_ctx_bucket(self, needed: int) -> int:
        return select_ctx_bucket(needed, self.decode_context_length_buckets, self.max_model_len)

    def describe(self) -> str:
        if not self.enabled:
            return "bucketing off: every batch runs at its actual shape"
        ctx = list(self.decode_context_length_buckets or []) + [self.max_model_len]
        return (
            f"prefill token buckets {list(self.num_batched_tokens_buckets)}, "
            f"decode batch buckets {list(self.num_seqs_buckets)}, "
            f"decode context buckets {ctx if self.decode_context_length_buckets else 'off'}"
            f" (block_size {self.block_size})"
        )


# Per-bucket counters the engine keeps per step (the server exports them to Prometheus).
# Bucket children exist at zero from start-up, so every bucket of the grid is visible before any
# traffic.

@dataclass
class BucketCounter:
    executions: int = 0
    actual: int = 0  # real tokens (prefill) or real sequences (decode)
    padded: int = 0  # the bucket's size, summed over executions

    @property
    def padding(self) -> int:
        return self.padded - self.actual


@dataclass
class BucketStats:
    prefill: dict[int, BucketCounter] = field(default_factory=dict)  # num_batched_tokens bucket
    decode: dict[int, BucketCounter] = field(default_factory=dict)  # num_seqs bucket
    decode_ctx: dict[int, int] = field(default_factory=dict)  # context bucket -> executions

    @classmethod
    def for_grid(cls, grid: BucketGrid) -> BucketStats:
        stats = cls()
        if grid.enabled:
            stats.prefill = {b: BucketCounter() for b in grid.num_batched_tokens_buckets}
            stats.decode = {b: BucketCounter() for b in grid.num_seqs_buckets}
            ctx = list(grid.decode_context_length_buckets or []) + [grid.max_model_len]
            stats.decode_ctx = dict.fromkeys(ctx, 0)
        return stats

    @classmethod
    def merged(cls, parts: list[BucketStats]) -> BucketStats:
        """The counters of several engines (data-parallel replicas) summed per bucket."""
        total = cls()
        for part in parts:
            for mine, theirs in ((total.prefill, part.prefill), (total.decode, part.decode)):
                for bucket, c in theirs.items():
                    t = mine.setdefault(bucket, BucketCounter())
                    t.executions += c.executions
                    t.actual += c.actual
                    t.padded += c.padded
            for ctx, n in part.decode_ctx.items():
                total.decode_ctx[ctx] = total.decode_ctx.get(ctx, 0) + n
        return total

    def record_prefill(self, bucket: int, actual: int) -> None:
        c = self.prefill.setdefault(bucket, BucketCounter())
        c.executions += 1
        c.actual += actual
        c.padded += bucket

    def record_decode(self, bucket: int, actual: int, ctx_bucket: int | None) -> None:
        c = self.decode.setdefault(bucket, BucketCounter())
        c.executions += 1
        c.actual += actual
        c.padded += bucket
        if ctx_bucket is not None:
            self.decode_ctx[ctx_bucket] = self.decode_ctx.get(ctx_bucket, 0) + 1
