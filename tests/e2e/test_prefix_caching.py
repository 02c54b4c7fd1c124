"""Prefix caching must not change a single greedy token (fp32 tiny models)."""

from __future__ import annotations

import random

import pytest

from faults import fails, injected
from ingot import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _prompts():
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    return [
        shared[:48] + [7, 8, 9],  # prefix ends at a block boundary (3 blocks of 16)
        shared[:48] + [11, 12, 13, 14, 15],
        shared[:40] + [21, 22],  # prefix ends mid-block
        shared[:64],  # exactly 4 blocks
        shared[:64],  # the whole prompt cached (last block is recomputed)
        shared[:50],
        [rng.randrange(3, 500) for _ in range(30)],  # no shared prefix
    ]


def _run(llm, prompts, one_by_one):
    outs = []
    if one_by_one:
        for p in prompts:
            outs += llm.generate([p], PARAMS)
    else:
        outs = llm.generate(prompts, PARAMS)
    return outs


def _tokens_and_lps(outs):
    return [
        (o.outputs[0].token_ids,
         [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)])
        for o in outs
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("one_by_one", [True, False], ids=["bs1", "batch"])
def test_greedy_identical_with_prefix_caching_on_and_off(tmp_path, arch, one_by_one):
    from tiny import make_tiny_model

    _prefix_caching_changes_nothing(make_tiny_model(arch, tmp_path), one_by_one)


def test_prefix_caching_twin_a_hit_that_skips_a_block_fails(tmp_path):
    """Broken twin: each hit's last block is a fresh one, its KV never computed."""
    from tiny import make_tiny_model

    path = make_tiny_model("llama", tmp_path)
    with injected("prefix_cache_skips_a_block"), fails():
        _prefix_caching_changes_nothing(path, one_by_one=True)


def _prefix_caching_changes_nothing(path, one_by_one: bool) -> None:
    kw = dict(dtype="float32", max_model_len=512, block_size=16, skip_tokenizer_init=True)
    prompts = _prompts()
    ref = _tokens_and_lps(_run(LLM(str(path), enable_prefix_caching=False, **kw), prompts, one_by_one))
    llm = LLM(str(path), enable_prefix_caching=True, **kw)
    first = _run(llm, prompts, one_by_one)
    second = _run(llm, prompts, one_by_one)  # now everything shared is cached
    assert sum(o.num_cached_tokens for o in second) > 0
    if one_by_one:
        assert first[1].num_cached_tokens == 48 and first[2].num_cached_tokens == 32
        assert first[4].num_cached_tokens == 48  # whole prompt cached: 63 tokens max -> 3 blocks
    for got in (_tokens_and_lps(first), _tokens_and_lps(second)):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref, strict=True):
            assert tokens == ref_tokens
            assert lps == pytest.approx(ref_lps, abs=1e-4)
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and 0 < stats["prefix_cache_hit_rate"] <= 1


def test_reset_prefix_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=16)
    prompt = list(range(3, 60))
    llm.generate([prompt], PARAMS)
    (again,) = llm.generate([prompt], PARAMS)
    assert again.num_cached_tokens == 48
    assert llm.reset_prefix_cache()
    (cold,) = llm.generate([prompt], PARAMS)
    assert cold.num_cached_tokens == 0


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=16)
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    (first,) = llm.generate([prompt], params)
    (second,) = llm.generate([prompt], params)
    assert second.num_cached_tokens == 0
    assert len(second.prompt_logprobs) == len(first.prompt_logprobs) == 40
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=1))
    assert plain.num_cached_tokens == 32  # the blocks were still published
