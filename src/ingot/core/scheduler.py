"""The holdback scheduler (integration-b §1): fixed shapes, no preemption.

Each step:
1. every waiting request moves to a holdback queue and is re-admitted FIFO while
   ``can_schedule`` allows (stopping at the first refusal keeps the order);
2. if a running request is still prefilling, only its next segment runs (decodes are held back);
   else if a request was just admitted, only its first segment runs; else all running requests
   decode one token;
3. prefill and decode are never in one batch, and at most one prefill runs per step.

Admission is bounded by the worst-case KV concurrency: at most
``usable_blocks // ceil(max_model_len / block_size)`` requests run at once, so every running
request can grow to ``max_model_len`` and nothing ever needs to be preempted.
"""

from __future__ import annotations

import enum
import time
from collections import deque

from ingot.config import SchedulerConfig
from ingot.core.buckets import BucketGrid
from ingot.core.kv_cache_manager import KVCacheManager, cdiv
from ingot.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.engine.request import Request, RequestStatus

MAX_PREFILLS_PER_BATCH = 1


class SchedulerState(enum.Enum):
    IDLE = "idle"
    ACTIVE_PREFILL = "active_prefill"
    ACTIVE_DECODE = "active_decode"


def max_kv_concurrency(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """Requests that can all reach max_model_len at once (block 0 is the null block)."""
    concurrent = (num_blocks - 1) // cdiv(max_model_len, block_size)
    return concurrent if concurrent > 0 else max_num_seqs


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, grid: BucketGrid
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.grid = grid
        self.max_kv_concurrent = max_kv_concurrency(
            kv_cache_manager.pool.num_blocks, kv_cache_manager.block_size,
            config.max_model_len, config.max_num_seqs,
        )
        self.waiting: deque[Request] = deque()
        self.holdback: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.state = SchedulerState.IDLE
        self.total_padding_tokens = 0
        self._finished_ids: set[str] = set()

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        self._finished_ids.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- admission ---------------------------------------------------------------------
    @staticmethod
    def _in_prefill(request: Request) -> bool:
        return request.num_computed_tokens < request.num_prompt_tokens

    def can_schedule(self, num_admitted: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if any(self._in_prefill(r) for r in self.running):
            return False
        if num_admitted >= MAX_PREFILLS_PER_BATCH:
            return False
        return len(self.running) < self.max_kv_concurrent

    def _admit(self) -> list[NewRequestData]:
        self.holdback.extend(self.waiting)
        self.waiting.clear()
        admitted: list[NewRequestData] = []
        while self.holdback and self.can_schedule(len(admitted)):
            request = self.holdback.popleft()
            # A request that wants prompt logprobs needs logits at every prompt position, so it
            # computes its whole prompt (its blocks are still published for others), as in vLLM.
            lookup = request.prompt_token_ids if request.sampling_params.prompt_logprobs is None else ()
            request.num_computed_tokens = self.kv.admit(request.request_id, lookup)
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.metrics.first_scheduled_time = time.time()
            self.running.append(request)
            admitted.append(
                NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params)
            )
        self.waiting, self.holdback = self.holdback, deque()
        return admitted

    # ---- scheduling --------------------------------------------------------------------
    def _schedule(self, request: Request, n: int, padded: int, is_prefill: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        blocks = self.kv.allocate_slots(request.request_id, start + n)  # actual tokens only
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=request.token_ids_between(start, start + n),
            start_position=start,
            block_ids=list(blocks),
            sample=start + n == request.num_tokens,
            is_prefill=is_prefill,
            num_tokens_padded=padded,
        )

    def schedule(self) -> SchedulerOutput:
        new_requests = self._admit()
        prefilling = [r for r in self.running if self._in_prefill(r)]
        scheduled: list[ScheduledRequest] = []
        if prefilling:
            request = prefilling[0]
            remaining = request.num_prompt_tokens - request.num_computed_tokens
            n = min(remaining, self.grid.num_batched_tokens_buckets[-1] if self.grid.enabled
                    else self.config.max_num_batched_tokens, self.config.max_num_batched_tokens)
            padded = self.grid.prefill_bucket(n)
            self.total_padding_tokens += padded - n
            scheduled.append(self._schedule(request, n, padded, is_prefill=True))
            self.state = SchedulerState.ACTIVE_PREFILL
        elif self.running:
            scheduled = [self._schedule(r, 1, 1, is_prefill=False) for r in self.running]
            self.state = SchedulerState.ACTIVE_DECODE
        else:
            self.state = SchedulerState.IDLE
        if len({s.is_prefill for s in scheduled}) > 1:
            raise RuntimeError("scheduler produced a batch mixing prefill and decode")
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled, new_requests, finished)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Advance computed-token counts for what ran (sampled tokens are appended by the
        engine, which also decides when a request stops)."""
        for item in output.scheduled:
            request = self.requests.get(item.req_id)
            if request is not None:
                request.num_computed_tokens += len(item.token_ids)
                if self.kv.has_uncached_full_blocks(request.request_id, request.num_computed_tokens):
                    self.kv.cache_full_blocks(
                        request.request_id, request.all_token_ids, request.num_computed_tokens
                    )
