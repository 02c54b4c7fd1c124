"""What the scheduler hands the executor for one step (plain, picklable data).

The step contract: a step is either a prefill step (one or more requests' prompt segments
packed end to end, padded to one ``num_batched_tokens_buckets`` entry) or a decode step (one
row per token, the rows padded to a ``num_seqs_buckets`` entry). A decode step usually has one
token per running request; under speculative decoding it may verify drafts: a request then
has ``1 + len(draft_token_ids)`` rows, one per position, laid end to end. The kind and the
padded size are decided once, here; the runner and the attention backend read them from the
step, never re-derive them from the tokens.

The step is incremental: a request's prompt and sampling parameters travel once, the first step
it is scheduled (``NewRequestData``); after that each step says only how many tokens it computes
from which position and which blocks it gained. The runner holds every request's tokens (the
prompt, and the tokens it sampled itself), so a step can be scheduled before the previous one's
sampled tokens are known (async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams

# Block 0 is the null block: the KV cache manager never hands it out, and the runner pads
# block-table columns with it, so a padded read lands on valid memory.
NULL_BLOCK_ID = 0


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
    num_tokens: int  # tokens computed this step (a prefill segment, or the one decode token)
    start_position: int  # absolute position of the first (= tokens computed before the step)
    new_block_ids: list[int]  # blocks allocated since the runner last heard (all, the first time)
    # This step reaches the end of the request's tokens: sample the next one (a pooling
    # request: its prompt is complete, its pooled output is due).
    sample: bool
    # A verification step: the drafts this step checks (num_tokens = 1 + len(drafts)).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the step's constrained requests: row i of ``bitmask`` (int32,
    ``[len(req_ids), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set = token t
    allowed) belongs to ``req_ids[i]``. Requests not listed are unconstrained."""

    req_ids: list[str]
    bitmask: np.ndarray


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
    # Grammar masks for the requests that sample this step under a constraint (None: none do).
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: the runner proposes drafts after sampling, for the next step.
    propose_drafts: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
