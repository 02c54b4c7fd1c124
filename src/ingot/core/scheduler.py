"""The holdback scheduler (integration-b §1): fixed shapes, no preemption.

Each step:
1. every waiting request moves to a holdback queue and is re-admitted FIFO while
   ``can_schedule`` allows (stopping at the first refusal keeps the order);
2. if any running request still has prompt tokens to compute, a prefill step runs: the
   segments of up to ``max_num_prefills_per_step`` such requests (oldest first) are packed into
   one token bucket, decodes held back; else all running requests decode one token;
3. prefill and decode are never in one batch.

Packing several prompts into one step is a deliberate change from the original's one prefill
per step: on CPUs with AMX the linear layers ran 2.3-3.6x cheaper per token at 2048 rows than
at 128 (docs/features.md; about even on AVX-512-only CPUs). ``max_num_prefills_per_step: 1`` restores the original behaviour.

Admission is bounded by the worst-case KV concurrency: at most
``usable_blocks // ceil(max_model_len / block_size)`` requests run at once, so every running
request can grow to ``max_model_len`` and nothing ever needs to be preempted.

The scheduler owns each request's tokens: ``update_from_output`` appends what the model
sampled, applies EOS / stop-token / length stops and frees finished requests' blocks.
"""

from __future__ import annotations

import enum
import time
from collections import deque

from ingot.config import SchedulerConfig
from ingot.core.buckets import BucketGrid
from ingot.core.kv_cache_manager import KVCacheManager, cdiv
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.metrics.stats import BucketStats
from ingot.structured_output.manager import StructuredOutputManager, TokenVerdict
from ingot.worker.outputs import ModelRunnerOutput


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
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grid: BucketGrid,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        # Grammar state of constrained requests: masks for each step, advanced with the tokens.
        self.structured_output = structured_output
        self.kv = kv_cache_manager
        self.grid = grid
        self.max_kv_concurrent = max_kv_concurrency(
            kv_cache_manager.pool.num_blocks, kv_cache_manager.block_size,
            config.max_model_len, config.max_num_seqs,
        )
        # Tokens one prefill step may hold: the largest token bucket.
        self.prefill_token_budget = (
            min(grid.num_batched_tokens_buckets[-1], config.max_num_batched_tokens)
            if grid.enabled else config.max_num_batched_tokens
        )
        self.waiting: deque[Request] = deque()
        self.holdback: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.state = SchedulerState.IDLE
        self.total_padding_tokens = 0
        # Executions and padding per bucket, derived from the steps as they are scheduled.
        self.bucket_stats = BucketStats.for_grid(grid)
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
        if request.use_structured_output and self.structured_output is not None:
            self.structured_output.remove_request(request_id)
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

    def _prefill_work(self) -> tuple[int, int]:
        """(requests still prefilling, prompt tokens they have left)."""
        pending = [r for r in self.running if self._in_prefill(r)]
        return len(pending), sum(r.num_prompt_tokens - r.num_computed_tokens for r in pending)

    def can_schedule(self, num_prefilling: int, tokens_left: int) -> bool:
        """One more request may join: a free sequence slot, KV for its worst case, a free
        place among this step's packed prefills and room in its token budget."""
        if len(self.running) >= min(self.config.max_num_seqs, self.max_kv_concurrent):
            return False
        if num_prefilling >= self.config.max_num_prefills_per_step:
            return False
        return tokens_left < self.prefill_token_budget

    def _admit(self) -> list[NewRequestData]:
        if not self.waiting:  # the decode steady state: nothing to admit, no scan of running
            return []
        self.holdback.extend(self.waiting)
        self.waiting.clear()
        admitted: list[NewRequestData] = []
        num_prefilling, tokens_left = self._prefill_work()
        while self.holdback and self.can_schedule(num_prefilling, tokens_left):
            request = self.holdback.popleft()
            # A request that wants prompt logprobs needs logits at every prompt position, so it
            # computes its whole prompt (its blocks are still published for others), as in vLLM.
            lookup = request.prompt_token_ids if request.sampling_params.prompt_logprobs is None else ()
            request.num_computed_tokens = self.kv.admit(request.request_id, lookup)
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = time.time()
            self.running.append(request)
            num_prefilling += 1
            tokens_left += request.num_prompt_tokens - request.num_computed_tokens
            admitted.append(
                NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params)
            )
        self.waiting, self.holdback = self.holdback, deque()
        return admitted

    # ---- scheduling --------------------------------------------------------------------
    def _schedule(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        blocks = self.kv.allocate_slots(request.request_id, start + n)  # actual tokens only
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=request.token_ids_between(start, start + n),
            start_position=start,
            block_ids=list(blocks),
            sample=start + n == request.num_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        so = self._schedule_step()
        manager = self.structured_output
        if manager is not None and manager.num_requests and so.scheduled:
            so.grammar_bitmask = manager.grammar_bitmask(so.scheduled)
        return so

    def _schedule_step(self) -> SchedulerOutput:
        new_requests = self._admit()
        prefilling = [r for r in self.running if self._in_prefill(r)]
        scheduled: list[ScheduledRequest] = []
        finished, self._finished_ids = self._finished_ids, set()
        grid = self.grid
        if prefilling:
            budget = self.prefill_token_budget
            for request in prefilling[: self.config.max_num_prefills_per_step]:
                if budget == 0:
                    break
                n = min(request.num_prompt_tokens - request.num_computed_tokens, budget)
                scheduled.append(self._schedule(request, n))
                budget -= n
            total = sum(s.num_tokens for s in scheduled)
            padded = grid.prefill_bucket(total)
            self.total_padding_tokens += padded - total
            if grid.enabled:
                self.bucket_stats.record_prefill(padded, total)
            self.state = SchedulerState.ACTIVE_PREFILL
            return SchedulerOutput(scheduled, new_requests, finished, True, padded)
        if self.running:
            scheduled = [self._schedule(r, 1) for r in self.running]
            padded = grid.decode_bucket(len(scheduled))
            ctx = None
            if grid.enabled:
                # Smallest context bucket covering the longest request after this token.
                ctx = grid.decode_ctx_bucket(max(s.start_position for s in scheduled) + 1)
                self.bucket_stats.record_decode(
                    padded, len(scheduled), ctx if grid.decode_context_length_buckets else None
                )
            self.state = SchedulerState.ACTIVE_DECODE
            return SchedulerOutput(scheduled, new_requests, finished, False, padded, ctx)
        self.state = SchedulerState.IDLE
        return SchedulerOutput([], new_requests, finished)

    # ---- results -----------------------------------------------------------------------
    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Sets ``request.stop_reason`` to the stop token id (never a string: stop strings are
        the front end's) when a listed stop token ends the request."""
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens and token in params.all_stop_token_ids:
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def update_from_output(
        self, so: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: advance computed tokens (publishing full blocks to the
        prefix cache), append sampled tokens, stop finished requests and free their blocks.
        Returns one output per request that ran this step and is still known to the core."""
        results: dict[str, EngineCoreOutput] = {}
        for item in so.scheduled:
            request = self.requests.get(item.req_id)
            if request is None:  # finished (aborted) while its step ran
                continue
            request.num_computed_tokens += item.num_tokens
            if self.kv.has_uncached_full_blocks(request.request_id, request.num_computed_tokens):
                self.kv.cache_full_blocks(
                    request.request_id, request.all_token_ids, request.num_computed_tokens
                )
            out = EngineCoreOutput(
                item.req_id, num_cached_tokens=request.num_cached_tokens,
                first_scheduled_time=request.first_scheduled_time,
                new_prompt_logprobs=output.prompt_logprobs.get(item.req_id),
            )
            results[item.req_id] = out
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = self.requests.get(req_id)
            out = results.get(req_id)
            if request is None or out is None:
                continue
            request.output_token_ids.append(token)
            out.new_token_ids.append(token)
            lp = output.logprobs.get(req_id)
            if lp is not None:
                out.new_logprobs.append(lp)
            status = self._check_stop(request, token)
            if request.use_structured_output and self.structured_output is not None:
                verdict = self.structured_output.accept_token(req_id, token)
                if verdict is TokenVerdict.REJECTED:
                    status = RequestStatus.FINISHED_ABORTED
                elif verdict is TokenVerdict.TERMINATED:  # complete, even on the last token
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                out.finish_status = status
                out.stop_reason = request.stop_reason
                self.finish_request(req_id, status)
        return list(results.values())
