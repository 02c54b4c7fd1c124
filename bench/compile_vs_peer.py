"""Compiled ingot (cold, then warm compile cache), eager ingot and the peer (vLLM's CPU backend)
on the shared offline and single-stream workloads, with each one's startup, in one run.

Each setting is its own process, in this order: compiled with an empty compile cache (it
compiles the whole grid before reporting ready), compiled again on the cache it left, eager,
then the peer at its default thread setting. Every ingot setting uses `ingot bench`'s defaults
(bf16, max_model_len 2048, 64 sequences), as the peer script does.

    .venv/bin/python bench/compile_vs_peer.py [--model-dir ~/.cache/ingot/smollm2-hf]

Prints the RESULT lines as they come and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from compare import (  # noqa: E402
    DEFAULT_MODEL_DIR,
    DEFAULT_PEER_PYTHON,
    SHARED_BENCH,
    ensure_model_dir,
    parse_results,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--peer-python", type=Path, default=DEFAULT_PEER_PYTHON)
    args = ap.parse_args()
    ensure_model_dir(args.model_dir)
    cache = tempfile.mkdtemp(prefix="ingot-compile-vs-peer-")
    ingot = [sys.executable, "-m", "ingot.cli.main", "bench", "--no-progress"]
    steps = [
        ("ingot compiled, cold cache", [*ingot, "offline,single", "--compile", "--cache-dir", cache]),
        ("ingot compiled, warm cache", [*ingot, "single", "--compile", "--cache-dir", cache]),
        ("ingot eager", [*ingot, "offline,single"]),
        ("vLLM, default threads", ["bash", str(SHARED_BENCH / "vllm_peer.sh"), str(args.model_dir),
                                   "--workloads", "offline,single"]),
    ]
    rows = []
    for label, argv in steps:
        print(f"== {label}: {' '.join(argv)}", flush=True)
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        results = {r["workload"]: r for r in parse_results(proc.stdout)}
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT"):
                print(line, flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], flush=True)
        rows.append((label, results))
    print("\n| setting | startup s | offline total tok/s | single output tok/s |")
    print("|---|---|---|---|")
    def get(results: dict, workload: str, key: str) -> str:
        value = results.get(workload, {}).get(key)
        return "" if value is None else f"{value:g}"

    for label, r in rows:
        print(f"| {label} | {get(r, 'startup', 'time_s')} | {get(r, 'offline', 'total_tok_s')} | "
              f"{get(r, 'single', 'output_tok_s')} |")


if __name__ == "__main__":
    main()
