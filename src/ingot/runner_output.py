"""What a worker returns for one step (plain, picklable data: it crosses process boundaries
under the multiprocess executor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampledLogprobs:
    """Per sampled row: token ids (column 0 = sampled token), their logprobs, sampled rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens ``first_position+1 ...`` (the targets) for one prefill chunk."""

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that sampled this step, in order
    # Per request: its new tokens (one, or under speculation the accepted drafts and the
    # token the target chose after them).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)  # one per token
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Pooling runner: the finished requests' outputs (embedding, or label scores).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # The worker's runtime counters after this step (Worker.runtime_stats): they travel with
    # the output so reading stats never waits behind the steps in flight.
    runtime_stats: dict[str, Any] | None = None
    # Speculative decoding: drafts proposed for each request's next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

