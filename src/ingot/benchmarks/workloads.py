"""`ingot bench offline|single|prefill`: the shared workloads of ../shared/bench/vllm_workloads.py
(same prompts as token ids, same RESULT line format), so ingot and the peer do identical work.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ingot.config import EngineArgs

WORKLOADS: dict[str, tuple[int, int, int]] = {
    # name: (requests, input_len, output_len)
    "offline": (64, 128, 128),  # throughput under continuous batching
    "single": (1, 128, 128),  # one stream, decode bound
    "prefill": (1, 1024, 1),  # long prompt, time to first token
}


def prompts_for(n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Identical to the peer script's prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(n)]


def result_line(name: str, n: int, inp: int, out: int, seconds: float, generated: int) -> str:
    return (
        f"RESULT workload={name} engine=ingot requests={n} input_len={inp} output_len={out} "
        f"time_s={seconds:.3f} output_tok_s={generated / seconds:.1f} "
        f"total_tok_s={(generated + n * inp) / seconds:.1f}"
    )


def run_workloads(engine_args: EngineArgs, names: list[str], progress: bool = True) -> list[str]:
    from ingot import LLM, SamplingParams

    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    lines = []
    start = time.perf_counter()
    kwargs: dict[str, Any] = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(engine_args.model, **kwargs)
    lines.append(f"RESULT workload=startup engine=ingot time_s={time.perf_counter() - start:.2f}")
    print(lines[-1], flush=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
    for name in names:
        n, inp, out = WORKLOADS[name]
        prompts = [{"prompt_token_ids": p} for p in prompts_for(n, inp)]
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=progress and n > 1)
        seconds = time.perf_counter() - t
        generated = sum(len(r.outputs[0].token_ids) for r in results)
        lines.append(result_line(name, n, inp, out, seconds, generated))
        print(lines[-1], flush=True)
    return lines
