"""Verification of draft tokens: one rejection sampler for every proposer.

A verification step runs the target over each request's last token and its ``d`` drafts, so
request ``i`` has ``d + 1`` logits rows: row ``j < d`` is the target's distribution after
``drafts[:j]`` (it verifies ``drafts[j]``), row ``d`` is the bonus row after all drafts.

* Greedy rows: a draft is accepted while it equals the target's argmax; at the first mismatch
  the target's argmax is emitted instead; when every draft is accepted the bonus row's argmax
  follows. The emitted tokens are exactly what plain greedy decoding would produce.
* Random rows (Leviathan et al., arXiv 2211.17192): draft ``x`` with draft probability ``q(x)``
  is accepted with probability ``min(1, p(x) / q(x))``; proposers here draft deterministically
  (n-gram lookup, a greedy draft model), so ``q`` is one-hot and the test is ``u <= p(x)``. On
  rejection the token is drawn from the residual ``max(p - q, 0)`` (``p`` with ``x`` removed),
  which makes every emitted token distributed exactly as ``p``. ``p`` is the sampler's own
  processed distribution (min_tokens, penalties, temperature, top-k, top-p, min-p), row by row.

Everything is tensor ops over all rows at once; the loops are O(requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ingot.model_executor.layers.sampler import (
    _SAMPLING_EPS,
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_logprobs,
    gather_logprobs,
    greedy_argmax,
    random_sample,
)


@dataclass
class SpecDecodeMetadata:
    """Where each request's logits rows are, for a step in which some requests carry drafts.

    ``logits_indices`` are the token rows (of the step's flattened tokens) whose logits are
    computed: the last ``1 + d`` of each request's scheduled tokens. Indices below are into
    those logits rows: ``target_logits_indices`` verify a draft each, ``bonus_logits_indices``
    is each request's row after its drafts."""

    draft_token_ids: torch.Tensor  # [total drafts] int64, requests in order
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [total drafts + B] int64
    target_logits_indices: torch.Tensor  # [total drafts] int64
    bonus_logits_indices: torch.Tensor  # [B] int64

    @classmethod
    def make(
        cls, draft_token_ids: list[list[int]], cu_num_scheduled_tokens: list[int]
    ) -> SpecDecodeMetadata:
        num_draft = [len(d) for d in draft_token_ids]
        if len(num_draft) != len(cu_num_scheduled_tokens):
            raise ValueError("one draft list and one cumulative token count per request")
        num_draft_t = torch.tensor(num_draft, dtype=torch.int64)
        num_rows = num_draft_t + 1
        cu_rows = torch.cumsum(num_rows, 0)
        total = int(cu_rows[-1]) if num_draft else 0
        req_of_row = torch.repeat_interleave(torch.arange(len(num_draft)), num_rows)
        # Row r of request i is the (cu_rows[i] - r)-th row from the request's end.
        from_end = cu_rows[req_of_row] - torch.arange(total)
        ends = torch.tensor(cu_num_scheduled_tokens, dtype=torch.int64)
        logits_indices = ends[req_of_row] - from_end
        bonus = cu_rows - 1
        is_target = torch.ones(total, dtype=torch.bool)
        is_target[bonus] = False
        return cls(
            draft_token_ids=torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64),
            num_draft_tokens=num_draft,
            cu_num_draft_tokens=torch.cumsum(num_draft_t, 0),
            logits_indices=logits_indices,
            target_logits_indices=torch.arange(total)[is_target],
            bonus_logits_indices=bonus,
        )


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then the target's token
    num_accepted: list[int]  # per request: drafts accepted
    logprobs_tensors: LogprobsTensors | None  # one row per emitted token, requests in order


def _uniform(n: int, rows: torch.Tensor, generators: dict[int, torch.Generator],
             device: torch.device) -> torch.Tensor:
    """One U(0, 1) draw per draft; a seeded request's draws come from its own generator."""
    u = torch.rand(n, device=device)
    if generators:
        for i, row in enumerate(rows.tolist()):
            gen = generators.get(row)
            if gen is not None:
                u[i] = torch.rand(1, generator=gen, device=device)[0]
    return u


class RejectionSampler:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    @staticmethod
    def residual(probs: torch.Tensor, draft_rows: torch.Tensor, drafts: torch.Tensor) -> None:
        """A rejected draft's row samples from the residual max(p - q, 0): with a one-hot q,
        p without the draft token (the exponential race needs no renormalising)."""
        probs[draft_rows, drafts] = 0.0

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata
    ) -> RejectionOutput:
        """``logits`` [rows, V]: the rows of ``spec.logits_indices`` in order; ``metadata``
        has one entry per row (a row's output tokens include the drafts before it)."""
        device = logits.device
        num_logprobs = metadata.max_num_logprobs
        raw_logprobs = compute_logprobs(logits) if num_logprobs is not None else None
        if metadata.all_greedy and metadata.no_penalties and not metadata.min_tokens:
            # Nothing to process: the argmax of the raw logits, no float32 copy (the plain
            # sampler's shortcut, so the tokens are its own).
            processed = logits
            target_argmax = greedy_argmax(logits)
        else:
            processed = self.sampler.apply_logits_processors(
                logits.to(dtype=torch.float32, copy=True), metadata
            )
            target_argmax = processed.argmax(dim=-1)
        draft_rows = spec.target_logits_indices.to(device)
        drafts = spec.draft_token_ids.to(device)
        if metadata.all_greedy:
            accept = target_argmax[draft_rows] == drafts
            row_tokens = target_argmax
        else:
            greedy_row = metadata.temperature.to(device) < _SAMPLING_EPS
            probs = self.sampler.probs(processed, metadata)
            u = _uniform(drafts.numel(), draft_rows, metadata.generators, device)
            random_accept = u <= probs[draft_rows, drafts]
            accept = torch.where(greedy_row[draft_rows], target_argmax[draft_rows] == drafts,
                                 random_accept)
            self.residual(probs, draft_rows, drafts)
            random_tokens = random_sample(probs, metadata.generators)
            row_tokens = torch.where(greedy_row, target_argmax, random_tokens)

        # Leading accepted drafts per request: pad each request's verdicts to [B, max d].
        num_draft = spec.num_draft_tokens
        num_reqs = len(num_draft)
        width = max(num_draft, default=0)
        verdicts = torch.zeros(num_reqs, max(width, 1), dtype=torch.bool, device=device)
        if drafts.numel():
            req = torch.repeat_interleave(torch.arange(num_reqs, device=device),
                                          torch.tensor(num_draft, device=device))
            starts = spec.cu_num_draft_tokens.to(device) - torch.tensor(num_draft, device=device)
            col = torch.arange(drafts.numel(), device=device) - starts[req]
            verdicts[req, col] = accept
        num_accepted = verdicts.to(torch.int64).cumprod(dim=1).sum(dim=1)
        # The token after the accepted drafts: the first rejected draft's row, or the bonus row.
        first_row = spec.bonus_logits_indices.to(device) - torch.tensor(num_draft, device=device)
        last_rows = first_row + num_accepted
        final = row_tokens[last_rows].tolist()
        accepted = num_accepted.tolist()
        drafts_list = spec.draft_token_ids.tolist()
        token_ids = []
        offset = 0
        for d, a, tok in zip(num_draft, accepted, final, strict=True):
            token_ids.append(drafts_list[offset : offset + a] + [tok])
            offset += d
        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            rows = torch.cat([torch.arange(int(f), int(f) + a + 1) for f, a in
                              zip(first_row.tolist(), accepted, strict=True)])
            emitted = torch.tensor([t for ts in token_ids for t in ts], dtype=torch.int64)
            logprobs_tensors = gather_logprobs(raw_logprobs[rows.to(device)], num_logprobs,
                                               emitted.to(device))
        return RejectionOutput(token_ids, accepted, logprobs_tensors)
