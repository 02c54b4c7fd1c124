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
import logging
import time
from collections import deque

from ingot.buckets import BucketGrid, BucketStats
from ingot.config import SchedulerConfig, SpeculativeConfig
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.outputs import EngineCoreOutput, failed_output
from ingot.core.request import Request, RequestStatus
from ingot.core.spec_policy import SpecDecodingStats, SpecPolicy
from ingot.runner_output import ModelRunnerOutput
from ingot.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.structured_output.manager import StructuredOutputManager, TokenVerdict
from ingot.utils.math_utils import cdiv

logger = logging.getLogger("ingot")


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
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        # Speculative decoding: drafts the runner proposed are verified in decode steps the
        # policy allows; the counters say how many were accepted.
        self.spec_policy = (
            SpecPolicy(speculative.adaptive, speculative.disable_by_batch_size)
            if speculative is not None else None
        )
        self.spec_stats = (
            SpecDecodingStats(speculative.num_speculative_tokens)
            if speculative is not None else None
        )
        self.lookahead_slots = speculative.lookahead_slots if speculative is not None else 0
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
        # Requests failed since the core last collected them (``take_failed``), with why.
        self._failed: list[EngineCoreOutput] = []

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.status = status
        request.num_output_placeholders = 0  # a step still in flight has its token dropped
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        releases = [self.kv.free]
        if request.use_structured_output and self.structured_output is not None:
            releases.append(self.structured_output.remove_request)
        for release in releases:
            # The request is finished whatever its cleanup raises: one request's failure must
            # not escape the step (at worst its blocks leak, which the log says).
            try:
                release(request_id)
            except Exception:
                logger.exception("request %s: %s failed while finishing it", request_id,
                                 release.__qualname__)
        self._finished_ids.add(request_id)

    def fail_request(self, request_id: str, exc: Exception | str, during: str = "") -> None:
        """Finish one request with an error for its caller (``exc``: what was raised, see
        ``failed_output``, or the message of a failure that is the request's own); the rest of
        the engine is untouched. Its output comes with the step's (``take_failed``)."""
        if isinstance(exc, str):
            out = EngineCoreOutput(request_id, finish_status=RequestStatus.FINISHED_ABORTED,
                                   error=exc)
        else:
            out = failed_output(request_id, exc, during)
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._failed.append(out)

    def take_failed(self) -> list[EngineCoreOutput]:
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_to_report(self) -> bool:
        """Finished requests the next SchedulerOutput will tell the workers to forget, or
        failed ones whose callers have not been told yet."""
        return bool(self._finished_ids or self._failed)

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

    def _admit(self) -> None:
        if not self.waiting:  # the decode steady state: nothing to admit, no scan of running
            return
        self.holdback.extend(self.waiting)
        self.waiting.clear()
        num_prefilling, tokens_left = self._prefill_work()
        compiling: list[Request] = []
        while self.holdback and self.can_schedule(num_prefilling, tokens_left):
            request = self.holdback.popleft()
            try:
                if (request.status == RequestStatus.WAITING_FOR_FSM
                        and not self._fsm_ready(request)):
                    compiling.append(request)  # passed over, not blocking the queue behind it
                    continue
                # A request that wants prompt logprobs needs logits at every prompt position,
                # so it computes its whole prompt (its blocks are still published for others),
                # as in vLLM; so does a pooling request (it pools every prompt token's state).
                params = request.sampling_params
                lookup = (request.prompt_token_ids
                          if params is not None and params.prompt_logprobs is None else ())
                request.num_computed_tokens = self.kv.admit(request.request_id, lookup,
                                                            request.cache_salt)
            except Exception as exc:
                # Its grammar matcher, prefix lookup...: this request fails, the step goes on.
                self.fail_request(request.request_id, exc, "admitting")
                continue
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = time.time()
            self.running.append(request)
            num_prefilling += 1
            tokens_left += request.num_prompt_tokens - request.num_computed_tokens
        self.holdback.extendleft(reversed(compiling))  # they keep their places
        self.waiting, self.holdback = self.holdback, deque()

    def _fsm_ready(self, request: Request) -> bool:
        """A request waiting for its grammar may run once the manager has it compiled."""
        if self.structured_output is not None and not self.structured_output.ready(
                request.request_id):
            return False
        if request.status is RequestStatus.WAITING_FOR_FSM:
            request.status = RequestStatus.WAITING
        return True

    # ---- scheduling --------------------------------------------------------------------
    def _can_sample(self, request: Request) -> bool:
        """Another sampled token is still allowed: a step already in flight may have taken the
        request to its max_tokens or to max_model_len (never true between synchronous steps,
        where such a request has finished)."""
        if request.sampling_params is None:  # a pooling request never decodes
            return False
        pending = request.num_output_placeholders
        if pending and request.use_structured_output:
            # Async scheduling: its next grammar mask depends on the token still in flight.
            return False
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens:
            return False
        return request.num_tokens + pending < self.config.max_model_len

    def _drafts(self, request: Request) -> list[int]:
        """The request's drafts that may run this step: the drafts and the token after them
        must stay within max_tokens and max_model_len (near either, fewer or none)."""
        drafts = request.spec_token_ids
        if not drafts or request.use_structured_output:
            return []
        room = self.config.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(request.output_token_ids) - 1)
        return drafts[: max(room, 0)]

    def _schedule(
        self, request: Request, n: int, new_requests: list[NewRequestData],
        drafts: list[int] | None = None,
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        drafts = drafts or []
        sample = start + n - len(drafts) == request.num_tokens + request.num_output_placeholders
        end = start + n
        if sample:  # room for the positions a draft model fills after the step
            end = min(end + self.lookahead_slots, self.config.max_model_len)
        blocks = self.kv.allocate_slots(request.request_id, end)  # never for padding
        if request.num_blocks_sent == 0:  # its first step: the runner learns of it now
            new_requests.append(
                NewRequestData(request.request_id, request.prompt_token_ids,
                               request.sampling_params, request.pooling_params,
                               request.prompt_embeds)
            )
        new_block_ids = list(blocks[request.num_blocks_sent :])
        request.num_blocks_sent = len(blocks)
        request.num_computed_tokens = start + n  # rejected drafts are taken back later
        if sample:
            request.num_output_placeholders += 1
        return ScheduledRequest(request.request_id, n, start, new_block_ids, sample, drafts)

    def schedule(self) -> SchedulerOutput:
        so = self._schedule_step()
        manager = self.structured_output
        if manager is not None and manager.num_requests and so.scheduled:
            so.grammar_bitmask = manager.grammar_bitmask(so.scheduled)
        return so

    def _schedule_step(self) -> SchedulerOutput:
        self._admit()
        new_requests: list[NewRequestData] = []
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
                if n < request.num_prompt_tokens - request.num_computed_tokens and scheduled \
                        and not self.config.enable_chunked_prefill:
                    break  # no chunking: a prompt that does not fit whole waits for a later step
                scheduled.append(self._schedule(request, n, new_requests))
                budget -= n
            total = sum(s.num_tokens for s in scheduled)
            padded = grid.prefill_bucket(total)
            self.total_padding_tokens += padded - total
            if grid.enabled:
                self.bucket_stats.record_prefill(padded, total)
            self.state = SchedulerState.ACTIVE_PREFILL
            # Drafts for a request's first decode step, proposed from its prompt.
            return SchedulerOutput(scheduled, new_requests, finished, True, padded,
                                   propose_drafts=self.spec_policy is not None)
        decodable = [r for r in self.running if self._can_sample(r)]
        if decodable:
            drafts = self._step_drafts(decodable)
            scheduled = [self._schedule(r, 1 + len(d), new_requests, d)
                         for r, d in zip(decodable, drafts, strict=True)]
            rows = sum(s.num_tokens for s in scheduled)
            padded = grid.decode_bucket(rows)
            ctx = None
            if grid.enabled:
                # Smallest context bucket covering the longest request after this step.
                ctx = grid.decode_ctx_bucket(max(s.start_position + s.num_tokens
                                                 for s in scheduled))
                self.bucket_stats.record_decode(
                    padded, rows, ctx if grid.decode_context_length_buckets else None
                )
            self.state = SchedulerState.ACTIVE_DECODE
            so = SchedulerOutput(scheduled, new_requests, finished, False, padded, ctx)
            if self.spec_policy is not None:
                so.propose_drafts = self.spec_policy.wants_drafts(
                    len(decodable), grid.decode_bucket(len(decodable)))
            return so
        self.state = SchedulerState.ACTIVE_DECODE if self.running else SchedulerState.IDLE
        return SchedulerOutput([], new_requests, finished)

    def _step_drafts(self, decodable: list[Request]) -> list[list[int]]:
        """Each request's drafts for this decode step: none unless speculation is on, the
        policy allows it for this batch and the rows fit the largest decode bucket."""
        none: list[list[int]] = [[] for _ in decodable]
        if self.spec_policy is None:
            return none
        # Asked every decode step (it counts them, so its probes come round).
        if not self.spec_policy.speculate(len(decodable), self.grid.decode_bucket(len(decodable))):
            return none
        drafts = [self._drafts(r) for r in decodable]
        rows = len(decodable) + sum(len(d) for d in drafts)
        if self.grid.enabled and rows > self.grid.num_seqs_buckets[-1]:
            # One row per token, within the largest decode bucket: fewer drafts each.
            each = (self.grid.num_seqs_buckets[-1] - len(decodable)) // len(decodable)
            drafts = [d[:each] for d in drafts]
        return drafts

    def record_step_time(self, so: SchedulerOutput, seconds: float, num_tokens: int) -> None:
        """The engine timed a decode step: the speculation policy learns its rate."""
        if self.spec_policy is None or so.is_prefill or not so.scheduled:
            return
        verified = any(s.draft_token_ids for s in so.scheduled)
        self.spec_policy.observe(self.grid.decode_bucket(len(so.scheduled)), verified,
                                 num_tokens, seconds)

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
        """Apply one step's results: publish the blocks it filled to the prefix cache, append
        sampled tokens, stop finished requests and free their blocks. Returns one output per
        request that ran this step and is still known to the core (a request aborted, or
        stopped by an earlier step, while this one ran is skipped: its token is dropped)."""
        results: dict[str, EngineCoreOutput] = {}
        new_tokens = dict(zip(output.req_ids, output.sampled_token_ids, strict=True))
        for item in so.scheduled:
            request = self.requests.get(item.req_id)
            if request is None:
                continue
            computed = item.start_position + item.num_tokens
            token_ids = request.all_token_ids
            if item.draft_token_ids:
                # Rejected drafts: their positions are computed again (their K/V is stale).
                accepted = len(new_tokens[item.req_id]) - 1
                rejected = len(item.draft_token_ids) - accepted
                request.num_computed_tokens -= rejected
                computed -= rejected
                token_ids = token_ids + item.draft_token_ids[:accepted]
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(item.draft_token_ids), accepted)
            # Published only now that the step has run: a block is shared only once its
            # K/V is written (a later step may already be scheduled past it).
            if self.kv.has_uncached_full_blocks(request.request_id, computed):
                self.kv.cache_full_blocks(request.request_id, token_ids, computed)
            out = EngineCoreOutput(
                item.req_id, num_cached_tokens=request.num_cached_tokens,
                first_scheduled_time=request.first_scheduled_time,
                new_prompt_logprobs=output.prompt_logprobs.get(item.req_id),
            )
            results[item.req_id] = out
            if request.pooling_params is not None and item.sample:
                # Prefill only: a pooling request ends with its prompt, with its pooled output.
                out.pooled = output.pooler_output.get(item.req_id)
                out.finish_status = RequestStatus.FINISHED_STOPPED
                self.finish_request(item.req_id, RequestStatus.FINISHED_STOPPED)
        for req_id, tokens in new_tokens.items():
            request = self.requests.get(req_id)
            out = results.get(req_id)
            if request is None or out is None:
                continue
            request.num_output_placeholders -= 1
            logprobs = output.logprobs.get(req_id)
            status = None
            for i, token in enumerate(tokens):  # a stop drops the tokens after it
                request.output_token_ids.append(token)
                out.new_token_ids.append(token)
                if logprobs is not None:
                    out.new_logprobs.append(logprobs[i])
                status = self._check_stop(request, token)
                if request.use_structured_output and self.structured_output is not None:
                    verdict = self.structured_output.accept_token(req_id, token)
                    if verdict is TokenVerdict.REJECTED:
                        status = RequestStatus.FINISHED_ABORTED
                    elif verdict is TokenVerdict.TERMINATED:  # complete, even on the last token
                        status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    break
            if status is not None:
                out.finish_status = status
                out.stop_reason = request.stop_reason
                self.finish_request(req_id, status)
            elif self.spec_policy is not None:
                request.spec_token_ids = output.draft_token_ids.get(req_id, [])
        return list(results.values())
