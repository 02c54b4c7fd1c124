"""Completion and chat-completion handlers: request -> engine requests -> OpenAI responses
(whole, or streamed as server-sent events)."""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from ingot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ingot.engine.processor import EMPTY_PROMPT
from ingot.engine.prompt_embeds import PROMPT_EMBEDS_PLACEHOLDER, decode_prompt_embeds
from ingot.engine.protocol import EngineClient
from ingot.entrypoints.openai.access_log import record_usage
from ingot.entrypoints.openai.chat_output import ChatOutputParser, finish_reason
from ingot.entrypoints.openai.chat_templates import ChatTemplateRenderer
from ingot.entrypoints.openai.limits import ServerLimits
from ingot.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValueError,
    UsageInfo,
    now,
    random_id,
)
from ingot.entrypoints.openai.reasoning_parsers import END as REASONING_END
from ingot.entrypoints.openai.reasoning_parsers import ReasoningParser
from ingot.entrypoints.openai.tool_parsers.base import ToolParser
from ingot.entrypoints.openai.tools import ToolRequest, parse_tool_request
from ingot.errors import PromptTooLongError, ServerBusyError, TokenIdError
from ingot.sampling_params import RequestOutputKind, SamplingParams

request_logger = logging.getLogger("ingot.requests")
logger = logging.getLogger("ingot")


class Waiting:
    """A prompt's sequences (its n) from admission until their first output. The server
    counts the live ones (``OpenAIServing.num_waiting``): one is dropped at the first output,
    and with its request however that ends, so the count cannot drift."""

    __slots__ = ("seqs", "__weakref__")

    def __init__(self, seqs: int) -> None:
        self.seqs = seqs


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]  # placeholders, one per row, for a prompt_embeds prompt
    embeds: Any = None  # a checked [seq_len, hidden] tensor (prompt_embeds)
    tools: ToolRequest | None = None  # chat: the request's tool settings
    waiting: Waiting | None = None  # set when the request is admitted


@dataclass
class ChatOptions:
    """The server's chat flags (``ingot serve``, vLLM's names)."""

    chat_template: str | None = None  # --chat-template, the template text
    enable_auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None  # --tool-call-parser
    reasoning_parser: type[ReasoningParser] | None = None  # --reasoning-parser


def tools_chat_template() -> str:
    """ingot's ChatML template with a hermes tools section (for the default model, whose own
    template has none)."""
    from importlib.resources import files

    return (files("ingot.entrypoints.openai") / "templates" / "chatml_tools.jinja").read_text()


@dataclass
class _ChoiceState:
    """What was already taken of one streamed choice (the engine sends deltas)."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    role_sent: bool = False  # chat: the role goes with the first generated content
    text: str = ""  # chat with output parsers: the text so far, which they parse whole


@dataclass
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def advance(self, cs: _ChoiceState, c: CompletionOutput) -> None:
        """Take the delta ``c`` (sent in a chunk, or held back text-less with its tokens
        counted)."""
        self.completion_tokens += len(c.token_ids)
        cs.text_len += len(c.text)
        cs.num_tokens += len(c.token_ids)
        cs.finished = c.finish_reason is not None


def _nothing_to_send(text: Any, c: CompletionOutput) -> bool:
    """A delta with no text to show (held back: a split character, a possible stop string)
    waits for a later chunk, unless logprobs are streamed token by token."""
    return not text and not c.finish_reason and (not c.token_ids or c.logprobs is None)


class ContextLengthError(PromptTooLongError):
    """Prompt plus completion over max_model_len; ``param`` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_fits(
    prompt_len: int, max_tokens: int | None, max_model_len: int,
    max_tokens_field: str = "max_tokens", prompt_field: str = "prompt",
) -> None:
    # Checked before the sampling parameters are built: the default max_tokens is the room the
    # prompt leaves, which must be at least one token.
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion; shorten the prompt",
            prompt_field,
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        # The prompt alone fits: it is the requested length that overflows.
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion); reduce {max_tokens_field} or the prompt",
            max_tokens_field,
        )


_PUMPS: set[asyncio.Task] = set()


async def merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generators; closing the merge closes (and so aborts) all of them.
    The queue holds at most one item per stream: a pump waits for the consumer rather than
    running ahead of it, so a slow consumer's outputs merge in the engine's per-request slot
    (AsyncLLM) instead of piling up here."""
    q: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await q.put((i, item))
        except asyncio.CancelledError:
            raise  # the consumer is gone; the stream's cleanup aborts its request
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, exc))
        else:
            await q.put((i, done))
        finally:
            # Cancelled while waiting for the consumer, the pump is outside its stream: close
            # it now, so its request is aborted at once rather than when it is collected.
            # (Cancelled inside it, or after its end, the stream has finished: a no-op.)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    for t in tasks:
        # The event loop holds tasks weakly: keep cancelled pumps alive until their abort
        # reaches the engine.
        _PUMPS.add(t)
        t.add_done_callback(_PUMPS.discard)
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        # Cancelling a pump raises CancelledError inside its stream, whose own cleanup aborts
        # the engine request. The streams must not be aclose()d here: a pump is still inside
        # them, and aclose() of a running async generator raises RuntimeError. Nor is there
        # anything to await: this may run inside a cancelled scope, where an await would be
        # cancelled again; the pumps finish on their own.
        for t in tasks:
            t.cancel()


class _DropTooLongWarning(logging.Filter):
    """transformers warns "Token indices sequence length is longer than the specified maximum
    sequence length" when a prompt passes the tokenizer's model_max_length. The server checks
    every prompt against max_model_len itself and answers a clear 400, so the warning is only
    noise in the server log (a 1 MB prompt printed it before ingot's own error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer")


_TOO_LONG_FILTER = _DropTooLongWarning()


def silence_too_long_warning() -> None:
    # The logger of transformers' tokenization base module; adding a filter twice is a no-op.
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_TOO_LONG_FILTER)


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_name: str,
                 log_requests: bool = False, chat_options: ChatOptions | None = None,
                 limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.chat_options = chat_options or ChatOptions()
        self.limits = limits or ServerLimits()
        self.renderer = ChatTemplateRenderer(self.limits.chat_template_timeout_s,
                                             self.limits.max_chat_template_output_chars)
        self._waiting: weakref.WeakSet[Waiting] = weakref.WeakSet()
        self.served_model_name = served_model_name
        self.log_requests = log_requests
        silence_too_long_warning()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        # The engine's own prompt checks, run here so a bad prompt is a 400 before a stream
        # starts (the engine runs them again when the request is added).
        self.processor = engine.input_processor

    # ---- prompts -------------------------------------------------------------------------
    def need_tokenizer(self, param: str = "prompt") -> Any:
        if self.tokenizer is None:
            raise RequestValueError(
                "the server runs without a tokenizer; send token-id prompts", param
            )
        return self.tokenizer

    def completion_prompts(self, prompt: Any) -> list[PreparedPrompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise RequestValueError(EMPTY_PROMPT, "prompt")
        prepared = []
        for p in prompt:
            if isinstance(p, str) and p:
                self.need_tokenizer()  # the server's own words for it
            try:
                text, token_ids = self.processor.tokenize_prompt(p)
                self.processor.check_token_ids(token_ids, "prompt")
            except ValueError as exc:
                raise RequestValueError(str(exc), "prompt") from None
            prepared.append(PreparedPrompt(text, token_ids))
        return prepared

    async def chat_prompt(
        self, request: ChatCompletionRequest, tools: ToolRequest | None = None
    ) -> PreparedPrompt:
        if not request.messages:
            raise RequestValueError("messages is empty; give at least one message", "messages")
        tokenizer = self.need_tokenizer("messages")
        if request.chat_template is not None and not self.limits.trust_request_chat_template:
            raise RequestValueError(
                "chat_template: this server does not run a request's own chat template (it is "
                "code the server would execute); leave the field out to use the model's "
                "template, or start the server with --trust-request-chat-template",
                "chat_template",
            )
        template = request.chat_template or self.chat_options.chat_template
        kwargs = request.template_kwargs()
        messages = request.message_dicts()
        render_tools = tools.tools if tools is not None and tools.render_tools else None
        # Tool calls and results in the conversation need a template that renders them too.
        if template is None and (render_tools or any(
                m.get("tool_calls") or m["role"] == "tool" for m in messages)):
            template = self._tools_template(tokenizer)
        text = await self.render_chat(
            messages, request.add_generation_prompt, template, render_tools, kwargs,
            "chat_template" if request.chat_template is not None else "messages",
        )
        return PreparedPrompt(text, tokenizer.encode(text, add_special_tokens=False), tools=tools)

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        template: str | None = None, tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None, param: str = "messages",
    ) -> str:
        """``messages`` through ``template`` (None: the server's or the model's), rendered
        within the server's limits (chat_templates.py), as ``tokenizer.apply_chat_template``
        would render them."""
        tokenizer = self.need_tokenizer("messages")
        if template is None:
            template = self.chat_options.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise RequestValueError(
                "the model has no chat template; start the server with --chat-template FILE, "
                "or send a plain prompt to /v1/completions", "messages",
            )
        try:
            # A name picks one of the model's templates (and "tool_use" for tools).
            text = tokenizer.get_chat_template(template, tools)
        except ValueError as exc:
            raise RequestValueError(str(exc), param) from None
        # The template sees the special tokens (bos_token, ...) as apply_chat_template passes
        # them; the request's kwargs win.
        special = dict(getattr(tokenizer, "special_tokens_map", {}))
        return await self.renderer.render(
            text, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            kwargs={**special, **(kwargs or {})}, param=param,
        )

    @staticmethod
    def _tools_template(tokenizer: Any) -> str | None:
        """The model's template if it renders tools, else ingot's tool-aware ChatML one for
        ChatML models; other models need --chat-template."""
        own = getattr(tokenizer, "chat_template", None) or ""
        if "tools" in own:
            return None
        if "<|im_start|>" in own:
            return tools_chat_template()
        raise RequestValueError(
            "the model's chat template does not render tools; start the server with "
            "--chat-template FILE (a template with a tools section)", "tools",
        )

    def _output_parsers(self, tools: ToolRequest | None) -> Any:
        """A factory of per-choice output parsers, or None when the text is the content."""
        opts = self.chat_options
        reasoning_cls = opts.reasoning_parser
        if tools is None or tools.parser(opts.tool_parser, self.tokenizer) is None:
            if reasoning_cls is None:
                return None
            return lambda: ChatOutputParser(reasoning_cls(), None)
        return lambda: ChatOutputParser(
            reasoning_cls() if reasoning_cls is not None else None,
            tools.parser(opts.tool_parser, self.tokenizer),
        )

    # ---- engine --------------------------------------------------------------------------
    async def check_constraints(self, params_list: list[SamplingParams], param: str) -> None:
        """Compile the requests' grammars before any response starts, so an invalid one (or
        one too slow to compile) is a 400 naming ``param``; the engine keeps stepping
        meanwhile (``EngineClient.check_structured_output``)."""
        for params in params_list:
            if params.structured_outputs is None:
                continue
            try:
                await self.engine.check_structured_output(params)
            except ValueError as exc:
                raise RequestValueError(str(exc), param) from exc
            break  # n prompts of one request share one constraint

    def check_token_ids(self, params: SamplingParams) -> None:
        """The engine's check of the parameters' token ids, as a 400 naming the field."""
        try:
            self.processor.check_sampling_params(params)
        except TokenIdError as exc:
            raise RequestValueError(str(exc), exc.param) from None

    # ---- admission: the waiting queue ----------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences admitted that have not produced their first output yet: queued in the
        engine, or in their prefill."""
        return sum(w.seqs for w in self._waiting)

    def admit(self, prompts: list[PreparedPrompt], n: int) -> None:
        """Count the request's sequences as waiting, or refuse it (503) when the queue would
        pass ``--max-waiting-requests``. An empty queue admits any request (each is bounded
        by --max-sequences-per-request)."""
        waiting = self.num_waiting
        limit = self.limits.max_waiting_requests
        if waiting and waiting + len(prompts) * n > limit:
            raise ServerBusyError(
                f"the server is busy: {waiting} sequences wait to start, and this request's "
                f"{len(prompts) * n} would pass the limit of {limit} (--max-waiting-requests); "
                "retry in 1 s"
            )
        for p in prompts:
            p.waiting = Waiting(n)
            self._waiting.add(p.waiting)

    async def _started(
        self, stream: AsyncIterator[RequestOutput], waiting: Waiting | None
    ) -> AsyncIterator[RequestOutput]:
        """``stream``, no longer counted as waiting from its first output (or its end)."""
        try:
            async for out in stream:
                if waiting is not None:
                    self._waiting.discard(waiting)
                yield out
        finally:
            if waiting is not None:
                self._waiting.discard(waiting)

    def _streams(
        self, prompts: list[PreparedPrompt], params_list: list[SamplingParams], prefix: str,
        cache_salt: str | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """The requests' output streams, of deltas (``output_kind=DELTA``: a step costs the new
        tokens only). A whole response merges them (``RequestOutput.add``) rather than asking
        for the final output only: its first delta, with its first token, is what ends its
        time in the waiting queue (``_started``)."""
        for params in params_list:
            params.output_kind = RequestOutputKind.DELTA
        if self.log_requests:
            for i, (p, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_logger.info("request %s-%d: %d prompt tokens, %s", prefix, i,
                                    len(p.token_ids), params)
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        return [
            self._started(self.engine.generate(
                {"prompt_embeds": p.embeds, **salt} if p.embeds is not None
                else {"prompt": p.text, "prompt_token_ids": p.token_ids, **salt},
                params, f"{prefix}-{i}",
            ), p.waiting)
            for i, (p, params) in enumerate(zip(prompts, params_list, strict=True))
        ]

    # ---- completions ---------------------------------------------------------------------
    def embeds_prompts(self, data: str | list[str]) -> list[PreparedPrompt]:
        """Decoded, checked prompt_embeds (engine/prompt_embeds.py), refused when off."""
        mc = self.engine.model_config
        try:
            self.processor.check_prompt_embeds_enabled()
        except ValueError as exc:
            raise RequestValueError(str(exc), "prompt_embeds") from None
        items = [data] if isinstance(data, str) else list(data)
        if not items:
            raise RequestValueError("prompt_embeds is empty", "prompt_embeds")
        prepared = []
        for item in items:
            try:
                embeds = decode_prompt_embeds(item, mc.hidden_size, mc.max_model_len)
            except ValueError as exc:
                raise RequestValueError(str(exc), "prompt_embeds") from None
            prepared.append(PreparedPrompt(None, [PROMPT_EMBEDS_PLACEHOLDER] * embeds.shape[0],
                                           embeds))
        return prepared

    def prepare_completion(
        self, request: CompletionRequest
    ) -> tuple[list[PreparedPrompt], list[SamplingParams]]:
        if request.prompt_embeds is not None:
            # The openai client requires prompt, so vLLM's documented call sends prompt="".
            if request.prompt not in (None, ""):
                raise RequestValueError(
                    "give prompt or prompt_embeds, not both (an empty prompt, \"\", may go "
                    "with prompt_embeds)", "prompt_embeds")
            prompts = self.embeds_prompts(request.prompt_embeds)
        elif request.prompt is None:
            raise RequestValueError(
                "prompt is required (or prompt_embeds, with --enable-prompt-embeds)", "prompt"
            )
        else:
            prompts = self.completion_prompts(request.prompt)
        params_list = []
        for p in prompts:
            check_prompt_fits(len(p.token_ids), None, self.max_model_len)
            params = request.to_sampling_params(self.max_model_len, len(p.token_ids))
            check_prompt_fits(len(p.token_ids), params.max_tokens, self.max_model_len)
            self.check_token_ids(params)
            params_list.append(params)
        self.admit(prompts, request.n)
        return prompts, params_list

    @staticmethod
    def _completion_logprobs(c: CompletionOutput, start: int, text_offset: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            sampled = entry[tid]
            text = sampled.decoded_token or ""
            tokens.append(text)
            token_lps.append(sampled.logprob)
            tops.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _prompt_logprobs(out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's shape: one entry per prompt position (None for the first), token id ->
        {logprob, rank, decoded_token}."""
        if out.prompt_logprobs is None:
            return None
        return [
            None if entry is None else {
                str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                           "decoded_token": lp.decoded_token}
                for tid, lp in entry.items()
            }
            for entry in out.prompt_logprobs
        ]

    async def completion(self, request: CompletionRequest) -> dict[str, Any]:
        prompts, params_list = self.prepare_completion(request)
        await self.check_constraints(params_list, "structured_outputs")
        request_id = random_id("cmpl")
        finals: dict[int, RequestOutput] = {}
        streams = self._streams(prompts, params_list, request_id, request.cache_salt)
        async with aclosing(merge(streams)) as outs:
            async for i, out in outs:
                if i in finals:
                    finals[i].add(out)  # deltas: the whole output is their sum
                else:
                    finals[i] = out
        n = params_list[0].n
        choices = []
        completion_tokens = 0
        for i in range(len(prompts)):
            for c in finals[i].outputs:
                completion_tokens += len(c.token_ids)
                choices.append({
                    "index": i * n + c.index,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c, 0, 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": self._prompt_logprobs(finals[i]),
                })
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        record_usage(prompt_tokens, completion_tokens)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.served_model_name,
            "choices": choices,
            "usage": UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ).model_dump(),
        }

    async def completion_stream(
        self, request: CompletionRequest, prompts: list[PreparedPrompt], params_list: list[SamplingParams]
    ) -> AsyncIterator[str]:
        request_id = random_id("cmpl")
        created = now()
        n = params_list[0].n
        state = _StreamState(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
        streams = self._streams(prompts, params_list, request_id, request.cache_salt)
        async with aclosing(merge(streams)) as merged, _usage_recorded(state):
            async for i, out in merged:
                for c in out.outputs:  # deltas: what is new since the last output read
                    index = i * n + c.index
                    cs = state.choices.setdefault(index, _ChoiceState())
                    if cs.finished:
                        continue
                    skip = _nothing_to_send(c.text, c)
                    chunk_choice = {
                        "index": index,
                        "text": c.text,
                        "logprobs": self._completion_logprobs(c, 0, cs.text_len),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    state.advance(cs, c)
                    if skip:
                        continue
                    chunk = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": self.served_model_name, "choices": [chunk_choice],
                    }
                    if include_usage and continuous:
                        chunk["usage"] = self._usage(state)
                    yield sse(chunk)
        if include_usage:
            yield sse({
                "id": request_id, "object": "text_completion", "created": created,
                "model": self.served_model_name, "choices": [], "usage": self._usage(state),
            })
        yield "data: [DONE]\n\n"

    @staticmethod
    def _usage(state: _StreamState) -> dict[str, int]:
        return {
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "total_tokens": state.prompt_tokens + state.completion_tokens,
        }

    # ---- chat ----------------------------------------------------------------------------
    async def prepare_chat(
        self, request: ChatCompletionRequest
    ) -> tuple[PreparedPrompt, SamplingParams]:
        tools = parse_tool_request(request.tools, request.tool_choice, request.parallel_tool_calls,
                                   self.chat_options.enable_auto_tool_choice)
        prompt = await self.chat_prompt(request, tools)
        try:  # the template or a message may hold ids the tokenizer adds beyond the model's
            self.processor.check_token_ids(prompt.token_ids, "messages")
        except ValueError as exc:
            raise RequestValueError(str(exc), "messages") from None
        check_prompt_fits(len(prompt.token_ids), None, self.max_model_len, prompt_field="messages")
        params = request.to_sampling_params(self.max_model_len, len(prompt.token_ids),
                                            tools.constraint())
        reasoning = self.chat_options.reasoning_parser
        constraint = params.structured_outputs
        if (reasoning is not None and constraint is not None and prompt.text is not None
                and reasoning.response_reasons(prompt.text)):
            # The grammar constrains the answer, not the thinking before it.
            constraint.reasoning_end_token_ids = self.tokenizer.encode(
                REASONING_END, add_special_tokens=False)
        check_prompt_fits(len(prompt.token_ids), params.max_tokens, self.max_model_len,
                          request.max_tokens_field, "messages")
        self.check_token_ids(params)
        self.admit([prompt], request.n)
        return prompt, params

    @staticmethod
    def _chat_logprob_entry(tid: int, entry: dict[int, Logprob], top_n: int) -> dict[str, Any]:
        def item(lp: Logprob) -> dict[str, Any]:
            token = lp.decoded_token or ""
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}

        sampled = item(entry[tid])
        tops = sorted(entry.values(), key=lambda lp: lp.rank or 0)
        sampled["top_logprobs"] = [item(lp) for lp in tops if (lp.rank or 0) >= 1][:top_n]
        return sampled

    def _chat_logprobs(self, c: CompletionOutput, start: int, top_n: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        return {
            "content": [
                self._chat_logprob_entry(tid, entry, top_n)
                for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False)
            ]
        }

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        prompt, params = await self.prepare_chat(request)
        await self.check_constraints([params], request.constraint_field)
        request_id = random_id("chatcmpl")
        final = None
        streams = self._streams([prompt], [params], request_id, request.cache_salt)
        async with aclosing(merge(streams)) as outs:
            async for _, out in outs:
                if final is None:
                    final = out
                else:
                    final.add(out)  # deltas: the whole output is their sum
        assert final is not None
        top_n = request.top_logprobs or 0
        make_parser = self._output_parsers(prompt.tools)
        choices = []
        for c in final.outputs:
            message = {"role": "assistant", "content": c.text}
            if make_parser is not None:
                message = make_parser().message(c.text)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._chat_logprobs(c, 0, top_n),
                "finish_reason": finish_reason(c.finish_reason, "tool_calls" in message),
                "stop_reason": c.stop_reason,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        record_usage(len(prompt.token_ids), completion_tokens)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.served_model_name,
            "choices": choices,
            "prompt_logprobs": self._prompt_logprobs(final),
            "usage": UsageInfo(
                prompt_tokens=len(prompt.token_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt.token_ids) + completion_tokens,
            ).model_dump(),
        }

    async def chat_stream(
        self, request: ChatCompletionRequest, prompt: PreparedPrompt, params: SamplingParams
    ) -> AsyncIterator[str]:
        request_id = random_id("chatcmpl")
        created = now()
        top_n = request.top_logprobs or 0
        state = _StreamState(prompt_tokens=len(prompt.token_ids))
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)

        def chunk(choices: list[dict[str, Any]], usage: bool = False) -> str:
            body: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name, "choices": choices,
            }
            if usage:
                body["usage"] = self._usage(state)
            return sse(body)

        make_parser = self._output_parsers(prompt.tools)
        parsers: dict[int, ChatOutputParser] = {}
        # No chunk before the model has produced something: clients time their first token
        # from the first chunk, so the role travels with each choice's first content (as vLLM).
        streams = self._streams([prompt], [params], request_id, request.cache_salt)
        async with aclosing(merge(streams)) as merged, _usage_recorded(state):
            async for _, out in merged:
                for c in out.outputs:  # deltas: what is new since the last output read
                    cs = state.choices.setdefault(c.index, _ChoiceState())
                    if cs.finished:
                        continue
                    called = False
                    if make_parser is None:
                        delta_text = c.text
                        delta: dict[str, Any] = {"content": delta_text} if delta_text else {}
                    else:
                        # Reasoning, content and tool calls; text that may still be a tag waits.
                        parser = parsers.setdefault(c.index, make_parser())
                        cs.text += c.text
                        parts = parser.update(cs.text, c.finish_reason is not None)
                        called = parser.called_tools
                        delta_text = parts.content
                        delta = {"content": delta_text} if delta_text else {}
                        if parts.reasoning:
                            delta["reasoning"] = parts.reasoning
                        if parts.tool_calls:
                            delta["tool_calls"] = parts.tool_calls
                    skip = _nothing_to_send(delta, c)
                    logprobs = self._chat_logprobs(c, 0, top_n)
                    state.advance(cs, c)
                    if skip:
                        continue
                    if not cs.role_sent:
                        delta = {"role": "assistant", "content": delta_text, **delta}
                        cs.role_sent = True
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(c.finish_reason, called),
                        "stop_reason": c.stop_reason,
                    }
                    yield chunk([choice], usage=include_usage and continuous)
        if include_usage:
            yield chunk([], usage=True)
        yield "data: [DONE]\n\n"


@asynccontextmanager
async def _usage_recorded(state: _StreamState) -> AsyncIterator[None]:
    """Report a stream's usage to the access log however it ends (finished or disconnected)."""
    try:
        yield
    finally:
        record_usage(state.prompt_tokens, state.completion_tokens)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _ClientStalled(Exception):
    """A send to the client waited past the stream's idle limit."""


class IdleLimitedStreamingResponse(StreamingResponse):
    """A streamed response that drops a client who stopped reading. The ASGI server's send
    waits while the connection's buffers are full (until its write buffer drains to the
    low-water mark, tens of KB), so a send that has waited ``idle_timeout`` seconds means the
    client has read next to nothing for about that long (a client taking a few KB a second
    counts as stalled at a limit of seconds; the default is 60 s): the response ends there, its body is closed (which aborts the engine requests and frees
    their KV blocks) and the server closes the connection. Until then the client costs its
    buffers and the one pending output per request (engine deltas merge while it lags)."""

    def __init__(self, content: AsyncIterator[str], idle_timeout: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.idle_timeout = idle_timeout

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self.idle_timeout):  # no task per chunk
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        body = self.body_iterator
        try:
            await super().stream_response(timed_send)
        except _ClientStalled:
            # Returning with the response incomplete makes the server close the connection.
            logger.warning("dropped a streaming client that read nothing for %g s "
                           "(--stream-idle-timeout); its request was aborted", self.idle_timeout)
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()  # at once, not when collected: the abort frees the blocks
