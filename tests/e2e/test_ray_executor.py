"""``--distributed-executor-backend ray``: the workers as Ray actors (the mp executor's Worker,
gloo inside the actors) on a small local Ray. ``LLM(tensor_parallel_size=2,
distributed_executor_backend="ray")`` gives TP=1's greedy tokens and logprobs; killing one
actor makes the next request fail with an error naming the rank, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import ray  # in the test extra: CI runs this
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.errors import IngotError

pytestmark = pytest.mark.slow  # a local Ray (a few seconds) and two actors

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7]]
COMMON = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4,
              max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def _outputs(llm: LLM) -> tuple[list, list]:
    out = llm.generate(PROMPTS, GREEDY)
    return ([o.outputs[0].token_ids for o in out],
            [[{t: v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs]
             for o in out])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("ray"), vocab_size=259,
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_equals_tp1_and_a_dead_actor_fails_requests(model_dir, local_ray):
    llm = LLM(str(model_dir), **COMMON)
    try:
        ref_tokens, ref_lp = _outputs(llm)
    finally:
        llm.llm_engine.shutdown()
    llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend="ray",
              **COMMON)
    try:
        tokens, lp = _outputs(llm)
        assert tokens == ref_tokens
        for got_req, ref_req in zip(lp, ref_lp, strict=True):
            for g, r in zip(got_req, ref_req, strict=True):
                assert g.keys() == r.keys()
                assert all(abs(g[t] - v) < 1e-5 for t, v in r.items())
        stats = llm.llm_engine.collective_rpc("startup_stats")
        pids = {s["pid"] for s in stats}
        assert len(pids) == 2 and os.getpid() not in pids  # two actors, not this process
        assert [s["tp_collectives"] for s in stats] == ["shm", "shm"]  # one node

        executor = llm.llm_engine.engine_core.executor
        ray.kill(executor.workers[1])
        start = time.monotonic()
        with pytest.raises(IngotError, match=r"worker rank 1 \(Ray actor\) failed"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 30
    finally:
        llm.llm_engine.shutdown()
