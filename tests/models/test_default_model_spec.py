"""Speculative decoding on the default model in its default dtype (bf16 on CPUs with bf16
math: its C kernels, the CPU decode path; fp32 elsewhere): n-gram speculation must not change
one greedy token, at batch sizes served by ingot's GEMV (up to 3 requests) and by oneDNN
(more)."""

from __future__ import annotations

import pytest

from faults import fails, injected
from ingot import LLM, SamplingParams

CODE = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
        "            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
        "    return out\n")
ASKS = ["Rename merge_sorted to merge and repeat the code exactly otherwise:",
        "Repeat this code, adding a docstring:", "Copy this code exactly:",
        "Rewrite this code with comments:", "Repeat the code below twice:",
        "Change i and j to left and right in this code:"]
# 64 tokens: the copies accept 57-59 drafted tokens over the two single requests in bf16 (94 at
# 96), 37 in fp32 (an AVX2 CPU: other greedy tokens), above the bound below, and the batch
# still decodes far past each prompt.
MAX_TOKENS = 64
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "adaptive": False}


def _prompts(llm: LLM) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"{ask}\n\n{CODE}"}],
                                    tokenize=False, add_generation_prompt=True) for ask in ASKS]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(max_model_len=1024, max_num_seqs=8)
    prompts = _prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    single = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return prompts, single, batch


@pytest.mark.slow
def test_default_model_greedy_identical_with_ngram(reference):
    _speculation_keeps_the_tokens(LLM(max_model_len=1024, max_num_seqs=8, speculative_config=SPEC),
                                  reference)


@pytest.mark.slow
def test_default_model_ngram_twin_one_wrong_draft_accepted_fails(reference):
    """Broken twin: one verification emits a draft the target rejected."""
    llm = LLM(max_model_len=1024, max_num_seqs=8, speculative_config=SPEC)
    with injected("accepts_a_wrong_draft"), fails():
        _speculation_keeps_the_tokens(llm, reference)


def _speculation_keeps_the_tokens(llm: LLM, reference) -> None:
    prompts, single, batch = reference
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]] == single
    stats = llm.llm_engine.get_stats()["spec_decode"]
    assert stats.num_accepted_tokens > 30  # the comparison covered many accepted drafts
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == batch
