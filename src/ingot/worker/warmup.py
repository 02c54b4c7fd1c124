"""The shapes a worker warms up: every distinct bucket shape ``ModelRunner.prepare_inputs``
can produce, and a dummy step of each. The step programs' warm-ups (worker/execution/: eager,
compiled, CUDA graphs) run them through :class:`DummySteps`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ingot.config import EngineConfig
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.sampling_params import SamplingParams
from ingot.sched_output import NULL_BLOCK_ID, NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.utils.math_utils import cdiv


@dataclass(frozen=True)
class WarmupShape:
    """One distinct compiled shape: a prefill of ``num_tokens`` or a decode batch of
    ``num_reqs``, reading ``width`` blocks per request."""

    kind: str  # "prefill" | "decode"
    num_tokens: int
    num_reqs: int
    width: int
    start_position: int = 0  # of each request's (first) token
    num_real: int = 1  # real (unpadded) tokens of a prefill

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill_t{self.num_tokens}_w{self.width}"
        return f"decode_b{self.num_reqs}_w{self.width}"

    @property
    def signature(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_reqs, self.width)


class DummySteps(Protocol):
    """What a warm-up needs of the model runner (``ModelRunner`` is one), and nothing more: the
    KV caches, a dummy step's inputs built exactly as serving builds a step's, and a way to
    forget the dummy steps afterwards."""

    kv_caches: list[torch.Tensor]

    def dummy_step(
        self, shape: WarmupShape
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of a dummy step of ``shape``."""
        ...

    def forget_dummy_steps(self) -> None:
        """Undo what the dummy steps left (the null block's K/V, the dummy requests)."""
        ...


def warmup_shapes(config: EngineConfig) -> list[WarmupShape]:
    """Every distinct shape ``ModelRunner.prepare_inputs`` can produce, in a stable order."""
    grid = config.buckets
    bs = config.cache_config.block_size
    ctx = [*(grid.decode_context_length_buckets or ()), grid.max_model_len]
    # A prefill continues at start > 0 only after a prefix-cache hit or a chunked prefill; its
    # block table then spans a context bucket instead of the chunk itself.
    continuations = (config.cache_config.enable_prefix_caching
                     or config.scheduler_config.enable_chunked_prefill)
    shapes: list[WarmupShape] = []
    seen: set[tuple[int, int, int]] = set()

    def add(shape: WarmupShape) -> None:
        if shape.signature not in seen:
            seen.add(shape.signature)
            shapes.append(shape)

    prev = 0
    for p in grid.num_batched_tokens_buckets:
        add(WarmupShape("prefill", p, 1, cdiv(p, bs), num_real=p))
        if continuations:
            for c in ctx:
                # A chunk padded to p has more than `prev` tokens and starts at >= 1, so it
                # reaches context bucket c only if prev + 2 <= c.
                if prev + 2 <= c:
                    n = min(p, c - 1)
                    add(WarmupShape("prefill", p, 1, cdiv(c, bs), start_position=c - n,
                                    num_real=n))
        prev = p
    for b in grid.num_seqs_buckets:
        for c in ctx:
            add(WarmupShape("decode", b, b, cdiv(c, bs), start_position=c - 1))
    return shapes


def warmup_scheduler_output(shape: WarmupShape) -> SchedulerOutput:
    """A SchedulerOutput of dummy requests (prompts of token 0) with this shape, all blocks
    the null block. Each step first finishes the previous shape's dummies of the same ids; the
    last ones' runner state goes with ``ModelRunner.forget_dummy_steps``."""
    blocks = [NULL_BLOCK_ID] * shape.width
    if shape.kind == "prefill":
        ids, num_real, prefill = ["warmup-0"], shape.num_real, True
    else:
        ids, num_real, prefill = [f"warmup-{i}" for i in range(shape.num_reqs)], 1, False
    prompt = [0] * (shape.start_position + num_real)
    new = [NewRequestData(i, prompt, SamplingParams()) for i in ids]
    items = [ScheduledRequest(i, num_real, shape.start_position, blocks, False) for i in ids]
    return SchedulerOutput(items, new, is_prefill=prefill, num_padded=shape.num_tokens,
                           ctx_bucket=None if prefill else shape.start_position + 1,
                           finished_req_ids=set(ids))
