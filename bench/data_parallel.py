"""Data parallelism: DP 1 vs DP 2 on the default model, offline (64 requests, 128 prompt + 128
new tokens, vLLM's shared workload), each setting in its own child process, alternating per
round (A B A B ...) so both see the same machine load. DP 2 runs two engine-core processes,
each with half the CPUs' threads (the TP rule) and its own KV cache.

Prints per run: tok/s (prompt + generated), the requests each replica got; then the medians
and the median of the per-round ratios, and whether DP 2's greedy tokens equal DP 1's. Usage
(under the shared benchmark lock):
  flock /tmp/ingot-bench.lock python bench/data_parallel.py [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

N, INPUT, OUTPUT = 64, 128, 128


def child(dp: int, model: str | None) -> None:
    from ingot import LLM, SamplingParams
    from ingot.benchmarks.workloads import prompts_for

    llm = LLM(model, data_parallel_size=dp, max_num_seqs=N)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * dp, SamplingParams(max_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(N, INPUT)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    ranks = llm.llm_engine.get_stats().get("dp_ranks", [])
    print("JSON " + json.dumps({
        "tok_s": N * (INPUT + OUTPUT) / seconds, "seconds": seconds,
        "routed": [r["requests_routed"] for r in ranks],
        "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
    llm.llm_engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child is not None:
        child(ns.child, ns.model)
        return
    rates: dict[int, list[float]] = {1: [], 2: []}
    tokens: dict[int, list] = {}
    for rnd in range(ns.rounds):
        for dp in (1, 2):
            cmd = [sys.executable, __file__, "--child", str(dp)]
            if ns.model:
                cmd += ["--model", ns.model]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line[5:] for line in out.splitlines()
                                     if line.startswith("JSON ")))
            rates[dp].append(result["tok_s"])
            tokens[dp] = result["tokens"]
            print(f"RESULT round={rnd} dp={dp} tok_s={result['tok_s']:.1f} "
                  f"seconds={result['seconds']:.1f} routed={result['routed']}", flush=True)
    ratios = [b / a for a, b in zip(rates[1], rates[2], strict=True)]
    print(f"MEDIAN dp1_tok_s={statistics.median(rates[1]):.1f} "
          f"dp2_tok_s={statistics.median(rates[2]):.1f} dp2_over_dp1={statistics.median(ratios):.3f} "
          f"ratios={','.join(f'{r:.3f}' for r in ratios)} same_tokens={tokens[1] == tokens[2]}")


if __name__ == "__main__":
    main()
