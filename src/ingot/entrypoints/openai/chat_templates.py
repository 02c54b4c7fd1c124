"""Chat templates rendered off the event loop, within a time, output and memory budget.

A chat template is Jinja code: the model's, the server's ``--chat-template``, or (with
``--trust-request-chat-template``) a request's. Rendered on the event loop, a template with a
nested ``range(100000)`` loop froze every route, ``/health`` included, and ``'x' * 10**10`` took
the server's memory. So every render runs in a separate process (chat_template_worker.py):

- time: the process is killed when the render passes ``--chat-template-timeout-s``. A thread
  cannot be stopped, and a sandbox that counts work only sees calls and attribute reads (a
  loop with an empty body makes neither), so only a process that can be killed bounds the time
  of any template;
- memory: the process's address space is capped (``RLIMIT_AS``), so an oversized string is a
  MemoryError there, at allocation, whatever filter or operator built it;
- output: text longer than ``--max-chat-template-output-chars`` is refused.

Each limit is a 400 naming it and its flag. Renders run on a few pooled processes (started
once, reused; a killed one is replaced); the server's threads only wait on their pipes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from ingot.entrypoints.openai.chat_template_worker import HEADER_SIZE, frame_length, write_frame
from ingot.entrypoints.openai.protocol import RequestValueError

logger = logging.getLogger("ingot")

WORKER_MODULE = "ingot.entrypoints.openai.chat_template_worker"
# Render processes: two, so one slow render does not hold up every other chat request.
NUM_RENDER_PROCESSES = 2
# A process imports transformers before it is ready (about 2 s; more on a loaded machine).
STARTUP_TIMEOUT_S = 120.0
# The address space a render may use beyond the process's own: room for the request's
# messages (at most the body limit) and for an output of the largest allowed size (up to 4
# bytes a character, a copy or two while it is joined and encoded).
BASE_RENDER_MEMORY = 256 * 2**20
MEMORY_PER_OUTPUT_CHAR = 16


class _RenderTimeout(Exception):
    pass


class _RenderProcessDied(Exception):
    pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


class _RenderProcess:
    """One render process and its pipes; used by one thread at a time."""

    def __init__(self, memory_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            # Out of the terminal's process group: a Ctrl-C that lands while the interpreter
            # starts (before the worker ignores SIGINT) must not kill it mid-start. The server
            # ends it (kill, or EOF on its stdin when the server is gone).
            start_new_session=True,
        )
        # Killed with the server (or the object) whatever path ends them.
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        try:
            ready = self._read(time.monotonic() + STARTUP_TIMEOUT_S)
        except (_RenderTimeout, _RenderProcessDied) as exc:
            self.kill()
            raise RuntimeError("the chat template renderer did not start") from exc
        assert ready == {"ready": True}, ready

    def kill(self) -> None:
        self._finalizer()

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            write_frame(self.proc.stdin, request)
        except OSError as exc:  # the process is gone
            raise _RenderProcessDied() from exc
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        data = bytearray()
        need = HEADER_SIZE
        header_read = False
        while len(data) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise _RenderTimeout()
            chunk = os.read(fd, max(need - len(data), 1 << 16))
            if not chunk:
                raise _RenderProcessDied()
            data += chunk
            if not header_read and len(data) >= HEADER_SIZE:
                need = HEADER_SIZE + frame_length(bytes(data[:HEADER_SIZE]))
                header_read = True
        return json.loads(bytes(data[HEADER_SIZE:need]))


class ChatTemplateRenderer:
    """Renders chat templates in pooled processes, each render within the limits."""

    def __init__(self, timeout_s: float, max_chars: int,
                 num_processes: int = NUM_RENDER_PROCESSES) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.memory_bytes = BASE_RENDER_MEMORY + MEMORY_PER_OUTPUT_CHAR * max_chars
        self.num_processes = num_processes
        # One thread per process: renders wait there, not on the event loop.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            num_processes, thread_name_prefix="ingot-chat-template")
        self._idle: list[_RenderProcess] = []
        self._alive = 0  # processes started or starting, idle or rendering
        self._starting = 0
        self._closed = False
        self._changed = threading.Condition()

    def start(self) -> None:
        """Start one process now, so the first chat request does not wait for it."""
        self._spawn_in_background()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
            self._changed.notify_all()
        self._threads.shutdown(wait=False, cancel_futures=True)
        for process in idle:
            process.kill()

    def _spawn_in_background(self) -> None:
        with self._changed:
            if self._closed or self._alive >= self.num_processes:
                return
            self._alive += 1
            self._starting += 1
        # Its own thread: the pool's may all be waiting for this very process.
        threading.Thread(target=lambda: self._release(self._spawn()), daemon=True,
                         name="ingot-chat-template-start").start()

    def _spawn(self) -> _RenderProcess | None:
        """A new process (its slot is counted by the caller); None if it did not start."""
        try:
            return _RenderProcess(self.memory_bytes)
        except (OSError, RuntimeError):
            with self._changed:
                closing = self._closed
            if not closing:  # a start cut short by the server's own shutdown is no error
                logger.exception("could not start a chat template render process")
            with self._changed:
                self._alive -= 1
                self._changed.notify_all()
            return None
        finally:
            with self._changed:
                self._starting -= 1
                self._changed.notify_all()

    def _take(self) -> _RenderProcess:
        """An idle process; else a new one if none is starting (one that is will be ready
        sooner than another) and the pool has room; else wait for one."""
        with self._changed:
            while not self._idle:
                if self._closed:
                    raise RuntimeError("the chat template renderer is closed")
                if self._starting == 0 and self._alive < self.num_processes:
                    self._alive += 1
                    self._starting += 1
                    break
                self._changed.wait()
            else:
                return self._idle.pop()
        process = self._spawn()
        if process is None:
            raise RuntimeError("the chat template renderer could not start a process")
        return process

    def _release(self, process: _RenderProcess | None) -> None:
        if process is None:
            return
        with self._changed:
            if not self._closed:
                self._idle.append(process)
                self._changed.notify_all()
                return
        process.kill()

    def _retire(self, process: _RenderProcess) -> None:
        """Kill ``process`` (a render that overran, or a process that died) and start its
        replacement now, so the next request finds one ready."""
        process.kill()
        with self._changed:
            self._alive -= 1
            self._changed.notify_all()
        self._spawn_in_background()

    def _render_blocking(self, request: dict[str, Any]) -> dict[str, Any]:
        process = self._take()
        try:
            reply = process.call(request, self.timeout_s)
        except _RenderTimeout:
            self._retire(process)  # stops the render, whatever it was doing
            return {"error": "timeout"}
        except _RenderProcessDied:
            self._retire(process)
            logger.warning("a chat template render process exited during a render (code %s)",
                           process.proc.returncode)
            return {"error": "died"}
        self._release(process)
        return reply

    async def render(
        self, template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], param: str,
    ) -> str:
        """The rendered prompt; a ``RequestValueError`` naming ``param`` (the field holding
        the template's input) when the template fails or passes a limit."""
        request = {
            "template": template, "messages": messages, "tools": tools, "kwargs": kwargs,
            "add_generation_prompt": add_generation_prompt, "max_chars": self.max_chars,
        }
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self._threads, self._render_blocking, request)
        if "text" in reply:
            return reply["text"]
        raise RequestValueError(self._message(reply), param)

    def _message(self, reply: dict[str, Any]) -> str:
        kind = reply["error"]
        if kind == "template":
            return f"the chat template failed on these messages: {reply['message']}"
        if kind == "timeout":
            return (f"the chat template took longer than the server's limit of "
                    f"{self.timeout_s:g} s to render (--chat-template-timeout-s); it was "
                    "stopped")
        if kind == "output":
            return (f"the chat template rendered {reply['chars']} characters, over the "
                    f"server's limit of {self.max_chars} (--max-chat-template-output-chars)")
        if kind == "memory":
            return (f"the chat template needed more than the renderer's "
                    f"{self.memory_bytes // 2**20} MiB of memory (set by "
                    "--max-chat-template-output-chars); it was stopped")
        return "the chat template renderer stopped during the render; it has been restarted"
