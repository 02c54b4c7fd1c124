"""The synchronous engine: the input processor, the engine core (or the data-parallel client)
and the output processor, composed; the step loop is ``step()``.

``InputProcessor`` (engine/processor.py) turns prompts into checked token ids;
``EngineCore`` (or ``DPEngineCoreClient``) owns scheduling and execution;
``OutputProcessor`` (engine/output_processor.py) turns the core's outputs into what users see.
The async server drives the same ``LLMEngine.step``.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.core.request import Request, RequestStatus
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.core import EngineCore
from ingot.engine.core_client import EngineCoreClient
from ingot.engine.dp_client import DPEngineCoreClient
from ingot.engine.output_processor import OutputProcessor
from ingot.engine.outputs import IterationStats, PoolingRequestOutput, RequestOutput
from ingot.engine.processor import InputProcessor, PromptType
from ingot.engine.tokenizer import load_tokenizer
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams
from ingot.worker.executor import RpcMethod


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config)
        self.processor = InputProcessor(config.model_config, self.tokenizer)
        # Data parallelism: N engine-core processes behind this front end, same interface.
        self.engine_core: EngineCoreClient = (
            DPEngineCoreClient(config) if config.parallel_config.data_parallel_size > 1
            else EngineCore(config, self.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer, self.processor.eos_token_ids)
        self._ids = itertools.count()
        #: What the latest ``step`` did for users' requests (the metrics read it).
        self.iteration_stats = IterationStats()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests ----------------------------------------------------------------------------
    def _request_id(self, request_id: str | None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        if isinstance(params, PoolingParams) or (params is None and self.model_config.is_pooling):
            return self._add_pooling_request(request_id, prompt, params or PoolingParams(),
                                             arrival_time)
        self.processor.check_generative()
        params = params or SamplingParams()
        request_id = self._request_id(request_id)
        processed = self.processor.process(prompt, params)
        detok_context = processed.token_ids if processed.embeds is None else []
        children = self.output_processor.fan_out(request_id, detok_context, params, arrival_time)
        added: list[str] = []
        try:
            for child in children:
                self.engine_core.add_request(
                    Request(child.request_id, processed.token_ids, child.params,
                            child.metrics.arrival_time, prompt_embeds=processed.embeds,
                            cache_salt=processed.cache_salt)
                )
                added.append(child.request_id)
        except BaseException:
            # The core fails a request it cannot admit in a later step's output; what raises
            # here (a DP replica's socket) leaves none of the request's children behind.
            self.engine_core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(request_id, processed.text, processed.token_ids,
                                          children)
        return request_id

    def _add_pooling_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
    ) -> str:
        params = self.processor.resolve_pooling_params(params)
        request_id = self._request_id(request_id)
        text, token_ids, model_ids = self.processor.pooling_prompt(
            prompt, params.truncate_prompt_tokens)
        state = self.output_processor.pooling_state(request_id, params, arrival_time)
        self.output_processor.add_request(request_id, text, token_ids, [state])
        self.engine_core.add_request(
            Request(request_id, model_ids, None, state.metrics.arrival_time, pooling_params=params)
        )
        return request_id

    def submit_structured_output(self, params: SamplingParams) -> Future | None:
        """Start compiling ``params``' constraint in the core, without waiting (the server's
        check before a response starts); None without a constraint."""
        return self.engine_core.submit_structured_output(params)

    def release_structured_output(self, params: SamplingParams, future: Future) -> None:
        """The caller of ``submit_structured_output`` stops waiting for ``future`` before it
        is done (it timed out, or its client left): a compile nobody waits for any more
        leaves the compile queue if it has not started."""
        self.engine_core.release_structured_output(params, future)

    def abort_request(self, request_ids: str | list[str]) -> dict[str, int]:
        """Abort the user requests still running among ``request_ids``; returns each one's
        number of sequences (its ``n``)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.output_processor.abort_requests(ids)
        for children in aborted.values():
            self.engine_core.finish_requests(children, RequestStatus.FINISHED_ABORTED)
        return {parent: len(children) for parent, children in aborted.items()}

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.get_num_unfinished_requests() > 0

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def has_pending_work(self) -> bool:
        """User requests still running, or core work left over from finished ones (a step in
        flight, workers not yet told to forget a request): a loop that owns the engine keeps
        stepping until this is False."""
        return self.has_unfinished_requests() or self.engine_core.has_pending_work()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step: the outputs of the requests it advanced, each shaped by its
        ``output_kind`` (FINAL_ONLY requests appear once, finished); the step's stats are
        then ``iteration_stats``."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        self.iteration_stats = processed.stats
        if processed.to_stop:
            self.engine_core.finish_requests(processed.to_stop, RequestStatus.FINISHED_STOPPED)
        if processed.to_abort:
            self.engine_core.finish_requests(processed.to_abort, RequestStatus.FINISHED_ABORTED)
        return processed.outputs

    # ---- workers, stats ----------------------------------------------------------------------
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
