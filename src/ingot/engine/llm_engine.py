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
from dataclasses import dataclass
from typing import Any

from ingot.config import EngineArgs, EngineConfig
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.scheduler import Scheduler
from ingot.engine.detokenizer import IncrementalDetokenizer
from ingot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ingot.engine.request import Request, RequestStatus
from ingot.engine.sampling_params import SamplingParams
from ingot.engine.tokenizer import load_tokenizer
from ingot.errors import PromptTooLongError
from ingot.worker.executor import UniProcExecutor
from ingot.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("ingot")

PromptType = str | Mapping[str, Any] | list[int]


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks,
            config.cache_config.block_size,
            config.model_config.max_model_len,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, config.buckets)
        logger.info(
            "bucket grid: %s; at most %d requests at once (KV bound)",
            config.buckets.describe(),
            min(self.scheduler.max_kv_concurrent, config.scheduler_config.max_num_seqs),
        )

    def step(self) -> tuple[list[str], ModelRunnerOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return [], ModelRunnerOutput([], [])
        output = self.executor.execute_model(so)
        self.scheduler.update_from_output(so)
        return [it.req_id for it in so.scheduled], output


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
        self.engine_core = EngineCore(config)
        self.scheduler = self.engine_core.scheduler
        self.eos_token_ids = self._eos_token_ids()
        self.eos_token_id = next(iter(sorted(self.eos_token_ids)), None)
        self.requests: dict[str, Request] = {}
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
            children.append(self._make_request(child_id, text, token_ids, child_params, arrival_time))
        self.parents[request_id] = _Parent(request_id, [c.request_id for c in children], text, token_ids)
        for child in children:
            self.scheduler.add_request(child)
            self.requests[child.request_id] = child
            self._child_to_parent[child.request_id] = request_id
        return request_id

    def _make_request(
        self,
        req_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> Request:
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
        return Request(req_id, token_ids, params, self.eos_token_id, text, arrival_time, detok)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for parent_id in ids:
            parent = self.parents.pop(parent_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(child, None)
                self._child_to_parent.pop(child, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self.engine_core.kv_cache_manager.reset_prefix_cache()

    def start_profile(self) -> None:
        self.engine_core.executor.profile(is_start=True)

    def stop_profile(self) -> str | None:
        """Stops the profiler; returns the trace path (None if nothing was recorded)."""
        return self.engine_core.executor.profile(is_start=False)

    def get_stats(self) -> dict[str, Any]:
        """Scheduler and KV cache state plus per-bucket padding counters (plain numbers)."""
        scheduler = self.scheduler
        kv = self.engine_core.kv_cache_manager
        pool = kv.pool
        runner_stats = self.engine_core.executor.worker.model_runner.stats
        return {
            "scheduler_state": scheduler.state.value,
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "max_kv_concurrent": scheduler.max_kv_concurrent,
            "total_padding_tokens": scheduler.total_padding_tokens,
            "kv_blocks_total": pool.num_usable_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_blocks_used": pool.num_usable_blocks - pool.num_free_blocks,
            "kv_usage": pool.usage(),
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
            "buckets": runner_stats,
            "compilation": self.engine_core.executor.worker.compile_stats(),
        }

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

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens and token in params.all_stop_token_ids:
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.model_config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _process(self, scheduled: list[str], output: ModelRunnerOutput) -> set[str]:
        """Apply one step's results; returns the parents whose outputs changed."""
        touched: set[str] = set()
        now = time.time()
        for req_id, chunk in output.prompt_logprobs.items():
            request = self.requests.get(req_id)
            if request is None or request.prompt_logprobs is None:
                continue
            for ids, lps, rank in zip(chunk.token_ids, chunk.logprobs, chunk.ranks, strict=True):
                request.prompt_logprobs.append(self._logprob_dict(ids, lps, rank))
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.output_token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            lp = output.logprobs.get(req_id)
            if lp is not None:
                request.append_logprobs(self._logprob_dict(lp.token_ids, lp.logprobs, lp.rank), lp.logprobs[0])
            status = self._check_stop(request, token)
            if request.detokenizer is not None:
                matched = request.detokenizer.update([token], finishing=status is not None)
                if matched is not None and status is None:
                    request.stop_reason = matched
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                request.metrics.finished_time = now
                self.scheduler.finish_request(req_id, status)
            touched.add(self._child_to_parent[req_id])
        for req_id in scheduled:
            parent = self._child_to_parent.get(req_id)
            if parent is not None and self.requests[req_id].prompt_logprobs is not None:
                touched.add(parent)
        return touched

    def _completion(self, index: int, request: Request) -> CompletionOutput:
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
            finish_reason=request.status.value if finished else None,
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
        scheduled, output = self.engine_core.step()
        touched = self._process(scheduled, output)
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
