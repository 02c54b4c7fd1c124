"""Outputs out (vLLM's ``OutputProcessor``): what users see of each request, built from the
core's per-step ``EngineCoreOutput``s: detokenized text, stop strings, logprob dicts, timings,
and the ``n > 1`` fan-out (one user request, n child requests in the core) aggregated back
into one ``RequestOutput``, shaped by the request's ``output_kind``: everything so far
(CUMULATIVE), only what is new (DELTA: the server's streams; a step costs O(new tokens), not
O(all tokens)), or one output at the end (FINAL_ONLY). Each step's ``IterationStats`` (the
metrics' source) are the same whatever the kind.

It never calls the core: what the core must hear of (a stop string ended a child, a failed
child's siblings must stop) is returned, and ``LLMEngine`` tells the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import RequestStatus
from ingot.engine.detokenizer import IncrementalDetokenizer
from ingot.engine.outputs import (
    CompletionOutput,
    IterationStats,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """What the front end keeps of one (child) request: what users see of it. The tokens'
    owner is the core; this is the copy that outputs are built from."""

    request_id: str
    params: SamplingParams | PoolingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's output
    error: str | None = None  # the core failed it (a constraint that did not compile)
    error_id: str | None = None  # ... through no fault of its own (EngineCoreOutput)
    # DELTA outputs: how much of output_token_ids / prompt_logprobs was sent (sent logprobs
    # are dropped: ``logprobs`` then holds the unsent ones only).
    num_sent_tokens: int = 0
    num_sent_prompt_logprobs: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ParentRequest:
    """Groups the n child requests of one user request."""

    request_id: str
    children: list[str]
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    last_token_time: float | None = None  # when its latest tokens came (None: none yet)


@dataclass
class ProcessedOutputs:
    """One step's outputs, and the children the core must finish."""

    outputs: list[RequestOutput | PoolingRequestOutput]
    to_stop: list[str]  # a stop string ended them; the core still runs them
    to_abort: list[str]  # a sibling failed (same constraint): they stop too
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}

    # ---- requests --------------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        """The user request ``request_id`` is running (its output is not finished)."""
        return request_id in self.parents

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def fan_out(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> list[RequestState]:
        """The ``params.n`` child requests of one user request (not yet added): each samples
        one sequence, with its own seed (``seed + i``) and the model's EOS ids among its stop
        ids. ``prompt_token_ids``: the detokenizer's context (none for prompt_embeds)."""
        children = []
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None and params.n > 1:
                child_params.seed = params.seed + i
            if not params.ignore_eos:
                child_params.all_stop_token_ids |= self.eos_token_ids
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(self._new_state(child_id, prompt_token_ids, child_params,
                                            arrival_time))
        return children

    def _new_state(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> RequestState:
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        with_lp = params.logprobs is not None
        return RequestState(
            req_id, params, detok,
            RequestMetrics(arrival_time=arrival_time or time.time()),
            logprobs=[] if with_lp else None,
            cumulative_logprob=0.0 if with_lp else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def pooling_state(
        self, request_id: str, params: PoolingParams, arrival_time: float | None
    ) -> RequestState:
        """A pooling request's state: one child, no detokenizer."""
        return RequestState(request_id, params, None,
                            RequestMetrics(arrival_time=arrival_time or time.time()))

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        children: list[RequestState],
    ) -> None:
        """Track a user request and its children (``fan_out``, or one ``pooling_state``)."""
        params = children[0].params
        # A pooling request has one output, when it finishes.
        kind = (params.output_kind if isinstance(params, SamplingParams)
                else RequestOutputKind.FINAL_ONLY)
        self.parents[request_id] = ParentRequest(
            request_id, [c.request_id for c in children], prompt, prompt_token_ids, kind)
        for child in children:
            self.requests[child.request_id] = child
            self._child_to_parent[child.request_id] = request_id

    def abort_requests(self, request_ids: list[str]) -> dict[str, list[str]]:
        """Forget the user requests still running among ``request_ids``; returns each one's
        children (for the core to finish)."""
        aborted = {}
        for parent_id in request_ids:
            if parent_id in self.parents:
                aborted[parent_id] = self._release(parent_id)
        return aborted

    def _release(self, parent_id: str) -> list[str]:
        parent = self.parents.pop(parent_id)
        for child in parent.children:
            self.requests.pop(child, None)
            self._child_to_parent.pop(child, None)
        return parent.children

    # ---- outputs ---------------------------------------------------------------------------
    def _decoded(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids: list[int], lps: list[float], sampled_rank: int) -> dict[int, Logprob]:
        entries = {ids[0]: Logprob(lps[0], sampled_rank, self._decoded(ids[0]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entries.setdefault(tid, Logprob(lp, rank, self._decoded(tid)))
        return entries

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs: the user requests whose outputs changed, each as
        one output of its kind (FINAL_ONLY ones only once finished; finished ones are
        forgotten), the children the core must finish, and the step's stats."""
        now = time.time()
        touched, to_stop, to_abort, new_tokens = self._apply(core_outputs, now)
        stats = IterationStats()
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        for parent_id in sorted(touched, key=lambda p: self.parents[p].children[0]):
            parent = self.parents[parent_id]
            children = [self.requests[c] for c in parent.children]
            finished = all(c.is_finished for c in children)
            self._record(stats, parent, children, new_tokens.get(parent_id, 0), finished, now)
            if finished or parent.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(parent, children, finished))
            if finished:
                self._release(parent_id)
        return ProcessedOutputs(outputs, to_stop, to_abort, stats)

    @staticmethod
    def _record(stats: IterationStats, parent: ParentRequest, children: list[RequestState],
                new_tokens: int, finished: bool, now: float) -> None:
        """Add one user request's step to the step's stats."""
        metrics = children[0].metrics
        if new_tokens:
            stats.num_generation_tokens += new_tokens
            if parent.last_token_time is None:  # its first tokens
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
                stats.time_to_first_tokens.append(now - metrics.arrival_time)
                if metrics.first_scheduled_time is not None:
                    stats.queue_times.append(metrics.first_scheduled_time - metrics.arrival_time)
            else:
                stats.inter_token_latencies.append(now - parent.last_token_time)
            parent.last_token_time = now
        if not finished:
            return
        if isinstance(children[0].params, PoolingParams):
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
            stats.finish_reasons.append("stop")
        else:
            stats.finish_reasons.extend(c.finish_reason or "unknown" for c in children)
        stats.e2e_latencies.append(now - metrics.arrival_time)

    def _apply(
        self, core_outputs: list[EngineCoreOutput], now: float
    ) -> tuple[set[str], list[str], list[str], dict[str, int]]:
        """(the parents whose outputs changed, children a stop string ended, children to
        abort, each parent's new tokens)."""
        touched: set[str] = set()
        new_tokens: dict[str, int] = {}
        stopped: list[str] = []
        failed: list[str] = []
        for out in core_outputs:
            state = self.requests.get(out.req_id)
            if state is None:
                continue
            parent = self._child_to_parent[out.req_id]
            if out.error is not None:
                state.error, state.error_id = out.error, out.error_id
                state.finish_reason = out.finish_status.value
                state.metrics.finished_time = now
                failed.append(parent)
                touched.add(parent)
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = out.first_scheduled_time
            chunk = out.new_prompt_logprobs
            if chunk is not None and state.prompt_logprobs is not None:
                for ids, lps, rank in zip(chunk.token_ids, chunk.logprobs, chunk.ranks, strict=True):
                    state.prompt_logprobs.append(self._logprob_dict(ids, lps, rank))
            if state.prompt_logprobs is not None:
                touched.add(parent)
            if isinstance(state.params, PoolingParams):
                if out.finish_status is not None:
                    state.pooled = out.pooled
                    state.finish_reason = out.finish_status.value
                    state.metrics.finished_time = now
                    touched.add(parent)
                continue
            if not out.new_token_ids:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            new_tokens[parent] = new_tokens.get(parent, 0) + len(out.new_token_ids)
            state.output_token_ids.extend(out.new_token_ids)
            for lp in out.new_logprobs:
                assert state.logprobs is not None and state.cumulative_logprob is not None
                state.logprobs.append(self._logprob_dict(lp.token_ids, lp.logprobs, lp.rank))
                state.cumulative_logprob += lp.logprobs[0]
            status = out.finish_status
            if status is not None:
                state.stop_reason = out.stop_reason
            if state.detokenizer is not None:
                matched = state.detokenizer.update(out.new_token_ids, finishing=status is not None)
                if matched is not None and status is None:
                    # A stop string: the core still runs the request; it must be told to stop.
                    state.stop_reason = matched
                    status = RequestStatus.FINISHED_STOPPED
                    stopped.append(out.req_id)
            if status is not None:
                state.finish_reason = status.value
                state.metrics.finished_time = now
            touched.add(parent)
        aborted: list[str] = []
        for parent in failed:
            # One failed child fails its request: its siblings (same constraint) stop too.
            rest = [c for c in self.parents[parent].children if not self.requests[c].is_finished]
            for child in rest:
                self.requests[child].finish_reason = RequestStatus.FINISHED_ABORTED.value
            aborted.extend(rest)
        return touched, stopped, aborted, new_tokens

    @staticmethod
    def _completion(index: int, request: RequestState, delta: bool) -> CompletionOutput:
        finished = request.is_finished
        text = ""
        if request.detokenizer is not None:
            text = request.detokenizer.get_next_output_text(finished, delta=delta)
        token_ids, logprobs = request.output_token_ids, request.logprobs
        if delta:  # only what was not sent yet: the step's cost is the new tokens'
            start = request.num_sent_tokens
            request.num_sent_tokens = len(token_ids)
            token_ids = token_ids[start:]
            if logprobs is not None:
                # Sent logprobs are not kept (the largest part of a long stream's state).
                request.logprobs = []
        else:
            token_ids = list(token_ids)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=request.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _make_output(self, parent: ParentRequest, children: list[RequestState],
                     finished: bool) -> RequestOutput | PoolingRequestOutput:
        if isinstance(children[0].params, PoolingParams):
            state = children[0]
            return PoolingRequestOutput(
                request_id=parent.request_id, prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids,
                outputs=PoolingOutput(list(state.pooled or [])), finished=state.is_finished,
                metrics=state.metrics, error=state.error, error_id=state.error_id,
            )
        first = children[0]
        failed = next((c for c in children if c.error is not None), None)
        delta = parent.output_kind is RequestOutputKind.DELTA
        prompt_logprobs = first.prompt_logprobs
        if delta and prompt_logprobs is not None:
            start = first.num_sent_prompt_logprobs
            first.num_sent_prompt_logprobs = len(prompt_logprobs)
            prompt_logprobs = prompt_logprobs[start:]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[self._completion(i, c, delta) for i, c in enumerate(children)],
            finished=finished,
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
            error=failed.error if failed is not None else None,
            error_id=failed.error_id if failed is not None else None,
        )
