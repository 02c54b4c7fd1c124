"""n-gram prompt lookup: drafts copied from earlier in the request's own tokens.

The longest suffix of the tokens (between ``prompt_lookup_min`` and ``prompt_lookup_max``
tokens long) that also occurs earlier proposes the ``k`` tokens that followed that earlier
occurrence, as vLLM's proposer does (ties: the earliest occurrence). Free to compute and strong
when the output repeats its input: editing a passage, answering with code from the prompt.

Vectorised: for every earlier end position, the length of its common suffix with the whole
sequence is found with one comparison per n-gram length (numpy, O(tokens * max_n) per request),
never a Python loop over the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (1-D int array); empty when no
    suffix of at least ``min_n`` tokens occurs earlier."""
    total = tokens.shape[0]
    if k <= 0 or total < min_n + 1:
        return tokens[:0]
    max_n = min(max_n, total - 1)
    # match[e] = the suffix tokens[-n:] ends at e too, for growing n (e < total - 1: an
    # earlier occurrence, possibly overlapping the suffix).
    ends = total - 1
    match = np.ones(ends, dtype=bool)
    length = np.zeros(ends, dtype=np.int32)
    for n in range(max_n):
        # tokens[e - n] == tokens[total - 1 - n], defined for e >= n
        cur = np.zeros(ends, dtype=bool)
        cur[n:] = tokens[: ends - n] == tokens[total - 1 - n]
        match &= cur
        if not match.any():
            break
        length += match
    longest = int(length.max())
    if longest < min_n:
        return tokens[:0]
    end = int(np.argmax(length == longest))  # the earliest of the longest matches
    start = end + 1
    return tokens[start : start + k]


class NgramProposer:
    """Keeps each request's tokens in a growing numpy buffer (appended to, never rebuilt)."""

    def __init__(self, min_n: int, max_n: int, k: int, max_model_len: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.max_model_len = max_model_len
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, requests: Sequence[tuple[str, Any]]) -> list[list[int]]:
        """Drafts for each (req_id, state) (``state.prompt_token_ids``, ``.output_token_ids``)."""
        return [self.propose_one(r, s.prompt_token_ids, s.output_token_ids) for r, s in requests]

    def propose_one(self, req_id: str, prompt: list[int], output: list[int]) -> list[int]:
        """Drafts for the request whose tokens are ``prompt + output`` (the last one sampled,
        not yet computed); no more than fit before max_model_len."""
        total = len(prompt) + len(output)
        buf, n = self._buffers.get(req_id, (None, 0))
        if buf is None or buf.shape[0] < total:
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < len(prompt):
            buf[n : len(prompt)] = prompt[n:]
            n = len(prompt)
        if n < total:
            buf[n:total] = output[n - len(prompt):]
        self._buffers[req_id] = (buf, total)
        # The drafts and the token after them are computed at positions < max_model_len.
        k = min(self.k, self.max_model_len - total - 1)
        return propose_ngram(buf[:total], self.min_n, self.max_n, k).tolist()

    def remove(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)
