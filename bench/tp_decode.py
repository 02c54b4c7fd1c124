"""Decode step time of the default model under tensor parallelism against one rank.

Each setting runs in its own child process (one engine per process), the settings alternate in
rounds (A B C A B C ...), and each child reports the median wall time of its decode-only
engine steps (one batch of ``--batch`` requests, ``--new-tokens`` each). The default model
(SmolLM2-135M, 9 query / 3 KV heads) splits over 3 ranks, not 2. Settings:

* ``tp1``: one rank (the batch-1 CPU decode program, every CPU's threads);
* ``tp3``: three worker processes, the TP collectives through shared memory (the default);
* ``tp3-gloo``: the same with ``INGOT_CPU_SHM_ALLREDUCE=0`` (every collective over gloo).

    .venv/bin/python bench/tp_decode.py [--rounds 3] [--batch 1] [--settings tp1,tp3,tp3-gloo]
    .venv/bin/python bench/tp_decode.py --prefill --prompt-len 384 --settings tp3-nosp,tp3-sp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "tp1": (1, {}),
    "tp2": (2, {}),
    "tp3": (3, {}),
    "tp3-gloo": (3, {"INGOT_CPU_SHM_ALLREDUCE": "0"}),
    # --prefill: sequence-parallel prefill on and off (buckets that split over 3 ranks).
    "tp3-sp": (3, {"SP": "1"}),
    "tp3-nosp": (3, {"SP": "0"}),
}


def child(tp: int, batch: int, prompt_len: int, new_tokens: int, dtype: str,
          model: str | None, prefill: bool = False) -> None:
    from ingot import LLM, SamplingParams

    kw = {"model": model} if model else {}
    if prefill:
        kw.update(max_num_batched_tokens=768, additional_config={
            "num_batched_tokens_buckets": [384, 768],
            "sequence_parallel_prefill": os.environ.get("SP") == "1"})
    llm = LLM(tensor_parallel_size=tp, dtype=dtype, max_model_len=1024, max_num_seqs=batch,
              **kw)
    engine = llm.llm_engine
    if prefill:  # the first step of a fresh prompt each time (no cached prefix)
        times = []
        for k in range(8):
            engine.add_request(None, [100 + (k * 131 + j * 7) % 4000 for j in range(prompt_len)],
                               SamplingParams(temperature=0, max_tokens=1))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        sp = engine.collective_rpc("startup_stats")[0].get("sequence_parallel_prefill")
        engine.shutdown()
        print("RESULT " + json.dumps({"median_s": statistics.median(times[2:]),
                                      "steps": len(times), "collectives": f"sp={sp}"}))
        return
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [100 + (i * 7 + j) % 4000 for j in range(prompt_len)], params)
    times = []
    while engine.has_unfinished_requests():
        steps = engine.get_stats()["buckets"].decode
        before = sum(c.executions for c in steps.values())
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if sum(c.executions for c in engine.get_stats()["buckets"].decode.values()) > before:
            times.append(elapsed)
    collectives = engine.collective_rpc("startup_stats")[0].get("tp_collectives")
    engine.shutdown()
    print("RESULT " + json.dumps({"median_s": statistics.median(times[2:]),
                                  "steps": len(times), "collectives": collectives}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--settings", default="tp1,tp3,tp3-gloo")
    parser.add_argument("--prefill", action="store_true",
                        help="time prefill steps of --prompt-len tokens instead (tp3-sp, tp3-nosp)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.batch, args.prompt_len, args.new_tokens, args.dtype, args.model,
              args.prefill)
        return
    names = args.settings.split(",")
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            tp, env = SETTINGS[name]
            cmd = [sys.executable, __file__, "--child", str(tp), "--batch", str(args.batch),
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                   "--dtype", args.dtype] + (["--prefill"] if args.prefill else [])
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                 check=True).stdout
            line = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
            results[name].append(line["median_s"])
            print(f"round {r} {name}: {line['median_s'] * 1e3:.1f} ms/step "
                  f"({line['steps']} steps, collectives {line['collectives']})", flush=True)
    base = statistics.median(results[names[0]])
    what = f"prefill of {args.prompt_len} tokens" if args.prefill else f"decode, batch {args.batch}"
    print(f"\n{what}, {args.dtype}, median over {args.rounds} rounds (each a child's median step)")
    print("| setting | step ms | vs " + names[0] + " |")
    print("|---|---|---|")
    for name in names:
        med = statistics.median(results[name])
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
