"""EngineCore: the scheduler, the KV cache manager and the executor; owns every request's
tokens and state. ``step()`` schedules, executes and applies the results, returning one
``EngineCoreOutput`` per request that ran. The front end (``LLMEngine``) only tokenizes,
detokenizes, checks stop strings and builds user-facing outputs.

With async scheduling the core keeps a batch queue of depth 2: it schedules and submits step
N+1 before it waits for step N's results, so scheduling, result processing and the front end's
work overlap the forward pass. The scheduler counts the tokens in flight as placeholders, so a
request never runs past its max_tokens; a request that stops (EOS, stop string, abort) while
its next step is in flight has that step's token dropped."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.core.scheduler import Scheduler
from ingot.core.spec_policy import SpecDecodingStats
from ingot.runner_output import ModelRunnerOutput
from ingot.sampling_params import SamplingParams
from ingot.sched_output import SchedulerOutput
from ingot.structured_output.manager import StructuredOutputManager
from ingot.worker.executor import Executor, RpcMethod, UniProcExecutor

logger = logging.getLogger("ingot")

#: Seconds between speculative decoding's acceptance lines in the log (vLLM logs as often).
SPEC_LOG_INTERVAL_S = 10.0


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        """``tokenizer``: the HF tokenizer, which grammars compile against (None: no
        structured outputs)."""
        self.config = config
        self.executor = executor_class(config)(config)
        try:
            self.num_blocks = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.cache_config.block_size,
            config.model_config.max_model_len,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
        )
        self.structured_output = StructuredOutputManager(
            tokenizer, config.model_config.vocab_size, config.structured_outputs
        )
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv_cache_manager, config.buckets, self.structured_output,
            config.speculative_config,
        )
        logger.info(
            "bucket grid: %s; at most %d requests at once (KV bound); up to %d prompts per "
            "prefill step",
            config.buckets.describe(),
            min(self.scheduler.max_kv_concurrent, config.scheduler_config.max_num_seqs),
            config.scheduler_config.max_num_prefills_per_step,
        )
        #: Forward steps run (not counting empty schedules).
        self.num_steps = 0
        # Async scheduling: steps submitted whose results are not applied yet, oldest first.
        self.max_in_flight = 2 if config.scheduler_config.async_scheduling else 1
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        # When the last speculative-decoding line was logged, and the counters then.
        self._spec_logged: tuple[float, SpecDecodingStats | None] = (time.monotonic(), None)
        # The workers' runtime counters, as the latest step output brought them.
        self._runtime_stats: dict[str, Any] = self.collective_rpc("runtime_stats")[0]

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. A constrained one waits (``WAITING_FOR_FSM``) while its grammar
        compiles on the manager's pool; one that fails to compile, or whose admission raises,
        finishes with ``error`` set in the next step's output: nothing raised here reaches the
        step loop (a DP replica's included)."""
        self.scheduler.add_request(request)  # first: a failure below finishes it there
        try:
            if request.use_structured_output and not self.structured_output.add_request(
                    request.request_id, request.sampling_params):
                request.status = RequestStatus.WAITING_FOR_FSM
        except Exception as exc:
            self.scheduler.fail_request(request.request_id, exc, "admitting")

    def submit_structured_output(self, params: SamplingParams) -> Future | None:
        """Start compiling ``params``' constraint (then cached) without waiting: the server
        awaits the future before a stream starts, so a bad schema is a 400 rather than an
        error event (and a full compile queue a 503). None without a constraint."""
        if params.structured_outputs is None:
            return None
        # The server's admission: a new grammar past a full compile queue is refused (503).
        return self.structured_output.submit(params.structured_outputs, admit=True)

    def release_structured_output(self, params: SamplingParams, future: Future) -> None:
        """The server stopped waiting for ``future``: if no request waits for that compile
        either and it has not started, it leaves the queue."""
        if params.structured_outputs is not None:
            self.structured_output.release(params.structured_outputs, future)

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        """Abort (or, for a stop string the front end found, stop) requests; frees blocks."""
        for rid in request_ids:
            self.scheduler.finish_request(rid, status)

    def has_pending_work(self) -> bool:
        """Requests to run, steps in flight, or finished requests the workers have not been
        told of yet: the step loop runs until none is left."""
        return (self.scheduler.has_unfinished_requests() or bool(self.batch_queue)
                or self.scheduler.has_finished_to_report())

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        self._fail_uncompiled()
        outputs = self._step()
        # The requests failed since the last step: at add, compiling, admission (this step's).
        outputs = self.scheduler.take_failed() + outputs
        if not outputs and not self.batch_queue:
            # Nothing ran: only requests waiting for a grammar are left (if any). Block on
            # their compiles briefly rather than spin; commands wait at most this long.
            self.structured_output.wait_for_compiles(0.01)
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self.max_in_flight > 1:
            return self._step_with_batch_queue()
        so = self.scheduler.schedule()
        if so.is_empty and not so.finished_req_ids:
            return []
        # (An empty step still tells the workers which requests to forget.)
        start = time.perf_counter()
        output = self.executor.execute_model(so)
        # The speculation policy compares decode steps' token rates (synchronous steps only:
        # speculation turns async scheduling off).
        self.scheduler.record_step_time(so, time.perf_counter() - start,
                                        sum(len(t) for t in output.sampled_token_ids))
        return self._apply(so, output)

    def _fail_uncompiled(self) -> None:
        """Fail the requests whose constraint failed to compile or timed out, each with its
        error (the request's fault); the rest of the engine is untouched."""
        for rid, error in self.structured_output.take_failed():
            self.scheduler.fail_request(rid, error)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Submit the next step while the queue has room; wait for the oldest only when the
        queue is full or nothing more can be scheduled. Returns [] when it only submitted."""
        queue = self.batch_queue
        submitted = False
        if len(queue) < self.max_in_flight:
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids:
                queue.append((so, self.executor.execute_model(so, non_block=True)))
                submitted = True
        if not queue or (submitted and len(queue) < self.max_in_flight):
            return []
        so, future = queue.popleft()
        return self._apply(so, future.result())

    def _apply(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if output.runtime_stats is not None:
            self._runtime_stats = output.runtime_stats
        if so.is_empty:
            return []
        self.num_steps += 1
        outputs = self.scheduler.update_from_output(so, output)
        self._log_spec_decoding()
        return outputs

    def _log_spec_decoding(self) -> None:
        """Every SPEC_LOG_INTERVAL_S while speculating: acceptance since the last line."""
        stats = self.scheduler.spec_stats
        now = time.monotonic()
        if stats is None or now - self._spec_logged[0] < SPEC_LOG_INTERVAL_S:
            return
        line = stats.log_line(self._spec_logged[1])
        if line is not None:
            logger.info(line)
        self._spec_logged = (now, stats.copy())

    # ---- workers, stats ------------------------------------------------------------------
    def collective_rpc(
        self, method: RpcMethod, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.executor.collective_rpc(method, args, kwargs)

    @property
    def workers_are_local(self) -> bool:
        return self.executor.is_local

    def check_health(self) -> None:
        self.executor.check_health()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def request_blocks(self, request_id: str) -> list[int]:
        """The block ids a running request holds (the accuracy toolkit reads its cache)."""
        return list(self.kv_cache_manager.req_blocks[request_id])

    def get_stats(self) -> dict[str, Any]:
        """Scheduler and KV cache state, per-bucket padding counters and the workers'
        compilation counters (plain numbers)."""
        scheduler = self.scheduler
        kv = self.kv_cache_manager
        pool = kv.pool
        runtime = self._runtime_stats
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
            "num_steps": self.num_steps,
            "buckets": scheduler.bucket_stats,
            "compilation": runtime["compilation"],
            "cpu_compute_threads": runtime["cpu_compute_threads"],
            "async_scheduling": self.max_in_flight > 1,
            "async_steps": runtime["async_steps"],
            "sync_fallback_steps": runtime["sync_fallback_steps"],
            "num_runner_requests": runtime["num_runner_requests"],
            "spec_decode": scheduler.spec_stats,
        }

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor ``--distributed-executor-backend`` names (imported only when chosen: Ray
    is an optional dependency)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from ingot.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from ingot.worker.ray_executor import RayExecutor

        return RayExecutor
    return UniProcExecutor
