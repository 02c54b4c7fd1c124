"""ingot vs HF transformers on tiny random-weight models, fp32, same weights.

Checks prefill logits, 16 teacher-forced decode steps over the paged cache, chunked prefill next
to another request, and greedy tokens through the full engine. A deliberately wrong config
(rope_theta changed via hf_overrides) must break the comparison.
"""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedHarness, hf_greedy, hf_logits
from tiny import hf_model, make_tiny_model

from faults import fails, injected
from ingot import LLM, SamplingParams

ATOL = 1e-4
PROMPT = [3, 17, 92, 45, 300, 11, 8, 250, 77, 5, 133]

ROPE_CASES = {
    "llama-default": ("llama", {}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(ROPE_CASES))
def tiny(request, tmp_path_factory):
    arch, overrides = ROPE_CASES[request.param]
    path = make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    return path, hf_model(path)


def _compare_prefill_and_decode(path, hf, **harness_args) -> float:
    """Largest |ingot - HF| over prefill logits and 16 teacher-forced decode steps."""
    decode = hf_greedy(hf, PROMPT, 16)
    ref = hf_logits(hf, PROMPT + decode)
    harness = PagedHarness(path, **harness_args)
    (prefill,) = harness.step([(0, PROMPT, 0)])
    worst = (prefill - ref[: len(PROMPT)]).abs().max().item()
    assert prefill[-1].argmax().item() == decode[0]
    # Teacher forcing: decode step i feeds HF's greedy token i and must predict token i + 1.
    for i, tok in enumerate(decode[:-1]):
        pos = len(PROMPT) + i
        (logits,) = harness.step([(0, [tok], pos)])
        worst = max(worst, (logits[0] - ref[pos]).abs().max().item())
        assert logits[0].argmax().item() == decode[i + 1], f"greedy token {i + 1} differs"
    return worst


def test_prefill_and_decode_logits_match_hf(tiny):
    path, hf = tiny
    assert _compare_prefill_and_decode(path, hf) < ATOL


def test_chunked_prefill_beside_other_request_matches_hf(tiny):
    path, hf = tiny
    other = [9, 8, 7, 6, 5, 4, 3]
    ref = hf_logits(hf, PROMPT)
    ref_other = hf_logits(hf, other)
    h = PagedHarness(path)
    a1, b1 = h.step([(0, PROMPT[:5], 0), (1, other, 0)])
    (a2,) = h.step([(0, PROMPT[5:], 5)])
    torch.testing.assert_close(torch.cat([a1, a2]), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(b1, ref_other, atol=ATOL, rtol=0)


def _engine_greedy_matches_hf(path, hf) -> None:
    expected = hf_greedy(hf, PROMPT, 16)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    assert out.outputs[0].token_ids == expected


def test_engine_greedy_tokens_match_hf(tiny):
    path, hf = tiny
    _engine_greedy_matches_hf(path, hf)


def test_engine_greedy_twin_a_perturbed_weight_fails(tmp_path):
    """The engine gate's broken twin: one weight wrong as the engine loads it."""
    path = make_tiny_model("llama", tmp_path)
    hf = hf_model(path)
    with injected("weight", name="layers.1.mlp.down_proj"), fails():
        _engine_greedy_matches_hf(path, hf)


@pytest.mark.parametrize("override", [{"rope_theta": 500.0}, {"rms_norm_eps": 0.5}])
def test_wrong_config_fails_the_comparison(tmp_path, override):
    """The gate must be able to fail: a model built with a wrong config is caught."""
    path = make_tiny_model("llama", tmp_path)
    hf = hf_model(path)
    with pytest.raises(AssertionError):
        assert _compare_prefill_and_decode(path, hf, hf_overrides=override) < ATOL
