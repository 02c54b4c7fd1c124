"""StructuredOutputManager: compiled grammars and one xgrammar matcher per constrained request.

Owned by the engine core (``EngineCore``) and driven by the scheduler, which owns the tokens:
- ``add_request`` compiles the request's constraint (cached by kind, spec text and options) and
  creates its matcher; an invalid schema, regex or grammar, or a compile that exceeds
  ``compile_timeout_s``, raises ``ValueError`` there, so only that request fails (a 400);
- ``grammar_bitmask`` fills the packed mask rows of the step's sampling, constrained requests
  (``Scheduler.schedule``); the runner applies them to the logits (``bitmask.py``);
- ``accept_token`` advances a matcher with the token the scheduler appended
  (``Scheduler.update_from_output``), reporting when the grammar has terminated (the request
  then stops) or rejected the token (the request is aborted, never the engine).

xgrammar is imported on the first constrained request: unconstrained engines never pay for it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import re
from collections import OrderedDict
from typing import Any

from ingot.config import StructuredOutputsConfig
from ingot.core.request import Request
from ingot.core.sched_output import GrammarBitmask, ScheduledRequest
from ingot.engine.sampling_params import StructuredOutputsParams

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


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: masks follow it, not the tokenizer
        self.config = config
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._matchers: dict[str, Any] = {}
        # Requests still reasoning: the end marker, and the output tokens seen so far (a tail
        # as long as the marker). Their tokens are free until the marker completes.
        self._reasoning: dict[str, tuple[list[int], list[int]]] = {}
        # Compiles run on a small pool so a slow one can be timed out (its thread finishes in
        # the background; the request has already failed).
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ingot-grammar")
        self.num_compiles = 0
        self.num_cache_hits = 0

    @property
    def num_requests(self) -> int:
        return len(self._matchers)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured outputs need a tokenizer; the engine was started with "
                    "skip_tokenizer_init"
                )
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            # Our cache keys carry the request options; xgrammar's own cache would duplicate it.
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    # ---- compiling -----------------------------------------------------------------------
    def _key(self, params: StructuredOutputsParams) -> tuple[Any, ...]:
        return (params.kind, params.spec, params.disable_any_whitespace)

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
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

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params`` (cached); ``ValueError`` if it cannot compile in
        ``compile_timeout_s``."""
        key = self._key(params)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return cached
        self._get_compiler()  # a missing tokenizer is the caller's error, raised here
        future = self._pool.submit(self._compile_now, params)
        timeout = self.config.compile_timeout_s
        try:
            compiled = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise ValueError(
                f"the {params.kind} constraint did not compile within {timeout:g} s "
                "(structured_outputs_config compile_timeout_s); simplify it"
            ) from exc
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f"invalid structured_outputs.{params.kind}: {_clean_error(exc)}"
            ) from exc
        self.num_compiles += 1
        self._cache[key] = compiled
        if len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return compiled

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Compile the request's constraint and give it a matcher (``ValueError`` if invalid)."""
        import xgrammar as xgr

        params = request.sampling_params.structured_outputs
        assert params is not None
        compiled = self.compile(params)
        stops = sorted(request.sampling_params.all_stop_token_ids)
        # The request's own stop tokens end the grammar (EOS unless ignore_eos); with none the
        # matcher terminates as soon as the grammar is complete, and the request stops there.
        self._matchers[request.request_id] = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=stops or None,
            terminate_without_stop_token=not stops,
        )
        if params.reasoning_end_token_ids:
            self._reasoning[request.request_id] = (list(params.reasoning_end_token_ids), [])

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._reasoning.pop(request_id, None)

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
