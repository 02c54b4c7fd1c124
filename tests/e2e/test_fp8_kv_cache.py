"""FP8 (e4m3) KV cache: capacity, rounding bound, and agreement with the bf16 cache."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.model_executor.layers.attention import FP8_E4M3_MAX, dequantize_kv, quantize_kv

# e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative, plus half the smallest
# subnormal step (2^-10) absolute, both in units of the scale.
REL_BOUND, ABS_BOUND = 2.0**-4, 2.0**-10
# Documented tolerance of FP8 vs bf16 KV on the default model (docs/features.md), in nats.
FP8_MEAN_LOGPROB_TOL, FP8_MAX_LOGPROB_TOL = 0.15, 0.75


def test_quantize_roundtrip_within_the_e4m3_bound():
    x = torch.randn(10000) * 3
    scale = x.abs().max().item() / FP8_E4M3_MAX
    back = dequantize_kv(quantize_kv(x, scale, torch.float8_e4m3fn), scale, torch.float32)
    assert ((back - x).abs() <= x.abs() * REL_BOUND + scale * ABS_BOUND).all()
    # Out-of-range values are clamped, never NaN.
    big = dequantize_kv(quantize_kv(torch.tensor([1e6, -1e6]), 1.0, torch.float8_e4m3fn), 1.0, torch.float32)
    assert big.tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX]


def test_unknown_kv_cache_dtype_lists_the_accepted_values(tiny_llama_dir):
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="int4")


def test_fp8_doubles_the_block_count_against_bf16(tiny_llama_dir):
    kw = dict(max_model_len=256, kv_cache_memory_bytes=2**20, dtype="bfloat16")
    bf16 = LLM(str(tiny_llama_dir), **kw).llm_engine.startup_stats()["num_blocks"]
    fp8 = LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", **kw).llm_engine.startup_stats()["num_blocks"]
    assert fp8 == 2 * bf16


def _layer0_kv(llm, prompt):
    """Prefill one request and read layer 0's K and V back through its block table."""
    engine = llm.llm_engine
    engine.add_request("probe", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    blocks = engine.engine_core.kv_cache_manager.req_blocks["probe"]
    worker = engine.engine_core.executor.worker
    cache = worker.kv_caches[0]
    attn = worker.model.model.layers[0].self_attn
    n = len(prompt)
    k = cache[0][blocks].flatten(0, 1)[:n]
    v = cache[1][blocks].flatten(0, 1)[:n]
    scales = attn.kv_scales
    out = (dequantize_kv(k, scales.k_scale, torch.float32), dequantize_kv(v, scales.v_scale, torch.float32))
    engine.abort_request("probe")
    return out, (scales.k_scale, scales.v_scale)


def test_dequantised_cache_matches_the_bf16_cache_within_rounding(tiny_llama_dir):
    prompt = [random.Random(0).randrange(3, 259) for _ in range(50)]
    kw = dict(max_model_len=256, dtype="bfloat16", enable_prefix_caching=False)
    (k_ref, v_ref), _ = _layer0_kv(LLM(str(tiny_llama_dir), **kw), prompt)
    (k8, v8), (ks, vs) = _layer0_kv(LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", **kw), prompt)
    # Layer 0 sees identical inputs in both engines, so its K/V differ only by the rounding.
    assert ((k8 - k_ref).abs() <= k_ref.abs() * REL_BOUND + ks * ABS_BOUND).all()
    assert ((v8 - v_ref).abs() <= v_ref.abs() * REL_BOUND + vs * ABS_BOUND).all()
    assert not torch.equal(k8, k_ref)  # the cache really is quantised


# The default model with the bf16 and the FP8 cache, built once for both gates below (each
# engine's start-up is most of their cost).
DEFAULT_KW = dict(max_model_len=512, max_num_seqs=16, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def bf16_engine():
    return LLM(**DEFAULT_KW)


@pytest.fixture(scope="module")
def fp8_engine():
    return LLM(kv_cache_dtype="fp8", **DEFAULT_KW)


@pytest.mark.slow
def test_default_model_fp8_logprobs_stay_within_tolerance(bf16_engine, fp8_engine):
    """Teacher-forced prompt logprobs of the default model with the FP8 cache against the bf16
    cache. The tolerance is the one documented in docs/features.md. (Greedy continuations
    drift apart sooner: the next test holds the greedy agreement bound, and docs/features.md,
    "FP8 KV cache", gives the measured agreement.)"""
    _fp8_logprobs_within_tolerance(bf16_engine, fp8_engine)


@pytest.mark.slow
def test_default_model_fp8_logprobs_twin_a_wrong_scale_fails(bf16_engine, fp8_engine):
    """Broken twin of the logprob tolerance: the same engine with wrong K/V scales."""
    from faults import fails

    with _wrong_scales(fp8_engine), fails():
        _fp8_logprobs_within_tolerance(bf16_engine, fp8_engine)


@contextmanager
def _wrong_scales(fp8):
    """Scales 10000x too large round most K/V to zero or e4m3 subnormals (restored after, the
    engine is the module's)."""
    scales = [layer.self_attn.kv_scales
              for layer in fp8.llm_engine.engine_core.executor.worker.model.model.layers]
    saved = [(s.k_scale, s.v_scale) for s in scales]
    try:
        for s in scales:
            s.k_scale *= 10000
            s.v_scale *= 10000
        yield
    finally:
        for s, (k_scale, v_scale) in zip(scales, saved, strict=True):
            s.k_scale, s.v_scale = k_scale, v_scale


def _fp8_logprobs_within_tolerance(bf16_engine, fp8_engine) -> None:
    prompts = [
        "Once upon a time, there was a little girl who lived in a village near the forest.",
        "The theory of relativity was developed by Albert Einstein in the early twentieth century.",
        "To install Python packages, you can use pip, the package installer for Python.",
        "Photosynthesis is the process by which plants turn light into chemical energy.",
    ]
    probe = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    lps = {}
    for dtype, llm in (("auto", bf16_engine), ("fp8", fp8_engine)):
        lps[dtype] = [
            [e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)]
            for o in llm.generate(prompts, probe)
        ]
    diffs = torch.tensor([
        abs(a - b)
        for ra, rb in zip(lps["auto"], lps["fp8"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    ])
    assert diffs.mean().item() < FP8_MEAN_LOGPROB_TOL, diffs.mean()
    assert diffs.max().item() < FP8_MAX_LOGPROB_TOL, diffs.max()


def _teacher_forced_agreement(llm, prompt_ids, continuations):
    """Fraction of continuation positions where the engine's greedy choice is (or ties with) the
    reference token, fed the reference prefix each time (so one flip does not derail the rest)."""
    probe = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, continuations, strict=True)], probe)
    hits = total = 0
    for p, c, o in zip(prompt_ids, continuations, outs, strict=True):
        for j, token in enumerate(c):
            entry = o.prompt_logprobs[len(p) + j]  # the target and the top-1 token
            hits += entry[token].logprob >= max(e.logprob for e in entry.values())  # ties agree
            total += 1
    return hits / total


@pytest.mark.slow
def test_default_model_fp8_greedy_agreement_and_a_broken_scale_fails(bf16_engine, fp8_engine):
    """Issue #6's agreement gate, measured teacher-forced (see docs/features.md for why: whole
    32-token continuations of this 135M model are not even stable between fp32 and bf16
    weights, 10/16, so a count of identical continuations measures near-ties, not the cache).
    The FP8 cache must pick the bf16-cache greedy token at >= 90% of positions (measured 97.7%;
    bf16 vs fp32 weights: 98.4%); the same engine with wrong scales must fall below."""
    from ingot.accuracy.validate import DEFAULT_PROMPTS

    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = bf16_engine.generate(list(DEFAULT_PROMPTS), greedy)
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    continuations = [list(o.outputs[0].token_ids) for o in outs]

    fp8 = fp8_engine
    assert _teacher_forced_agreement(fp8, prompt_ids, continuations) >= 0.90

    with _wrong_scales(fp8):
        assert _teacher_forced_agreement(fp8, prompt_ids, continuations) < 0.90
