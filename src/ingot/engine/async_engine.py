"""AsyncLLM: the engine's step loop on a background thread, an asyncio front end.

The engine (scheduler, runner, detokenizer) is only ever touched by its own thread. The asyncio
side sends it commands (add, abort) through a queue and each request receives its outputs on
its own asyncio queue. A thread rather than a process: torch releases the GIL inside its ops, the
loop's Python work per step is small, and outputs need no serialisation. If a step raises, every
pending request gets the error and the engine reports itself dead (the health check fails);
nothing hangs.
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

from ingot.config import EngineArgs
from ingot.engine.llm_engine import LLMEngine, PromptType
from ingot.engine.outputs import RequestOutput
from ingot.engine.sampling_params import SamplingParams
from ingot.errors import IngotError

logger = logging.getLogger("ingot")


class EngineDeadError(IngotError, RuntimeError):
    """The engine loop failed; the server must be restarted."""


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_abort = on_abort
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="ingot-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopped and self._thread.is_alive()

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
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._run_commands()
            if not engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except BaseException as exc:  # noqa: BLE001 - the loop must report, not die silently
                logger.exception("engine step failed; failing every pending request")
                self.dead_error = exc
                with self._streams_lock:
                    ids = list(self._streams)
                for rid in ids:
                    self._deliver(rid, EngineDeadError(f"the engine failed: {exc!r}"))
                self._fail_pending_commands(exc)
                return
            elapsed = time.perf_counter() - start
            if self._on_step is not None:
                try:
                    self._on_step(engine, outputs, elapsed)
                except Exception:  # metrics must never take the engine down
                    logger.exception("stat logging failed")
            for out in outputs:
                self._deliver(out.request_id, out)

    def _fail_pending_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineDeadError(f"the engine failed: {exc!r}"))

    # ---- asyncio side --------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and await its result."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine failed: {self.dead_error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs; the last one has ``finished=True``. Leaving the
        iteration early (client gone, task cancelled) aborts the request at once."""
        q: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt, params))
            while True:
                item = await q.get()
                # Outputs are cumulative: when several are queued only the newest matters.
                while not q.empty() and not isinstance(item, BaseException):
                    if item.finished:
                        break
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished and self.dead_error is None:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            if request_id in self.engine.parents:
                self.engine.abort_request(request_id)
                if self._on_abort is not None:
                    self._on_abort(request_id)

        try:
            await self.call(do_abort)
        except EngineDeadError:
            pass

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
