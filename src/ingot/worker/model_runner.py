"""Turns a SchedulerOutput into model inputs, runs the model, samples.

The runner keeps a small state per request (sampling params, generator, prompt and output
tokens) so each step ships only what changed. Input preparation is vectorised: positions,
slot mapping and block table are built with tensor ops, O(tokens) with no per-token Python.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ingot.config import EngineConfig
from ingot.core.kv_cache_manager import NULL_BLOCK_ID
from ingot.core.sched_output import SchedulerOutput
from ingot.engine.sampling_params import SamplingParams
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
)

logger = logging.getLogger("ingot")


@dataclass
class CachedRequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


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
    req_ids: list[str]  # requests that sampled a token this step, in order
    sampled_token_ids: list[int]
    logprobs: dict[str, SampledLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


def _tensors_to_lists(t: LogprobsTensors, row: int, k: int) -> tuple[list[int], list[float], int]:
    return (
        t.token_ids[row, : 1 + k].tolist(),
        t.logprobs[row, : 1 + k].tolist(),
        int(t.ranks[row]),
    )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    def _register(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.new_requests:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.sampling_params, list(new.prompt_token_ids), generator=generator
            )

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        items = so.scheduled
        query_lens = [len(it.token_ids) for it in items]
        input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64)
        starts = torch.tensor([it.start_position for it in items], dtype=torch.int64)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        req_idx = torch.repeat_interleave(torch.arange(len(items)), lens)
        first_token = torch.cumsum(lens, 0) - lens
        positions = starts[req_idx] + torch.arange(int(lens.sum())) - first_token[req_idx]

        width = max(len(it.block_ids) for it in items)
        block_table = torch.full((len(items), width), NULL_BLOCK_ID, dtype=torch.int64)
        for row, it in enumerate(items):
            block_table[row, : len(it.block_ids)] = torch.tensor(it.block_ids, dtype=torch.int64)
        block_of_token = block_table[req_idx, positions // self.block_size]
        slot_mapping = block_of_token * self.block_size + positions % self.block_size

        meta = AttentionMetadata.build(
            positions.to(self.device),
            query_lens,
            slot_mapping.to(self.device),
            block_table.to(self.device),
        )
        return input_ids.to(self.device), positions.to(self.device), meta

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._register(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        input_ids, positions, meta = self.prepare_inputs(so)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Which hidden rows need logits: the last token of each sampling request, and every
        # token of a prefill chunk whose request asked for prompt logprobs.
        offsets = meta.query_start_loc.tolist()
        sample_rows: list[int] = []
        sample_reqs: list[str] = []
        prompt_lp: list[tuple[str, int, int, int]] = []  # req, first row, n rows, first position
        for i, it in enumerate(so.scheduled):
            state = self.requests[it.req_id]
            if it.is_prefill and state.params.prompt_logprobs is not None:
                # targets exist for positions < prompt_len - 1
                n = min(len(it.token_ids), len(state.prompt_token_ids) - 1 - it.start_position)
                if n > 0:
                    prompt_lp.append((it.req_id, offsets[i], n, it.start_position))
            if it.sample:
                sample_rows.append(offsets[i + 1] - 1)
                sample_reqs.append(it.req_id)

        output = ModelRunnerOutput(sample_reqs, [])
        if prompt_lp:
            self._prompt_logprobs(hidden, prompt_lp, output)
        if not sample_rows:
            return output
        logits = self.model.compute_logits(hidden[sample_rows]).float()
        states = [self.requests[r] for r in sample_reqs]
        metadata = SamplingMetadata.from_params(
            [s.params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.vocab_size,
            self.device,
        )
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        output.sampled_token_ids = sampled
        for state, token in zip(states, sampled, strict=True):
            state.output_token_ids.append(token)
        if result.logprobs_tensors is not None:
            for row, (req_id, state) in enumerate(zip(sample_reqs, states, strict=True)):
                k = state.params.logprobs
                if k is not None:
                    ids, lps, rank = _tensors_to_lists(result.logprobs_tensors, row, k)
                    output.logprobs[req_id] = SampledLogprobs(ids, lps, rank)
        return output

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        prompt_lp: list[tuple[str, int, int, int]],
        output: ModelRunnerOutput,
    ) -> None:
        for req_id, first_row, n, first_pos in prompt_lp:
            state = self.requests[req_id]
            logits = self.model.compute_logits(hidden[first_row : first_row + n]).float()
            targets = torch.tensor(
                state.prompt_token_ids[first_pos + 1 : first_pos + 1 + n],
                dtype=torch.int64,
                device=logits.device,
            )
            k = state.params.prompt_logprobs
            t = compute_prompt_logprobs(logits, targets, k)
            output.prompt_logprobs[req_id] = PromptLogprobsChunk(
                first_pos,
                t.token_ids[:, : 1 + k].tolist(),
                t.logprobs[:, : 1 + k].tolist(),
                t.ranks.tolist(),
            )
