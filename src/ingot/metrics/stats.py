"""Plain in-process counters the engine keeps per step (the server exports them to Prometheus).

Bucket children exist at zero from start-up, so every bucket of the grid is visible before any
traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ingot.core.buckets import BucketGrid


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
