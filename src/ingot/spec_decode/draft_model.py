"""A draft model proposes: a smaller causal LM with the target's tokenizer decodes k tokens
greedily ahead of the target, which verifies them in one step.

Its KV cache has the target's block layout and uses the same block ids (the request's blocks),
in tensors of its own. For each request the proposer remembers which positions of its cache
are valid and for which tokens: after a verification step the positions of rejected drafts
are computed again. So each call runs

1. one packed forward over every request's tokens the draft has not computed yet (its new
   prompt on the first call; afterwards the accepted drafts and the target's token), whose
   last rows give the first draft, then
2. k - 1 one-token decode forwards, each feeding the previous draft.

The drafts' own positions are written into blocks the scheduler allocated ahead for them
(``SpeculativeConfig.lookahead_slots``). The draft always decodes greedily, so its proposals
are deterministic (q is one-hot for the rejection sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.sampler import greedy_argmax
from ingot.spec_decode.metadata import drafter_metadata

#: How the draft's steps run: the worker's step program for it (its modules, or for the decode
#: steps it serves its attention backend's decode program): hidden states.
DraftForward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata],
                        torch.Tensor]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    def __init__(self, model: nn.Module, forward: DraftForward, kv_caches: list[torch.Tensor],
                 k: int, block_size: int, max_model_len: int, device: torch.device) -> None:
        """``forward``: runs the draft's steps (``model`` computes the logits)."""
        self.model, self.forward, self.kv_caches, self.k = model, forward, kv_caches, k
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        # Per request: positions whose K/V is valid, and the tokens they were computed for.
        self._computed: dict[str, int] = {}
        self._tokens: dict[str, list[int]] = {}

    def remove(self, req_id: str) -> None:
        self._computed.pop(req_id, None)
        self._tokens.pop(req_id, None)

    def _forward(self, ids: list[int], positions: list[int], query_lens: list[int],
                 tables: list[list[int]], is_decode: bool) -> torch.Tensor:
        """Hidden states of the rows; ``tables``: each request's block ids."""
        pos = torch.tensor(positions, dtype=torch.int64)
        meta = drafter_metadata(pos, query_lens, tables, self.block_size, self.device, is_decode)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.forward(ids_t, pos.to(self.device), self.kv_caches, meta)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return greedy_argmax(self.model.compute_logits(hidden)).tolist()

    @torch.inference_mode()
    def propose(self, requests: Sequence[tuple[str, Any]],
                block_ids: Callable[[str], list[int]]) -> list[list[int]]:
        """Drafts for each (req_id, state) whose tokens are ``state.prompt_token_ids +
        state.output_token_ids`` (the last one sampled, not yet computed by the target);
        ``block_ids(req_id)``: the request's KV blocks (shared with the target's)."""
        work = []  # (index, tokens, first uncomputed position, drafts wanted, blocks)
        for i, (req_id, state) in enumerate(requests):
            tokens = state.prompt_token_ids + state.output_token_ids
            total = len(tokens)
            k = min(self.k, self.max_model_len - total - 1)
            if k <= 0:
                continue
            valid = _common_prefix(self._tokens.get(req_id, []), tokens,
                                   min(self._computed.get(req_id, 0), total - 1))
            work.append((i, req_id, tokens, valid, k, block_ids(req_id)))
        drafts: list[list[int]] = [[] for _ in requests]
        if not work:
            return drafts
        # 1. Catch up: every position not computed yet, up to the last token; its last row
        # gives the first draft.
        ids, positions, lens = [], [], []
        for _, _, tokens, valid, _, _ in work:
            ids += tokens[valid:]
            positions += list(range(valid, len(tokens)))
            lens.append(len(tokens) - valid)
        hidden = self._forward(ids, positions, lens, [w[5] for w in work], is_decode=False)
        last = torch.cumsum(torch.tensor(lens), 0) - 1
        for w, token in zip(work, self._argmax(hidden[last.to(hidden.device)]), strict=True):
            drafts[w[0]].append(token)
        # 2. k - 1 decode steps, each over the requests that want another draft.
        for j in range(1, max(w[4] for w in work)):
            live = [w for w in work if w[4] > j]
            ids = [drafts[w[0]][-1] for w in live]
            positions = [len(w[2]) - 1 + j for w in live]
            hidden = self._forward(ids, positions, [1] * len(live), [w[5] for w in live],
                                   is_decode=True)
            for w, token in zip(live, self._argmax(hidden), strict=True):
                drafts[w[0]].append(token)
        for i, req_id, tokens, _, k, _ in work:
            # Valid now: the tokens, and every draft but the last (fed, never computed).
            self._tokens[req_id] = tokens + drafts[i][: k - 1]
            self._computed[req_id] = len(tokens) + k - 1
        return drafts
