"""End to end: expert parallelism across data-parallel replicas. ``LLM(qwen3_moe,
data_parallel_size=2, enable_expert_parallel=True)`` (TP 1, ep_degree 2: each replica holds
half the experts and the MoE layers exchange the replicas' tokens) gives the greedy tokens of
one engine holding every expert, though the replicas run unrelated steps: one prefills while the
other decodes (padded to the same token count), and the one that finishes first runs dummy
batches until the other is done."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.distributed.wire import rpc_function

pytestmark = pytest.mark.slow  # two engines, one of two replicas: ~25 s here

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70)),
           [5, 6], [100, 101, 102]]
# Replica 0 gets prompts 0, 2, 4 and replica 1 prompts 1, 3: unequal work on purpose.
MAX_TOKENS = [20, 3, 12, 30, 5]


@rpc_function  # it runs in the replicas' processes
def layout(worker: Any) -> tuple[int, int, int, list[int], int]:
    """(global rank, first local expert, local experts, DP group ranks, dummy steps run)."""
    from ingot.distributed.parallel_state import get_dp_group

    layer = next(m for m in worker.model.modules() if hasattr(m, "w13"))
    return (worker.global_rank, layer.expert_start, layer.num_local_experts,
            get_dp_group().ranks, worker.model_runner.dummy_steps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("dp-ep"), vocab_size=259)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    results = {}
    for dp, ep in ((1, False), (2, True)):
        llm = LLM(str(path), data_parallel_size=dp, enable_expert_parallel=ep, dtype="float32",
                  skip_tokenizer_init=True, max_model_len=128, block_size=4)
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            results[dp] = (tokens, llm.llm_engine.collective_rpc(layout))
        finally:
            llm.llm_engine.shutdown()
    return results


def test_greedy_tokens_equal_one_engine_with_every_expert(runs):
    assert len({tuple(t) for t in runs[1][0]}) == len(PROMPTS)
    assert runs[2][0] == runs[1][0]


def test_dp_ep_twin_a_wrong_router_in_one_replica_fails(runs, tmp_path):
    """Broken twin: replica 1 (global rank 1) loads layer 0's router weight wrong, so its
    tokens go to other experts than one engine's would."""
    from faults import fails, injected_in_children

    path = make_tiny_model("qwen3_moe", tmp_path, vocab_size=259)  # the same seeded weights
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with injected_in_children("weight", name="layers.0.mlp.gate.weight", rank=1):
        llm = LLM(str(path), data_parallel_size=2, enable_expert_parallel=True, dtype="float32",
                  skip_tokenizer_init=True, max_model_len=128, block_size=4)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.llm_engine.shutdown()
    with fails():
        assert tokens == runs[1][0]


def test_each_replica_holds_half_the_experts_and_the_idle_one_ran_dummies(runs):
    (r0, start0, n0, dp0, dummies0), (r1, start1, n1, dp1, dummies1) = runs[2][1]
    assert (r0, start0, n0, dp0) == (0, 0, 2, [0, 1])
    assert (r1, start1, n1, dp1) == (1, 2, 2, [0, 1])
    # Replica 1 (3 + 30 tokens) and replica 0 (20, 12, 5) finish at different steps: the
    # one done first meets the other's collectives with dummy batches.
    assert dummies0 + dummies1 > 0
    assert runs[1][1][0][1:3] == (0, 4)  # DP 1: every expert on its one rank
