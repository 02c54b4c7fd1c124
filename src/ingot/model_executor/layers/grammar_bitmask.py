"""The packed token bitmask of structured outputs: pack, unpack, apply to logits.

Layout (xgrammar's and vLLM's): int32 words, ``ceil(vocab / 32)`` per row, token ``t`` allowed
when bit ``t % 32`` of word ``t // 32`` is set (little-endian bit order; bit 31 is the sign
bit, so an all-allowed word is -1). Plain torch, no xgrammar: the worker applies masks without
importing the grammar engine.
"""

from __future__ import annotations

import numpy as np
import torch

from ingot.sched_output import GrammarBitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` bool -> ``[N, ceil(V / 32)]`` int32 (tokens past V are disallowed)."""
    n, vocab = allowed.shape
    width = bitmask_width(vocab)
    bits = torch.zeros(n, width * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.to(torch.int64)
    words = (bits.view(n, width, 32) << _SHIFTS.to(torch.int64)).sum(-1)
    # Words are unsigned 32-bit values; reinterpret the top bit as int32's sign.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, W]`` int32 -> ``[N, vocab_size]`` bool; ``vocab_size`` may be below ``32 W``."""
    n, width = packed.shape
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(n, width * 32)[:, :vocab_size].bool()


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: list[str], grammar: GrammarBitmask | None
) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the rows whose request has a
    mask. ``row_req_ids[i]`` is the request of logits row ``i``; masks of requests not in the
    batch are skipped. The mask's width follows the logits' width (the model's vocab), so a
    tokenizer smaller than the embedding leaves the extra ids disallowed."""
    if grammar is None:
        return
    position = {rid: i for i, rid in enumerate(row_req_ids)}
    rows, mask_rows = [], []
    for j, rid in enumerate(grammar.req_ids):
        i = position.get(rid)
        if i is not None:
            rows.append(i)
            mask_rows.append(j)
    if not rows:
        return
    packed = torch.from_numpy(np.ascontiguousarray(grammar.bitmask[mask_rows]))
    vocab = logits.shape[-1]
    if packed.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {packed.shape[1] * 32} tokens, logits {vocab}")
    allowed = unpack_bitmask(packed.to(logits.device), vocab)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
