"""Async scheduling: the core schedules step N+1 while step N runs (batch queue of depth 2).
Greedy outputs must be token for token those of synchronous scheduling; the counters say which
decode steps took the previous step's sampled tokens as their inputs."""

from __future__ import annotations

import time

import pytest
from test_engine_core_v2 import _engine, _mixed_requests, _run

from ingot import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=1, async_scheduling=False)
    return _run(engine, _mixed_requests())


@pytest.mark.parametrize("prefills,backend", [(8, "uni"), (1, "uni"), (8, "mp")])
def test_async_outputs_identical_to_sync(tiny_llama_dir, reference, prefills, backend):
    engine = _engine(tiny_llama_dir, prefills, backend, async_scheduling=True)
    try:
        got = _run(engine, _mixed_requests())
        assert got == reference
        while engine.has_pending_work():  # the steps in flight, the finished ids
            engine.step()
        stats = engine.get_stats()
        assert stats["async_scheduling"] and stats["async_steps"] > 0
        # Nothing left behind: every request's runner state and block is gone.
        assert stats["num_runner_requests"] == 0 and stats["num_running"] == 0
    finally:
        engine.shutdown()


def test_async_reference_is_not_trivially_equal(tiny_llama_dir, reference):
    """The broken case: a runner that feeds a wrong token as the next step's input (here: the
    previous step's sampled tensor shifted by one) must change the outputs compared above."""
    engine = _engine(tiny_llama_dir, prefills=8, async_scheduling=True)
    runner = engine.engine_core.executor.worker.model_runner
    original = runner._decode_input_ids

    def shifted(so, b_pad):
        ids = original(so, b_pad)
        return (ids + 1) % 250
    runner._decode_input_ids = shifted
    try:
        assert _run(engine, _mixed_requests()) != reference
    finally:
        engine.shutdown()


def test_constant_batch_counts_async_steps_and_one_fallback(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=8, async_scheduling=True)
    for i in range(4):
        engine.add_request(str(i), [10 + i] * 12, SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_pending_work():
        engine.step()
    stats = engine.get_stats()
    # One packed prefill (token 1), then 11 decodes of the same four requests: the first
    # decode builds its inputs from the token lists, the ten after it take the sampled tensor.
    assert stats["num_steps"] == 12
    assert (stats["sync_fallback_steps"], stats["async_steps"]) == (1, 10)
    sync = _engine(tiny_llama_dir, prefills=8, async_scheduling=False)
    sync.add_request("a", [5] * 12, SamplingParams(max_tokens=6, ignore_eos=True))
    while sync.has_pending_work():
        sync.step()
    assert (sync.get_stats()["sync_fallback_steps"], sync.get_stats()["async_steps"]) == (0, 0)


def test_forward_steps_equal_max_tokens_under_async(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=8, async_scheduling=True)
    engine.add_request("a", [5] * 30, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_pending_work():
        engine.step()
    assert engine.get_stats()["num_steps"] == 5  # scheduled ahead, yet no step wasted


def test_slow_device_overlaps_and_keeps_at_most_two_in_flight(tiny_llama_dir):
    """A fake slow device (every forward sleeps 30 ms): step i+1 is submitted before step i's
    results are applied, and never more than two steps are in flight."""
    engine = _engine(tiny_llama_dir, prefills=8, async_scheduling=True)
    core = engine.engine_core
    worker = core.executor.worker
    events: list[tuple[str, int]] = []
    forward = worker.execute_model

    def slow(so):
        time.sleep(0.03)
        return forward(so)
    worker.execute_model = slow
    submit, apply = core.executor.execute_model, core.scheduler.update_from_output
    submitted = []
    max_in_flight = 0

    def submitting(so, non_block=False):
        nonlocal max_in_flight
        submitted.append(so)
        events.append(("submit", len(submitted) - 1))
        fut = submit(so, non_block)
        max_in_flight = max(max_in_flight, len(core.batch_queue) + 1)
        return fut

    def applying(so, out):
        events.append(("apply", next(i for i, s in enumerate(submitted) if s is so)))
        return apply(so, out)
    core.executor.execute_model = submitting
    core.scheduler.update_from_output = applying
    for i in range(3):
        engine.add_request(str(i), [7 + i] * 9, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_pending_work():
        engine.step()
    assert max_in_flight == 2
    applied = [i for kind, i in events if kind == "apply"]
    assert applied == sorted(applied) and len(applied) == 8
    for i in applied[:-1]:
        assert events.index(("submit", i + 1)) < events.index(("apply", i))


def test_async_flag_offline_and_accuracy_toolkit_refuses_it(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, async_scheduling=True)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    from ingot.accuracy.ingot_runner import local_worker

    with pytest.raises(ValueError, match="async_scheduling=False"):
        local_worker(llm.llm_engine)
