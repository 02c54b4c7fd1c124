"""End to end: an MoE model (Qwen3-MoE, with a dense layer) under
``LLM(tensor_parallel_size=2)``: two worker processes over gloo, experts split by TP, and with
``enable_expert_parallel`` (whole experts per rank), give TP=1's greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.distributed.wire import rpc_function

pytestmark = pytest.mark.slow  # three engines, two with two worker processes: ~15 s here

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70))]


@rpc_function  # it runs in the workers' processes
def expert_layout(worker: Any) -> tuple[int, int, tuple[int, ...]]:
    """(first local expert, local experts, w13 shape) of a worker's first MoE layer."""
    layer = next(m for m in worker.model.modules() if hasattr(m, "w13"))
    return layer.expert_start, layer.num_local_experts, tuple(layer.w13.shape)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tp-moe"), vocab_size=259)


def _greedy(path, **kw) -> tuple[list[list[int]], list]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              block_size=4, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        return tokens, llm.llm_engine.collective_rpc(expert_layout)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tp1(moe_dir):
    return _greedy(moe_dir)


def test_moe_greedy_tokens_under_tp2_equal_tp1(moe_dir, tp1):
    tokens, layout = _greedy(moe_dir, tensor_parallel_size=2)
    assert tokens == tp1[0]
    # Every expert on both ranks, half of the intermediate dim (32) each.
    assert layout == [[0, 4, [4, 32, 64]], [0, 4, [4, 32, 64]]]  # plain data: lists


def test_moe_greedy_tokens_under_expert_parallel_equal_tp1(moe_dir, tp1):
    tokens, layout = _greedy(moe_dir, tensor_parallel_size=2, enable_expert_parallel=True,
                             additional_config={"ep_degree": 2})
    assert tokens == tp1[0]
    # Experts 0-1 on rank 0, 2-3 on rank 1, the whole intermediate dim.
    assert layout == [[0, 2, [2, 64, 64]], [2, 2, [2, 64, 64]]]


def test_ep_twin_a_wrong_router_on_one_rank_fails(moe_dir, tp1):
    """Broken twin: rank 1 loads layer 0's router weight wrong, so the ranks route apart."""
    from faults import fails, injected_in_children

    with injected_in_children("weight", name="layers.0.mlp.gate.weight", rank=1):
        tokens, _ = _greedy(moe_dir, tensor_parallel_size=2, enable_expert_parallel=True,
                            additional_config={"ep_degree": 2})
    with fails():
        assert tokens == tp1[0]
