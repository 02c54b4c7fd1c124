"""llama.cpp's ``llama-bench`` on a GGUF file, as RESULT lines bench/compare.py reads.

    .venv/bin/python bench/llama_bench.py "$(bench/llama_cpp.sh)/llama-bench"        # default model
    .venv/bin/python bench/llama_bench.py PATH/llama-bench --model some.gguf --threads 2

Runs ``llama-bench -n 128`` and ``-p 1024`` (``-r REPEATS -o json``; llama.cpp's own tg128 and
pp1024: 128 tokens generated one at a time from an empty context, and a 1024-token prompt
processed in one batch) with as many threads as this process may use, each test in its own run,
rerun with ``--repack 0`` (llama.cpp's weights as the file has them) where its default crashes,
which the RESULT line then says (``repack=0``), and prints::

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
    base = [args.llama_bench, "-m", model, "-t", str(args.threads), "-r", str(args.repeats),
            "-o", "json"]
    lines: list[str] = []
    # One test per run: a crash of one (llama.cpp's repacked AMX path segfaulted at pp on a
    # Xeon with AMX, build 11434) must not lose the other.
    for test in (["-p", "0", "-n", str(GEN)], ["-p", str(PROMPT), "-n", "0"]):
        for extra in ([], ["--repack", "0"]):
            cmd = base + test + extra
            print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
            if proc.returncode == 0:
                note = " repack=0" if extra else ""
                lines += [line + note for line in results_lines(json.loads(proc.stdout),
                                                                args.threads)]
                break
            print(f"llama-bench exited with {proc.returncode}"
                  + ("" if extra else "; again without its repacked weights (--repack 0)"),
                  file=sys.stderr, flush=True)
    print(f"RESULT workload=llama_file engine=llama.cpp model={os.path.basename(model)}")
    print("\n".join(lines), flush=True)
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
