"""ingot's bf16 GEMM (cpu_kernels.c, ``ingot_gemm_bf16``) against oneDNN's packed bf16 linear
and ingot's GEMV, on the default model's linear shapes, one process, kernels alternating
within each repeat (median of the repeats).

  .venv/bin/python bench/gemm_kernel.py --threads 1
  .venv/bin/python bench/gemm_kernel.py --threads 2 --rows 1,2,3,4,16,64,256,1024

Prints one RESULT line per (shape, rows) with microseconds and GFLOP/s per kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ingot.model_executor.layers import cpu_kernels as ck

# The default model's (SmolLM2-135M) linears: qkv, o, gate-up, down, the tied LM head.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _time(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,8,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ns = ap.parse_args()
    kernels = ck.load_cpu_kernels()
    if kernels is None:
        raise SystemExit("ingot's CPU kernels do not build here (no C compiler)")
    torch.set_num_threads(ns.threads)
    print(f"LOAD before={os.getloadavg()} threads={ns.threads}", flush=True)
    for name in ns.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k).to(torch.bfloat16)
        gemm_w, gemv_w = ck.pack_gemm_weight(kernels, w), ck.pack_gemv_weight(w)
        onednn_w = torch.ops.mkldnn._reorder_linear_weight(w)
        for rows in (int(r) for r in ns.rows.split(",")):
            if name == "lm_head" and rows > 256:
                continue
            x = torch.randn(rows, k).to(torch.bfloat16)
            runs = {
                "gemm": lambda x=x, w=gemm_w, n=n: ck.gemm_bf16(kernels, x, w, n),
                "onednn": lambda x=x, w=onednn_w: torch.ops.mkldnn._linear_pointwise(
                    x, w, None, "none", [], ""),
            }
            if rows <= 8:
                runs["gemv"] = lambda x=x, w=gemv_w, n=n: ck.gemv_bf16(kernels, x, w, n)
            reps = max(2, int(2e8 / (2 * rows * n * k)))  # ~0.2 GFLOP per timing
            times: dict[str, list[float]] = {kind: [] for kind in runs}
            for _ in range(ns.repeats):  # kernels alternate within each repeat
                for kind, fn in runs.items():
                    times[kind].append(_time(fn, reps))
            flops = 2 * rows * n * k
            fields = " ".join(
                f"{kind}_us={statistics.median(t) * 1e6:.0f} "
                f"{kind}_gflops={flops / statistics.median(t) / 1e9:.0f}"
                for kind, t in times.items())
            ratio = statistics.median(times["onednn"]) / statistics.median(times["gemm"])
            print(f"RESULT shape={name} n={n} k={k} rows={rows} {fields} "
                  f"onednn_over_gemm={ratio:.2f}", flush=True)
    print(f"LOAD after={os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
