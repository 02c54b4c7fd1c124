"""Continuous-batching scheduler.

Each step: every running request gets its next chunk (one token when decoding, up to the token
budget when still prefilling); then waiting requests are admitted FIFO while there is token
budget, a free sequence slot, and KV blocks for the request's worst case. Reserving the worst case
at admission means no request ever has to be preempted.
"""

from __future__ import annotations

import time
from collections import deque

from ingot.config import SchedulerConfig
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if not self.kv.fits_at_all(request.num_prompt_tokens, params.max_tokens):
            raise ValueError(
                f"request needs {self.kv.worst_case_blocks(request.num_prompt_tokens, params.max_tokens)}"
                f" KV blocks but the cache has {self.kv.pool.num_usable_blocks}; lower max_tokens "
                "or --max-model-len, or give the KV cache more memory"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
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

    # ---- scheduling --------------------------------------------------------------------
    def _schedule_chunk(self, request: Request, budget: int) -> ScheduledRequest | None:
        remaining = request.num_tokens - request.num_computed_tokens
        n = min(remaining, budget)
        if n <= 0:
            return None
        start = request.num_computed_tokens
        blocks = self.kv.allocate_slots(request.request_id, start + n)
        tokens = request.all_token_ids[start : start + n]
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=tokens,
            start_position=start,
            block_ids=list(blocks),
            sample=start + n == request.num_tokens,
            is_prefill=start < request.num_prompt_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for request in self.running:
            if budget <= 0:
                break
            item = self._schedule_chunk(request, budget)
            if item is not None:
                scheduled.append(item)
                budget -= len(item.token_ids)

        new_requests: list[NewRequestData] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            params = request.sampling_params
            if not self.kv.can_admit(request.num_prompt_tokens, params.max_tokens):
                break
            if not self.config.enable_chunked_prefill and request.num_prompt_tokens > budget:
                break
            self.waiting.popleft()
            self.kv.admit(request.request_id, request.num_prompt_tokens, params.max_tokens)
            request.status = RequestStatus.RUNNING
            request.metrics.first_scheduled_time = time.time()
            self.running.append(request)
            new_requests.append(
                NewRequestData(request.request_id, request.prompt_token_ids, params)
            )
            item = self._schedule_chunk(request, budget)
            assert item is not None
            scheduled.append(item)
            budget -= len(item.token_ids)

        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled, new_requests, finished)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Advance computed-token counts for what ran (sampled tokens are appended by the
        engine, which also decides when a request stops)."""
        for item in output.scheduled:
            request = self.requests.get(item.req_id)
            if request is not None:
                request.num_computed_tokens += len(item.token_ids)
