"""End to end: an MoE model (Qwen3-MoE, with a dense layer) under
``LLM(tensor_parallel_size=2)``: two worker processes over gloo, experts split by TP, give
TP=1's greedy tokens."""

from __future__ import annotations

import pytest
from tiny import make_tiny_model

from ingot import LLM, SamplingParams

pytestmark = pytest.mark.slow  # two engines, one with two worker processes

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70))]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tp-moe"), vocab_size=259)


def _greedy(path, **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              block_size=4, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.llm_engine.shutdown()


def test_moe_greedy_tokens_under_tp2_equal_tp1(moe_dir):
    assert _greedy(moe_dir, tensor_parallel_size=2) == _greedy(moe_dir)
