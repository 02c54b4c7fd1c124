"""Grammars compile off the engine thread (issue 16's mechanism), on the tiny random Llama.

A compile is made slow deterministically: ``_compile_now`` waits on a ``threading.Event`` for
constraints whose spec mentions "gated". While it waits, the request is ``WAITING_FOR_FSM`` and
already-running requests keep decoding; the broken twin (the pool replaced by a synchronous,
inline compile, as before this change) stalls them, and the same check says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from typing import Any

import pytest
from test_async_engine import asgi

from ingot import LLM, SamplingParams
from ingot.core.request import RequestStatus
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.entrypoints.openai.api_server import ServerSettings, build_app
from ingot.metrics.prometheus import EngineMetrics
from ingot.structured_output.manager import StructuredOutputManager

PROMPT = [5, 6, 7, 8]
FREE = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _schema(title: str) -> dict[str, Any]:
    """A small bounded schema; the title makes each test's compile its own (no cache hit)."""
    return {
        "title": title,
        "type": "object",
        "properties": {"gated": {"enum": ["a", "b"]},
                       "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["gated", "n"],
        "additionalProperties": False,
    }


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (set(value) == {"gated", "n"} and value["gated"] in ("a", "b")
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


def _constrained(title: str, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                          structured_outputs={"json": _schema(title),
                                              "disable_any_whitespace": True})


@pytest.fixture
def gate(monkeypatch):
    """Closed: a "gated" compile blocks (at most 30 s) until the test sets it."""
    event = threading.Event()
    event.entered = threading.Event()  # a gated compile has started
    compile_now = StructuredOutputManager._compile_now

    def gated(self, params):
        if "gated" in (params.spec or ""):
            event.entered.set()
            assert event.wait(30), "the test never opened the gate"
        return compile_now(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile_now", gated)
    yield event
    event.set()  # never leave a pool thread blocked


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # The default: synchronous scheduling (the main check is repeated with async).
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4)


class _Inline:
    """The broken twin's pool: compiles synchronously on the calling (engine) thread."""

    def submit(self, fn, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the future, as a pool does
            future.set_exception(exc)
        return future

    def shutdown(self, **_: Any) -> None:
        pass


class _Driver:
    """Steps an LLMEngine and keeps each request's latest output."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.outs: dict[str, Any] = {}

    def step(self) -> None:
        for out in self.engine.step():
            self.outs[out.request_id] = out

    def tokens(self, rid: str) -> int:
        out = self.outs.get(rid)
        return 0 if out is None else len(out.outputs[0].token_ids)

    def finish(self, rid: str, limit_s: float = 60) -> Any:
        deadline = time.monotonic() + limit_s
        while not (rid in self.outs and self.outs[rid].finished):
            assert time.monotonic() < deadline, f"{rid} did not finish"
            self.step()
        return self.outs[rid]


def _advance_while_compiling(engine: LLMEngine, gate: threading.Event, title: str,
                             release_after_s: float) -> tuple[int, Any, bool]:
    """The check: a running request's new tokens while a constrained request's compile is
    held closed (a timer opens the gate after ``release_after_s`` if the steps never get
    there: a synchronous compile blocks ``add_request`` until then). Returns (tokens it
    gained while the gate was closed, the constrained output, whether that request was seen
    WAITING_FOR_FSM)."""
    d = _Driver(engine)
    engine.add_request("free", PROMPT, FREE)
    while d.tokens("free") < 2:
        d.step()
    before = d.tokens("free")
    timer = threading.Timer(release_after_s, gate.set)
    timer.start()
    try:
        engine.add_request("json", [9, 10, 11], _constrained(title))
        seen_waiting = False
        while not gate.is_set() and d.tokens("free") < before + 5:
            d.step()
            request = engine.engine_core.scheduler.requests["json"]
            seen_waiting |= request.status is RequestStatus.WAITING_FOR_FSM
            assert d.tokens("json") == 0  # nothing is sampled for it before its grammar
        advanced = d.tokens("free") - before if not gate.is_set() else 0
        if not gate.is_set():
            assert seen_waiting
    finally:
        gate.set()
        timer.cancel()
    out = d.finish("json")
    engine.abort_request("free")
    d.step()
    return advanced, out, seen_waiting


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async"])
def test_running_request_decodes_while_a_grammar_compiles(llm, tiny_llama_dir, gate,
                                                          async_scheduling):
    if async_scheduling:
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4,
                  async_scheduling=True)
    engine = llm.llm_engine
    assert (engine.engine_core.max_in_flight > 1) is async_scheduling
    advanced, out, seen_waiting = _advance_while_compiling(engine, gate, "pool", 30)
    assert advanced >= 5 and seen_waiting
    assert out.error is None and out.outputs[0].finish_reason == "stop"
    assert _valid(out.outputs[0].text), out.outputs[0].text
    assert not engine.has_unfinished_requests()


def test_broken_twin_synchronous_compile_stalls_decoding(llm, gate, monkeypatch):
    """The same check against a synchronous compile (the pool replaced by an inline one):
    the running request gains nothing while the compile is held, so the check can fail."""
    monkeypatch.setattr(llm.llm_engine.engine_core.structured_output, "_pool", _Inline())
    advanced, out, seen_waiting = _advance_while_compiling(llm.llm_engine, gate, "sync", 0.5)
    assert advanced == 0 and not seen_waiting
    assert _valid(out.outputs[0].text)  # it still works, only without overlap


def test_compile_error_fails_only_its_request(llm):
    engine = llm.llm_engine
    d = _Driver(engine)
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True))
    engine.add_request("bad", PROMPT, SamplingParams(structured_outputs={
        "json": {"type": "no-such-type"}}))
    bad = d.finish("bad")
    assert bad.outputs[0].finish_reason == "abort"
    assert bad.error.startswith("invalid structured_outputs.json:") and "no-such-type" in bad.error
    free = d.finish("free")
    assert free.error is None and len(free.outputs[0].token_ids) == 30
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.structured_output.num_compiling == 0


def test_compile_timeout_fails_only_its_request(tiny_llama_dir, gate):
    timed = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4,
                structured_outputs_config={"compile_timeout_s": 0.05})
    engine = timed.llm_engine
    d = _Driver(engine)
    engine.add_request("free", PROMPT, FREE)
    d.step()
    engine.add_request("slow", PROMPT, _constrained("timeout"))
    slow = d.finish("slow", limit_s=10)
    assert slow.error == ("the json constraint did not compile within 0.05 s "
                          "(structured_outputs_config compile_timeout_s); simplify it")
    assert not d.outs["free"].finished  # it ran on through the timeout
    free = d.finish("free")
    assert free.error is None and len(free.outputs[0].token_ids) == 200
    # offline generate raises the timeout as before, and the engine serves on
    with pytest.raises(ValueError, match="did not compile within 0.05 s"):
        timed.generate([PROMPT], _constrained("timeout-2"))
    gate.set()
    (ok,) = timed.generate([PROMPT], SamplingParams(max_tokens=5, structured_outputs={
        "choice": ["yes", "no"]}))
    assert ok.outputs[0].text in ("yes", "no")


def test_abort_while_compiling_and_the_queue_behind_it(llm, gate):
    """A compiling request neither blocks a request queued behind it nor loses its place;
    aborted mid-compile it is gone at once, its result only warms the cache."""
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    d = _Driver(engine)
    engine.add_request("json", PROMPT, _constrained("abort"))
    engine.add_request("free", [9, 10, 11], FREE)  # queued behind the compiling request
    while d.tokens("free") < 3:
        d.step()
    scheduler = engine.engine_core.scheduler
    assert scheduler.waiting[0].request_id == "json"
    assert scheduler.requests["json"].status is RequestStatus.WAITING_FOR_FSM
    compiling = manager._compiling["json"].future
    engine.abort_request("json")
    assert manager.num_compiling == 0 and "json" not in scheduler.requests
    gate.set()
    hits = manager.num_cache_hits
    compiling.result(timeout=30)  # the abandoned compile ends on the pool
    for _ in range(3):
        d.step()
    assert "json" not in d.outs and manager.num_requests == 0
    (again,) = llm.generate([PROMPT], _constrained("abort"))
    assert manager.num_cache_hits == hits + 1 and _valid(again.outputs[0].text)
    engine.abort_request("free")
    d.step()
    assert not engine.has_unfinished_requests()


def test_only_compiling_requests_neither_spin_nor_stop_the_loop(llm, gate):
    engine = llm.llm_engine
    engine.add_request("json", PROMPT, _constrained("idle"))
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.3:
        assert engine.has_unfinished_requests() and engine.has_pending_work()
        assert engine.step() == []
        steps += 1
    assert steps <= 60, f"{steps} steps in 0.3 s: the loop spins"  # each blocks ~10 ms
    gate.set()
    out = _Driver(engine).finish("json")
    assert _valid(out.outputs[0].text)


def test_server_precheck_waits_off_the_engine_thread(tiny_llama_dir, gate):
    """Over HTTP the grammar compiles before the response starts (a bad or slow one is a 400
    naming the field and the knob), without holding the engine thread: a stream started
    before keeps getting tokens while the gated compile is pending."""
    engine = LLMEngine.from_engine_args(_engine_args(tiny_llama_dir))
    real_step = engine.step

    def slow_step() -> list:
        time.sleep(0.01)  # 200 tokens take >= 2 s: the stream outlasts the compile's timeout
        return real_step()

    engine.step = slow_step
    llm = AsyncLLM(engine)
    app = build_app(llm, ServerSettings(served_model_name="tiny"), EngineMetrics("tiny"))

    async def main() -> tuple:
        counts: list[int] = []

        async def stream() -> None:
            async for out in llm.generate([9] * 8, FREE, "stream"):
                counts.append(len(out.outputs[0].token_ids))

        task = asyncio.create_task(stream())
        while not counts:
            await asyncio.sleep(0.01)
        body = {"prompt": "x", "max_tokens": 20, "structured_outputs": {"json": _schema("srv")}}
        slow = asyncio.create_task(asgi(app, "POST", "/v1/completions", body))
        while not gate.entered.is_set():
            await asyncio.sleep(0.01)
        before = counts[-1]
        await asyncio.sleep(0.3)
        during = counts[-1] - before
        assert not slow.done() and llm.engine.get_num_unfinished_requests() == 1  # still in its pre-check
        timed_out = await asyncio.wait_for(slow, 10)
        bad = await asgi(app, "POST", "/v1/completions", {
            "prompt": "x", "max_tokens": 5, "structured_outputs": {"regex": "(unclosed"}})
        gate.set()
        await asyncio.wait_for(task, 60)
        return during, timed_out, bad

    try:
        during, (status, body), (bad_status, bad_body) = asyncio.run(asyncio.wait_for(main(), 90))
    finally:
        gate.set()
        llm.shutdown()
    assert during > 0  # the engine stepped while the compile was pending
    assert status == 400
    err = json.loads(body)["error"]
    assert "compile_timeout_s" in err["message"] and err["param"] == "structured_outputs"
    assert bad_status == 400 and "invalid structured_outputs.regex" in json.loads(bad_body)[
        "error"]["message"]


def _engine_args(path):
    from ingot.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), dtype="float32", max_model_len=256,
                      structured_outputs_config={"compile_timeout_s": 1.0})
