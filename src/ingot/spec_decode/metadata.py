"""Attention metadata for a drafter's own forwards (a draft model, an EAGLE3 head): its KV
cache uses the request's block ids, so its rows are laid out like the target's, unpadded."""

from __future__ import annotations

import torch

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.sched_output import NULL_BLOCK_ID


def drafter_metadata(positions: torch.Tensor, query_lens: list[int], tables: list[list[int]],
                     block_size: int, device: torch.device, is_decode: bool) -> AttentionMetadata:
    """``positions`` [rows] (requests' rows end to end, ``query_lens`` each); ``tables``: each
    request's block ids (every position's block must be among them)."""
    width = max(len(t) for t in tables)
    table = torch.full((len(tables), width), NULL_BLOCK_ID, dtype=torch.int64)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata.build(positions.to(device), query_lens, slots.to(device),
                                   table.to(device), block_size=block_size, is_decode=is_decode)
