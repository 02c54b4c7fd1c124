"""What the scheduler hands the model runner for one step (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ingot.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the runner keeps for it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class ScheduledRequest:
    req_id: str
    token_ids: list[int]  # tokens computed this step (a prefill chunk, or the last token)
    start_position: int  # absolute position of token_ids[0] (= computed tokens before the step)
    block_ids: list[int]  # all blocks the request owns, in order
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    is_prefill: bool
    # Prefill: the bucket the chunk pads to. Decode: the actual count (the runner pads the
    # decode batch). Kept apart from len(token_ids) so padding never counts as progress.
    num_tokens_padded: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_prefill(self) -> bool:
        return bool(self.scheduled) and self.scheduled[0].is_prefill
