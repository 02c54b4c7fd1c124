"""Executors run the model on one or more workers. The engine core talks to workers only
through this interface (``initialize``, ``execute_model``, ``collective_rpc``, ``shutdown``),
so the uniprocess, multiprocess and Ray executors are interchangeable.

``collective_rpc(method, args)`` calls a public Worker method by name on every worker, or a
module-level function ``fn(worker, *args)``, and returns one result per worker, rank order.
Workers in other processes receive the call as data (distributed/wire.py): a function travels
as its name and must be registered with ``@rpc_function``; arguments and results are plain
data, tensors and arrays (a tuple comes back as a list). An RPC that raises on a rank raises
the same error (a builtin or ingot error class) in the caller, and the workers serve on; only
a failed step (``STEP_METHODS``) or a dead process ends them.

``execute_model(so, non_block=True)`` returns a future instead (async scheduling): steps run
in the order they are submitted, and a ``collective_rpc`` waits behind the steps in flight, so
a worker only ever does one thing at a time.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.distributed.wire import RpcName
from ingot.runner_output import ModelRunnerOutput
from ingot.sched_output import SchedulerOutput

RpcMethod = str | Callable[..., Any] | RpcName

#: The calls a step is made of: their ranks meet in collectives, so one that raises leaves the
#: others waiting there, and the workers are broken (any other RPC's error is only returned).
STEP_METHODS = frozenset({"execute_model", "execute_dummy_batch", "dp_has_unfinished",
                          "determine_num_blocks", "initialize_cache"})
#: How long the other ranks may take to answer a call that one rank failed (a registered
#: function may hold them in a collective with it) before the workers are taken as stuck.
RPC_ERROR_GRACE_S = float(os.environ.get("INGOT_RPC_ERROR_GRACE_S", "30"))


def rpc_label(method: RpcMethod) -> str:
    """How errors name a call."""
    if isinstance(method, RpcName):
        return method.name
    return method if isinstance(method, str) else getattr(method, "__name__", "rpc")


def run_on_worker(worker: Any, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``method`` on ``worker``: a public Worker method by name, a registered function that
    came by name (``RpcName``), or, in the worker's own process only, any function."""
    if isinstance(method, RpcName):
        return method.resolve()(worker, *args, **kwargs)
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(type(worker), method, None)):
            raise AttributeError(f"the worker has no RPC method {method!r} (a public Worker "
                                 "method, or a function registered with @rpc_function)")
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)


class Executor(ABC):
    #: The workers share this process's memory: objects (a model, a module hook) can be handed
    #: back and forth through collective_rpc. The accuracy toolkit needs that.
    is_local: bool = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

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

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Rank 0's output of one step; with ``non_block``, a future of it."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""



class FanOutExecutor(Executor):
    """An executor whose workers are elsewhere (processes, Ray actors): every call goes to
    every rank and one reply gathers theirs (rank 0's output of a step, every rank's result of
    a ``collective_rpc``). Subclasses say how a call travels (``_send``)."""

    @abstractmethod
    def _send(self, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any] | None,
              pick: Callable[[list[Any]], Any]) -> Future[Any]:
        """Send one call to every rank; the future resolves to ``pick(results in rank order)``
        and fails when a rank does."""

    def collective_rpc(
        self, method: RpcMethod, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self._send(method, args, kwargs, list).result()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        reply = self._send("execute_model", (scheduler_output,), None, lambda r: r[0])
        return reply if non_block else reply.result()


class ComputeThread:
    """The one thread that runs a worker, from its construction (model load, warmup) to its
    last step; calls run in submission order.

    Why one thread for the worker's whole life: OpenMP keeps a team of threads per calling
    thread, and while a second thread's team exists both run at about half speed on a busy
    core count (measured: batch-1 decode 60 -> 35 tok/s once an engine warmed up on one
    thread was stepped from another, as the server's engine thread did). With every model op
    on this thread, the engine thread (scheduling, detokenizing, serving) runs none. A daemon:
    a process that exits (Ctrl-C during start-up) does not wait for a model load to finish.
    """

    def __init__(self, name: str = "ingot-device") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, args, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(exc)
            # While it waits for the next call this frame must hold nothing: the last call's
            # arguments and result (the worker itself) would outlive an engine dropped
            # without shutdown(), model and KV cache included.
            del call, fn, args, future

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((fn, args, future))
        return future

    def release(self) -> None:
        """End the thread after the calls already submitted, without waiting for it."""
        self._calls.put(None)

    def stop(self) -> None:
        """Finish the calls already submitted, then end the thread."""
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)


class UniProcExecutor(Executor):
    """One worker in this process, built and run on its own compute thread (see
    ``ComputeThread``). Calls wait for their result, except ``execute_model(non_block=True)``
    under async scheduling: torch releases the GIL inside its kernels, so the engine thread
    schedules and detokenizes while the step runs."""

    is_local = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from ingot.worker.worker import Worker

        self._device = ComputeThread()
        try:
            self.worker = self._device.submit(Worker, config).result()
        except BaseException:
            self._device.stop()
            raise
        # An engine dropped without shutdown() (an LLM that goes out of scope) ends its compute
        # thread too, which then lets the worker go (without waiting for the thread).
        weakref.finalize(self, self._device.release)

    def collective_rpc(
        self, method: RpcMethod, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [self._device.submit(run_on_worker, self.worker, method, args, kwargs or {}).result()]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        future = self._device.submit(self.worker.execute_model, scheduler_output)
        return future if non_block else future.result()

    def check_health(self) -> None:
        pass  # the worker lives and dies with this process

    def shutdown(self) -> None:
        self._device.stop()
