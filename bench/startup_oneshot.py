"""Start-up of a one-shot command: `ingot generate "The capital of France is"` on the default
model, from process start to ready (engine built), first token and exit.

Each run is a fresh process (``python bench/startup_oneshot.py --child ...``) that runs the
real CLI with timers wrapped around the start-up phases: weight loading (``load_model``, and
``bind``, which packs the weights for the kernels), KV cache allocation
(``allocate_kv_cache``), warmup (``EagerProgram.warm_up``, worker/execution/program.py), and the
first engine step that produced a token. ``--server-sized`` passes the engine defaults a server
uses (max_num_seqs 256, token budget 2048) as flags, which is what `generate` ran before it was
sized to its one prompt.

    python bench/startup_oneshot.py --runs 3            # one-shot sizing (the default)
    python bench/startup_oneshot.py --runs 1 --server-sized
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"
SERVER_SIZED = ["--max-num-seqs", "256", "--max-num-batched-tokens", "2048"]


def child(spawned_at: float, extra: list[str]) -> None:
    """Run `ingot generate` in this process with phase timers; print one JSON line."""
    from ingot.cli import main as cli
    from ingot.engine.llm_engine import LLMEngine
    from ingot.entrypoints.llm import LLM
    from ingot.worker import worker
    from ingot.worker.execution import program

    imported = time.time()  # interpreter start + ingot, torch and the engine's modules

    phases: dict[str, float] = {}
    marks: dict[str, float] = {}

    def timed(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(worker, "load_model", "load_s")
    timed(worker, "bind", "load_s")  # packing the weights for the kernels: part of loading
    timed(worker, "allocate_kv_cache", "kv_alloc_s")
    timed(program.EagerProgram, "warm_up", "warmup_s")
    llm_init = LLM.__init__

    def init(self: LLM, *args: object, **kwargs: object) -> None:
        llm_init(self, *args, **kwargs)
        marks["ready"] = time.time()

    LLM.__init__ = init  # type: ignore[method-assign]
    step = LLMEngine.step

    def first_token_step(self: LLMEngine) -> object:
        outputs = step(self)
        if "first_token" not in marks and any(c.token_ids for o in outputs for c in o.outputs):
            marks["first_token"] = time.time()
        return outputs

    LLMEngine.step = first_token_step  # type: ignore[method-assign]
    rc = cli.main(["--log-level", "warning", "generate", PROMPT, "--max-tokens", "8", *extra])
    done = time.time()
    print(json.dumps({
        "rc": rc,
        "imports_s": imported - spawned_at,
        **phases,
        "ready_s": marks["ready"] - spawned_at,
        "first_token_s": marks["first_token"] - spawned_at,
        "total_s": done - spawned_at,
    }), flush=True)


def run_once(extra: list[str]) -> dict[str, float]:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", repr(start), *extra],
        capture_output=True, text=True, env=os.environ,
    )
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["text"] = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    return result


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(float(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-sized", action="store_true",
                        help="pass the server's engine sizes (what generate used before)")
    ns = parser.parse_args()
    extra = SERVER_SIZED if ns.server_sized else []
    results = [run_once(extra) for _ in range(ns.runs)]
    keys = ["imports_s", "load_s", "kv_alloc_s", "warmup_s", "ready_s", "first_token_s",
            "total_s", "wall_s"]
    label = "server-sized" if ns.server_sized else "one-shot"
    for i, r in enumerate(results, 1):
        print(f"run {i} ({label}): " + " ".join(f"{k}={r.get(k, 0.0):.2f}" for k in keys))
    median = {k: statistics.median(r.get(k, 0.0) for r in results) for k in keys}
    print(f"RESULT workload=startup_generate mode={label} runs={len(results)} "
          + " ".join(f"{k}={v:.2f}" for k, v in median.items()))


if __name__ == "__main__":
    main()
