"""The synchronous engine: request intake and validation, the step loop (schedule -> execute ->
update), stop checks, detokenization, and ``n > 1`` fan-out into child requests.

``EngineCore`` owns scheduling and execution; ``LLMEngine`` wraps it with the input and output
processing that users see. The async server drives the same ``LLMEngine.step``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ingot.config import EngineArgs, EngineConfig
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.engine.core import EngineCore
from ingot.engine.detokenizer import IncrementalDetokenizer
from ingot.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ingot.engine.sampling_params import SamplingParams
from ingot.engine.tokenizer import load_tokenizer
from ingot.errors import PromptTooLongError
from ingot.worker.executor import RpcMethod

logger = logging.getLogger("ingot")

PromptType = str | Mapping[str, Any] | list[int]


@dataclass
class _ReqState:
    """What the front end keeps of one (child) request: what users see of it. The tokens'
    owner is the core; this is the copy that outputs are built from."""

    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    """Groups the n child requests of one user request."""

    request_id: str
    children: list[str]
    prompt: str | None
    prompt_token_ids: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config)
        self.engine_core = EngineCore(config, self.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, _ReqState] = {}
        self.parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        for source in (self.model_config.generation_config, vars(self.model_config.hf_config)):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        return ids

    # ---- input processing ----------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of the vocabulary [0, {vocab})")
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len ({max_len}); "
                "shorten the prompt or raise --max-model-len"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        if params.prompt_logprobs is not None and len(token_ids) < 1:
            raise ValueError("prompt_logprobs needs a prompt")
        children = []
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None and params.n > 1:
                child_params.seed = params.seed + i
            if not params.ignore_eos:
                child_params.all_stop_token_ids |= self.eos_token_ids
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(self._make_request(child_id, token_ids, child_params, arrival_time))
        added: list[str] = []
        try:
            for child in children:
                self.engine_core.add_request(
                    Request(child.request_id, token_ids, child.params, child.metrics.arrival_time)
                )
                added.append(child.request_id)
        except BaseException:
            # A constraint that does not compile fails this request only, with nothing left.
            self.engine_core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.parents[request_id] = _Parent(request_id, [c.request_id for c in children], text, token_ids)
        for child in children:
            self.requests[child.request_id] = child
            self._child_to_parent[child.request_id] = request_id
        return request_id

    def _make_request(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> _ReqState:
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
        return _ReqState(
            req_id, params, detok,
            RequestMetrics(arrival_time=arrival_time or time.time()),
            logprobs=[] if with_lp else None,
            cumulative_logprob=0.0 if with_lp else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for parent_id in ids:
            parent = self.parents.pop(parent_id, None)
            if parent is None:
                continue
            self.engine_core.finish_requests(parent.children, RequestStatus.FINISHED_ABORTED)
            for child in parent.children:
                self.requests.pop(child, None)
                self._child_to_parent.pop(child, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self.engine_core.reset_prefix_cache()

    def start_profile(self) -> None:
        self.engine_core.collective_rpc("profile", (True,))

    def stop_profile(self) -> str | None:
        """Stops the profiler; returns the trace path (None if nothing was recorded)."""
        return self.engine_core.collective_rpc("profile", (False,))[0]

    def get_stats(self) -> dict[str, Any]:
        """Scheduler and KV cache state plus per-bucket padding counters (plain numbers)."""
        return self.engine_core.get_stats()

    def startup_stats(self) -> dict[str, Any]:
        """Rank 0's load, compile and warmup figures."""
        return self.engine_core.collective_rpc("startup_stats")[0]

    def collective_rpc(
        self, method: RpcMethod, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a Worker method (or ``fn(worker, *args)``) on every worker."""
        return self.engine_core.collective_rpc(method, args, kwargs)

    @property
    def workers_are_local(self) -> bool:
        """The workers run in this process (the uni executor)."""
        return self.engine_core.workers_are_local

    def request_blocks(self, request_id: str) -> list[int]:
        """The KV block ids a running request holds."""
        return self.engine_core.request_blocks(request_id)

    def check_health(self) -> None:
        self.engine_core.check_health()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- output processing ---------------------------------------------------------------
    def _decoded(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids: list[int], lps: list[float], sampled_rank: int) -> dict[int, Logprob]:
        entries = {ids[0]: Logprob(lps[0], sampled_rank, self._decoded(ids[0]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entries.setdefault(tid, Logprob(lp, rank, self._decoded(tid)))
        return entries

    def _process(self, core_outputs: list[EngineCoreOutput]) -> set[str]:
        """Apply one step's core outputs; returns the parents whose outputs changed."""
        touched: set[str] = set()
        now = time.time()
        stopped: list[str] = []
        for out in core_outputs:
            state = self.requests.get(out.req_id)
            if state is None:
                continue
            parent = self._child_to_parent[out.req_id]
            state.num_cached_tokens = out.num_cached_tokens
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = out.first_scheduled_time
            chunk = out.new_prompt_logprobs
            if chunk is not None and state.prompt_logprobs is not None:
                for ids, lps, rank in zip(chunk.token_ids, chunk.logprobs, chunk.ranks, strict=True):
                    state.prompt_logprobs.append(self._logprob_dict(ids, lps, rank))
            if state.prompt_logprobs is not None:
                touched.add(parent)
            if not out.new_token_ids:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
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
                    # A stop string: the core still runs the request; tell it to stop.
                    state.stop_reason = matched
                    status = RequestStatus.FINISHED_STOPPED
                    stopped.append(out.req_id)
            if status is not None:
                state.finish_reason = status.value
                state.metrics.finished_time = now
            touched.add(parent)
        if stopped:
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return touched

    def _completion(self, index: int, request: _ReqState) -> CompletionOutput:
        finished = request.is_finished
        text = ""
        if request.detokenizer is not None:
            text = request.detokenizer.get_next_output_text(finished, delta=False)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob,
            logprobs=request.logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _make_output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        children = [self.requests[c] for c in parent.children]
        finished = all(c.is_finished for c in children)
        first = children[0]
        return RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=[self._completion(i, c) for i, c in enumerate(children)],
            finished=finished,
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
        )

    def step(self) -> list[RequestOutput]:
        touched = self._process(self.engine_core.step())
        outputs = []
        for parent_id in sorted(touched, key=lambda p: self.parents[p].children[0]):
            out = self._make_output(parent_id)
            outputs.append(out)
            if out.finished:
                self._release(parent_id)
        return outputs

    def _release(self, parent_id: str) -> None:
        parent = self.parents.pop(parent_id)
        for child in parent.children:
            self.requests.pop(child, None)
            self._child_to_parent.pop(child, None)
