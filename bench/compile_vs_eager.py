"""Compiled (torch.compile per bucket) vs eager on the default model: start-up and throughput.

Each configuration runs in its own process, so "cold" really starts from an empty compile cache
and "warm" from the cache the cold run left:

    .venv/bin/python bench/compile_vs_eager.py                 # default model, bf16
    .venv/bin/python bench/compile_vs_eager.py --model DIR --dtype float32

Reported per mode (eager, compiled cold, compiled warm): seconds to ready, graphs compiled,
single-stream decode tok/s (1 request, 128 prompt + 128 output tokens) and offline tok/s
(--batch requests of 128 + 128 at once). The grid is kept small (--max-model-len 256, decode
buckets 1 and --batch) so that the cold compile stays in minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT_LEN = 128
OUTPUT_LEN = 128


def _worker(ns: argparse.Namespace) -> None:
    start = time.perf_counter()
    import random

    from ingot import LLM, SamplingParams

    kwargs = dict(model=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len,
                  max_num_seqs=ns.batch, max_num_batched_tokens=ns.max_model_len,
                  additional_config={"num_seqs_buckets": sorted({1, ns.batch})})
    if ns.mode == "eager":
        llm = LLM(enforce_eager=True, **kwargs)
    else:
        llm = LLM(compile=True, cache_dir=ns.cache_dir, **kwargs)
    ready = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()["compilation"]
    vocab = llm.llm_engine.config.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)]}
                for _ in range(n)]

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts(1), SamplingParams(max_tokens=4, ignore_eos=True))  # first-call costs
    t = time.perf_counter()
    llm.generate(prompts(1), params)
    single = OUTPUT_LEN / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate(prompts(ns.batch), params)
    offline = ns.batch * OUTPUT_LEN / (time.perf_counter() - t)
    # bf16 agreement check: the same greedy continuations in every mode (printed, compared in main).
    probe = llm.generate([{"prompt_token_ids": list(range(200 + 37 * i, 200 + 37 * i + 24))}
                          for i in range(4)],
                         SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    after = llm.llm_engine.get_stats()["compilation"]
    print("RESULT " + json.dumps({
        "greedy_tokens": [list(o.outputs[0].token_ids) for o in probe],
        "mode": ns.mode, "ready_s": round(ready, 2), "graphs": stats["graphs"],
        "compiled": stats["compilations"], "cache_hits": stats["cache_hits"],
        "compile_s_per_bucket": {k: round(v, 2) for k, v in
                                 stats.get("compile_seconds_per_bucket", {}).items()},
        "single_tok_s": round(single, 2), "offline_tok_s": round(offline, 2),
        "compilations_while_serving": after["compilations"] - stats["compilations"],
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--modes", default="eager,cold,warm")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.mode:
        _worker(ns)
        return
    cache_dir = tempfile.mkdtemp(prefix="ingot-bench-cache-")
    results = []
    for mode in ns.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode, "--cache-dir", cache_dir,
               "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
               "--batch", str(ns.batch)]
        if ns.model:
            cmd += ["--model", ns.model]
        env = {k: v for k, v in os.environ.items() if k != "INGOT_DISABLE_WARMUP_COMPILE"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
        out = proc.stdout
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
        print(line, flush=True)
    by_mode = {r["mode"]: r for r in results}
    if "cold" in by_mode and "warm" in by_mode:
        print(f"warm start is {by_mode['cold']['ready_s'] / by_mode['warm']['ready_s']:.1f}x "
              "faster to ready than cold")
    if "eager" in by_mode:
        ref = by_mode["eager"]["greedy_tokens"]
        for r in results[1:]:
            same = sum(a == b for a, b in zip(r["greedy_tokens"], ref, strict=True))
            print(f"{r['mode']}: {same}/{len(ref)} greedy continuations identical to eager")
    if "eager" in by_mode and "warm" in by_mode:
        for key in ("single_tok_s", "offline_tok_s"):
            print(f"{key}: compiled/eager = {by_mode['warm'][key] / by_mode['eager'][key]:.2f}")


if __name__ == "__main__":
    main()
