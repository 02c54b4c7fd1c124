"""Executors run the model on one or more workers. The engine core talks to workers only
through this interface (``initialize``, ``execute_model``, ``collective_rpc``, ``shutdown``),
so the uniprocess and multiprocess executors are interchangeable.

``collective_rpc(method, args)`` calls a Worker method by name on every worker, or a
module-level function ``fn(worker, *args)`` (the multiprocess executor pickles it by
reference), and returns one result per worker, rank order.

``execute_model(so, non_block=True)`` returns a future instead (async scheduling): steps run
in the order they are submitted, and a ``collective_rpc`` waits behind the steps in flight, so
a worker only ever does one thing at a time.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.core.sched_output import SchedulerOutput
from ingot.worker.outputs import ModelRunnerOutput

RpcMethod = str | Callable[..., Any]


def run_on_worker(worker: Any, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)


class Executor(ABC):
    #: The workers share this process's memory: objects (a model, a module hook) can be handed
    #: back and forth through collective_rpc. The accuracy toolkit needs that.
    is_local: bool = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from ingot.worker.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        return UniProcExecutor

    def initialize(self) -> int:
        """Load the model on every worker, agree on the KV block count (the minimum over
        workers), allocate the caches and compile or warm up. Returns the block count."""
        num_blocks = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_cache", (num_blocks,))
        return num_blocks

    @abstractmethod
    def collective_rpc(
        self, method: RpcMethod, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class UniProcExecutor(Executor):
    """One worker in this process: calls are plain method calls. With async scheduling the
    worker runs on a dedicated "device" thread (torch releases the GIL inside its kernels, so
    the engine thread schedules and detokenizes meanwhile); every call goes through it, in
    order."""

    is_local = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from ingot.worker.worker import Worker

        self.worker = Worker(config)
        self._device: concurrent.futures.ThreadPoolExecutor | None = None
        if config.scheduler_config.async_scheduling:
            self._device = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ingot-device"
            )

    def collective_rpc(
        self, method: RpcMethod, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if self._device is None:
            return [run_on_worker(self.worker, method, args, kwargs or {})]
        return [self._device.submit(run_on_worker, self.worker, method, args, kwargs or {}).result()]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._device is None:
            output = self.worker.execute_model(scheduler_output)
            if not non_block:
                return output
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(output)
            return done
        future = self._device.submit(self.worker.execute_model, scheduler_output)
        return future if non_block else future.result()

    def check_health(self) -> None:
        pass  # the worker lives and dies with this process

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown(wait=True, cancel_futures=True)
