"""Packed prefill: the shared offline workload (64 requests, 128 prompt + 128 new tokens) on
the default model at several ``max_num_prefills_per_step`` values, rounds alternating.

Prints per run: total tok/s, the prefill phase (seconds until every request has its first
token) and the mean TTFT, and checks every setting's greedy tokens equal those of 1 (the
original one-prefill-per-step rule). Usage:
  python bench/packed_prefill.py [--values 1,4,8,16] [--rounds 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from ingot import LLM, SamplingParams
from ingot.benchmarks.workloads import WORKLOADS, prompts_for


def run(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, float, float, list]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    tokens = [done[f"r{i}"] for i in range(len(prompts))]
    return seconds, max(first.values()), statistics.mean(first.values()), tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ns = ap.parse_args()
    values = [int(v) for v in ns.values.split(",")]
    n, inp, out = WORKLOADS["offline"]
    prompts = prompts_for(n, inp)
    results: dict[int, list[tuple[float, float, float]]] = {v: [] for v in values}
    reference = None
    for rnd in range(ns.rounds):
        for v in values:
            llm = LLM(ns.model, additional_config={"max_num_prefills_per_step": v})
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
            seconds, prefill_s, ttft, tokens = run(llm, prompts, out)
            if reference is None:
                reference = tokens
            same = tokens == reference
            total = (n * (inp + out)) / seconds
            results[v].append((total, prefill_s, ttft))
            print(f"RESULT round={rnd} max_num_prefills_per_step={v} total_tok_s={total:.1f} "
                  f"prefill_phase_s={prefill_s:.2f} mean_ttft_s={ttft:.2f} "
                  f"same_tokens_as_first={same}", flush=True)
            del llm
            gc.collect()
    for v in values:
        rows = results[v]
        print(f"MEDIAN max_num_prefills_per_step={v} "
              f"total_tok_s={statistics.median(r[0] for r in rows):.1f} "
              f"prefill_phase_s={statistics.median(r[1] for r in rows):.2f} "
              f"mean_ttft_s={statistics.median(r[2] for r in rows):.2f}")


if __name__ == "__main__":
    main()
