"""The engine core's step contract: packed prefill, the executor kinds, the core owning
tokens. Greedy outputs must not depend on how prompts are packed or where the worker runs."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from ingot import LLM, SamplingParams
from ingot.distributed.wire import rpc_function
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.protocol import EngineDeadError

BASE = dict(dtype="float32", max_model_len=256, block_size=4, max_num_seqs=16)


def _engine(path, prefills: int, backend: str = "uni", **kw) -> LLMEngine:
    args = {**BASE, **kw}
    args["additional_config"] = {"max_num_prefills_per_step": prefills}
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(path), distributed_executor_backend=backend, **args)
    )


def _mixed_requests(n: int = 32, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Mixed lengths with stop strings, max_tokens 1-3, min_tokens, penalties and n > 1."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 90))]
        kind = i % 6
        params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        if kind == 1:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 3), ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0, max_tokens=30, stop=["e", "a"])
        elif kind == 3:
            params = SamplingParams(temperature=0, max_tokens=16, min_tokens=8,
                                    stop_token_ids=[rng.randrange(3, 259) for _ in range(40)])
        elif kind == 4:
            params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                                    presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True)
        elif kind == 5:
            params = SamplingParams(temperature=0, max_tokens=10, n=2, ignore_eos=True)
        out.append((prompt, params))
    return out


ABORTED = {"7", "20"}


def _run(engine: LLMEngine, requests) -> dict[str, list]:
    """Every request's (token ids, text, finish reason) per choice; requests 7 and 20 are
    aborted after the first step they produce output."""
    free = engine.get_stats()["kv_blocks_free"]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    results: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in ABORTED:
                engine.abort_request(out.request_id)
                continue
            if out.finished:
                results[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                                           for c in out.outputs]
    assert engine.get_stats()["kv_blocks_free"] == free  # aborts and stops freed every block
    assert set(results) == {str(i) for i in range(len(requests))} - ABORTED
    return results


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=1)
    return _run(engine, _mixed_requests())


@pytest.mark.parametrize("prefills,backend,batched", [
    (8, "uni", None), (3, "uni", 48), (8, "mp", None),
])
def test_outputs_identical_packed_or_not_and_in_a_worker_process(
    tiny_llama_dir, reference, prefills, backend, batched
):
    kw = {} if batched is None else {"max_num_batched_tokens": batched}
    engine = _engine(tiny_llama_dir, prefills, backend, **kw)
    try:
        got = _run(engine, _mixed_requests())
        assert got == reference
        reasons = {c[2] for choices in got.values() for c in choices}
        assert reasons == {"stop", "length"}  # stop strings and stop tokens really fired
    finally:
        engine.shutdown()


def test_reference_is_not_trivially_equal(tiny_llama_dir, reference):
    """The broken case: dropping a prompt token changes the outputs the check compares."""
    requests = _mixed_requests()
    requests[0] = (requests[0][0][1:] or [5], requests[0][1])
    engine = _engine(tiny_llama_dir, prefills=8)
    assert _run(engine, requests) != reference


def test_packed_steps_hold_several_prompts(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=8)
    for i in range(8):
        engine.add_request(str(i), [10 + i] * 12, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    buckets = engine.get_stats()["buckets"]
    # 96 prompt tokens in one 128-token step, instead of eight.
    assert {b: c.executions for b, c in buckets.prefill.items() if c.executions} == {128: 1}


def test_forward_steps_equal_max_tokens(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=8)
    engine.add_request("a", [5] * 30, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["num_steps"] == 5  # one prefill (token 1) + four decodes


def test_bad_packing_knob_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_prefills_per_step"):
        LLM(str(tiny_llama_dir), additional_config={"max_num_prefills_per_step": 0})
    with pytest.raises(ValueError, match="needs eager layers"):
        LLM(str(tiny_llama_dir), compile=True, additional_config={"max_num_prefills_per_step": 4})
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="slurm")


def test_worker_error_is_raised_and_the_executor_reports_it(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefills=8, backend="mp")
    try:
        assert not engine.workers_are_local
        # An RPC's error is the caller's (issue #31): the workers serve on.
        with pytest.raises(AttributeError, match="no RPC method 'no_such_method'"):
            engine.collective_rpc("no_such_method")
        engine.check_health()
        with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
            from ingot.accuracy.ingot_runner import local_worker

            local_worker(engine)
    finally:
        engine.shutdown()


@rpc_function
def _drop_runner(worker) -> None:  # noqa: ANN001
    worker.model_runner = None


@pytest.mark.parametrize("backend,async_scheduling", [("mp", False), ("uni", True)])
def test_worker_failure_mid_request_fails_the_stream_not_hangs(
    tiny_llama_dir, backend, async_scheduling
):
    """An exception inside the worker during a step (in its process, or on its compute thread
    with two steps in flight): the in-flight request gets an error, the engine reports itself
    dead, and shutting down leaves no child process behind."""
    llm = AsyncLLM(_engine(tiny_llama_dir, prefills=8, backend=backend,
                           async_scheduling=async_scheduling))
    pid = llm.engine.startup_stats()["pid"]

    async def run() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = llm.generate([5] * 10, params, "long")
        await stream.__anext__()
        # The worker's next step raises (its runner is gone).
        await llm.call(lambda: llm.engine.collective_rpc(_drop_runner))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert not llm.is_running
    finally:
        llm.shutdown()
    if backend == "uni":
        return
    with pytest.raises(ProcessLookupError):  # the worker process is gone
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
