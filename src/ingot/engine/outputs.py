"""Output types, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ingot.errors import EngineRequestError


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = field(default=None, repr=False)
    # ingot: set (with finish_reason "abort") when the engine failed the request, e.g. its
    # constraint did not compile; LLM.generate raises it as ValueError, the server as a 400.
    error: str | None = None
    # ... and this when the failure was the engine's (``request_error``: a 500 on the server).
    error_id: str | None = None

    def add(self, newer: RequestOutput) -> None:
        """Merge a later DELTA output of the same request into this one (its consumer fell
        behind): texts, token ids and logprobs concatenate, the rest is the newer's. So a slow
        consumer holds one pending output, the size of what it has not read."""
        mine = {c.index: c for c in self.outputs}
        for c in newer.outputs:
            old = mine.get(c.index)
            if old is None:
                self.outputs.append(c)
                continue
            old.text += c.text
            old.token_ids.extend(c.token_ids)
            if old.logprobs is not None and c.logprobs is not None:
                old.logprobs.extend(c.logprobs)
            old.cumulative_logprob = c.cumulative_logprob
            old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
        if newer.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + newer.prompt_logprobs
        self.finished = newer.finished
        self.metrics = newer.metrics
        self.num_cached_tokens = newer.num_cached_tokens
        if newer.error is not None:
            self.error, self.error_id = newer.error, newer.error_id


@dataclass
class IterationStats:
    """What one engine step did for users' requests (vLLM's ``IterationStats``): the metrics'
    source, the same whatever output kind (cumulative, delta, final only) each request asked
    for. Times in seconds."""

    num_prompt_tokens: int = 0  # of the requests whose first token (or pooled output) came now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # per request with tokens
    finish_reasons: list[str] = field(default_factory=list)  # one per finished sequence
    e2e_latencies: list[float] = field(default_factory=list)  # one per finished request


@dataclass
class PoolingOutput:
    """A pooling request's output: an embedding, or a classifier's label scores."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """vLLM's shape: what ``LLM.encode`` returns (and the others wrap)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # as RequestOutput's
    error_id: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.outputs.data),
                   out.finished)


@dataclass
class ClassificationOutput:
    probs: list[float]  # after the activation (softmax; sigmoid for one label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, ClassificationOutput(out.outputs.data),
                   out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def request_error(out: RequestOutput | PoolingRequestOutput) -> Exception | None:
    """What a request the engine failed raises for its caller: ``ValueError`` for the
    request's own fault (a 400 on the server), ``EngineRequestError`` for the engine's (a 500
    with the error id); None for a request that did not fail."""
    if out.error is None:
        return None
    if out.error_id is None:
        return ValueError(out.error)
    return EngineRequestError(out.error, out.error_id)
