"""EAGLE3 proposals: a one-layer head reads the target's hidden states and drafts k tokens.

After every target step, for each request the step computed:

1. Initial pass over the rows the target computed and kept (a prefill segment; a decode
   token; a verification's last token and its accepted drafts): the row at position p takes
   the embedding of token p + 1 and the target's auxiliary hidden states at p (through
   ``fc``), and writes the head's K/V at p. The last row's output drafts the first token; its
   pre-norm output is the recurrent state.
2. k - 1 recurrent steps: the previous draft at the next position, with the previous row's
   state, each drafting one more token.

The head's KV cache is one layer in the target's block layout (the request's block ids, its
own tensor). Positions written by recurrent steps are rewritten by the next initial pass,
which covers exactly the positions the target has confirmed since.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.sampler import greedy_argmax
from ingot.spec_decode.metadata import drafter_metadata


@dataclass
class StepRows:
    """What a target step computed for one request: ``num_rows`` rows from ``first_row`` of
    its hidden states, at positions ``first_position``... (those it kept)."""

    req_id: str
    state: Any  # the runner's CachedRequestState (tokens after this step's)
    first_row: int
    first_position: int
    num_rows: int


class Eagle3Proposer:
    def __init__(self, head: nn.Module, kv_caches: list[torch.Tensor], k: int, block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        self.head, self.kv_caches, self.k = head, kv_caches, k
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device

    def remove(self, req_id: str) -> None:  # the head keeps no per-request state
        pass

    def _draft(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(greedy_argmax(self.head.compute_logits(normed)))

    @torch.inference_mode()
    def propose(self, requests: Sequence[tuple[str, Any]], step: list[StepRows],
                aux: torch.Tensor, block_ids: Callable[[str], list[int]]) -> list[list[int]]:
        """Drafts for ``requests`` (those that sampled), after the target step ``step`` whose
        auxiliary hidden states are ``aux`` [rows, 3 x hidden]; ``block_ids(req_id)``: the
        request's KV blocks. Every segment of the step runs the initial pass (so the head's
        cache follows the target's)."""
        drafts: list[list[int]] = [[] for _ in requests]
        if not step:
            return drafts
        ids, positions, rows = [], [], []
        for seg in step:
            tokens = seg.state.prompt_token_ids + seg.state.output_token_ids
            p0 = seg.first_position
            ids += tokens[p0 + 1 : p0 + 1 + seg.num_rows]
            positions += range(p0, p0 + seg.num_rows)
            rows += range(seg.first_row, seg.first_row + seg.num_rows)
        pos = torch.tensor(positions, dtype=torch.int64)
        meta = drafter_metadata(pos, [s.num_rows for s in step], [block_ids(s.req_id) for s in step],
                                self.block_size, self.device, is_decode=False)
        state = aux[torch.tensor(rows, device=aux.device)]
        normed, prenorm = self.head(torch.tensor(ids, dtype=torch.int64, device=self.device),
                                    pos.to(self.device), self.kv_caches, meta, state)
        by_id = {seg.req_id: i for i, seg in enumerate(step)}
        last = torch.cumsum(torch.tensor([s.num_rows for s in step]), 0) - 1
        live = []  # (index in requests, segment, drafts wanted)
        for i, (req_id, st) in enumerate(requests):
            total = len(st.prompt_token_ids) + len(st.output_token_ids)
            k = min(self.k, self.max_model_len - total - 1)
            if k > 0 and req_id in by_id:
                live.append((i, step[by_id[req_id]], k))
        if not live:
            return drafts
        sel = last[[by_id[seg.req_id] for _, seg, _ in live]].to(normed.device)
        tokens = self._draft(normed[sel])
        state = prenorm[sel]
        for (i, _, _), t in zip(live, tokens.tolist(), strict=True):
            drafts[i].append(t)
        for j in range(1, max(k for _, _, k in live)):
            keep = [n for n, (_, _, k) in enumerate(live) if k > j]
            live = [live[n] for n in keep]
            tokens, state = tokens[keep], state[keep]
            pos = torch.tensor([seg.first_position + seg.num_rows - 1 + j for _, seg, _ in live],
                               dtype=torch.int64)
            meta = drafter_metadata(pos, [1] * len(live), [block_ids(seg.req_id) for _, seg, _ in live],
                                    self.block_size, self.device, is_decode=True)
            normed, state = self.head(tokens, pos.to(self.device), self.kv_caches, meta, state)
            tokens = self._draft(normed)
            for (i, _, _), t in zip(live, tokens.tolist(), strict=True):
                drafts[i].append(t)
        return drafts
