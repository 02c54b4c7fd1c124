"""A request as the engine core owns it: its tokens, how many are computed, its status.

The core appends sampled tokens and decides EOS / stop-token / length stops
(``Scheduler.update_from_output``); the front end keeps only what users see (text, logprob
dicts, timings) and tells the core when a stop string ends a request.
"""

from __future__ import annotations

import enum
import time

import torch

from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    # Its grammar is still compiling on the StructuredOutputManager's pool: the scheduler
    # passes over it (keeping its place) until the manager says it is ready, then WAITING.
    WAITING_FOR_FSM = "waiting_for_fsm"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        prompt_embeds: torch.Tensor | None = None,
        cache_salt: bytes = b"",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Exactly one of the two: a generation request samples, a pooling request (prefill
        # only) finishes with its pooled output once its prompt has run.
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        # A prompt given as embeddings: prompt_token_ids are placeholders (scheduling stays in
        # token space). ``cache_salt`` roots its prefix-cache hash chain: the embeds' content
        # hash and/or the request's cache_salt (engine/processor.py, prefix_cache_root).
        self.prompt_embeds = prompt_embeds
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        # Tokens whose computation has been scheduled (advanced when a step is scheduled, so
        # the next step can be scheduled while this one runs).
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        # Tokens scheduled to be sampled whose values have not come back yet (0 between
        # synchronous steps; 1 or 2 under async scheduling).
        self.num_output_placeholders = 0
        # KV blocks the runner has been told about (0 until the first scheduled step).
        self.num_blocks_sent = 0
        # Speculative decoding: drafts proposed for the next step (verified, not yet tokens).
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.arrival_time = arrival_time or time.time()
        self.first_scheduled_time: float | None = None
        # A grammar constrains its tokens (its matcher lives in the StructuredOutputManager).
        self.use_structured_output = (
            sampling_params is not None and sampling_params.structured_outputs is not None
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
