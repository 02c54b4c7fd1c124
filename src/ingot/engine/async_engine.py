"""AsyncLLM: the engine's step loop on a background thread, an asyncio front end.

The engine (scheduler, runner, detokenizer) is only ever touched by its own thread. The asyncio
side sends it commands (add, abort) through a queue and each request receives its outputs in
its own ``OutputSlot``: one pending output, into which newer ones merge (deltas concatenate,
cumulative and final outputs replace), so a consumer that falls behind holds at most the
output it has not read, never a queue of copies. A thread rather than a process: torch
releases the GIL inside its ops, the loop's Python work per step is small, and outputs need no
serialisation. If a step raises, every pending request gets the error and the engine reports
itself dead (the health check fails); nothing hangs. It is the server's ``EngineClient``
(engine/protocol.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ingot.config import ModelConfig
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.outputs import (
    IterationStats,
    PoolingRequestOutput,
    RequestOutput,
    request_error,
)
from ingot.engine.processor import InputProcessor, PromptType
from ingot.engine.protocol import EngineDeadError
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import RequestOutputKind, SamplingParams
from ingot.structured_output.manager import compile_timeout_message

logger = logging.getLogger("ingot")

# Called on the engine thread after every step: (engine, the step's stats, step seconds).
StepCallback = Callable[[LLMEngine, IterationStats, float], None]
# Called on the engine thread after an abort freed a request: (engine, request id, sequences).
AbortCallback = Callable[[LLMEngine, str, int], None]


class OutputSlot:
    """Where one request's outputs wait for its consumer (on the consumer's event loop): at
    most one pending item. A newer DELTA output merges into the pending one; a cumulative or
    final output replaces it; an error replaces everything (it ends the stream)."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self._item: Any = None  # RequestOutput | PoolingRequestOutput | BaseException | None
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        pending = self._item
        if isinstance(pending, BaseException):
            pass  # the stream ends with its error
        elif self.delta and isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.add(item)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> Any:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: StepCallback | None = None,
        on_abort: AbortCallback | None = None,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_abort = on_abort
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputSlot]] = {}
        # Guards _streams and the dead/stopped transition: a command or stream registered
        # while the engine dies must either be failed by the loop or see the error itself.
        self._lock = threading.Lock()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="ingot-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.processor

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopped and self._thread.is_alive()

    def dead(self) -> EngineDeadError:
        """The error to raise for work sent to a failed or stopped engine."""
        if self.dead_error is not None:
            return EngineDeadError(f"the engine failed: {self.dead_error!r}; restart the server")
        return EngineDeadError("the engine is shut down")

    # ---- engine thread -------------------------------------------------------------------
    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, slot = stream
            try:
                loop.call_soon_threadsafe(slot.put, item)
            except RuntimeError:  # the front end's loop is closed: nobody is listening
                pass

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                self._run_commands()
                if not engine.has_pending_work():
                    engine.check_health()  # a worker process that died while idle
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                if self._on_step is not None:
                    try:
                        self._on_step(engine, engine.iteration_stats, elapsed)
                    except Exception:  # metrics must never take the engine down
                        logger.exception("stat logging failed")
                for out in outputs:
                    # A request the engine failed (its constraint did not compile, its
                    # admission raised) ends its stream with the error, as add_request would.
                    error = request_error(out)
                    self._deliver(out.request_id, out if error is None else error)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not die silently
            logger.exception("engine step failed; failing every pending request")
            with self._lock:
                self.dead_error = exc
        self._fail_everything()

    def _fail_everything(self) -> None:
        """After the loop ends (failure or shutdown): every stream and queued command gets an
        error, so no caller waits forever."""
        with self._lock:
            self._stopped = True
            ids = list(self._streams)
        for rid in ids:
            self._deliver(rid, self.dead())
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(self.dead())

    # ---- asyncio side --------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            # Checked under the lock: once _fail_everything has drained the queue, nothing
            # new may enter it, or its future would never complete.
            if self._stopped or self.dead_error is not None:
                raise self.dead()
            self._commands.put((fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs of ``params.output_kind`` (what the consumer has not read yet
        merged into one: with DELTA, each is everything new since the last one yielded); the
        last one has ``finished=True``. Leaving the iteration early (client gone, task
        cancelled) aborts the request at once."""
        return self._stream(prompt, params, request_id)

    def encode(
        self, prompt: PromptType, params: PoolingParams, request_id: str
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (a pooling model): yields its one, finished output."""
        return self._stream(prompt, params, request_id)

    async def _stream(
        self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str
    ) -> AsyncIterator[Any]:
        slot = OutputSlot(getattr(params, "output_kind", None) is RequestOutputKind.DELTA)
        with self._lock:
            if self._stopped or self.dead_error is not None:
                raise self.dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), slot)
        finished = False
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt, params))
            while True:
                item = await slot.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and self.is_running:
                # Shielded: this runs while the caller is being cancelled, and the abort must
                # reach the engine so the request's KV blocks are freed at once.
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            num_seqs = self.engine.abort_request(request_id).get(request_id)
            if num_seqs is not None and self._on_abort is not None:  # None: already finished
                try:
                    self._on_abort(self.engine, request_id, num_seqs)
                except Exception:  # metrics must never take the engine down
                    logger.exception("stat logging failed")

        try:
            await self.call(do_abort)
        except EngineDeadError:
            pass

    async def check_structured_output(self, params: SamplingParams) -> None:
        """Compile the constraint before a response starts, so an invalid one is the caller's
        ``ValueError``. The compile is submitted on the engine thread (which owns the
        compiled-grammar cache) and runs on a compile pool; only this caller awaits it, so the
        engine keeps stepping. The request then finds its grammar cached. The wait (for a
        pool thread included) counts against ``compile_timeout_s``; a new grammar past a full
        compile queue is a ``ServerBusyError`` (503)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        timeout = self.engine.config.structured_outputs.compile_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout  # the wait for the engine thread counts too
        future = await self.call(lambda: self.engine.submit_structured_output(params))
        try:
            # Shielded: a timeout must not cancel a compile other requests may share.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                   max(deadline - loop.time(), 0))
        except TimeoutError:
            raise ValueError(compile_timeout_message(constraint.kind, timeout)) from None
        finally:
            if not future.done() and self.is_running:
                # Timed out, or the client left: a compile nobody else waits for leaves the
                # queue. Shielded, as the abort in _stream: it runs while being cancelled.
                await asyncio.shield(self._release(params, future))

    async def _release(self, params: SamplingParams, future: concurrent.futures.Future) -> None:
        try:
            await self.call(lambda: self.engine.release_structured_output(params, future))
        except EngineDeadError:
            pass

    async def start_profile(self) -> None:
        await self.call(self.engine.start_profile)

    async def stop_profile(self) -> str | None:
        return await self.call(self.engine.stop_profile)

    async def reset_prefix_cache(self) -> bool:
        return await self.call(self.engine.reset_prefix_cache)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within 10 s")
        self.engine.shutdown()
