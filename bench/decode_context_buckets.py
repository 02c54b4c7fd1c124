"""How much decode time context-length bucketing saves at max_model_len 8192, short contexts.

Runs the default model (bf16 where supported) with decode_context_length_buckets off (every
decode step reads KV for all 8192 positions) and on, interleaved, and reports the median decode
step time of each and their ratio.

    .venv/bin/python bench/decode_context_buckets.py [--batch 8] [--prompt-len 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ingot import LLM, SamplingParams

CTX_BUCKETS = [256, 512, 1024, 2048, 4096]


def decode_step_times(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> list[float]:
    """Wall time of every decode-only engine step of one batch."""
    engine = llm.llm_engine
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
            times.append(elapsed)  # a decode step (the bucket counters moved)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engines = {
        "off": LLM(
            max_model_len=8192,
            dtype=args.dtype,
            max_num_seqs=args.batch,
            additional_config={"decode_context_length_buckets": None},  # the default is on
        ),
        "on": LLM(
            max_model_len=8192,
            dtype=args.dtype,
            max_num_seqs=args.batch,
            additional_config={"decode_context_length_buckets": CTX_BUCKETS},
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):  # interleaved, so machine noise hits both alike
        for name, llm in engines.items():
            samples[name] += decode_step_times(llm, args.batch, args.prompt_len, args.new_tokens)
    off, on = (statistics.median(samples[k]) * 1e3 for k in ("off", "on"))
    print(
        f"RESULT workload=decode_ctx_buckets batch={args.batch} prompt_len={args.prompt_len} "
        f"max_model_len=8192 step_ms_off={off:.2f} step_ms_on={on:.2f} speedup={off / on:.2f}"
    )


if __name__ == "__main__":
    main()
