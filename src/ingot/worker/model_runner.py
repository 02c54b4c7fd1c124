"""Turns a SchedulerOutput into model inputs, runs the model, samples.

The runner keeps a state per request (sampling params, generator, prompt and sampled tokens) and
a persistent input batch (worker/input_batch.py: each request's row of the block table, and the
decode batch's sampling metadata) so each step ships only what changed (see
``sched_output.py``): the input tokens of a step are the runner's own. Input preparation is
vectorised: positions, slot mapping and block table are built with tensor ops, O(tokens) with no
per-token Python.

Under async scheduling a decode step whose requests are exactly the previous decode step's, in
the same order, takes that step's sampled-token tensor as its input ids as it is (on a device,
no round trip through the host); any other decode step builds them from the token lists and
counts a synchronous fallback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ingot.config import EngineConfig
from ingot.distributed.data_parallel import get_dp_padding
from ingot.distributed.parallel_state import get_dp_group, get_tp_group
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.attention_backend import TORCH_ATTENTION, AttentionBackend
from ingot.model_executor.layers.grammar_bitmask import apply_grammar_bitmask
from ingot.model_executor.layers.pooler import Pooler, PoolingSegment
from ingot.model_executor.layers.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from ingot.model_executor.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from ingot.runner_output import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SampledLogprobs,
)
from ingot.sampling_params import SamplingParams
from ingot.sched_output import NULL_BLOCK_ID, SchedulerOutput
from ingot.spec_decode.draft_model import DraftModelProposer
from ingot.spec_decode.eagle3 import Eagle3Proposer, StepRows
from ingot.spec_decode.ngram import NgramProposer
from ingot.utils.math_utils import cdiv
from ingot.worker.execution.program import EagerProgram, StepProgram
from ingot.worker.input_batch import InputBatch
from ingot.worker.warmup import WarmupShape, warmup_scheduler_output

logger = logging.getLogger("ingot")

PAD_SLOT_ID = -1


@dataclass
class CachedRequestState:
    params: SamplingParams | None  # None: a pooling request (the pooler keeps its params)
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden] (replaces token ids)
    # (Its block ids live in the input batch's row, their one owner.)

    def token_ids(self, start: int, n: int) -> list[int]:
        """Tokens at positions [start, start + n) of prompt + sampled tokens."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : start - n_prompt + n]
        if start + n <= n_prompt:
            return self.prompt_token_ids[start : start + n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + n - n_prompt]


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
        draft: tuple[nn.Module, list[torch.Tensor]] | None = None,
        attn_backend: AttentionBackend = TORCH_ATTENTION,
        program: StepProgram | None = None,
        draft_program: StepProgram | None = None,
    ) -> None:
        """``draft``: speculative decoding's drafter (a draft model or an EAGLE3 head) and its
        KV cache. ``attn_backend``: the backend bound to ``model`` (it builds each step's
        attention metadata). ``program`` / ``draft_program``: how the model's / a draft
        model's steps run (worker/execution/; default: their modules)."""
        self.config = config
        self.attn_backend = attn_backend
        self.model = model
        #: How every step of the model runs (chosen once, by the worker).
        self.program = program if program is not None else EagerProgram(model)
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.sampler = Sampler()
        self.tp_group = get_tp_group()
        # EP across data-parallel replicas: every step pads to the replicas' largest token
        # count, so their MoE layers exchange equal shapes (distributed/data_parallel.py).
        self.dp_group = get_dp_group()
        self.dp_sync = config.parallel_config.replicas_synchronise
        self.dummy_steps = 0  # idle-replica steps run (execute_dummy_batch)
        self.requests: dict[str, CachedRequestState] = {}
        sched = config.scheduler_config
        lookahead = spec.lookahead_slots if (spec := config.speculative_config) else 0
        self.input_batch = InputBatch(sched.max_num_seqs,
                                      cdiv(sched.max_model_len + lookahead, self.block_size))
        self.grid = config.buckets
        #: A pooling runner pools instead of computing logits and sampling (layers/pooler.py).
        pooler_config = config.model_config.pooler_config
        self.pooler = Pooler(pooler_config.pooling_type, model) if pooler_config else None
        self.async_scheduling = config.scheduler_config.async_scheduling
        # The previous decode step's request order and sampled tokens (async scheduling).
        self._prev_decode: tuple[list[str], torch.Tensor] | None = None
        self.async_steps = 0
        self.sync_fallback_steps = 0
        self.rejection_sampler = RejectionSampler(self.sampler)
        spec = config.speculative_config
        self.proposer: NgramProposer | DraftModelProposer | Eagle3Proposer | None = None
        if spec is not None and spec.method == "ngram":
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                          spec.num_speculative_tokens,
                                          config.model_config.max_model_len)
        elif spec is not None:
            assert draft is not None, "a draft model proposer needs the draft and its cache"
            args = (spec.num_speculative_tokens, self.block_size,
                    config.model_config.max_model_len, device)
            if spec.method != "eagle3":
                # The draft's steps run its program (its decode program's fast path included).
                forward = (draft_program if draft_program is not None
                           else EagerProgram(draft[0])).forward
                self.proposer = DraftModelProposer(draft[0], forward, draft[1], *args)
            else:
                self.proposer = Eagle3Proposer(draft[0], draft[1], *args)
                # The target leaves the inputs of these layers for the head.
                model.model.aux_hidden_state_layers = tuple(spec.aux_layer_ids)
                if draft[0].shares_target_embedding:
                    draft[0].embed_tokens = model.model.embed_tokens

    def dummy_step(
        self, shape: WarmupShape
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The inputs of a warm-up's dummy step of ``shape`` (worker/warmup.py), built by
        ``prepare_inputs`` itself so that warm-ups see exactly what serving will."""
        input_ids, positions, meta, _ = self.prepare_inputs(warmup_scheduler_output(shape))
        return input_ids, positions, meta

    def forget_dummy_steps(self) -> None:
        """After a warm-up (before any request): the dummy steps wrote K/V into
        the null block; zero it again (masked-out reads must see zeros), and drop the dummy
        requests."""
        for kv_cache in self.kv_caches:
            kv_cache[:, NULL_BLOCK_ID].zero_()
        self.requests.clear()
        self.input_batch.clear()
        self._prev_decode = None
        self.async_steps = self.sync_fallback_steps = 0

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's changes to the per-request state: finished requests leave, new
        ones arrive, scheduled ones gain their new blocks."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove(req_id)
            if self.proposer is not None:
                self.proposer.remove(req_id)
            if self.pooler is not None:
                self.pooler.remove_request(req_id)
        for new in so.new_requests:
            if new.pooling_params is not None:
                assert self.pooler is not None, "a pooling request needs --runner pooling"
                p = new.pooling_params
                self.pooler.add_request(new.req_id, p.task or "embed", bool(p.normalize),
                                        p.dimensions, p.activation is not False)
                self.requests[new.req_id] = CachedRequestState(
                    None, list(new.prompt_token_ids))
                batch.add(new.req_id)
                continue
            assert new.sampling_params is not None
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.sampling_params, list(new.prompt_token_ids), generator=generator,
                prompt_embeds=new.prompt_embeds,
            )
            batch.add(new.req_id)
        for it in so.scheduled:
            if it.new_block_ids:
                batch.append_block_ids(it.req_id, it.new_block_ids)

    def _decode_input_ids(self, so: SchedulerOutput, b_pad: int) -> torch.Tensor:
        items = so.scheduled
        input_ids = torch.zeros(b_pad, dtype=torch.int64, device=self.device)
        if self.async_scheduling and items:  # (a dummy batch has no request to feed)
            prev = self._prev_decode
            if prev is not None and prev[0] == [it.req_id for it in items]:
                self.async_steps += 1
                input_ids[: len(items)] = prev[1]
                return input_ids
            self.sync_fallback_steps += 1
        tokens = [self.requests[it.req_id].token_ids(it.start_position, 1)[0] for it in items]
        input_ids[: len(items)] = torch.tensor(tokens, dtype=torch.int64)
        return input_ids

    def prepare_inputs(
        self, so: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Apply the step to the request states (``update_states``), then build the model
        inputs padded to the step's bucket, and the rows holding each request's last token of
        the step.

        Prefill: the requests' segments laid end to end, padded to ``so.num_padded`` tokens;
        padded tokens repeat the last real position and get slot -1. One request attends with
        its padding (the layout is then the identity and a first segment is plainly causal);
        packed requests attend each to its own context, and padded rows attend to nothing.
        Decode: the batch pads to ``so.num_padded`` rows with dummy rows (token 0, position 0,
        slot -1, a block-table row of null blocks). Padding never allocates a block and never
        writes the cache. With EP across data-parallel replicas both pad further, to the
        replicas' largest count (``get_dp_padding``), before any metadata is built.
        """
        self.update_states(so)
        items = so.scheduled
        states = [self.requests[it.req_id] for it in items]
        bs = self.block_size
        grid = self.grid
        num_reqs = len(items)
        batch_rows = self.input_batch.rows([it.req_id for it in items])
        lens = [it.num_tokens for it in items]
        starts = [it.start_position for it in items]
        from_zero = all(s == 0 for s in starts)
        if so.is_prefill:
            total = sum(lens)
            n_pad = max(so.num_padded, total) if grid.enabled else total
            n_pad += get_dp_padding(n_pad, self.dp_group, self.dp_sync)[0]
            real_pos = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                                  for s, n in zip(starts, lens, strict=True)])
            positions = torch.cat([real_pos, real_pos[-1:].expand(n_pad - total)])
            ids = [t for st, s, n in zip(states, starts, lens, strict=True)
                   for t in st.token_ids(s, n)]
            input_ids = torch.tensor(ids + [0] * (n_pad - total), dtype=torch.int64)
            rows = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(lens))
            if not grid.enabled:
                width = self.input_batch.max_num_blocks(batch_rows)
            elif from_zero:
                # First segments attend only to themselves.
                width = cdiv(n_pad if num_reqs == 1 else max(lens), bs)
            else:
                width = cdiv(grid.decode_ctx_bucket(max(s + n for s, n in zip(starts, lens, strict=True))), bs)
            query_lens = [n_pad] if num_reqs == 1 else lens
            ends = torch.cumsum(torch.tensor(lens), 0)
            sample_rows = (ends - 1).tolist()
        else:
            # One row per token: a request's last token, then its drafts (a verification step
            # lays each request's 1 + d rows end to end, one decode row per position).
            total = sum(lens)
            b_pad = max(so.num_padded, total) if grid.enabled else total
            b_pad += get_dp_padding(b_pad, self.dp_group, self.dp_sync)[0]
            positions = torch.zeros(b_pad, dtype=torch.int64)
            rows = torch.arange(num_reqs)
            if total == num_reqs:
                real_pos = torch.tensor(starts, dtype=torch.int64)
                input_ids = self._decode_input_ids(so, b_pad)
            else:
                rows = torch.repeat_interleave(rows, torch.tensor(lens))
                real_pos = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                                      for s, n in zip(starts, lens, strict=True)])
                ids = [t for st, it in zip(states, items, strict=True)
                       for t in st.token_ids(it.start_position, 1) + it.draft_token_ids]
                input_ids = torch.zeros(b_pad, dtype=torch.int64)
                input_ids[:total] = torch.tensor(ids, dtype=torch.int64)
            positions[:total] = real_pos
            if grid.enabled:
                assert so.ctx_bucket is not None
                width = cdiv(so.ctx_bucket, bs)
            else:
                width = self.input_batch.max_num_blocks(batch_rows)
            query_lens = [1] * b_pad
            sample_rows = (torch.cumsum(torch.tensor(lens), 0) - 1).tolist()
            n_pad = b_pad
        table = self.input_batch.table(batch_rows, max(num_reqs, len(query_lens)), width)
        slots = torch.full((n_pad,), PAD_SLOT_ID, dtype=torch.int64)
        slots[:total] = slot_mapping(table, rows, real_pos, bs)
        verifying = not so.is_prefill and total > num_reqs
        if verifying:  # each row reads its own request's blocks
            table = torch.cat([table[rows], table[num_reqs:num_reqs + 1].expand(n_pad - total, -1)])
        meta = self.attn_backend.build_metadata(
            positions.to(self.device),
            query_lens,
            slots.to(self.device),
            table.to(self.device),
            block_size=bs,
            # Eager only: under compilation the flag would split a prefill bucket in two graphs.
            from_position_zero=from_zero and not self.config.compilation.enabled,
            is_decode=not so.is_prefill,
            rows_share_sequences=verifying,
            # The kernels of a plain decode step of these requests (bit-exact greedy).
            kernel_rows=grid.decode_bucket(num_reqs) if verifying else 0,
        )
        return input_ids.to(self.device), positions.to(self.device), meta, sample_rows

    def dummy_batch_inputs(
        self, num_padded: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The inputs of a decode step without requests, for a data-parallel replica that is
        idle while expert parallelism spans the replicas (spec §2): built by
        ``prepare_inputs`` itself, so every tensor has the shape of a real one-request decode
        batch padded to ``num_padded`` rows (default: the smallest batch bucket) at the
        narrowest context bucket. Every row is padding: token 0, slot PAD_SLOT_ID (nothing is
        written to the KV cache), null blocks."""
        grid = self.grid
        if not grid.enabled:
            raise ValueError("dummy batches need bucketing (a real batch's shapes come from "
                             "the bucket grid); drop enable_bucketing=false")
        rows = num_padded if num_padded is not None else grid.decode_bucket(1)
        so = SchedulerOutput([], is_prefill=False, num_padded=rows,
                             ctx_bucket=grid.decode_ctx_bucket(1))
        return self.prepare_inputs(so)

    def execute_dummy_batch(self, num_padded: int | None = None) -> None:
        """Run the model on ``dummy_batch_inputs`` (no logits, no sampling): the replica's
        MoE layers take part in the step's collectives with the same shapes as the others'."""
        with self.program.grad_mode():
            input_ids, positions, meta, _ = self.dummy_batch_inputs(num_padded)
            self.program.forward(input_ids, positions, self.kv_caches, meta)
        self.dummy_steps += 1

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with self.program.grad_mode():
            return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.is_empty:
            self.update_states(so)
            return ModelRunnerOutput([], [])
        input_ids, positions, meta, last_rows = self.prepare_inputs(so)
        if so.is_prefill:
            self._prev_decode = None
        return self._run_model(so, input_ids, positions, meta, last_rows)

    def _run_model(
        self, so: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata, last_rows: list[int],
    ) -> ModelRunnerOutput:
        embeds: tuple[torch.Tensor, ...] = ()
        if so.is_prefill and self.config.model_config.enable_prompt_embeds:
            embeds = self._prompt_embeds_inputs(so, input_ids.shape[0]) or ()
        hidden = self.program.forward(input_ids, positions, self.kv_caches, meta, embeds)
        if self.pooler is not None:  # no logits, no sampling
            return ModelRunnerOutput([], [], pooler_output=self._pool(hidden, so, last_rows))

        # Which hidden rows need logits: the last real token of each sampling request, and
        # every real token of a prefill chunk whose request asked for prompt logprobs.
        sample_rows: list[int] = []
        sample_reqs: list[str] = []
        prompt_lp: list[tuple[str, int, int, int]] = []  # req, first row, n rows, first position
        for it, last_row in zip(so.scheduled, last_rows, strict=True):
            state = self.requests[it.req_id]
            if so.is_prefill and state.params.prompt_logprobs is not None:
                # targets exist for positions < prompt_len - 1
                n = min(it.num_tokens, len(state.prompt_token_ids) - 1 - it.start_position)
                if n > 0:
                    prompt_lp.append((it.req_id, last_row - it.num_tokens + 1, n, it.start_position))
            if it.sample:
                sample_rows.append(last_row)
                sample_reqs.append(it.req_id)

        output = ModelRunnerOutput(sample_reqs, [])
        if prompt_lp:
            self._prompt_logprobs(hidden, prompt_lp, output)
        if not sample_rows:
            self._propose(so, last_rows, [], [], [], output)
            return output
        states = [self.requests[r] for r in sample_reqs]
        if meta.rows_share_sequences:  # a verification step
            new_tokens, logprobs_tensors = self._verify(hidden, so, states, last_rows)
        else:
            new_tokens, logprobs_tensors = self._sample(hidden, so, sample_rows, sample_reqs,
                                                        states)
        output.sampled_token_ids = new_tokens
        row = 0
        for req_id, state, tokens in zip(sample_reqs, states, new_tokens, strict=True):
            state.output_token_ids.extend(tokens)
            k = state.params.logprobs
            if logprobs_tensors is not None and k is not None:
                output.logprobs[req_id] = [
                    SampledLogprobs(*_tensors_to_lists(logprobs_tensors, row + j, k))
                    for j in range(len(tokens))
                ]
            row += len(tokens)
        self._propose(so, last_rows, sample_reqs, states, new_tokens, output)
        return output

    def _propose(
        self, so: SchedulerOutput, last_rows: list[int], sample_reqs: list[str],
        states: list[CachedRequestState], new_tokens: list[list[int]], output: ModelRunnerOutput,
    ) -> None:
        """Speculative decoding: drafts for the next step, when the scheduler asks for them."""
        proposer = self.proposer
        if proposer is None:
            return
        # Not for constrained requests: their drafts would need the grammar's masks too.
        wanted = [(r, st) for r, st in zip(sample_reqs, states, strict=True)
                  if st.params.structured_outputs is None] if so.propose_drafts else []
        if not wanted and not isinstance(proposer, Eagle3Proposer):
            return  # (the EAGLE3 head follows every step)
        # (The drafter's forwards build their own metadata: their kernels go by their own rows.)
        drafts = self._drafts(proposer, so, last_rows, sample_reqs, new_tokens, wanted)
        for (req_id, _), d in zip(wanted, drafts, strict=True):
            if d:
                output.draft_token_ids[req_id] = d

    def _drafts(
        self, proposer: NgramProposer | DraftModelProposer | Eagle3Proposer, so: SchedulerOutput,
        last_rows: list[int], sample_reqs: list[str], new_tokens: list[list[int]],
        wanted: list[tuple[str, CachedRequestState]],
    ) -> list[list[int]]:
        if isinstance(proposer, Eagle3Proposer):
            # The head follows every step (its cache must cover each computed position).
            kept = dict(zip(sample_reqs, (len(t) for t in new_tokens), strict=True))
            step = [StepRows(it.req_id, self.requests[it.req_id], last - it.num_tokens + 1,
                             it.start_position,
                             kept[it.req_id] if it.draft_token_ids else it.num_tokens)
                    for it, last in zip(so.scheduled, last_rows, strict=True)]
            aux = self.model.model.aux_hidden_states
            assert aux is not None, "the target left no auxiliary hidden states"
            return proposer.propose(wanted, step, aux, self.input_batch.block_ids)
        if isinstance(proposer, DraftModelProposer):
            return proposer.propose(wanted, self.input_batch.block_ids)
        return proposer.propose(wanted)

    def _sampling_metadata(
        self, states: list[CachedRequestState], outputs: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """One row per state (``outputs``: each row's output tokens, when they are not the
        state's own, e.g. a verification row after some drafts)."""
        return SamplingMetadata.from_params(
            [s.params for s in states],
            outputs if outputs is not None else [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.vocab_size,
            self.device,
        )

    def _sample(
        self, hidden: torch.Tensor, so: SchedulerOutput, sample_rows: list[int],
        sample_reqs: list[str], states: list[CachedRequestState],
    ) -> tuple[list[list[int]], LogprobsTensors | None]:
        """Logits and sampling for the rows that sample. Under TP every rank must feed the
        same token to its next step: plain greedy rows take the argmax over the vocab shards
        (no logits gathered, identical on every rank); anything else samples on the gathered
        logits and rank 0's tokens are broadcast."""
        metadata = self.input_batch.sampling_metadata(
            sample_reqs, lambda: self._sampling_metadata(states))
        tp = self.tp_group
        if tp.world_size > 1 and metadata.argmax_only and so.grammar_bitmask is None:
            result = SamplerOutput(
                sampled_token_ids=self.model.greedy_token_ids(hidden[sample_rows]),
                logprobs_tensors=None)
        else:
            # Model dtype: the sampler makes its own float32 copy only when it processes them.
            logits = self.model.compute_logits(hidden[sample_rows])
            apply_grammar_bitmask(logits, sample_reqs, so.grammar_bitmask)
            result = self.sampler(logits, metadata)
            if tp.world_size > 1:
                result.sampled_token_ids = tp.broadcast(result.sampled_token_ids.contiguous(), 0)
        if not so.is_prefill:
            self._prev_decode = (sample_reqs, result.sampled_token_ids)
        return [[t] for t in result.sampled_token_ids.tolist()], result.logprobs_tensors

    def _verify(
        self, hidden: torch.Tensor, so: SchedulerOutput, states: list[CachedRequestState],
        last_rows: list[int],
    ) -> tuple[list[list[int]], LogprobsTensors | None]:
        """A verification step: logits at each request's last token and drafts, checked by
        the rejection sampler (every scheduled request samples in a decode step)."""
        drafts = [it.draft_token_ids for it in so.scheduled]
        spec = SpecDecodeMetadata.make(drafts, [row + 1 for row in last_rows])
        # A plain decode step computes its logits on one row per request (unpadded): the LM
        # head takes that step's kernel, as the layers took the padded batch's.
        logits = self.model.compute_logits(hidden[spec.logits_indices.to(hidden.device)],
                                           kernel_rows=len(drafts))
        row_states = [st for st, d in zip(states, drafts, strict=True) for _ in range(len(d) + 1)]
        row_outputs = [st.output_token_ids + d[:j] for st, d in zip(states, drafts, strict=True)
                       for j in range(len(d) + 1)]
        result = self.rejection_sampler(logits, self._sampling_metadata(row_states, row_outputs),
                                        spec)
        if self.tp_group.world_size > 1:
            return self._agree_on_tokens(result.token_ids, drafts), result.logprobs_tensors
        return result.token_ids, result.logprobs_tensors

    def _agree_on_tokens(self, tokens: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
        """Rank 0's accepted tokens on every rank (each request has at most its drafts + 1, a
        shape every rank knows, so one fixed-size broadcast carries them)."""
        width = max(len(d) for d in drafts) + 1
        table = torch.full((len(tokens), width), -1, dtype=torch.int64)
        for row, ids in enumerate(tokens):
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        table = self.tp_group.broadcast(table.to(self.device), 0).cpu()
        return [[t for t in row if t >= 0] for row in table.tolist()]

    def _prompt_embeds_inputs(
        self, so: SchedulerOutput, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(inputs_embeds [rows, H], is_token_ids [rows]) for a prefill step in which some
        request still has prompt-embeds positions (its slice from its computed tokens on, so
        a chunked prefill continues where it stopped); None otherwise."""
        pieces = []
        row = 0
        for it in so.scheduled:
            embeds = self.requests[it.req_id].prompt_embeds
            if embeds is not None and it.start_position < embeds.shape[0]:
                n = min(it.num_tokens, embeds.shape[0] - it.start_position)
                pieces.append((row, embeds[it.start_position : it.start_position + n]))
            row += it.num_tokens
        if not pieces:
            return None
        hidden = pieces[0][1].shape[1]
        inputs = torch.zeros(num_rows, hidden, dtype=self.config.model_config.dtype)
        is_token_ids = torch.ones(num_rows, dtype=torch.bool)
        for start, piece in pieces:
            inputs[start : start + piece.shape[0]] = piece
            is_token_ids[start : start + piece.shape[0]] = False
        return inputs.to(self.device), is_token_ids.to(self.device)

    def _pool(
        self, hidden: torch.Tensor, so: SchedulerOutput, last_rows: list[int]
    ) -> dict[str, list[float]]:
        assert self.pooler is not None
        segments = [
            PoolingSegment(it.req_id, row - it.num_tokens + 1, it.num_tokens, it.start_position,
                           it.sample)
            for it, row in zip(so.scheduled, last_rows, strict=True)
        ]
        return self.pooler(hidden, segments)

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
