"""Serving with packed prefill and async scheduling on vs off: `ingot serve` (default model)
driven by `ingot bench serve`'s client, 16 concurrent clients in a closed loop (each sends its
next 128-token prompt as soon as its previous answer ends, so prompts arrive while the others
decode). Settings alternate within each round so machine noise lands on all of them.

Prints each run's RESULT line (TTFT p50/p99, ITL, output tok/s) with its setting, then the
medians per setting. Usage:
  python bench/serve_packing_async.py [--rounds 2] [--num-requests 48] [--output-len 64]
"""

from __future__ import annotations

import argparse
import re
import statistics

from serve_util import ingot_server

from ingot.benchmarks.serve import run_serve_bench

SETTINGS = {  # name -> extra `ingot serve` flags
    "packing1_sync": ["--additional-config", '{"max_num_prefills_per_step": 1}',
                      "--no-async-scheduling"],
    "packing8_sync": ["--additional-config", '{"max_num_prefills_per_step": 8}',
                      "--no-async-scheduling"],
    "packing8_async": ["--additional-config", '{"max_num_prefills_per_step": 8}',
                       "--async-scheduling"],
    "packing1_async": ["--additional-config", '{"max_num_prefills_per_step": 1}',
                       "--async-scheduling"],
}
FIELDS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def serve_and_bench(flags: list[str], ns: argparse.Namespace) -> str:
    with ingot_server(["--max-num-seqs", "16", "--max-model-len", "1024", *flags]) as url:
        return run_serve_bench(url, concurrency=16, num_requests=ns.num_requests,
                               input_len=128, output_len=ns.output_len)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ns = ap.parse_args()
    names = ns.settings.split(",")
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for rnd in range(ns.rounds):
        for name in names:
            line = serve_and_bench(SETTINGS[name], ns)
            print(f"SETTING {name} round={rnd} {line}", flush=True)
            rows[name].append({k: float(re.search(rf"{k}=([\d.]+)", line).group(1))
                               for k in FIELDS})
    for name in names:
        med = {k: statistics.median(r[k] for r in rows[name]) for k in FIELDS}
        print(f"MEDIAN {name} " + " ".join(f"{k}={v:.1f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
