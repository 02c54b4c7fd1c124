"""Async scheduling on vs off on the default model: the shared offline workload (64 requests,
128 prompt + 128 new tokens) and the single stream (1 x 128 + 128), engines alternating per
round so both see the same machine load.

Prints per run: tok/s (total for offline, output for single) and the async counters, checks
that async's greedy tokens equal sync's, and prints the median of each setting and of the
per-round ratios. Usage:
  python bench/async_scheduling.py [--rounds 3] [--workloads offline,single] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import statistics

from packed_prefill import run

from ingot import LLM, SamplingParams
from ingot.benchmarks.workloads import WORKLOADS, prompts_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="offline,single")
    ap.add_argument("--model", default=None)
    ns = ap.parse_args()
    for name in ns.workloads.split(","):
        n, inp, out = WORKLOADS[name]
        prompts = prompts_for(n, inp)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for rnd in range(ns.rounds):
            tokens_by_mode = {}
            for mode in (False, True):
                llm = LLM(ns.model, async_scheduling=mode, max_num_seqs=max(n, 1))
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
                seconds, _, ttft, tokens = run(llm, prompts, out)
                tokens_by_mode[mode] = tokens
                rate = n * (inp + out) / seconds if name == "offline" else n * out / seconds
                rates[mode].append(rate)
                stats = llm.llm_engine.get_stats()
                print(f"RESULT workload={name} round={rnd} async={mode} tok_s={rate:.1f} "
                      f"mean_ttft_s={ttft:.3f} async_steps={stats['async_steps']} "
                      f"sync_fallback_steps={stats['sync_fallback_steps']}", flush=True)
                del llm
                gc.collect()
            print(f"CHECK workload={name} round={rnd} "
                  f"same_tokens={tokens_by_mode[True] == tokens_by_mode[False]}", flush=True)
        ratios = [a / s for a, s in zip(rates[True], rates[False], strict=True)]
        print(f"MEDIAN workload={name} sync_tok_s={statistics.median(rates[False]):.1f} "
              f"async_tok_s={statistics.median(rates[True]):.1f} "
              f"async_over_sync={statistics.median(ratios):.3f} "
              f"ratios={','.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
