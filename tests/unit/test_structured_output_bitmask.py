"""The packed grammar bitmask: layout, round trips, and applying it to logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ingot.model_executor.layers.grammar_bitmask import (
    apply_grammar_bitmask,
    bitmask_width,
    pack_bitmask,
    unpack_bitmask,
)
from ingot.sched_output import GrammarBitmask


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 64, 259, 1000])
def test_pack_unpack_round_trip(vocab):
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=gen) < 0.5
    allowed[0] = True
    allowed[1] = False
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (5, bitmask_width(vocab))
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)


def test_bit_31_and_layout_match_xgrammar():
    """Token t is bit t % 32 of word t // 32; bit 31 is int32's sign bit. xgrammar's own
    kernel must agree with our unpacking on the same words."""
    import xgrammar as xgr  # a required dependency (pyproject.toml): never a skip

    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 63, 69]] = True
    packed = pack_bitmask(allowed)
    assert packed[0, 0].item() == (1 | -(2**31))  # bits 0 and 31
    assert packed[0, 1].item() == (1 | -(2**31))  # tokens 32 and 63
    assert packed[0, 2].item() == 1 << 5  # token 69
    logits = torch.zeros(1, 70)
    xgr.apply_token_bitmask_inplace(logits, packed)
    assert torch.equal(torch.isfinite(logits), allowed)


def test_all_ones_mask_leaves_logits_bit_identical():
    logits = torch.randn(3, 259, dtype=torch.bfloat16)
    before = logits.clone()
    mask = GrammarBitmask(["a", "b", "c"], np.full((3, bitmask_width(259)), -1, dtype=np.int32))
    apply_grammar_bitmask(logits, ["a", "b", "c"], mask)
    assert torch.equal(logits.view(torch.int16), before.view(torch.int16))


def test_masked_argmax_only_picks_allowed_tokens():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(4, 100, generator=gen)
        allowed = torch.rand(4, 100, generator=gen) < 0.1
        allowed[:, 7] = True  # at least one per row
        mask = GrammarBitmask(list("wxyz"), pack_bitmask(allowed).numpy())
        apply_grammar_bitmask(logits, list("wxyz"), mask)
        picked = logits.argmax(-1)
        assert allowed[torch.arange(4), picked].all()
        # the best allowed token wins, not merely some allowed token
        assert torch.isinf(logits[~allowed]).all() and torch.isfinite(logits[allowed]).all()


def test_rows_land_at_their_requests_batch_positions():
    """Masks arrive in the manager's order and cover only constrained requests; each lands on
    its own request's row, other rows are untouched, masks for absent requests are skipped."""
    vocab = 40
    logits = torch.zeros(4, vocab)
    only = {"r3": 5, "r1": 33, "gone": 2}
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    for i, tok in enumerate(only.values()):
        allowed[i, tok] = True
    mask = GrammarBitmask(list(only), pack_bitmask(allowed).numpy())
    apply_grammar_bitmask(logits, ["r0", "r1", "r2", "r3"], mask)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [33]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [5]


def test_mask_narrower_than_logits_is_an_error():
    mask = GrammarBitmask(["a"], np.full((1, 1), -1, dtype=np.int32))
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_grammar_bitmask(torch.zeros(1, 33), ["a"], mask)
