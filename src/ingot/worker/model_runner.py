"""Turns a SchedulerOutput into model inputs, runs the model, samples.

The runner keeps a small state per request (sampling params, generator, prompt and output
tokens) so each step ships only what changed. Input preparation is vectorised: positions,
slot mapping and block table are built with tensor ops, O(tokens) with no per-token Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ingot.config import EngineConfig
from ingot.core.kv_cache_manager import NULL_BLOCK_ID, cdiv
from ingot.core.sched_output import SchedulerOutput
from ingot.engine.sampling_params import SamplingParams
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from ingot.structured_output.bitmask import apply_grammar_bitmask
from ingot.worker.cuda_graphs import CaptureFn, DecodeGraphs
from ingot.worker.outputs import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SampledLogprobs,
)

logger = logging.getLogger("ingot")

PAD_SLOT_ID = -1


@dataclass
class CachedRequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def slot_mapping(
    block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """slot = block_table[row][pos // block_size] * block_size + pos % block_size."""
    return block_table[rows, positions // block_size] * block_size + positions % block_size


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
        self.grid = config.buckets
        self.decode_graphs: DecodeGraphs | None = None
        #: Autograd-free mode of every forward. Precompiled layers switch it to no_grad: their
        #: saved guards expect ordinary tensors (torch restores them without inference mode).
        self.grad_mode: Callable[[], AbstractContextManager[Any]] = torch.inference_mode

    def capture_decode_graphs(self, capture: CaptureFn | None = None) -> DecodeGraphs:
        """Capture every decode bucket of the grid (largest first, as the later, smaller graphs
        then fit in the memory pool the first ones grew); decode steps replay them from now on."""
        from ingot.compilation.model_compiler import warmup_scheduler_output, warmup_shapes

        graphs = DecodeGraphs(lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
                              capture)
        shapes = [s for s in warmup_shapes(self.config) if s.kind == "decode"]
        with self.grad_mode():
            for shape in sorted(shapes, key=lambda s: (-s.num_reqs, -s.width)):
                ids, positions, meta, _ = self.prepare_inputs(warmup_scheduler_output(shape))
                graphs.capture(ids, positions, meta)
            self.forget_dummy_steps()
        self.decode_graphs = graphs
        logger.info("CUDA graphs: %d decode buckets captured in %.1f s", len(graphs.graphs),
                    graphs.capture_seconds)
        return graphs

    def warm_up_eager(self) -> float:
        """One dummy step per row count the linear layers will see (each prefill bucket from
        position 0, each decode batch bucket at its narrowest context), so that oneDNN's
        just-in-time kernels for those shapes, and the first touch of the activations' memory,
        happen before the engine reports ready instead of in the first requests of each size.
        Returns the seconds it took."""
        from ingot.compilation.model_compiler import warmup_scheduler_output, warmup_shapes
        from ingot.utils.progress import progress

        start = time.perf_counter()
        seen: set[tuple[str, int]] = set()
        shapes = warmup_shapes(self.config)
        with self.grad_mode():
            for shape in progress(shapes, "warmup", total=len(shapes), unit="shape"):
                rows = (shape.kind, shape.num_tokens)
                if rows in seen or (shape.kind == "prefill" and shape.start_position > 0):
                    continue
                seen.add(rows)
                ids, positions, meta, _ = self.prepare_inputs(warmup_scheduler_output(shape))
                self.model(ids, positions, self.kv_caches, meta)
            self.forget_dummy_steps()
        return time.perf_counter() - start

    def forget_dummy_steps(self) -> None:
        """After warmup or graph capture: the dummy steps wrote K/V into the null block; zero
        it again (masked-out reads must see zeros)."""
        for kv_cache in self.kv_caches:
            kv_cache[:, NULL_BLOCK_ID].zero_()

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

    def prepare_inputs(
        self, so: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Model inputs padded to the step's bucket, and the rows holding each request's last
        token of the step.

        Prefill: the requests' segments laid end to end, padded to ``so.num_padded`` tokens;
        padded tokens repeat the last real position and get slot -1. One request attends with
        its padding (the layout is then the identity and a first segment is plainly causal);
        packed requests attend each to its own context, and padded rows attend to nothing.
        Decode: the batch pads to ``so.num_padded`` rows with dummy rows (token 0, position 0,
        slot -1, a block-table row of null blocks). Padding never allocates a block and never
        writes the cache.
        """
        items = so.scheduled
        bs = self.block_size
        grid = self.grid
        num_reqs = len(items)
        lens = [it.num_tokens for it in items]
        starts = [it.start_position for it in items]
        if so.is_prefill:
            total = sum(lens)
            n_pad = max(so.num_padded, total) if grid.enabled else total
            real_pos = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                                  for s, n in zip(starts, lens, strict=True)])
            positions = torch.cat([real_pos, real_pos[-1:].expand(n_pad - total)])
            ids = [t for it in items for t in it.token_ids]
            input_ids = torch.tensor(ids + [0] * (n_pad - total), dtype=torch.int64)
            rows = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(lens))
            from_zero = all(s == 0 for s in starts)
            if not grid.enabled:
                width = max(len(it.block_ids) for it in items)
            elif from_zero:
                # First segments attend only to themselves.
                width = cdiv(n_pad if num_reqs == 1 else max(lens), bs)
            else:
                width = cdiv(grid.decode_ctx_bucket(max(s + n for s, n in zip(starts, lens, strict=True))), bs)
            query_lens = [n_pad] if num_reqs == 1 else lens
            ends = torch.cumsum(torch.tensor(lens), 0)
            sample_rows = (ends - 1).tolist()
            causal = num_reqs == 1 and from_zero and not self.config.compilation.enabled
        else:
            b_pad = so.num_padded if grid.enabled else num_reqs
            positions = torch.zeros(b_pad, dtype=torch.int64)
            real_pos = torch.tensor(starts, dtype=torch.int64)
            positions[:num_reqs] = real_pos
            input_ids = torch.zeros(b_pad, dtype=torch.int64)
            input_ids[:num_reqs] = torch.tensor([it.token_ids[0] for it in items], dtype=torch.int64)
            if grid.enabled:
                assert so.ctx_bucket is not None
                width = cdiv(so.ctx_bucket, bs)
            else:
                width = max(len(it.block_ids) for it in items)
            rows = torch.arange(num_reqs)
            query_lens = [1] * b_pad
            sample_rows = list(range(num_reqs))
            n_pad, total = b_pad, num_reqs
            causal = False
        table = torch.full((max(num_reqs, len(query_lens)), width), NULL_BLOCK_ID, dtype=torch.int64)
        for row, it in enumerate(items):
            blocks = it.block_ids[:width]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        slots = torch.full((n_pad,), PAD_SLOT_ID, dtype=torch.int64)
        slots[:total] = slot_mapping(table, rows, real_pos, bs)
        meta = AttentionMetadata.build(
            positions.to(self.device),
            query_lens,
            slots.to(self.device),
            table.to(self.device),
            block_size=bs,
            # Eager only: under compilation the flag would split a prefill bucket in two graphs.
            causal=causal,
        )
        return input_ids.to(self.device), positions.to(self.device), meta, sample_rows

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with self.grad_mode():
            return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._register(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        input_ids, positions, meta, last_rows = self.prepare_inputs(so)
        hidden = None
        if self.decode_graphs is not None and not so.is_prefill:
            hidden = self.decode_graphs.replay(input_ids, positions, meta)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Which hidden rows need logits: the last real token of each sampling request, and
        # every real token of a prefill chunk whose request asked for prompt logprobs.
        sample_rows: list[int] = []
        sample_reqs: list[str] = []
        prompt_lp: list[tuple[str, int, int, int]] = []  # req, first row, n rows, first position
        for it, last_row in zip(so.scheduled, last_rows, strict=True):
            state = self.requests[it.req_id]
            if so.is_prefill and state.params.prompt_logprobs is not None:
                # targets exist for positions < prompt_len - 1
                n = min(len(it.token_ids), len(state.prompt_token_ids) - 1 - it.start_position)
                if n > 0:
                    prompt_lp.append((it.req_id, last_row - len(it.token_ids) + 1, n, it.start_position))
            if it.sample:
                sample_rows.append(last_row)
                sample_reqs.append(it.req_id)

        output = ModelRunnerOutput(sample_reqs, [])
        if prompt_lp:
            self._prompt_logprobs(hidden, prompt_lp, output)
        if not sample_rows:
            return output
        # Model dtype: the sampler makes its own float32 copy only when it processes them.
        logits = self.model.compute_logits(hidden[sample_rows])
        states = [self.requests[r] for r in sample_reqs]
        metadata = SamplingMetadata.from_params(
            [s.params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.vocab_size,
            self.device,
        )
        apply_grammar_bitmask(logits, sample_reqs, so.grammar_bitmask)
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
