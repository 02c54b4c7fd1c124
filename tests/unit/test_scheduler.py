"""The holdback scheduler with a fake runner (no model): admission, batching, accounting."""

from __future__ import annotations

import random

from ingot.config import SchedulerConfig
from ingot.core.buckets import BucketGrid
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.scheduler import Scheduler, SchedulerState
from ingot.engine.request import Request, RequestStatus
from ingot.engine.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=200, block_size=16, max_model_len=512, max_num_seqs=8, max_batched=128,
    additional=None,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_batched, max_model_len, True)
    grid = BucketGrid.from_config(additional or {}, max_batched, max_num_seqs, max_model_len, block_size)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, max_model_len), grid)


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{i}", [5] * prompt_len, params, eos_token_id=None)


def step(sched: Scheduler):
    """One step with a fake runner: every sampling request gets token 7."""
    out = sched.schedule()
    sched.update_from_output(out)
    for item in out.scheduled:
        if item.sample:
            req = sched.requests[item.req_id]
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                sched.finish_request(item.req_id, RequestStatus.FINISHED_LENGTH)
    return out


def test_randomized_invariants_over_1000_steps():
    rng = random.Random(0)
    sched = make_scheduler()
    pool = sched.kv.pool
    start_free = pool.num_free_blocks
    assert sched.max_kv_concurrent == 199 // 32  # 6 full-length requests fit
    arrivals, admitted_order, aborted = [], [], set()
    next_id = 0
    steps = 0
    while steps < 1000 or sched.has_unfinished_requests():
        if steps < 1000 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                req = make_request(next_id, rng.randint(1, 400), rng.randint(1, 100))
                req.sampling_params.max_tokens = min(req.sampling_params.max_tokens, 512 - req.num_prompt_tokens)
                sched.add_request(req)
                arrivals.append(req.request_id)
                next_id += 1
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        out = step(sched)
        admitted_order += [n.req_id for n in out.new_requests]
        kinds = {s.is_prefill for s in out.scheduled}
        assert len(kinds) <= 1, "mixed prefill and decode"
        assert sum(s.is_prefill for s in out.scheduled) <= 1
        assert len(out.new_requests) <= 1
        assert len(sched.running) <= min(sched.max_kv_concurrent, 8)
        for s in out.scheduled:
            assert len(s.token_ids) <= 128
            assert len(s.block_ids) == -(-(s.start_position + len(s.token_ids)) // 16)
        steps += 1
        assert steps < 20000, "requests did not finish"
    # FIFO: admission order is arrival order (aborted-while-waiting ones never admitted)
    admitted = set(admitted_order)
    assert admitted_order == [r for r in arrivals if r in admitted]
    assert set(arrivals) - aborted <= admitted  # every request that was not aborted ran
    assert pool.num_free_blocks == start_free
    assert sched.state in (SchedulerState.IDLE, SchedulerState.ACTIVE_DECODE)


def test_32k_prompt_prefills_in_exactly_4_segments_with_decodes_held():
    sched = make_scheduler(num_blocks=4200, block_size=16, max_model_len=32768, max_batched=8192)
    sched.add_request(make_request(0, 10, 50))
    step(sched)  # r0 prefilled, now decoding
    step(sched)
    sched.add_request(make_request(1, 32000, 5))
    computed = []
    for _ in range(4):
        out = step(sched)
        assert [s.req_id for s in out.scheduled] == ["r1"] and out.is_prefill
        computed.append(sched.requests["r1"].num_computed_tokens)
        assert sched.state is SchedulerState.ACTIVE_PREFILL
    assert computed == [8192, 16384, 24576, 32000]
    out = step(sched)
    assert not out.is_prefill and {s.req_id for s in out.scheduled} == {"r0", "r1"}


def test_5000_token_prompt_pads_to_8192_and_next_step_decodes():
    sched = make_scheduler(num_blocks=1000, block_size=16, max_model_len=8192, max_batched=8192)
    sched.add_request(make_request(0, 5000, 3))
    out = step(sched)
    (item,) = out.scheduled
    assert len(item.token_ids) == 5000 and item.num_tokens_padded == 8192
    assert len(item.block_ids) == 313  # ceil(5000 / 16): padding allocates nothing
    assert sched.total_padding_tokens == 3192
    out = step(sched)
    assert not out.is_prefill and out.scheduled[0].num_tokens_padded == 1


def test_kv_bound_caps_running_requests():
    # 2 full-length requests fit: (33 - 1) // (256 / 16)
    sched = make_scheduler(num_blocks=33, block_size=16, max_model_len=256, max_num_seqs=8)
    assert sched.max_kv_concurrent == 2
    for i in range(8):
        sched.add_request(make_request(i, 20, 30))
    steps = 0
    while sched.has_unfinished_requests():
        step(sched)
        assert len(sched.running) <= 2
        steps += 1
        assert steps < 8 * 40
    assert sched.kv.pool.num_free_blocks == 32


def test_bucketing_off_keeps_actual_counts():
    sched = make_scheduler(additional={"enable_bucketing": False})
    sched.add_request(make_request(0, 50, 2))
    (item,) = step(sched).scheduled
    assert item.num_tokens_padded == 50


def test_token_ids_between_matches_all_token_ids():
    req = make_request(0, 5, 10)
    req.prompt_token_ids = [1, 2, 3, 4, 5]
    req.output_token_ids = [6, 7, 8]
    for start in range(9):
        for end in range(start, 9):
            assert req.token_ids_between(start, end) == req.all_token_ids[start:end]
