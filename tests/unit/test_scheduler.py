"""The holdback scheduler with a fake runner (no model): admission, batching, accounting."""

from __future__ import annotations

import random

import pytest

from ingot.buckets import BucketGrid
from ingot.config import SchedulerConfig
from ingot.core.kv_cache_manager import KVCacheManager
from ingot.core.request import Request, RequestStatus
from ingot.core.scheduler import Scheduler, SchedulerState
from ingot.runner_output import ModelRunnerOutput
from ingot.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=200, block_size=16, max_model_len=512, max_num_seqs=8, max_batched=128,
    additional=None, prefills=1,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_batched, max_model_len, True, prefills)
    grid = BucketGrid.from_config(additional or {}, max_batched, max_num_seqs, max_model_len, block_size)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, max_model_len), grid)


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{i}", [5] * prompt_len, params)


def step(sched: Scheduler):
    """One step with a fake runner: every sampling request gets token 7 (the scheduler
    appends it and stops requests at max_tokens)."""
    out = sched.schedule()
    sampled = [item.req_id for item in out.scheduled if item.sample]
    sched.update_from_output(out, ModelRunnerOutput(sampled, [[7]] * len(sampled)))
    return out


@pytest.mark.parametrize("prefills", [1, 4])
def test_randomized_invariants_over_1000_steps(prefills):
    rng = random.Random(0)
    sched = make_scheduler(prefills=prefills)
    pool = sched.kv.pool
    start_free = pool.num_free_blocks
    assert sched.max_kv_concurrent == 199 // 32  # 6 full-length requests fit
    arrivals, admitted_order, aborted = [], [], set()
    next_id = 0
    steps = 0
    sent: dict[str, list[int]] = {}  # the blocks each request's steps told the runner of
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
        if out.is_prefill:
            assert 1 <= len(out.scheduled) <= prefills
            assert out.total_num_scheduled_tokens <= out.num_padded <= 128
            assert all(sched.requests[s.req_id].num_computed_tokens
                       <= sched.requests[s.req_id].num_prompt_tokens for s in out.scheduled
                       if s.req_id in sched.requests)
        else:  # a decode step: every running request, one token each
            assert all(s.num_tokens == 1 for s in out.scheduled)
            # (requests that finished this step have left sched.running already)
            assert {s.req_id for s in out.scheduled} >= {r.request_id for r in sched.running}
        assert len(out.new_requests) <= prefills
        assert len(sched.running) <= min(sched.max_kv_concurrent, 8)
        for s in out.scheduled:
            assert s.num_tokens <= 128
            blocks = sent.setdefault(s.req_id, [])
            blocks += s.new_block_ids
            assert len(blocks) == -(-(s.start_position + s.num_tokens) // 16)
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
    assert item.num_tokens == 5000 and out.num_padded == 8192
    assert len(item.new_block_ids) == 313  # ceil(5000 / 16): padding allocates nothing
    assert sched.total_padding_tokens == 3192
    out = step(sched)
    assert not out.is_prefill and out.num_padded == 1


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
    out = step(sched)
    assert out.num_padded == 50 and out.scheduled[0].num_tokens == 50


def test_runner_token_ids_match_prompt_plus_outputs():
    from ingot.sampling_params import SamplingParams
    from ingot.worker.model_runner import CachedRequestState

    state = CachedRequestState(SamplingParams(), [1, 2, 3, 4, 5], [6, 7, 8])
    every = [1, 2, 3, 4, 5, 6, 7, 8]
    for start in range(9):
        for end in range(start, 9):
            assert state.token_ids(start, end - start) == every[start:end]


def test_packed_prefill_takes_up_to_max_prefills_then_decodes_everyone():
    sched = make_scheduler(prefills=4)
    for i in range(5):
        sched.add_request(make_request(i, 30, 3))
    out = step(sched)
    assert out.is_prefill and [s.req_id for s in out.scheduled] == ["r0", "r1", "r2", "r3"]
    assert out.total_num_scheduled_tokens == 120 and out.num_padded == 128
    assert [s.start_position for s in out.scheduled] == [0, 0, 0, 0]
    assert all(s.sample for s in out.scheduled)
    assert sched.bucket_stats.prefill[128].executions == 1
    assert sched.bucket_stats.prefill[128].padding == 8
    out = step(sched)
    assert out.is_prefill and [s.req_id for s in out.scheduled] == ["r4"]
    out = step(sched)
    assert not out.is_prefill and len(out.scheduled) == 5 and out.num_padded == 8


def test_packed_prefill_splits_the_last_prompt_at_the_token_budget():
    sched = make_scheduler(prefills=4)
    for i in range(3):
        sched.add_request(make_request(i, 100, 2))
    out = step(sched)
    # r0 fills 100 of 128 tokens; r1 joins (the budget is not full) and gets the other 28.
    assert [(s.req_id, s.start_position, s.num_tokens, s.sample) for s in out.scheduled] == [
        ("r0", 0, 100, True), ("r1", 0, 28, False)]
    out = step(sched)
    # r1 continues from 28; r2 joins behind it.
    assert [(s.req_id, s.start_position, s.num_tokens) for s in out.scheduled] == [
        ("r1", 28, 72), ("r2", 0, 56)]
    assert sched.requests["r0"].output_token_ids == [7]  # no decode while prompts remain


def test_update_from_output_stops_at_eos_after_min_tokens_and_frees_blocks():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=10, min_tokens=2)
    params.all_stop_token_ids |= {7}
    sched.add_request(Request("a", [5] * 20, params))
    free = sched.kv.pool.num_free_blocks
    outs = []
    for _ in range(2):
        outs.append(sched.update_from_output(sched.schedule(), ModelRunnerOutput(["a"], [[7]])))
    # The first 7 comes before min_tokens is reached, so only the second one stops it.
    assert [o[0].new_token_ids for o in outs] == [[7], [7]]
    assert [o[0].finish_status for o in outs] == [None, RequestStatus.FINISHED_STOPPED]
    assert sched.schedule().is_empty
    assert "a" not in sched.requests and sched.kv.pool.num_free_blocks == free


def _run_async(num_requests: int = 500, seed: int = 1) -> None:
    """Two steps in flight (each scheduled before the previous one's tokens are back), random
    arrivals, aborts and stop tokens; asserts what must hold throughout and afterwards."""
    from collections import deque

    rng = random.Random(seed)
    sched = make_scheduler(prefills=4)
    pool = sched.kv.pool
    start_free = pool.num_free_blocks
    queue: deque = deque()
    made: dict[str, Request] = {}
    sampled_steps: dict[str, int] = {}
    next_id = steps = 0
    while next_id < num_requests or sched.has_unfinished_requests() or queue:
        if next_id < num_requests and rng.random() < 0.5:
            req = make_request(next_id, rng.randint(1, 200), rng.randint(1, 20))
            if next_id % 3 == 0:  # may stop early on token 9
                req.sampling_params = SamplingParams(max_tokens=20, stop_token_ids=[9])
            sched.add_request(req)
            made[req.request_id] = req
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.finish_request(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        if not so.is_empty:
            queue.append(so)
            assert len(queue) <= 2
        if queue and (len(queue) == 2 or so.is_empty):
            done = queue.popleft()
            ids = [it.req_id for it in done.scheduled if it.sample]
            for rid in ids:
                sampled_steps[rid] = sampled_steps.get(rid, 0) + 1
            tokens = [[9 if rng.random() < 0.1 else 7] for _ in ids]
            sched.update_from_output(done, ModelRunnerOutput(ids, tokens))
        steps += 1
        assert steps < 50000, "requests did not finish"
    assert pool.num_free_blocks == start_free
    assert not sched.requests and not sched.running
    for rid, req in made.items():
        max_tokens = req.sampling_params.max_tokens
        assert len(req.output_token_ids) <= max_tokens
        if req.status is RequestStatus.FINISHED_LENGTH:
            # No wasted step: exactly one sampling step per token.
            assert sampled_steps[rid] == max_tokens == len(req.output_token_ids)
        assert req.num_output_placeholders == 0
        # Only steps already in flight when it stopped ran in vain.
        assert sampled_steps.get(rid, 0) - len(req.output_token_ids) <= 2
    statuses = {r.status for r in made.values()}
    assert statuses == {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED,
                        RequestStatus.FINISHED_ABORTED}


def test_async_scheduling_500_requests_with_aborts_and_stops():
    _run_async()


def test_async_broken_case_without_placeholders_overruns_max_tokens(monkeypatch):
    """The check above can fail: a scheduler blind to the tokens in flight schedules a
    sampling step too many for max_tokens requests."""
    monkeypatch.setattr(Scheduler, "_can_sample", lambda self, request: True)
    with pytest.raises(AssertionError):
        _run_async(60)


def _run_to_end(sched: Scheduler) -> dict[str, list]:
    """Steps until nothing is left: every output per request, failures included."""
    outs: dict[str, list] = {}
    for _ in range(100):
        if not sched.has_unfinished_requests() and not sched.has_finished_to_report():
            break
        so = sched.schedule()
        sampled = [item.req_id for item in so.scheduled if item.sample]
        for out in sched.take_failed() + sched.update_from_output(
                so, ModelRunnerOutput(sampled, [[7]] * len(sampled))):
            outs.setdefault(out.req_id, []).append(out)
    return outs


def test_a_request_whose_admission_raises_fails_alone(monkeypatch, caplog):
    """Issue #31: an exception while admitting one request (its grammar matcher, its prefix
    lookup) fails that request only: the engine's fault with an error id (the log has the
    traceback, the caller only the id), the request's own (ValueError) with its message; the
    request admitted beside them runs to its end and every block comes back."""
    sched = make_scheduler(prefills=4)
    free = sched.kv.pool.num_free_blocks
    admit = sched.kv.admit

    def faulty_admit(request_id, token_ids=(), salt=b""):
        if request_id == "r1":
            raise RuntimeError("grammar_matcher.cc:489: Check failed")
        if request_id == "r2":
            raise ValueError("the request's own bad value")
        return admit(request_id, token_ids, salt)

    monkeypatch.setattr(sched.kv, "admit", faulty_admit)
    for i in range(3):
        sched.add_request(make_request(i, 20, 4))
    outs = _run_to_end(sched)
    (engine_fault,) = outs["r1"]
    assert engine_fault.finish_status is RequestStatus.FINISHED_ABORTED
    assert engine_fault.error_id and engine_fault.error_id in engine_fault.error
    assert "grammar_matcher" not in engine_fault.error  # internals go to the log only
    assert "grammar_matcher" in caplog.text and engine_fault.error_id in caplog.text
    (own_fault,) = outs["r2"]
    assert own_fault.error == "the request's own bad value" and own_fault.error_id is None
    assert sum(len(o.new_token_ids) for o in outs["r0"]) == 4
    assert outs["r0"][-1].finish_status is RequestStatus.FINISHED_LENGTH
    assert not sched.requests and sched.kv.pool.num_free_blocks == free


def test_a_failure_while_finishing_a_request_does_not_escape_the_step(monkeypatch):
    """Freeing one finished request's blocks raises: the request still finishes (its caller
    gets its tokens), the step goes on, the other request is untouched."""
    sched = make_scheduler(prefills=4)
    free_blocks = sched.kv.free

    def faulty_free(request_id):
        free_blocks(request_id)
        if request_id == "r1":
            raise RuntimeError("free failed")

    monkeypatch.setattr(sched.kv, "free", faulty_free)
    sched.add_request(make_request(0, 20, 6))
    sched.add_request(make_request(1, 20, 2))
    outs = _run_to_end(sched)
    assert outs["r1"][-1].finish_status is RequestStatus.FINISHED_LENGTH
    assert sum(len(o.new_token_ids) for o in outs["r0"]) == 6
    assert not sched.requests and not sched.running
