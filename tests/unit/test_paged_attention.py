"""paged_attention's first-prefill shortcut (attend to the fresh key/value rows instead of
gathering them back from the cache) against the gather path and plain causal attention."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ingot.model_executor.layers.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 8


def _prefill(real: int, padded: int, width: int) -> torch.Tensor:
    """One request prefilled from position 0 (``real`` tokens padded to ``padded``) over a
    block table of ``width`` blocks; returns the real rows of the output."""
    torch.manual_seed(11)
    q = torch.randn(padded, HEADS, HEAD_DIM)
    k = torch.randn(padded, KV_HEADS, HEAD_DIM)
    v = torch.randn(padded, KV_HEADS, HEAD_DIM)
    cache = torch.randn(2, 1 + width, BLOCK, KV_HEADS, HEAD_DIM)  # block 0: the null block
    table = torch.arange(1, 1 + width).view(1, width)
    real_pos = torch.arange(real)
    positions = torch.cat([real_pos, real_pos[-1:].expand(padded - real)])
    slots = torch.full((padded,), -1)
    slots[:real] = BLOCK + real_pos  # blocks 1.. in order
    meta = AttentionMetadata.build(positions, [padded], slots, table, block_size=BLOCK,
                                   from_position_zero=True)
    out = paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
    return out[:real], q[:real], k[:real], v[:real]


def test_first_prefill_shortcut_equals_the_gather_path_and_causal_attention():
    real, padded = 21, 24  # padded to three blocks
    got, q, k, v = _prefill(real, padded, width=3)  # context == tokens: the shortcut
    gathered, *_ = _prefill(real, padded, width=5)  # wider table: gathers from the cache
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        scale=HEAD_DIM**-0.5, enable_gqa=True,
    ).transpose(0, 1).reshape(real, HEADS * HEAD_DIM)
    assert torch.allclose(got, gathered, atol=1e-5)
    assert torch.allclose(got, ref, atol=1e-5)
    # Broken case: attention without the causal mask must not pass the same check.
    wrong = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=HEAD_DIM**-0.5,
        enable_gqa=True,
    ).transpose(0, 1).reshape(real, HEADS * HEAD_DIM)
    assert not torch.allclose(got, wrong, atol=1e-5)
