"""n-gram prompt lookup (vLLM's rule: the longest suffix match in [min, max], the earliest
occurrence on ties) and the speculative config's validation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ingot.config import SpeculativeConfig
from ingot.spec_decode.ngram import NgramProposer, propose_ngram


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """A plain restatement: for n from max down to min, the earliest earlier occurrence of
    the last n tokens proposes what followed it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(0, total - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def _propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_vllm_docstring_example():
    # [1,2,3,4,2,3], n in [2, 3], k = 4: [4,2,3] has no earlier match, [2,3] does.
    assert _propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_match_wins_and_ties_take_the_earliest():
    # suffix [7, 8, 9]: length 3 matches at 4 (followed by 1); length 2 alone at 0 (by 5)
    tokens = [8, 9, 5, 0, 7, 8, 9, 1, 0, 8, 9, 2, 7, 8, 9]
    assert _propose(tokens, 1, 3, 2) == [1, 0]
    # two equal-length matches: the earliest one's continuation
    assert _propose([4, 5, 1, 4, 5, 2, 4, 5], 2, 2, 1) == [1]


def test_no_match_below_min():
    assert _propose([1, 2, 3, 4, 5, 6, 7, 3], 2, 4, 3) == []
    assert _propose([1, 2, 3, 4, 5, 6, 7, 3], 1, 4, 3) == [4, 5, 6]
    assert _propose([5], 1, 3, 3) == []


def test_matches_the_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 60))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        assert _propose(tokens, lo, hi, k) == _reference(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_proposer_buffers_grow_and_respect_max_model_len():
    p = NgramProposer(1, 3, 4, max_model_len=12)
    prompt = [1, 2, 3, 1, 2]
    assert p.propose_one("a", prompt, []) == [3, 1, 2]
    assert p.propose_one("a", prompt, [3, 1]) == [2, 3, 1]  # all that follows the match
    # 9 tokens: the drafts and the token after them must fit in 12 -> at most 2 drafts
    assert p.propose_one("a", prompt, [3, 1, 2, 3]) == [1, 2]
    p.remove("a")
    assert p.propose_one("a", [9, 9, 9], []) == [9]


def test_config_defaults_and_validation():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    bad = [
        ({"method": "medusa", "num_speculative_tokens": 3}, "not supported"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "must be <="),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "needs \"model\""),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(value)
