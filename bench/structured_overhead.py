"""Structured outputs' cost on the default model: decode step time at batch 1 and 16 with one
JSON-schema-constrained request in the batch vs none (rounds alternate), and the grammar
compile time of the test schemas (cold, then cached).

A step's time is the wall time of one ``LLMEngine.step()`` during decode (the mask is filled on
the engine thread before the step and applied to the logits in it). Only steps while every
request of the batch still runs count. Usage:
  python bench/structured_overhead.py [--rounds 3] [--batches 1,16] [--steps 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ingot import LLM, SamplingParams
from ingot.sampling_params import StructuredOutputsParams

# A record with a long required string: the constrained request keeps running (and its mask
# keeps being computed) for the whole measured window.
LONG = {
    "type": "object",
    "properties": {"id": {"type": "integer"},
                   "text": {"type": "string", "minLength": 400, "maxLength": 500}},
    "required": ["id", "text"],
    "additionalProperties": False,
}
# The tests' nested schema: object, enum, integer, array, required, no additional properties.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}
TEST_SCHEMAS = {
    "nested object + enum + array": {"json": SCHEMA},
    "regex": {"regex": r"[A-Z][a-z]{2,8} \d{3}-\d{4}"},
    "choice": {"choice": ["positive", "negative", "neutral"]},
    "ebnf": {"grammar": 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*'},
}


def decode_step_times(llm: LLM, batch: int, constrained: bool, steps: int) -> list[float]:
    engine = llm.llm_engine
    for i in range(batch):
        so = StructuredOutputsParams(json=LONG) if constrained and i == 0 else None
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=so is None,
                                structured_outputs=so)
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(100 + i, 164 + i))}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        stats = engine.get_stats()
        decoding = outs and all(len(o.outputs[0].token_ids) > 1 for o in outs)
        if decoding and stats["num_running"] == batch and stats["num_waiting"] == 0:
            times.append(elapsed)
    return times[2:]  # the first decodes pay one-off costs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--model", default=None)
    ns = ap.parse_args()
    llm = LLM(ns.model, max_num_seqs=16, max_model_len=512, async_scheduling=False)
    core = llm.llm_engine.engine_core
    for name, spec in TEST_SCHEMAS.items():
        params = StructuredOutputsParams(**spec)
        start = time.perf_counter()
        core.structured_output.compile(params)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        core.structured_output.compile(params)
        warm = time.perf_counter() - start
        print(f"COMPILE schema={name!r} cold_ms={cold * 1000:.2f} cached_ms={warm * 1000:.3f}")
    decode_step_times(llm, 1, True, 8)  # warm both paths
    for batch in (int(b) for b in ns.batches.split(",")):
        medians: dict[bool, list[float]] = {False: [], True: []}
        for rnd in range(ns.rounds):
            for constrained in (False, True):
                t = decode_step_times(llm, batch, constrained, ns.steps)
                medians[constrained].append(statistics.median(t))
                print(f"RESULT batch={batch} round={rnd} constrained={constrained} "
                      f"steps={len(t)} median_step_ms={statistics.median(t) * 1000:.2f}",
                      flush=True)
        base, with_so = statistics.median(medians[False]), statistics.median(medians[True])
        print(f"MEDIAN batch={batch} none_ms={base * 1000:.2f} one_json_ms={with_so * 1000:.2f} "
              f"overhead={(with_so / base - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
