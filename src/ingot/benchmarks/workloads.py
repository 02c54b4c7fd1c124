"""`ingot bench offline|single|prefill`: the shared workloads of ../shared/bench/vllm_workloads.py
(same prompts as token ids, same RESULT line format), so ingot and the peer do identical work.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from ingot.engine.arg_utils import EngineArgs

logger = logging.getLogger("ingot")

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


# The batch-size sweep (`ingot bench sweep`, bench/peer_sweep.py for the peer): B requests of
# 128 prompt tokens and SWEEP_OUTPUT_LEN new tokens, all submitted at once, for each B. 64 new
# tokens (not 128) keep one engine's sweep near a minute on 2 cores, so compare.py can run
# ingot plus the peer at two thread settings in a few minutes; decode still dominates the time.
SWEEP_BATCH_SIZES: tuple[int, ...] = (1, 4, 16, 64)
SWEEP_INPUT_LEN = 128
SWEEP_OUTPUT_LEN = 64


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,4,16,64"`` -> [1, 4, 16, 64]; every size must be a positive integer."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be a comma list of integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def result_line(name: str, n: int, inp: int, out: int, seconds: float, generated: int) -> str:
    return (
        f"RESULT workload={name} engine=ingot requests={n} input_len={inp} output_len={out} "
        f"time_s={seconds:.3f} output_tok_s={generated / seconds:.1f} "
        f"total_tok_s={(generated + n * inp) / seconds:.1f}"
    )


def decode_rate(results: list[Any]) -> str:
    """`` decode_tok_s=X`` for one stream: its tokens after the first over the time from the
    first to the last (llama.cpp's tg128 times generation alone, without the prompt); "" for
    several requests or without the request's timestamps."""
    if len(results) != 1 or results[0].metrics is None:
        return ""
    metrics, generated = results[0].metrics, len(results[0].outputs[0].token_ids)
    first, last = metrics.first_token_time, metrics.finished_time
    if first is None or last is None or generated < 2 or last <= first:
        return ""
    return f" decode_tok_s={(generated - 1) / (last - first):.1f}"


def ran_with(llm: Any) -> str:
    """``dtype=bfloat16 kernels=avx2``: the model's dtype and the builds of ingot's CPU
    libraries its layers run (``kernels=none``: torch ops only; ``bf16:avx2,f32:avx2`` where
    the layers run both libraries), as the worker bound them."""
    builds = llm.llm_engine.startup_stats()["cpu_kernels"]
    isas = set(builds.values())
    kernels = (next(iter(isas)) if len(isas) == 1
               else ",".join(f"{lib}:{isa}" for lib, isa in builds.items()) or "none")
    return f"dtype={str(llm.llm_engine.model_config.dtype).removeprefix('torch.')} " \
           f"kernels={kernels}"


def run_workloads(
    engine_args: EngineArgs,
    names: list[str],
    progress: bool = True,
    batch_sizes: list[int] | None = None,
    sweep_output_len: int = SWEEP_OUTPUT_LEN,
    contend: int = 0,
) -> list[str]:
    """Run the named workloads on one engine; ``sweep`` runs one batch per ``batch_sizes``
    entry and prints ``RESULT workload=sweep requests=B ...`` for each. ``contend`` competing
    CPU-bound processes run from after start-up to the end of the last workload (their count
    is the RESULT lines' ``contend=`` field)."""
    from ingot import LLM, SamplingParams
    from ingot.benchmarks.contend import check_contend, contention

    check_contend(contend)

    unknown = [n for n in names if n not in WORKLOADS and n != "sweep"]
    if unknown:
        raise ValueError(
            f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}, sweep, serve"
        )
    runs: list[tuple[str, int, int, int]] = []
    for name in names:
        if name == "sweep":
            sizes = batch_sizes or list(SWEEP_BATCH_SIZES)
            runs += [("sweep", b, SWEEP_INPUT_LEN, sweep_output_len) for b in sizes]
        else:
            runs.append((name, *WORKLOADS[name]))
    lines = []
    start = time.perf_counter()
    kwargs: dict[str, Any] = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(engine_args.model, **kwargs)
    lines.append(f"RESULT workload=startup engine=ingot time_s={time.perf_counter() - start:.2f} "
                 + ran_with(llm))
    print(lines[-1], flush=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
    with contention(contend):
        for i, (name, n, inp, out) in enumerate(runs, start=1):
            # A workload runs for up to minutes: say what is running (the RESULT line follows
            # it); a multi-request run also gets the LLM's bar on a terminal.
            logger.info("bench %d/%d: %s, %d request(s) of %d prompt -> %d new tokens", i,
                        len(runs), name, n, inp, out)
            prompts = [{"prompt_token_ids": p} for p in prompts_for(n, inp)]
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=progress and n > 1)
            seconds = time.perf_counter() - t
            generated = sum(len(r.outputs[0].token_ids) for r in results)
            lines.append(result_line(name, n, inp, out, seconds, generated)
                         + decode_rate(results) + (f" contend={contend}" if contend else ""))
            print(lines[-1], flush=True)
    return lines
