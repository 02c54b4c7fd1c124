"""llama.cpp's ``llama-bench`` on a GGUF file, as RESULT lines bench/compare.py reads.

    .venv/bin/python bench/llama_bench.py "$(bench/llama_cpp.sh)/llama-bench"        # default model
    .venv/bin/python bench/llama_bench.py PATH/llama-bench --model some.gguf --threads 2

Runs ``llama-bench -p 1024 -n 128 -r REPEATS -o json`` (llama.cpp's own pp1024 and tg128: a
1024-token prompt processed in one batch, and 128 tokens generated one at a time from an empty
context) with as many threads as this process may use, and prints::

    RESULT workload=llama_tg engine=llama.cpp n_gen=128 output_tok_s=... threads=2
    RESULT workload=llama_pp engine=llama.cpp n_prompt=1024 tok_s=... time_s=... threads=2

llama.cpp is a benchmark peer, never a dependency of ingot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

PROMPT, GEN = 1024, 128


def results_lines(records: Sequence[dict[str, Any]], threads: int) -> list[str]:
    """RESULT lines from llama-bench's JSON records (one per test: pp or tg)."""
    out = []
    for r in records:
        ts = float(r["avg_ts"])
        if int(r.get("n_gen", 0)) > 0 and int(r.get("n_prompt", 0)) == 0:
            out.append(f"RESULT workload=llama_tg engine=llama.cpp n_gen={int(r['n_gen'])} "
                       f"output_tok_s={ts:.2f} threads={threads}")
        elif int(r.get("n_prompt", 0)) > 0 and int(r.get("n_gen", 0)) == 0:
            n = int(r["n_prompt"])
            out.append(f"RESULT workload=llama_pp engine=llama.cpp n_prompt={n} "
                       f"tok_s={ts:.2f} time_s={n / ts:.4f} threads={threads}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_bench", help="path of the llama-bench binary (bench/llama_cpp.sh)")
    ap.add_argument("--model", default=None, help="GGUF file (default: ingot's default model)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        model = str(default_model_path())
    cmd = [args.llama_bench, "-m", model, "-p", str(PROMPT), "-n", str(GEN), "-t",
           str(args.threads), "-r", str(args.repeats), "-o", "json"]
    print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"llama-bench exited with {proc.returncode}", file=sys.stderr)
        return proc.returncode
    lines = results_lines(json.loads(proc.stdout), args.threads)
    print(f"RESULT workload=llama_file engine=llama.cpp model={os.path.basename(model)}")
    print("\n".join(lines), flush=True)
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
