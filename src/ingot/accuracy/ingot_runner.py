"""Drive one ingot request at a time and record the raw logits of every step.

The runner wraps ``model.compute_logits`` (the model's last op before the sampler) for the
duration of a request, so the logits are exactly those the sampler saw, through the real
scheduler, buckets, paged KV cache and decode path. Nothing in the engine changes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ingot.sampling_params import SamplingParams

_ids = itertools.count()


def _the_worker(worker: Any) -> Any:
    return worker


def local_worker(engine: Any) -> Any:
    """The engine's worker object, for tools that hook its model in this process (captures,
    replacements, logits recording). Reached through ``collective_rpc``; refused when the
    worker runs in another process."""
    if not engine.workers_are_local:
        raise ValueError(
            "the accuracy toolkit hooks the model in this process; run the engine with "
            "distributed_executor_backend='uni'"
        )
    if engine.config.scheduler_config.async_scheduling:
        # Captures read the KV cache between steps; a step in flight would be writing it.
        raise ValueError(
            "the accuracy toolkit reads the model's state between steps; run the engine with "
            "async_scheduling=False (--no-async-scheduling)"
        )
    return engine.collective_rpc(_the_worker)[0]


@dataclass
class GenerateResult:
    tokens: list[int]  # greedy tokens, one per recorded logits row
    logits: torch.Tensor  # [n, V] float32 raw logits
    kv: Any = None  # whatever ``on_last_step`` returned


@dataclass
class _Recorder:
    rows: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def record_logits(model: nn.Module) -> Iterator[_Recorder]:
    """Record every ``compute_logits`` output (detached float32 copies) while active."""
    rec = _Recorder()
    original = model.compute_logits

    def wrapper(hidden: torch.Tensor, kernel_rows: int = 0) -> torch.Tensor:
        out = original(hidden, kernel_rows)
        rec.rows.append(out.detach().float().cpu().clone())
        return out

    model.compute_logits = wrapper  # instance attribute shadows the method
    try:
        yield rec
    finally:
        del model.compute_logits


class IngotRunner:
    """Greedy generation on an ``ingot.LLM`` with logits capture, one request at a time."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.worker = local_worker(self.engine)
        self.model: nn.Module = self.worker.model

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.model_config.dtype

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes, so the next prefill computes (and captures) every position."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if reset is not None and not reset():
            raise RuntimeError("cannot reset the prefix cache while requests hold KV blocks")

    def request_blocks(self, request_id: str) -> list[int]:
        """The block ids of a running request (freed when it finishes)."""
        return self.engine.request_blocks(request_id)

    def generate(
        self,
        prompt_ids: list[int],
        num_tokens: int,
        stop_at: list[int] | None = None,
        on_last_step: Callable[[str, list[int]], Any] | None = None,
    ) -> GenerateResult:
        """Greedy-generate up to ``num_tokens`` tokens (EOS ignored).

        ``stop_at``: the reference continuation; generation stops after the first token that
        differs from it (nothing after a divergence is ever validated, so it is not computed).
        ``on_last_step(request_id, tokens)`` runs while the request still holds its KV blocks:
        its cache then holds K/V of ``prompt_ids + tokens[:-1]``.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if self.engine.get_num_unfinished_requests():
            raise RuntimeError("the engine has other requests in flight; validation needs it idle")
        req_id = f"accuracy-{next(_ids)}"
        # One spare token so the request never finishes (and frees its blocks) by itself before
        # on_last_step has seen the cache; it is aborted instead.
        params = SamplingParams(
            temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True, detokenize=False
        )
        tokens: list[int] = []
        extra = None
        with record_logits(self.model) as rec:
            self.engine.add_request(req_id, {"prompt_token_ids": list(prompt_ids)}, params)
            try:
                finished = False
                while len(tokens) < num_tokens and not finished:
                    for out in self.engine.step():
                        if out.request_id == req_id:
                            tokens = list(out.outputs[0].token_ids)
                            finished = out.finished
                    if stop_at is not None and any(
                        t != r for t, r in zip(tokens, stop_at, strict=False)
                    ):
                        break
                tokens = tokens[:num_tokens]
                if on_last_step is not None and not finished:
                    extra = on_last_step(req_id, tokens)
            finally:
                self.engine.abort_request(req_id)
        if len(rec.rows) < len(tokens):
            raise RuntimeError(
                f"recorded {len(rec.rows)} logits rows for {len(tokens)} tokens; is another "
                "request running on this engine?"
            )
        logits = torch.cat(rec.rows)[: len(tokens)] if tokens else torch.empty(0)
        return GenerateResult(tokens, logits, extra)

    def teacher_forced_logits(self, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] logits of one prefill over prompt + tokens[:-1] (prompt logprobs
        path): the prefill-only counterpart of ``generate``, without decode steps."""
        seq = list(prompt_ids) + list(tokens[:-1])
        params = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, prompt_logprobs=0
        )
        # A prefix-cache hit would skip the prompt-logprob rows of the cached positions.
        self.reset_prefix_cache()
        with record_logits(self.model) as rec:
            self.llm.generate([{"prompt_token_ids": seq}], params)
        # Rows arrive in position order: the prompt-logprob rows of each prefill chunk
        # (positions 0..S-2), then the sampled row (position S-1).
        every = torch.cat(rec.rows)
        return every[len(prompt_ids) - 1 :]
