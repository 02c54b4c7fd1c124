"""Prefix caching on a shared system prompt: token hit rate and time to first token.

50 requests share a 512-token system prompt, each followed by its own 16-token question; each
request is sent alone (so time to first token is its prefill, not queueing) to an engine with
prefix caching on and to one with it off, interleaved. Reports the median TTFT of each, their
ratio, and the hit rate over the shared part.

    .venv/bin/python bench/prefix_caching.py [--requests 50] [--shared 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ingot import LLM, SamplingParams


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    engine = llm.llm_engine
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while True:
        outs = engine.step()
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            elapsed = time.perf_counter() - start
            cached = next(o.num_cached_tokens for o in outs if o.request_id == rid)
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed, cached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--shared", type=int, default=512)
    parser.add_argument("--question", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(args.shared)]
    prompts = [
        shared + [rng.randrange(100, 40000) for _ in range(args.question)]
        for _ in range(args.requests)
    ]
    kw = dict(max_model_len=2048, max_num_seqs=8)
    engines = {"on": LLM(enable_prefix_caching=True, **kw), "off": LLM(enable_prefix_caching=False, **kw)}
    times: dict[str, list[float]] = {"on": [], "off": []}
    cached_tokens = 0
    for i, prompt in enumerate(prompts):
        for name, llm in engines.items():
            t, cached = ttft(llm, prompt)
            if i > 0:  # the first request fills the cache
                times[name].append(t)
                if name == "on":
                    cached_tokens += min(cached, args.shared)
    hit_rate = cached_tokens / (args.shared * (args.requests - 1))
    on, off = statistics.median(times["on"]) * 1e3, statistics.median(times["off"]) * 1e3
    print(
        f"RESULT workload=prefix_caching requests={args.requests} shared={args.shared} "
        f"question={args.question} shared_hit_rate={hit_rate:.3f} ttft_ms_on={on:.1f} "
        f"ttft_ms_off={off:.1f} speedup={off / on:.2f}"
    )


if __name__ == "__main__":
    main()
