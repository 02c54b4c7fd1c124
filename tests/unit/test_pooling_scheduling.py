"""Pooling requests in the scheduler (prefill only, finished with their pooled output, blocks
freed) and the pooling knobs' validation in EngineArgs."""

from __future__ import annotations

import pytest
from test_scheduler import make_scheduler

from ingot.buckets import BucketGrid
from ingot.config import (
    DEFAULT_MAX_PREFILLS_PER_STEP,
    ENCODER_STEP_TOKENS,
    SchedulerConfig,
)
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.request import Request, RequestStatus
from ingot.core.scheduler import Scheduler
from ingot.engine.arg_utils import EngineArgs
from ingot.pooling_params import PoolingParams
from ingot.runner_output import ModelRunnerOutput


def pooling_request(i: int, n: int) -> Request:
    return Request(f"p{i}", [5] * n, None, pooling_params=PoolingParams(task="embed"))


def run_step(sched: Scheduler):
    out = sched.schedule()
    assert out.is_empty or out.is_prefill, "a pooling request is never decoded"
    pooled = {it.req_id: [1.0] for it in out.scheduled if it.sample}
    return out, sched.update_from_output(out, ModelRunnerOutput([], [], pooler_output=pooled))


def test_pooling_requests_finish_after_prefill_and_free_their_blocks():
    sched = make_scheduler(prefills=4)
    free = sched.kv.pool.num_free_blocks
    for i, n in enumerate([10, 200, 30]):  # 200 > the 128-token budget: chunked
        sched.add_request(pooling_request(i, n))
    finished = {}
    steps = 0
    while sched.has_unfinished_requests():
        _, outs = run_step(sched)
        steps += 1
        for o in outs:
            if o.finished:
                assert o.finish_status == RequestStatus.FINISHED_STOPPED and o.pooled == [1.0]
                finished[o.req_id] = steps
            else:
                assert o.pooled is None  # an unfinished chunk reports nothing
    assert set(finished) == {"p0", "p1", "p2"}
    assert finished["p1"] > 1  # it took more than one step
    sched.schedule()  # flushes the finished ids
    assert sched.kv.pool.num_free_blocks == free


def test_without_chunked_prefill_a_packed_prompt_is_never_split():
    config = SchedulerConfig(8, 128, 128, False, 4)
    grid = BucketGrid.from_config({}, 128, 8, 128, 16)
    sched = Scheduler(config, KVCacheManager(200, 16, 128), grid)
    for i, n in enumerate([100, 100]):
        sched.add_request(pooling_request(i, n))
    out, _ = run_step(sched)
    assert [(it.req_id, it.num_tokens) for it in out.scheduled] == [("p0", 100)]
    out, _ = run_step(sched)
    assert [(it.req_id, it.num_tokens) for it in out.scheduled] == [("p1", 100)]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"runner": "embed"}, "runner"),
    ({"convert": "rerank"}, "convert"),
    ({"convert": "embed"}, "--runner pooling"),
    ({"pooler_config": {"pooling_type": "MEAN"}}, "--runner pooling"),
    ({"runner": "pooling", "convert": "none"}, "--convert embed"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}}, "pooling_type"),
    ({"runner": "pooling", "pooler_config": {"pool": "MEAN"}}, "unknown pooler_config"),
    ({"runner": "pooling", "pooler_config": {"normalize": "yes"}}, "normalize"),
    ({"runner": "pooling", "kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"runner": "pooling", "async_scheduling": True}, "async_scheduling"),
    ({"runner": "pooling", "enable_prompt_embeds": True}, "enable_prompt_embeds"),
])
def test_pooling_knobs_are_validated(tiny_llama_dir, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineArgs(model=str(tiny_llama_dir), **kwargs).create_engine_config()


def test_pooling_defaults(tiny_llama_dir):
    mc = EngineArgs(model=str(tiny_llama_dir), runner="pooling").create_engine_config()
    assert (mc.model_config.convert, mc.model_config.pooler_config.pooling_type) == ("embed", "LAST")
    assert mc.model_config.pooler_config.normalize
    assert not mc.cache_config.enable_prefix_caching  # every prompt token must be computed
    embedder = EngineArgs(runner="pooling").create_engine_config()  # the default embedder
    assert embedder.model_config.architecture == "BertModel"
    assert not embedder.scheduler_config.enable_chunked_prefill  # bidirectional attention
    with pytest.raises(ValueError, match="--runner pooling"):
        EngineArgs(model=embedder.model_config.model, runner="generate").create_engine_config()


def test_encoder_steps_default_to_a_larger_token_budget(tiny_llama_dir):
    """An encoder packs as many prompts as ENCODER_STEP_TOKENS holds; a causal LM turned into
    an embedder keeps the decoder defaults (its prefills reuse the buckets); given values win."""
    sc = EngineArgs(runner="pooling").create_engine_config().scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_prefills_per_step) == (ENCODER_STEP_TOKENS, 256)
    sc = EngineArgs(runner="pooling", max_num_seqs=32, max_num_batched_tokens=1024,
                    additional_config={"max_num_prefills_per_step": 4},
                    ).create_engine_config().scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_prefills_per_step) == (1024, 4)
    sc = EngineArgs(runner="pooling", max_num_seqs=32).create_engine_config().scheduler_config
    assert sc.max_num_prefills_per_step == 32
    sc = EngineArgs(model=str(tiny_llama_dir), runner="pooling").create_engine_config().scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_prefills_per_step) == (2048, DEFAULT_MAX_PREFILLS_PER_STEP)


def test_pooling_params_validation():
    for bad in ({"truncate_prompt_tokens": 0}, {"dimensions": 0}, {"normalize": 1},
                {"task": "generate"}):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
