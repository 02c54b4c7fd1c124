"""What a grammar compile costs the requests already running: one unconstrained request decodes
on the default model while a JSON-schema request with a slow compile (about 330 ms: 14
records with string patterns, enums and bounded arrays) is added. Measures, from the
add until the constrained request's prefill step starts, the running request's longest gap
between two tokens (the engine loop's view: ``add_request`` plus the steps), its tokens and
its median step time, with the compile pool (default) and with the pool replaced by a
synchronous compile on the engine thread (the old behaviour).
Cases: ``warm`` (xgrammar's tokenizer info already built, the schema new) and ``cold`` (the
engine's first constrained request: the tokenizer info is built too). Rounds alternate.
Usage:
  python bench/structured_compile_stall.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from typing import Any

from ingot import LLM, SamplingParams
from ingot.sampling_params import StructuredOutputsParams


def slow_schema(tag: int, records: int = 14) -> dict[str, Any]:
    props = {
        f"field_{i}": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "code": {"type": "string", "pattern": "^[0-9]{3}-[A-Z]{2}$"},
                "kind": {"enum": [f"k{tag}_{i}_{j}" for j in range(5)]},  # tag: no cache hit
                "vals": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 1000}, "maxItems": 5},
            },
            "required": ["name", "code", "kind", "vals"],
            "additionalProperties": False,
        }
        for i in range(records)
    }
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


class Inline:
    """The pool replaced by a synchronous compile on the calling (engine) thread."""

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the future, as a pool does
            future.set_exception(exc)
        return future

    def shutdown(self, **_: Any) -> None:
        pass


def measure(llm: LLM, tag: int, sync: bool, cold: bool) -> tuple[float, int, float, float, float]:
    """The running request's longest gap between tokens from the add until the constrained
    request's prefill step starts (that step itself, a prefill that holds decodes back in
    either mode, is left out), its tokens and median step time in that window, the window's
    length, and its median step time before the add (ms, count, ms, ms, ms)."""
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    pool = manager._pool
    if sync:
        manager._pool = Inline()
    if cold:
        manager._compiler = None  # the next compile rebuilds xgrammar's tokenizer info
    free = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request("free", {"prompt_token_ids": list(range(100, 164))}, free)
    engine.step()  # its prefill
    before: list[float] = []
    for _ in range(6):  # decodes before the add: the baseline step time
        t0 = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t0)
    last = time.perf_counter()
    start = last
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(
        json=slow_schema(tag)))
    engine.add_request("json", {"prompt_token_ids": list(range(200, 232))}, params)
    gaps: list[float] = []
    steps: list[float] = []
    while True:
        t0 = time.perf_counter()
        ids = {o.request_id for o in engine.step()}
        if "json" in ids:
            gaps.append(t0 - last)
            break
        if "free" in ids:
            now = time.perf_counter()
            gaps.append(now - last)
            steps.append(now - t0)
            last = now
    window = t0 - start
    while engine.output_processor.has_request("json"):
        engine.step()
    engine.abort_request("free")
    engine.step()
    manager._pool = pool
    median = statistics.median(steps) * 1000 if steps else float("nan")
    return max(gaps) * 1000, len(steps), median, window * 1000, statistics.median(before) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ns = ap.parse_args()
    llm = LLM(ns.model, max_num_seqs=4, max_model_len=512, async_scheduling=False)
    llm.generate([[100 + i for i in range(64)]], SamplingParams(max_tokens=8))  # warm up
    tag = 0
    for cold in (False, True):
        case = "cold" if cold else "warm"
        results: dict[bool, list[tuple[float, int, float, float, float]]] = {False: [], True: []}
        for rnd in range(ns.rounds):
            for sync in (False, True):
                tag += 1
                row = measure(llm, tag, sync, cold)
                results[sync].append(row)
                print(f"RESULT case={case} round={rnd} mode={'sync' if sync else 'pool'} "
                      f"longest_gap_ms={row[0]:.1f} tokens_while_compiling={row[1]} "
                      f"median_step_ms={row[2]:.1f} window_ms={row[3]:.0f} "
                      f"step_ms_before={row[4]:.1f}", flush=True)
        for sync in (False, True):
            rows = results[sync]
            print(f"MEDIAN case={case} mode={'sync' if sync else 'pool'} "
                  f"longest_gap_ms={statistics.median(r[0] for r in rows):.1f} "
                  f"tokens_while_compiling={statistics.median(r[1] for r in rows):g} "
                  f"window_ms={statistics.median(r[3] for r in rows):.0f} "
                  f"step_ms_before={statistics.median(r[4] for r in rows):.1f}")

if __name__ == "__main__":
    main()
