"""The batch-size sweep on vLLM's CPU backend (the peer), in one process.

Runs inside the peer's virtual environment (ingot is not installed there), so the seeded prompt
generator is a copy of ../shared/bench/vllm_workloads.py's prompts_for (a unit test checks the
copies agree), and the engine settings are that script's:

    ~/.cache/ingot-peer/vllm/bin/python bench/peer_sweep.py MODEL_DIR --batch-sizes 1,4,16,64

Prints the startup line and one line per batch size, in `ingot bench sweep`'s format:
  RESULT workload=sweep engine=vllm requests=B input_len=128 output_len=64 time_s=... ...
"""

from __future__ import annotations

import argparse
import random
import time

# Same defaults as ingot.benchmarks.workloads.SWEEP_* (a unit test checks they agree).
SWEEP_BATCH_SIZES = (1, 4, 16, 64)
SWEEP_INPUT_LEN = 128
SWEEP_OUTPUT_LEN = 64


def prompts_for(n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Copy of the peer script's (and ingot's) seeded prompt generator."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default=",".join(map(str, SWEEP_BATCH_SIZES)))
    ap.add_argument("--input-len", type=int, default=SWEEP_INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=SWEEP_OUTPUT_LEN)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=64, max_num_batched_tokens=2048,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"RESULT workload=startup engine=vllm time_s={time.perf_counter() - t0:.2f}", flush=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
    inp, out = args.input_len, args.output_len
    for n in sizes:
        prompts = [{"prompt_token_ids": p} for p in prompts_for(n, inp)]
        sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        print(f"RESULT workload=sweep engine=vllm requests={n} input_len={inp} output_len={out} "
              f"time_s={dt:.3f} output_tok_s={gen / dt:.1f} total_tok_s={(gen + n * inp) / dt:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
