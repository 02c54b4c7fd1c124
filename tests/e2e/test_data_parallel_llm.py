"""End to end: ``LLM(model, data_parallel_size=2)`` runs two engine-core processes (each its own
scheduler, KV cache and worker) behind one front end. Its outputs come back in input order and
equal DP=1's (greedy and seeded), though the replicas ran different batches; the replicas never
share a process group (TP=1: none at all; TP=2: each one's world is its own TP group, global
ranks dp_rank * TP + tp_rank), and they split the CPU threads as TP ranks do."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.distributed.wire import rpc_function
from ingot.platforms.cpu_threads import detect_cpu_budget

pytestmark = pytest.mark.slow  # four engines, two of them data-parallel: ~40 s here

# Five prompts: the replicas get three and two of them (different batch sizes).
PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70)),
           [100, 101], [60, 7, 7, 7, 60]]


@rpc_function  # it runs in the replicas' processes
def placement(worker: Any) -> tuple[int, int | None, int]:
    """(global rank, size of the torch.distributed world it joined or None, compute threads)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else None
    return worker.global_rank, world, torch.get_num_threads()


@pytest.fixture(scope="module")
def dp_model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("dp-llm"), vocab_size=259,
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def runs(dp_model):
    path = dp_model
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
    results = {}
    for dp, tp in ((1, 1), (2, 1), (2, 2)):
        llm = LLM(str(path), data_parallel_size=dp, tensor_parallel_size=tp, dtype="float32",
                  skip_tokenizer_init=True, max_model_len=128, block_size=4,
                  cpu_adaptive_threads=False)
        try:
            results[dp, tp] = {
                "greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)],
                "seeded": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)],
                "ids": [o.request_id for o in llm.generate(PROMPTS[:2], greedy)],
                "placement": llm.llm_engine.collective_rpc(placement),
                "stats": llm.llm_engine.get_stats(),
            }
        finally:
            llm.llm_engine.shutdown()
    return results


def test_outputs_in_input_order_equal_dp1(runs):
    _outputs_equal_dp1(runs)


def test_dp_twin_a_perturbed_weight_in_one_replica_fails(runs, dp_model):
    """Broken twin: replica 1 (global rank 1) loads one weight wrong; replica 0 is right."""
    from faults import fails, injected_in_children

    with injected_in_children("weight", name="layers.1.mlp.down_proj", rank=1):
        llm = LLM(str(dp_model), data_parallel_size=2, dtype="float32", skip_tokenizer_init=True,
                  max_model_len=128, block_size=4, cpu_adaptive_threads=False)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        broken = {key: dict(runs[key]) for key in runs}
        broken[2, 1]["greedy"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        with fails():
            _outputs_equal_dp1(broken)
    finally:
        llm.llm_engine.shutdown()


def _outputs_equal_dp1(runs) -> None:
    ref = runs[1, 1]
    # Distinct prompts give distinct continuations, so a mix-up of the order would show.
    assert len({tuple(t) for t in ref["greedy"]}) == len(PROMPTS)
    for key in ((2, 1), (2, 2)):
        assert runs[key]["greedy"] == ref["greedy"]
        assert runs[key]["seeded"] == ref["seeded"]
        ids = runs[key]["ids"]
        assert ids == sorted(ids, key=int)  # returned in the order they were given


def test_replicas_ran_different_batches(runs):
    for key in ((2, 1), (2, 2)):
        ranks = runs[key]["stats"]["dp_ranks"]
        # 5 + 5 + 2 requests, least-loaded with round-robin ties.
        assert [r["requests_routed"] for r in ranks] == [6, 6]
        assert runs[key]["stats"]["num_steps"] == sum(r["num_steps"] for r in ranks)
    assert "dp_ranks" not in runs[1, 1]["stats"]


def test_replicas_share_no_process_group(runs):
    usable = detect_cpu_budget().usable
    ranks, worlds, threads = zip(*runs[2, 1]["placement"], strict=True)
    assert ranks == (0, 1) and worlds == (None, None)  # no torch.distributed at all
    ranks, worlds, threads = zip(*runs[2, 2]["placement"], strict=True)
    assert ranks == (0, 1, 2, 3) and worlds == (2, 2, 2, 2)
    # Four ranks on one host take a quarter of its CPUs each (the TP rule), DP 1 all of them.
    assert set(threads) == {max(1, usable // 4)}
    assert runs[1, 1]["placement"] == [(0, None, usable)]
