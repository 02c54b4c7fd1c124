"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers in fp32 on the
same (dequantised) weights: greedy tokens must match, in a batch and one at a time."""

from __future__ import annotations

import pytest
import torch
from paged_harness import hf_greedy

from ingot import LLM, SamplingParams

pytestmark = pytest.mark.slow

# 16: the HF reference (paged_harness.hf_greedy) is one of the costliest fixtures of the
# suite; every shape below still decodes past the prompt's end.
NEW_TOKENS = 16
_PARAGRAPH = (
    "The history of mathematics spans thousands of years, from counting marks on bones to "
    "abstract algebra. Ancient Babylonians used a base-60 system, Greeks formalised geometry, "
    "and Indian scholars introduced the concept of zero. "
)
PROMPTS = [
    "Hello, my name is",
    "The capital of Germany is",
    "def fibonacci(n):\n    ",
    "List three colors: red,",
    "Translate to French: I like cheese. ->",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    _PARAGRAPH * 3 + "Summarise the text above in one sentence:",
    _PARAGRAPH * 6 + "Question: which civilisation introduced zero? Answer:",
]


@pytest.fixture(scope="module")
def hf_reference(default_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(default_hf_dir, dtype=torch.float32).eval()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    return prompt_ids, [hf_greedy(model, ids, NEW_TOKENS) for ids in prompt_ids]


@pytest.fixture(scope="module")
def llm():
    # The HF reference is the GGUF dequantized to float32: so is this engine (the quantized
    # default is gated against it in tests/e2e/test_gguf_quantized.py).
    return LLM(dtype="float32", quantization="none", max_model_len=1024, max_num_seqs=8)


def test_prompt_lengths_cover_5_to_300_tokens(hf_reference):
    prompt_ids, _ = hf_reference
    lengths = sorted(len(p) for p in prompt_ids)
    assert lengths[0] >= 5 and lengths[-1] <= 300 and lengths[-1] >= 250, lengths


def test_greedy_matches_hf_batched_and_alone(llm, hf_reference):
    _greedy_matches_hf(llm, hf_reference)


def test_greedy_twin_a_perturbed_weight_fails(hf_reference):
    """Broken twin: one weight wrong as the engine loads the default model."""
    from faults import fails, injected

    with injected("weight", name="layers.10.mlp.down_proj", scale=0.2):
        broken = LLM(dtype="float32", quantization="none", max_model_len=1024, max_num_seqs=8)
    with fails():
        _greedy_matches_hf(broken, hf_reference)


def _greedy_matches_hf(llm, hf_reference) -> None:
    prompt_ids, expected = hf_reference
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in batched] == expected
    for ids, want in zip(prompt_ids, expected, strict=True):
        (alone,) = llm.generate([{"prompt_token_ids": ids}], params)
        assert alone.outputs[0].token_ids == want
        # The batch left these prompts in the prefix cache: the rerun reused their KV.
        assert alone.num_cached_tokens == (len(ids) - 1) // 32 * 32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"additional_config": {"enable_bucketing": False}, "enable_prefix_caching": False},
        {"additional_config": {"decode_context_length_buckets": [256, 512]}},
    ],
    ids=["buckets-and-prefix-caching-off", "context-buckets"],
)
def test_greedy_matches_hf_with_other_shapes(hf_reference, kwargs):
    prompt_ids, expected = hf_reference
    llm = LLM(dtype="float32", quantization="none", max_model_len=1024, max_num_seqs=8, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in batched] == expected


def test_ingot_tokenizer_matches_hf(llm, hf_reference):
    prompt_ids, _ = hf_reference
    tok = llm.get_tokenizer()
    assert [tok.encode(p) for p in PROMPTS] == prompt_ids


def test_chat_answers_paris(llm):
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_defaults_need_no_block_bucket_or_memory_flag():
    from ingot.model_executor.layers.cpu_kernels import bf16_kernel_isa
    from ingot.platforms.cpu import CpuPlatform

    llm = LLM()  # auto dtype, max_model_len 8192, budgeted KV cache
    assert llm.llm_engine.model_config.max_model_len == 8192
    # The CPU's auto rule (tests/unit/test_dtype_rules.py): bf16 where it runs at full speed
    # here (ingot's vector bf16 kernels or native bf16), else float32.
    expected = CpuPlatform.auto_dtype(None, bf16_kernel_isa()).dtype
    assert llm.llm_engine.model_config.dtype is expected
    assert llm.llm_engine.model_config.quantization == "gguf"  # the file's blocks
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    # The answer's first token is a near-tie in the dequantized float32 model ("The" over "L"
    # by 0.08 nats) that the quantized activations flip ("L'Étoile, ..."); the fact itself is
    # checked on the dequantized weights (test_chat_answers_paris) and the quantized model's
    # accuracy by the teacher-forced gate (tests/e2e/test_gguf_quantized.py).
    assert out.outputs[0].text.strip() and out.outputs[0].finish_reason in ("stop", "length")
