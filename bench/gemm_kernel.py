"""Per-linear GEMM kernels on the default model's linear shapes, one process, kernels
alternating within each repeat (median of the repeats).

``--dtype bfloat16`` (default): ingot's bf16 GEMM (cpu_kernels.c, ``ingot_gemm_bf16``) against
oneDNN's packed bf16 linear (where this CPU has it: AVX512-BF16 / AMX; skipped elsewhere) and
ingot's GEMV. ``--dtype float32``: MKL's sgemm (``F.linear`` on the plain weight, what a float32
linear runs unpacked) against oneDNN's packed float32 linear as ingot packs it
(``LinearBase.pack_f32_weight``); ``onednn_over_mkl`` < 1 is oneDNN faster.

  .venv/bin/python bench/gemm_kernel.py --threads 1
  .venv/bin/python bench/gemm_kernel.py --threads 2 --rows 1,2,3,4,16,64,256,1024
  .venv/bin/python bench/gemm_kernel.py --dtype float32 --layers 30 --threads 1 \
      --rows 1,2,4,16,64,128,512,1024
  .venv/bin/python bench/gemm_kernel.py --dtype float32 --pass --layers 30 --threads 2 \
      --rows 1,2,4,16,64 --repeats 9

Prints one RESULT line per (shape, rows) with microseconds (per weight) and GFLOP/s per kernel.
On a machine shared with other jobs, time one thread (``--threads 1``, ``--clock cpu`` for
its CPU time): two threads' parallel regions stall whenever another job preempts one of them,
which swamps the kernels' difference (multi-ms steps at the scheduler's time slices).

float32 on an AMD EPYC (Zen 3, 2 vCPUs under KVM, AVX2 + FMA), 2026-12-03, time of oneDNN's
packed linear / MKL's sgemm (< 1: oneDNN faster):

  ``--pass --layers 30`` (a decode step's linears: 30 layers' weights streamed from memory,
  the LM head), 3 runs each started when the machine was quiet (load < 0.8), medians:
    rows        1     2     4     16    64
    2 threads   0.80  0.42  0.43  0.60  0.70   (runs: 0.76-0.83 at 1 row; MKL ~69 ms a pass)
    1 thread    1.17  0.59  0.70  0.75  0.80   (runs: 1.09-1.25 at 1 row; MKL ~65 ms a pass)

  per shape, ``--layers 30 --threads 1``, median of 3 interleaved runs (load ~2):
    rows   qkv   o     gate_up  down  lm_head
    1      1.10  1.20  1.09     1.68  0.96
    2      0.70  0.86  0.62     1.07  0.50
    16     0.85  1.05  0.77     0.96  0.57
    128    0.98  1.02  0.89     1.05  0.60
    1024   0.88  0.83  0.85     1.02  -

oneDNN wins at every row count on both cores (ingot's thread count on a quiet machine) and
from 2 rows on one thread; it loses only single-stream decode on one thread (what ingot's
adaptive threads drop to while other processes hold the CPUs). One kernel at every row count
is what ``binding.select_kernels`` packs for a float32 model on such a CPU
(``onednn_f32_preferred``): choosing by row count would keep a plain copy of every weight
beside the packed one, and its rows would no longer be batch-invariant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn import functional as F

from ingot.model_executor.layers import cpu_kernels as ck
from ingot.model_executor.layers.linear import cpu_packed_linear_supported

# The default model's (SmolLM2-135M) linears: qkv, o, gate-up, down, the tied LM head.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _time(fn, reps: int, clock=time.perf_counter) -> float:  # noqa: ANN001
    fn()
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps


def _bf16_runs(kernels, w: torch.Tensor, x: torch.Tensor, rows: int) -> dict:  # noqa: ANN001
    n = w.shape[0]
    gemm_w, gemv_w = ck.pack_gemm_weight(kernels, w), ck.pack_gemv_weight(w)
    runs = {"gemm": lambda: ck.gemm_bf16(kernels, x, gemm_w, n)}
    if cpu_packed_linear_supported(w.dtype, w.device):
        onednn_w = torch.ops.mkldnn._reorder_linear_weight(w)
        runs["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, onednn_w, None, "none", [], "")
    if rows <= 8:
        runs["gemv"] = lambda: ck.gemv_bf16(kernels, x, gemv_w, n)
    return runs


def _f32_runs(ws: list[torch.Tensor], x: torch.Tensor) -> dict:
    # Each timed call runs every copy in turn (--layers): a model's pass streams each layer's
    # weight from memory, where one weight timed alone stays in cache.
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]  # as pack_f32_weight

    def mkl() -> None:
        for w in ws:
            F.linear(x, w)

    def onednn() -> None:
        for p in packed:
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    return {"mkl": mkl, "onednn": onednn}


def _f32_pass(ns: argparse.Namespace) -> None:
    """``--pass``: one timed call is a decode step's linears, every layer's four (distinct
    weights, ``--layers`` of them) and the LM head, on MKL then on oneDNN, pair after pair."""
    layers = [[torch.randn(*SHAPES[s]) for s in ("qkv", "o", "gate_up", "down")]
              for _ in range(ns.layers)]
    weights = [w for layer in layers for w in layer] + [torch.randn(*SHAPES["lm_head"])]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    for rows in (int(r) for r in ns.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        runs = {"mkl": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
                "onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(
                    x, p, None, "none", [], "") for x, p in zip(xs, packed, strict=True)]}
        times: dict[str, list[float]] = {kind: [] for kind in runs}
        for _ in range(ns.repeats):
            for kind, fn in runs.items():
                times[kind].append(_time(fn, 1))
        pairs = statistics.median(o / m for m, o in zip(times["mkl"], times["onednn"],
                                                                  strict=True))
        fields = " ".join(f"{kind}_ms={statistics.median(t) * 1e3:.1f}"
                          for kind, t in times.items())
        print(f"RESULT shape=pass layers={ns.layers} rows={rows} {fields} "
              f"onednn_over_mkl={pairs:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,8,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gflop", type=float, default=0.2, help="work per timing")
    ap.add_argument("--layers", type=int, default=1,
                    help="float32: distinct copies of each weight a timed call runs in turn, as "
                         "a model's layers do (30: the default model; the LM head stays one)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (--threads 1 on a shared machine: time "
                         "spent preempted by other jobs does not count)")
    ap.add_argument("--pass", dest="decode_pass", action="store_true",
                    help="float32: time whole decode passes (every layer's linears and the LM "
                         "head) instead of one shape at a time; the ratio is the median of the "
                         "per-pair ratios")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="of the repeats (min: the uncontended moments of a busy machine)")
    ns = ap.parse_args()
    dtype = getattr(torch, ns.dtype)
    kernels = ck.load_cpu_kernels() if dtype == torch.bfloat16 else None
    if dtype == torch.bfloat16 and kernels is None:
        raise SystemExit("ingot's CPU kernels do not build here (no C compiler)")
    if ns.clock == "cpu" and ns.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread: use it with --threads 1")
    clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
    torch.set_num_threads(ns.threads)
    print(f"LOAD before={os.getloadavg()} threads={ns.threads} dtype={ns.dtype} "
          f"clock={ns.clock} stat={ns.stat}", flush=True)
    if ns.decode_pass:
        if dtype != torch.float32:
            raise SystemExit("--pass compares the float32 kernels: use it with --dtype float32")
        _f32_pass(ns)
        print(f"LOAD after={os.getloadavg()}", flush=True)
        return
    for name in ns.shapes.split(","):
        n, k = SHAPES[name]
        copies = 1 if kernels is not None or name == "lm_head" else ns.layers
        ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        w = ws[0]
        for rows in (int(r) for r in ns.rows.split(",")):
            if name == "lm_head" and rows > 256:
                continue
            x = torch.randn(rows, k).to(dtype)
            runs = _bf16_runs(kernels, w, x, rows) if kernels is not None else _f32_runs(ws, x)
            flops = 2 * rows * n * k * copies
            reps = max(2, int(ns.gflop * 1e9 / flops))
            times: dict[str, list[float]] = {kind: [] for kind in runs}
            for _ in range(ns.repeats):  # kernels alternate within each repeat
                for kind, fn in runs.items():
                    times[kind].append(_time(fn, reps, clock))
            stat = min if ns.stat == "min" else statistics.median
            med = {kind: stat(t) for kind, t in times.items()}
            fields = " ".join(f"{kind}_us={t / copies * 1e6:.0f} "
                              f"{kind}_gflops={flops / t / 1e9:.0f}" for kind, t in med.items())
            base = "gemm" if kernels is not None else "mkl"
            ratio = (f" onednn_over_{base}={med['onednn'] / med[base]:.2f}"
                     if "onednn" in med else "")
            print(f"RESULT shape={name} n={n} k={k} rows={rows} copies={copies} {fields}{ratio}",
                  flush=True)
    print(f"LOAD after={os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
