"""StructuredOutputManager: compiled grammars and one xgrammar matcher per constrained request.

Owned by the engine core (``EngineCore``) and driven by the scheduler, which owns the tokens:
- ``add_request`` submits the request's constraint to a small compile pool (cached by kind,
  spec text and options; a grammar already compiled or compiling is shared) and, unless it is
  ready at once, puts the request in ``WAITING_FOR_FSM``. The engine thread never waits on a
  compile: xgrammar releases the GIL while it compiles, so running requests keep decoding;
- the server's check before a request is added (``submit(admit=True)``) is refused with a
  503 (``ServerBusyError``) when a new grammar would find ``compile_threads +
  max_queued_compiles`` compiles already pending; a compile that nobody waits for any more
  (its requests aborted or timed out, the server's check abandoned) leaves the queue if it has
  not started. One that has started runs to its end on its pool thread: xgrammar cannot
  interrupt a compile;
- ``ready`` (the scheduler asks it of a ``WAITING_FOR_FSM`` request) gives the request its
  matcher once the compile is done and moves it to ``WAITING``;
- ``take_failed`` hands the engine core the requests whose compile failed, or ran past
  ``compile_timeout_s`` (counted from ``add_request``): the core finishes each with its error
  (``ValueError`` offline, a 400 over HTTP), never the engine;
- ``grammar_bitmask`` fills the packed mask rows of the step's sampling, constrained requests
  (``Scheduler.schedule``); the runner applies them to the logits (``bitmask.py``);
- ``accept_token`` advances a matcher with the token the scheduler appended
  (``Scheduler.update_from_output``), reporting when the grammar has terminated (the request
  then stops) or rejected the token (the request is aborted, never the engine).

Everything but the compile itself runs on the engine thread; pool threads only compile.
xgrammar is imported on the first constrained request: unconstrained engines never pay for it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ingot.config import StructuredOutputsConfig
from ingot.errors import ServerBusyError
from ingot.sampling_params import SamplingParams, StructuredOutputsParams
from ingot.sched_output import GrammarBitmask, ScheduledRequest

logger = logging.getLogger("ingot")

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a failed
# check's text); users need only the message after it.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class TokenVerdict(enum.Enum):
    ACCEPTED = "accepted"
    TERMINATED = "terminated"  # accepted, and the grammar allows nothing more: stop
    REJECTED = "rejected"


def _clean_error(exc: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


def compile_timeout_message(kind: str, timeout: float) -> str:
    """The error of a constraint that did not compile in time (it names the knob)."""
    return (
        f"the {kind} constraint did not compile within {timeout:g} s "
        "(structured_outputs_config compile_timeout_s); simplify it"
    )


def compile_queue_full_message(pending: int) -> str:
    """The 503 of a new grammar past a full compile queue (it names the knob)."""
    return (
        f"the server is compiling {pending} other grammars (compile_threads + "
        "max_queued_compiles of --structured-outputs-config); retry later"
    )


@dataclass
class _Compile:
    """A compile submitted to the pool, shared by everyone waiting for that grammar."""

    future: concurrent.futures.Future
    waiters: int = 0  # requests and server checks holding it (see ``release``)


@dataclass
class _Compiling:
    """A request waiting for its grammar: the (possibly shared) compile and its deadline."""

    params: SamplingParams
    future: concurrent.futures.Future
    deadline: float  # time.monotonic()


def _failure(future: concurrent.futures.Future) -> str | None:
    """The user-facing error of a finished compile, or None if it succeeded."""
    if future.cancelled():
        return "the constraint's compile was cancelled (the engine is shutting down)"
    exc = future.exception()
    return None if exc is None else str(exc)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: masks follow it, not the tokenizer
        self.config = config
        self._compiler: Any = None
        # The first compile builds xgrammar's tokenizer info on a pool thread; two compiles
        # starting at once must not both build it.
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        # Compiles submitted and not yet swept into the cache, by key (shared by every request
        # with that constraint, and by the server's check before a request is added).
        self._inflight: dict[tuple[Any, ...], _Compile] = {}
        self._compiling: dict[str, _Compiling] = {}
        self._matchers: dict[str, Any] = {}
        # Requests still reasoning: the end marker, and the output tokens seen so far (a tail
        # as long as the marker). Their tokens are free until the marker completes.
        self._reasoning: dict[str, tuple[list[int], list[int]]] = {}
        # Compiles run here, off the engine thread. A compile that outlives its timeout keeps
        # its thread until it ends (xgrammar cannot cancel one); its requests have failed.
        # Only compiles still queued can be withdrawn (``release``).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.compile_threads, thread_name_prefix="ingot-grammar"
        )
        self.num_compiles = 0
        self.num_cache_hits = 0

    @property
    def num_requests(self) -> int:
        """Requests with a matcher (compiled); ``num_compiling`` more wait for their grammar."""
        return len(self._matchers)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    @property
    def num_pending_compiles(self) -> int:
        """Compiles running or queued for a pool thread (not counting finished ones)."""
        return sum(1 for c in self._inflight.values() if not c.future.done())

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                # Our cache keys carry the request options; xgrammar's own would duplicate it.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    # ---- compiling -----------------------------------------------------------------------
    def _key(self, params: StructuredOutputsParams) -> tuple[Any, ...]:
        return (params.kind, params.spec, params.disable_any_whitespace)

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
        """Compile on the calling thread (a pool thread): the compiled grammar."""
        import xgrammar as xgr

        compiler = self._get_compiler()
        kind = params.kind
        any_ws = not params.disable_any_whitespace
        max_ws = self.config.max_json_whitespace if any_ws else None
        if kind in ("json", "json_object"):
            schema = params.spec if kind == "json" else '{"type": "object"}'
            # strict_mode: objects without additionalProperties allow none, as vLLM's
            # xgrammar backend does (disable_additional_properties asks for exactly that).
            return compiler.compile_json_schema(
                schema, any_whitespace=any_ws, max_whitespace_cnt=max_ws, strict_mode=True
            )
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            # json.dumps gives a double-quoted literal with the escapes EBNF also reads.
            alternatives = " | ".join(json.dumps(c) for c in params.choice or [])
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        spec = json.loads(params.structural_tag or "{}")
        if isinstance(spec, dict) and "structures" in spec:  # vLLM's older form
            tags = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
                )
                for s in spec["structures"]
            ]
            return compiler.compile_structural_tag(tags, spec.get("triggers", []))
        return compiler.compile_structural_tag(params.structural_tag)

    def _compile_task(self, params: StructuredOutputsParams) -> Any:
        """What a pool thread runs: xgrammar's errors become the user-facing ValueError."""
        try:
            return self._compile_now(params)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f"invalid structured_outputs.{params.kind}: {_clean_error(exc)}"
            ) from exc

    def _sweep(self) -> None:
        """Move finished compiles into the cache (failures are not cached). A compile whose
        requests were aborted or timed out still lands here, for the next request."""
        for key, entry in list(self._inflight.items()):
            future = entry.future
            if not future.done():
                continue
            del self._inflight[key]
            if _failure(future) is not None:
                continue
            self._cache[key] = future.result()
            if len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)

    def submit(
        self, params: StructuredOutputsParams, admit: bool = False
    ) -> concurrent.futures.Future:
        """The compile of ``params``' grammar, never waited for: already done when cached,
        shared when that grammar is already compiling. Its error is the request's
        ``ValueError``. The caller holds the compile until it is done or the caller calls
        ``release``. ``admit`` (the server's check before a request is added): a new grammar
        that would find ``compile_threads + max_queued_compiles`` compiles pending gets a
        future failed with ``ServerBusyError`` (a 503) instead; requests added to the engine
        are never refused (offline ``LLM`` batches queue). Engine thread only (the server's
        pre-check runs there too)."""
        if self.tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer; the engine was started with "
                "skip_tokenizer_init"
            )
        self._sweep()
        key = self._key(params)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(cached)
            return done
        entry = self._inflight.get(key)
        if entry is None:
            pending = self.num_pending_compiles
            if admit and pending >= self.config.compile_threads + self.config.max_queued_compiles:
                refused: concurrent.futures.Future = concurrent.futures.Future()
                # By compile_timeout_s every queued compile has run or been withdrawn.
                refused.set_exception(ServerBusyError(
                    compile_queue_full_message(pending),
                    retry_after_s=math.ceil(self.config.compile_timeout_s)))
                return refused
            entry = _Compile(self._pool.submit(self._compile_task, params))
            self._inflight[key] = entry
            self.num_compiles += 1
        entry.waiters += 1
        return entry.future

    def release(self, params: StructuredOutputsParams, future: concurrent.futures.Future) -> None:
        """A holder of ``future`` (from ``submit``) stops waiting for it. When nobody waits
        any more and the compile has not started, it leaves the queue (cancelled), so a
        timed-out or abandoned request frees its place; a compile already running goes on
        (xgrammar cannot interrupt it) and lands in the cache."""
        key = self._key(params)
        entry = self._inflight.get(key)
        if entry is None or entry.future is not future:
            return  # done and swept (or another compile of the same grammar): nothing held
        entry.waiters -= 1
        if entry.waiters <= 0 and future.cancel():
            del self._inflight[key]

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params``, waiting for it (benchmarks and tools; the
        engine never calls this); ``ValueError`` if it cannot compile in
        ``compile_timeout_s``."""
        timeout = self.config.compile_timeout_s
        future = self.submit(params)
        try:
            compiled = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise ValueError(compile_timeout_message(params.kind, timeout)) from exc
        finally:
            self.release(params, future)
        self._sweep()
        return compiled

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, params: SamplingParams) -> bool:
        """Start the request's compile; True when its grammar is ready (cached) now, else the
        request waits for it (the scheduler keeps it ``WAITING_FOR_FSM``). ``ValueError`` only
        when structured outputs cannot run at all."""
        assert params.structured_outputs is not None
        future = self.submit(params.structured_outputs)
        if future.done() and _failure(future) is None:
            self.release(params.structured_outputs, future)
            self._start(request_id, params, future.result())
            return True
        self._compiling[request_id] = _Compiling(
            params, future, time.monotonic() + self.config.compile_timeout_s
        )
        return False

    def ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled: once its compile is done it gets its matcher.
        A failed compile stays not ready until ``take_failed``."""
        entry = self._compiling.get(request_id)
        if entry is None:
            return True
        if not entry.future.done() or _failure(entry.future) is not None:
            return False
        self._forget(request_id)
        self._start(request_id, entry.params, entry.future.result())
        return True

    def _forget(self, request_id: str) -> None:
        """The request no longer waits for its compile (it has its grammar, failed, or is
        gone): it stops holding that compile."""
        entry = self._compiling.pop(request_id, None)
        if entry is not None:
            assert entry.params.structured_outputs is not None
            self.release(entry.params.structured_outputs, entry.future)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of each request whose compile failed or passed its deadline;
        they are forgotten here, and the caller finishes them."""
        if not self._compiling:
            return []
        now = time.monotonic()
        failed = []
        for rid, entry in list(self._compiling.items()):
            if entry.future.done():
                error = _failure(entry.future)
            elif now >= entry.deadline:
                params = entry.params.structured_outputs
                error = compile_timeout_message(params.kind, self.config.compile_timeout_s)
            else:
                continue
            if error is None:
                continue  # compiled: ``ready`` starts it when the scheduler gets to it
            self._forget(rid)
            logger.warning("request %s: %s", rid, error)
            failed.append((rid, error))
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` s (less if a deadline comes sooner) until a pending compile
        finishes: the engine loop calls this when nothing else can run, so it neither spins
        nor sleeps past a compile. Returns at once when none is pending."""
        if not self._compiling:
            return
        futures = {e.future for e in self._compiling.values()}
        if any(f.done() for f in futures):
            return  # something to act on already
        soonest = min(e.deadline for e in self._compiling.values()) - time.monotonic()
        concurrent.futures.wait(
            futures, timeout=max(0.0, min(timeout, soonest)),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def _start(self, request_id: str, sampling_params: SamplingParams, compiled: Any) -> None:
        import xgrammar as xgr

        params = sampling_params.structured_outputs
        stops = sorted(sampling_params.all_stop_token_ids)
        # The request's own stop tokens end the grammar (EOS unless ignore_eos); with none the
        # matcher terminates as soon as the grammar is complete, and the request stops there.
        self._matchers[request_id] = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=stops or None,
            terminate_without_stop_token=not stops,
        )
        if params.reasoning_end_token_ids:
            self._reasoning[request_id] = (list(params.reasoning_end_token_ids), [])

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request; a compile still running for it goes on (its
        result is cached for later requests, and no matcher is made for this one), one still
        queued that nobody else waits for is withdrawn."""
        self._matchers.pop(request_id, None)
        self._reasoning.pop(request_id, None)
        self._forget(request_id)

    def grammar_bitmask(self, scheduled: list[ScheduledRequest]) -> GrammarBitmask | None:
        """Masks for the scheduled requests that sample this step under a constraint."""
        rows = [
            s.req_id for s in scheduled
            if s.sample and s.req_id in self._matchers and s.req_id not in self._reasoning
        ]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, rid in enumerate(rows):
            self._matchers[rid].fill_next_token_bitmask(bitmask, i)
        return GrammarBitmask(rows, bitmask.numpy())

    def accept_token(self, request_id: str, token: int) -> TokenVerdict:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return TokenVerdict.ACCEPTED
        reasoning = self._reasoning.get(request_id)
        if reasoning is not None:
            marker, tail = reasoning
            tail.append(token)
            del tail[: -len(marker)]
            if tail == marker:  # the constraint applies from the next token on
                del self._reasoning[request_id]
            return TokenVerdict.ACCEPTED
        if not matcher.accept_token(token):
            logger.warning("request %s: the grammar rejected token %d", request_id, token)
            return TokenVerdict.REJECTED
        return TokenVerdict.TERMINATED if matcher.is_terminated() else TokenVerdict.ACCEPTED

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
