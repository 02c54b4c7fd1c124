"""The synchronous engine: request intake and validation, the step loop (schedule -> execute ->
update), stop checks, detokenization, and ``n > 1`` fan-out into child requests.

``EngineCore`` owns scheduling and execution; ``LLMEngine`` wraps it with the input and output
processing that users see. The async server drives the same ``LLMEngine.step``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingot.config import EngineConfig
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.core import EngineCore
from ingot.engine.detokenizer import IncrementalDetokenizer
from ingot.engine.dp_client import DPEngineCoreClient
from ingot.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ingot.engine.prompt_embeds import (
    PROMPT_EMBEDS_PLACEHOLDER,
    check_prompt_embeds,
    content_hash,
)
from ingot.engine.tokenizer import encode_texts, load_tokenizer
from ingot.errors import PromptTooLongError
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams
from ingot.worker.executor import RpcMethod

logger = logging.getLogger("ingot")

PromptType = str | Mapping[str, Any] | list[int]


@dataclass
class _ReqState:
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
        # Data parallelism: N engine-core processes behind this front end, same interface.
        self.engine_core: EngineCore | DPEngineCoreClient = (
            DPEngineCoreClient(config, self.tokenizer)
            if config.parallel_config.data_parallel_size > 1 else EngineCore(config, self.tokenizer))
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
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        is_pooling = self.model_config.is_pooling
        if isinstance(params, PoolingParams) or (params is None and is_pooling):
            return self._add_pooling_request(request_id, prompt, params or PoolingParams(),
                                             arrival_time)
        if is_pooling:
            raise ValueError(
                f"this engine runs {self.model_config.architecture} as a pooling model "
                "(--runner pooling): it returns embeddings or scores and cannot generate text; "
                "use embed / classify / score, or start a generative model"
            )
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        embeds = self._prompt_embeds(prompt, params)
        salt = b""
        if embeds is not None:
            # Scheduling stays in token space: one placeholder id per row.
            text, token_ids = None, [PROMPT_EMBEDS_PLACEHOLDER] * embeds.shape[0]
            salt = content_hash(embeds)
        else:
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
            detok_context = token_ids if embeds is None else []
            children.append(self._make_request(child_id, detok_context, child_params, arrival_time))
        added: list[str] = []
        try:
            for child in children:
                self.engine_core.add_request(
                    Request(child.request_id, token_ids, child.params, child.metrics.arrival_time,
                            prompt_embeds=embeds, cache_salt=salt)
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

    def _prompt_embeds(self, prompt: PromptType, params: SamplingParams) -> Any:
        """The checked tensor of a ``{"prompt_embeds": tensor}`` prompt, else None."""
        if not isinstance(prompt, Mapping) or "prompt_embeds" not in prompt:
            return None
        mc = self.model_config
        if not mc.enable_prompt_embeds:
            raise ValueError(
                "prompt_embeds is off on this engine; start it with --enable-prompt-embeds "
                "(LLM(enable_prompt_embeds=True))"
            )
        if params.prompt_logprobs is not None or params.repetition_penalty != 1.0:
            raise ValueError(
                "prompt_logprobs and repetition_penalty need the prompt's token ids; a "
                "prompt_embeds request has none"
            )
        return check_prompt_embeds(prompt["prompt_embeds"], mc.hidden_size, mc.max_model_len)

    # ---- pooling requests ------------------------------------------------------------------
    def pretokenize(
        self, prompts: Sequence[PromptType], truncate: Sequence[int | None]
    ) -> list[PromptType]:
        """The text prompts that would be encoded one by one (non-empty, no truncation),
        encoded in one batch (``encode_texts``) into ``{"prompt", "prompt_token_ids"}``
        prompts, which give the same ids; every other prompt is returned as it is."""
        out = list(prompts)
        todo = [i for i, (p, k) in enumerate(zip(prompts, truncate, strict=True))
                if isinstance(p, str) and p and k is None]
        if self.tokenizer is None or len(todo) < 2:
            return out
        for i, ids in zip(todo, encode_texts(self.tokenizer, [out[i] for i in todo]), strict=True):
            out[i] = {"prompt": out[i], "prompt_token_ids": ids}
        return out

    def pooling_prompt(
        self, prompt: PromptType, truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int], list[int]]:
        """(text, token ids, the ids the model gets) of a pooling prompt, truncated to
        ``truncate_prompt_tokens`` (-1: max_model_len): text through the tokenizer (which keeps
        its end token, as sentence-transformers truncates), token ids keep their last tokens (as
        vLLM). A prompt dict may carry ``token_type_ids`` (cross-encoder pairs): the model's ids
        carry them (models/bert.py, ``encode_token_type_ids``)."""
        k = truncate_prompt_tokens
        if k == -1:
            k = self.model_config.max_model_len
        types = prompt.get("token_type_ids") if isinstance(prompt, Mapping) else None
        if isinstance(prompt, str) and k is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            text, token_ids = prompt, self.tokenizer.encode(prompt, truncation=True, max_length=k)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
            if k is not None and len(token_ids) > k:
                token_ids = token_ids[-k:]
                types = types[-k:] if types is not None else None
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise PromptTooLongError(
                f"the input has {len(token_ids)} tokens, more than max_model_len ({max_len}); "
                "shorten it or pass truncate_prompt_tokens (-1: cut to max_model_len)"
            )
        self._validate_prompt(token_ids)
        if types is None:
            return text, token_ids, token_ids
        if not self.model_config.is_encoder_only:
            raise ValueError("token_type_ids are for BERT-style (encoder-only) models")
        from ingot.model_executor.models.bert import encode_token_type_ids

        types = list(types)
        type_vocab = int(getattr(self.model_config.hf_config, "type_vocab_size", 1))
        if any(not isinstance(t, int) or not 0 <= t < type_vocab for t in types):
            raise ValueError(f"token_type_ids must be integers in [0, {type_vocab})")
        return text, token_ids, encode_token_type_ids(token_ids, types)

    def resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """The request's parameters with the model's defaults filled in; refuses what the model
        cannot do (a task it lacks, ``dimensions`` on a model not trained for them)."""
        mc = self.model_config
        if not mc.is_pooling:
            raise ValueError(
                f"{mc.architecture} is served as a generative model: embeddings, classification "
                "and scores need a pooling model (start it with --runner pooling)"
            )
        pooler = mc.pooler_config
        assert pooler is not None
        params = params.clone()
        native = pooler.task
        if params.task is None or params.task == "encode":
            params.task = native
        allowed = ("embed",) if native == "embed" else ("classify", "score")
        if params.task not in allowed:
            raise ValueError(
                f"task {params.task!r} is not supported by {mc.architecture} (a "
                f"{'n embedding' if native == 'embed' else ' classification'} model); it "
                f"supports {', '.join(allowed)}"
            )
        if params.dimensions is not None:
            if params.task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            hf = mc.hf_config
            listed = getattr(hf, "matryoshka_dimensions", None)
            if not (listed or getattr(hf, "is_matryoshka", False)):
                raise ValueError(
                    f"Model \"{mc.served_model_name}\" does not support matryoshka "
                    "representation, changing output dimensions will lead to poor results; "
                    "drop dimensions"
                )
            if listed and params.dimensions not in listed:
                raise ValueError(f"dimensions must be one of {sorted(listed)}, got {params.dimensions}")
            if params.dimensions > int(hf.hidden_size):
                raise ValueError(f"dimensions must be <= {hf.hidden_size}, got {params.dimensions}")
        if params.normalize is None:
            params.normalize = pooler.normalize and params.task == "embed"
        if params.activation is None:
            params.activation = True
        return params

    def _add_pooling_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
    ) -> str:
        params = self.resolve_pooling_params(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, model_ids = self.pooling_prompt(prompt, params.truncate_prompt_tokens)
        state = _ReqState(request_id, params, None,
                          RequestMetrics(arrival_time=arrival_time or time.time()))
        self.parents[request_id] = _Parent(request_id, [request_id], text, token_ids)
        self.requests[request_id] = state
        self._child_to_parent[request_id] = request_id
        self.engine_core.add_request(
            Request(request_id, model_ids, None, state.metrics.arrival_time, pooling_params=params)
        )
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

    def has_pending_work(self) -> bool:
        """User requests still running, or core work left over from finished ones (a step in
        flight, workers not yet told to forget a request): a loop that owns the engine keeps
        stepping until this is False."""
        return bool(self.parents) or self.engine_core.has_pending_work()

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
        failed: list[str] = []
        for out in core_outputs:
            state = self.requests.get(out.req_id)
            if state is None:
                continue
            parent = self._child_to_parent[out.req_id]
            if out.error is not None:
                state.error, state.finish_reason = out.error, out.finish_status.value
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
        for parent in failed:
            # One failed child fails its request: its siblings (same constraint) stop too.
            rest = [c for c in self.parents[parent].children if not self.requests[c].is_finished]
            self.engine_core.finish_requests(rest, RequestStatus.FINISHED_ABORTED)
            for child in rest:
                self.requests[child].finish_reason = RequestStatus.FINISHED_ABORTED.value
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

    def _make_output(self, parent_id: str) -> RequestOutput | PoolingRequestOutput:
        parent = self.parents[parent_id]
        children = [self.requests[c] for c in parent.children]
        if isinstance(children[0].params, PoolingParams):
            state = children[0]
            return PoolingRequestOutput(
                request_id=parent_id, prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids,
                outputs=PoolingOutput(list(state.pooled or [])), finished=state.is_finished,
                metrics=state.metrics,
            )
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
            error=next((c.error for c in children if c.error is not None), None),
        )

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
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
