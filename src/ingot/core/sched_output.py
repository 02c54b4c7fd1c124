"""What the scheduler hands the executor for one step (plain, picklable data).

The step contract: a step is either a prefill step (one or more requests' prompt segments
packed end to end, padded to one ``num_batched_tokens_buckets`` entry) or a decode step (one
token per running request, the batch padded to a ``num_seqs_buckets`` entry). The kind and the
padded size are decided once, here; the runner and the attention backend read them from the
step, never re-derive them from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ingot.engine.pooling_params import PoolingParams
from ingot.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the runner keeps for it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None = None  # a pooling request (no sampling params)
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden]: replaces the token ids


@dataclass
class ScheduledRequest:
    req_id: str
    token_ids: list[int]  # tokens computed this step (a prefill segment, or the last token)
    start_position: int  # absolute position of token_ids[0] (= computed tokens before the step)
    block_ids: list[int]  # all blocks the request owns, in order
    # This step reaches the end of the known tokens: sample the next one (a pooling request:
    # its prompt is complete, its pooled output is due).
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    is_prefill: bool = False
    # Prefill: the token bucket the packed segments pad to. Decode: the batch bucket. Equal to
    # the actual count when bucketing is off. Padding never counts as progress.
    num_padded: int = 0
    # Decode with context buckets: the context bucket the batch reads up to (None otherwise).
    ctx_bucket: int | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r.req_id: len(r.token_ids) for r in self.scheduled}
