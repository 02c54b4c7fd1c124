"""What the engine core reports per request and step (``Scheduler.update_from_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ingot.core.request import RequestStatus
from ingot.runner_output import PromptLogprobsChunk, SampledLogprobs


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampledLogprobs] = field(default_factory=list)  # one per new token
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    # Set when the core finished the request this step (EOS, stop token, length).
    finish_status: RequestStatus | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    pooled: list[float] | None = None  # a pooling request's output (it finishes with it)
    # Why the core failed the request (aborted): its constraint did not compile.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_status is not None
