"""OpenAI-compatible request and response bodies (plus vLLM's extra sampling fields).

Unknown fields are rejected (OpenAI answers "Unrecognized request argument"), wrong types fail
validation (the server validates in strict mode: "5" is not an integer, 1 is not a boolean);
both become 400 errors in the OpenAI error shape.

Value ranges are SamplingParams' to check, except where a value would otherwise reach torch
out of its range (seed, top_k) or make one request unboundedly large (n, logprob counts):
those are bounded here, so no request can take the engine down.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ingot.sampling_params import SamplingParams, StructuredOutputsParams

# torch seeds generators with a 64-bit value (anything outside fails inside a step); int64
# leaves room for the engine adding the choice index to the seed when n > 1.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# top_k reaches torch as int64; every value >= the vocabulary size means "off" anyway.
TOP_K_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's own limit on choices per request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs

# apply_chat_template parameters a request must not override through chat_template_kwargs
# (they would change the return type or the prompt's framing).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "chat_template",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "continue_final_message",
})


class RequestValueError(ValueError):
    """A bad value in a request, with the request field it is about (the error's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIModel):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's constraint field: {json | regex | choice | grammar | json_object | structural_tag,
    # disable_any_whitespace, disable_additional_properties, whitespace_pattern}
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: requests share cached prefix blocks only with requests of the same salt
    # (tenants isolate theirs); mixed into the first block's hash (engine/processor.py).
    cache_salt: str | None = Field(None, min_length=1)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        if self.structured_outputs is None:
            return None
        try:
            return SamplingParams(structured_outputs=self.structured_outputs).structured_outputs
        except ValueError as exc:
            raise RequestValueError(str(exc), "structured_outputs") from exc

    def _check_common(self) -> None:
        if self.logit_bias:
            raise RequestValueError(
                "logit_bias is not supported; remove it from the request", "logit_bias"
            )
        if self.stream_options is not None and not self.stream:
            raise RequestValueError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise RequestValueError(
                "prompt_logprobs is only returned in whole responses; drop it or set stream "
                "to false", "prompt_logprobs",
            )

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, default_max: int,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            structured_outputs=structured_outputs or self._structured_outputs(),
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # --enable-prompt-embeds: base64 safetensors (preferred) or torch.save bytes of a
    # [seq_len, hidden] tensor, one per prompt (engine/prompt_embeds.py decodes them).
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, max_model_len: int, prompt_len: int) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise RequestValueError("echo is not supported; remove it or set it to false", "echo")
        if self.suffix:
            raise RequestValueError("suffix is not supported; remove it", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestValueError(
                "best_of is not supported (only best_of == n); remove it", "best_of"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestValueError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs"
            )
        return self._sampling_params(self.max_tokens, self.logprobs, max_model_len - prompt_len)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted so that real clients' requests go through; none of them changes generation here
    # (nothing is stored, no tiers exist), which docs/serving.md states.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(
        self, max_model_len: int, prompt_len: int,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """``tool_constraint``: the schema a required or named tool_choice imposes."""
        self._check_common()
        constraint = self._response_format()
        if constraint is not None and self.structured_outputs is not None:
            raise RequestValueError(
                "response_format and structured_outputs both constrain the output; send one",
                "response_format",
            )
        if tool_constraint is not None:
            if constraint is not None or self.structured_outputs is not None:
                raise RequestValueError(
                    "a required or named tool_choice constrains the output itself; drop "
                    "response_format / structured_outputs or use tool_choice auto",
                    "tool_choice",
                )
            constraint = tool_constraint
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestValueError("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestValueError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            self.requested_max_tokens, logprobs, max_model_len - prompt_len, constraint
        )

    def _response_format(self) -> StructuredOutputsParams | None:
        """OpenAI's response_format as a constraint: text (none), json_object, json_schema."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind != "json_schema":
            raise RequestValueError(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                "response_format",
            )
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestValueError(
                'response_format json_schema needs {"name": ..., "schema": {...}}',
                "response_format.json_schema",
            )
        # OpenAI: a json_schema without "schema" allows any JSON object.
        try:
            return StructuredOutputsParams(json=spec.get("schema", {"type": "object"}))
        except ValueError as exc:
            raise RequestValueError(str(exc), "response_format.json_schema") from exc

    @property
    def constraint_field(self) -> str:
        """The field a compile error is about."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        return "tools"  # a required / named tool_choice's schema

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field the client set the completion length with (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise RequestValueError(
                f"chat_template_kwargs may not set {reserved}; use the request's own fields "
                "(add_generation_prompt, chat_template) instead", "chat_template_kwargs",
            )
        return kwargs

    def message_dicts(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them; OpenAI content parts become plain text."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestValueError(
                        f"messages[{i}].content: only text parts "
                        f'({{"type": "text", "text": "..."}}) are supported, got {part!r}',
                        f"messages[{i}].content",
                    )
                texts.append(part["text"])
            d["content"] = "".join(texts)
        for call in d.get("tool_calls") or []:
            # Templates render arguments as JSON objects (as vLLM hands them over); OpenAI
            # sends them as JSON text.
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
        out.append(d)
    return out


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- pooling routes (vLLM's shapes): /v1/embeddings, /pooling, /classify, /score, /rerank ----

# input: one text, several texts, one token-id prompt, or several.
PoolingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingFields(OpenAIModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @model_validator(mode="before")
    @classmethod
    def _no_sampling(cls, data: Any) -> Any:
        # Named before the generic "unrecognized argument": a client sending temperature to an
        # embedding route should learn why it cannot apply.
        if isinstance(data, dict):
            sampling = sorted(set(data) & SAMPLING_FIELDS)
            if sampling:
                raise ValueError(
                    f"{', '.join(sampling)}: sampling parameters do not apply to a pooling "
                    "request (it returns vectors or scores, it does not generate); remove them"
                )
        return data


class EmbeddingRequest(_PoolingFields):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's own output (an embedding, or a classifier's label scores)."""

    activation: bool | None = None


class ClassificationRequest(_PoolingFields):
    input: PoolingInput
    activation: bool | None = None


class ScoreRequest(_PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields):
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)  # 0: every document


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "server_error"
]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo




SAMPLING_FIELDS = frozenset(
    set(_SamplingFields.model_fields)
    - {"model", "user", "stream", "stream_options", "cache_salt"}
    | {"max_completion_tokens", "logprobs", "top_logprobs", "best_of", "echo", "suffix"}
)
