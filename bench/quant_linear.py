"""Quantized-weight linears on the default model's real shapes (issue #33's first measurement):
the kept library options against ingot's bf16 path as served today, timed interleaved on the
GGUF's own weights, with each option's numerical error against the GGUF's dequantization.

    .venv/bin/python bench/quant_linear.py                       # everything (~30 minutes)
    .venv/bin/python bench/quant_linear.py --threads 1 --clock thread   # on a loaded machine
    .venv/bin/python bench/quant_linear.py --shapes qkv,lm_head --rows 1,4 --repeats 5
    PYTHONPATH=/tmp/torchao-pkgs .venv/bin/python bench/quant_linear.py   # + torchao's layouts

Shapes are layer 0's linears, fused as ingot fuses them (qkv = q + k + v rows, gate_up), read
from the GGUF (``--model``; default: ingot's default model) with their own blocks, plus the tied
LM head (the Q8_0 token embedding, 49152 x 576). Rows 1, 2, 4 are decode; 128, 512 prefill (the
LM head is skipped past 4 rows: a prefill takes logits of its last token only). Every timed
call reads the next of several copies of its weight, ``--cold-mib`` of them together (default
128, four times this CPU's 32 MiB L3), so the weights come from memory as a decode step's do
(30 layers and the head are 96 MB), not from the cache a repeated call would leave them in.
Variants alternate within each repeat; figures are medians over ``--repeats`` (other
processes share the 2 CPUs, so timings are interleaved and repeated).

Variants:
  bf16_ingot  ingot's path today: the GGUF dequantized, then bf16, ingot's GEMV (rows <= 2 on
              CPUs without AMX, GEMV_MAX_ROWS_BESIDE_GEMM) or GEMM (linear.py's choice).
  f32_torch   float32 ``F.linear`` (MKL) on the dequantized weights.
  int4_f32 / int4_bf16   ``aten._weight_int4pack_mm_for_cpu`` at group 32 (float32 / bf16
              activations and scales): Q4_1 maps onto it exactly (q in 0..15, scale d, zero
              m + 8 d, since the op computes (q - 8) * scale + zero). Q4_1 tensors only.
  int8_f32 / int8_bf16   ``aten._weight_int8pack_mm``: int8 weights with one scale per output
              row. Q8_0 has a scale per 32 weights and Q4_1 a scale and min per 32, so both are
              requantized per row from the dequantized weights: not the file's numbers.
  int8_dyn    int8 activations (symmetric, per row) x the per-row int8 weights above on
              ``torch._int_mm`` (oneDNN's u8s8 GEMM; torchao's Int8DynamicActivationInt8Weight
              runs the same call): requantized, as int8_*.
  q_ingot     ingot's own kernel (cpu_kernels_quant.c): the file's blocks repacked 8 rows
              interleaved, activations quantized per 32 to int8 (Q8_1: scale and sum), integer
              dot products. Q4_0 / Q4_1 / Q8_0; when that library builds.
  torchao_int4 / torchao_int8   with torchao importable (PYTHONPATH): its CPU int4 layout
              (Int4OpaqueTensor, the same aten op as int4_bf16 behind a tensor subclass, with
              its own quantization of the weights) and int8 weight-only (Int8Tensor, which
              converts the int8 weights to float on every call).
Not measured: ``aten._dyn_quant_matmul_4bit`` (torchao's IntxOpaqueTensor "aten" path) is
KleidiAI on ARM; on x86 its pack stores float32 weights and it is symmetric (no zero points).
torchao's own CPU kernels (da8w4_linear_cpu: AVX-512 VNNI) ship only in its CPU wheel from
download.pytorch.org, which this machine cannot reach; PyPI's wheel carries CUDA extensions
only, so its CPU layouts are the aten ops above.

Prints per (shape, rows, variant): ``RESULT shape= rows= variant= us= gb_s= of_bound=
gflops=`` where gb_s is the variant's own weight bytes over its time and of_bound is the time
the GGUF's bytes take at the measured read bandwidth (bench/membw.py's sum, ``--membw`` to give
it) over the variant's time (1.0 = streaming the file's bytes at full bandwidth); then per
(shape, variant) ``NUMERICS``: w_exact (the weights the op applies, read back through identity
activations, equal the GGUF's float32 dequantization bit for bit), w_err (max |difference| /
max |weight|) and y_err (4 random float32 rows: max |y - x @ W_deq^T| / max |x @ W_deq^T|, the
reference in float64). Variants that quantize activations (int8_dyn, q_ingot) quantize the
identity rows too (1 -> 127 x fl(1/127)), so their w_err includes that scale's rounding (q_ingot:
~5e-8, the weights themselves being the file's; tests/unit/test_quant_kernels.py checks it bit
for bit against its restatement).

Then ``DECODE`` lines: one decode step's linears (layers x (qkv + o + gate_up + down) + the LM
head) per variant, and for the fastest kept library per shape (``BEST_LIBRARY`` names them).

Measured on the AMD EPYC (Zen 3 class, AVX2 + FMA, 2 vCPUs under load 5-8 from other jobs, so
``--threads 1 --clock thread``; one core's read bandwidth 10.4 GB/s on that clock), 1 row,
microseconds: qkv bf16_ingot 122, int4_bf16 100, int8_bf16 178, q_ingot 54 (0.62 of the
bound); gate_up 429 / 305 / 647 / 150 (0.71); LM head (Q8_0) bf16_ingot 6757, int8_bf16 9979,
q_ingot 4236 (0.68). A decode step's linears: q_ingot 14.2 ms, bf16_ingot 32.3, the fastest
library per shape 29.0. At 512 rows gate_up: q_ingot 16.4 ms, bf16_ingot 32.1, f32_torch 31.6,
int4_bf16 59.1. int4_f32 (the exact int4 path) 11-35x int4_bf16's time. The full table and the
decision it supports: docs/features.md, "Quantized weights (GGUF)".
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ingot.model_executor.layers import cpu_kernels as ck

ROWS = (1, 2, 4, 128, 512)
# ingot's fusions: (fused name, GGUF tensors of layer 0 whose rows it stacks)
FUSED = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
LM_HEAD = "token_embd"  # tied: the output projection is the embedding table
VARIANTS = ("bf16_ingot", "f32_torch", "int4_f32", "int4_bf16", "int8_f32", "int8_bf16",
            "int8_dyn", "q_ingot", "torchao_int4", "torchao_int8")


@dataclass
class Weight:
    name: str
    qtype: str           # GGML type name
    raw: np.ndarray      # [N, row bytes] uint8, the file's blocks
    n: int
    k: int
    deq: torch.Tensor    # [N, K] float32, gguf.quants.dequantize


@dataclass
class Variant:
    call: Callable[[torch.Tensor, object], torch.Tensor]
    weights: object      # what call reads; copied for the cold rotation
    nbytes: int          # bytes of one copy
    x_dtype: torch.dtype
    weight_only: bool = True


def load_weights(path: str, names: list[str]) -> dict[str, Weight]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for name in names:
        parts = [f"blk.0.{p}.weight" for p in FUSED[name]] if name in FUSED else [f"{LM_HEAD}.weight"]
        tensors = [by_name[p] for p in parts]
        qtypes = {t.tensor_type.name for t in tensors}
        assert len(qtypes) == 1, f"{name}: mixed types {qtypes}"
        raw = np.concatenate([np.asarray(t.data).reshape(int(t.shape[1]), -1) for t in tensors])
        qtype = tensors[0].tensor_type
        n, k = raw.shape[0], int(tensors[0].shape[0])
        deq = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32))
        out[name] = Weight(name, qtype.name, raw, n, k, deq)
    return out


# ---- the file's blocks --------------------------------------------------------------------

def q4_1_parts(w: Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [N, K] int32 in 0..15, d [N, K/32] float32, m [N, K/32] float32): w = d q + m."""
    blocks = w.raw.reshape(w.n, w.k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(w.n, w.k).astype(np.int32)
    return q, d, m


def per_row_int8(deq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of float32 weights: (q [N, K] int8, scale [N] float32)."""
    scale = deq.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(deq / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


# ---- variants -----------------------------------------------------------------------------

def make_variants(w: Weight, names: tuple[str, ...]) -> dict[str, Variant]:
    out: dict[str, Variant] = {}
    bf16 = ck.load_cpu_kernels()
    if "bf16_ingot" in names and bf16 is not None:
        wb = w.deq.to(torch.bfloat16)
        beside = ck.gemm_preferred()
        gemv_w, gemm_w = ck.pack_gemv_weight(wb), ck.pack_gemm_weight(bf16, wb)
        limit = ck.GEMV_MAX_ROWS_BESIDE_GEMM if beside else ck.GEMV_MAX_ROWS

        def bf16_call(x: torch.Tensor, ws: tuple, n: int = w.n) -> torch.Tensor:
            if x.shape[0] <= limit:
                return ck.gemv_bf16(bf16, x, ws[0], n)
            return ck.gemm_bf16(bf16, x, ws[1], n)

        # Each path reads its own copy; the bytes a call reads are one copy's (2 B / weight).
        out["bf16_ingot"] = Variant(bf16_call, (gemv_w, gemm_w), 2 * w.n * w.k, torch.bfloat16)
    if "f32_torch" in names:
        out["f32_torch"] = Variant(lambda x, ws: F.linear(x, ws[0]), (w.deq.clone(),),
                                   4 * w.n * w.k, torch.float32)
    if w.qtype == "Q4_1":
        q, d, m = q4_1_parts(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 1)
        for dt, tag in ((torch.float32, "int4_f32"), (torch.bfloat16, "int4_bf16")):
            if tag not in names:
                continue
            sz = torch.stack([torch.from_numpy(d).t(), torch.from_numpy(m + 8 * d).t()], -1)
            sz = sz.contiguous().to(dt)  # [K/32, N, 2]: scale, zero

            def int4_call(x: torch.Tensor, ws: tuple) -> torch.Tensor:
                return torch.ops.aten._weight_int4pack_mm_for_cpu(x, ws[0], 32, ws[1])

            out[tag] = Variant(int4_call, (packed, sz),
                               packed.numel() + sz.numel() * sz.element_size(), dt)
    q8, s8 = per_row_int8(w.deq)
    for dt, tag in ((torch.float32, "int8_f32"), (torch.bfloat16, "int8_bf16")):
        if tag in names:
            out[tag] = Variant(lambda x, ws: torch.ops.aten._weight_int8pack_mm(x, ws[0], ws[1]),
                               (q8, s8.to(dt)), q8.numel() + s8.numel() * dt.itemsize, dt)
    if "int8_dyn" in names:
        def int8_dyn_call(x: torch.Tensor, ws: tuple) -> torch.Tensor:
            sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            xq = torch.round(x / sx).to(torch.int8)
            return torch._int_mm(xq, ws[0].t()).float() * sx * ws[1]

        out["int8_dyn"] = Variant(int8_dyn_call, (q8, s8), q8.numel() + 4 * s8.numel(),
                                  torch.float32, weight_only=False)
    if "q_ingot" in names and w.qtype in ("Q4_0", "Q4_1", "Q8_0"):
        qk = ck.load_quant_kernels() if hasattr(ck, "load_quant_kernels") else None
        if qk is not None:
            packed_q = ck.pack_quant_weight(w.raw, w.qtype, w.n, w.k)

            def q_call(x: torch.Tensor, ws: tuple, n: int = w.n, qt: str = w.qtype) -> torch.Tensor:
                return ck.quant_matmul(qk, x, ws[0], qt, n)

            out["q_ingot"] = Variant(q_call, (packed_q,), packed_q.numel(), torch.float32,
                                     weight_only=False)
    if any(n.startswith("torchao") for n in names):
        out.update(_torchao_variants(w, names))
    return out


def _torchao_variants(w: Weight, names: tuple[str, ...]) -> dict[str, Variant]:
    try:
        import torchao  # noqa: F401
        from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
        from torchao.quantization import Int8Tensor
        from torchao.quantization.granularity import PerRow
    except Exception:  # noqa: BLE001  (not installed, or a version without these)
        return {}
    out = {}
    if "torchao_int4" in names and w.k % 32 == 0:
        t4 = Int4OpaqueTensor.from_hp(w.deq.to(torch.bfloat16), [1, 32])
        out["torchao_int4"] = Variant(lambda x, ws: F.linear(x, ws), t4,
                                      t4.qdata.numel() + 2 * t4.scale_and_zero.numel(),
                                      torch.bfloat16)
    if "torchao_int8" in names:
        t8 = Int8Tensor.from_hp(w.deq.to(torch.bfloat16), granularity=PerRow())
        out["torchao_int8"] = Variant(lambda x, ws: F.linear(x, ws), t8,
                                      t8.qdata.numel() + 2 * t8.scale.numel(), torch.bfloat16)
    return out


def _clone(ws: object) -> object:
    if isinstance(ws, tuple):
        return tuple(t.clone() for t in ws)
    return copy.deepcopy(ws)


# ---- numerics -----------------------------------------------------------------------------

def numerics(w: Weight, v: Variant) -> tuple[bool, float, float]:
    """(w_exact, w_err, y_err) as the module docstring says."""
    eye = torch.eye(w.k, dtype=v.x_dtype)
    applied = v.call(eye, v.weights).float().t()
    scale = w.deq.abs().max().item()
    w_exact = torch.equal(applied, w.deq)
    w_err = (applied - w.deq).abs().max().item() / scale
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, w.k, generator=gen)
    ref = x.double() @ w.deq.double().t()
    y = v.call(x.to(v.x_dtype), v.weights).double()
    y_err = (y - ref).abs().max().item() / ref.abs().max().item()
    return w_exact, w_err, y_err


# ---- timing -------------------------------------------------------------------------------

_clock = time.perf_counter  # --clock thread: time.thread_time


def _timed(v: Variant, copies: list, x: torch.Tensor, reps: int, start: int) -> float:
    t = _clock()
    for i in range(reps):
        v.call(x, copies[(start + i) % len(copies)])
    return (_clock() - t) / reps


def read_gb_s(gib: float = 1.0, repeats: int = 7) -> float:
    """Read bandwidth (a torch sum over a buffer far past the L3; bench/membw.py's method),
    median of the repeats, on the clock the variants are timed with."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()
    rates = []
    for _ in range(repeats):
        t = _clock()
        buf.sum()
        rates.append(buf.numel() * 4 / (_clock() - t) / 1e9)
    return statistics.median(rates)


def _layers(path: str) -> int:
    from ingot.model_executor.loader.gguf_loader import read_gguf_header

    metadata, _ = read_gguf_header(path)
    arch = metadata["general.architecture"]
    return int(metadata[f"{arch}.block_count"])


def _decode_estimates(medians: dict, shapes: list[str], rows_list: list[int], layers: int) -> None:
    """The linears of one decode step from the per-shape medians: layers x (qkv + o + gate_up
    + down) + the LM head, per variant that took every shape, and for the fastest kept library
    per shape (``best_library``: any variant but ingot's own)."""
    if set(shapes) != {*FUSED, "lm_head"}:
        return
    count = {**dict.fromkeys(FUSED, layers), "lm_head": 1}
    for rows in (r for r in rows_list if r <= 4):
        per_variant: dict[str, float] = {}
        for vname in VARIANTS:
            if all((s, rows, vname) in medians for s in shapes):
                per_variant[vname] = sum(count[s] * medians[s, rows, vname] for s in shapes)
        best = {s: min(((t, v) for (s2, r, v), t in medians.items()
                        if s2 == s and r == rows and v not in ("bf16_ingot", "q_ingot")),
                       default=(None, None)) for s in shapes}
        if all(t is not None for t, _ in best.values()):
            per_variant["best_library"] = sum(count[s] * best[s][0] for s in shapes)
            print(f"BEST_LIBRARY rows={rows} " + " ".join(f"{s}={v}" for s, (_, v) in best.items()))
        for vname, t in per_variant.items():
            print(f"DECODE rows={rows} variant={vname} linears_ms={t * 1e3:.2f} "
                  f"tok_s_bound_by_linears={rows / t:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: ingot's default model)")
    ap.add_argument("--shapes", default=",".join([*FUSED, "lm_head"]))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=15.0, help="time per timing")
    ap.add_argument("--cold-mib", type=float, default=128.0,
                    help="weight copies rotated per variant (0: one copy, cache-hot)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--membw", type=float, default=None, help="read GB/s (default: measure)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (--threads 1 only), which a "
                         "loaded machine's preemptions do not inflate")
    ap.add_argument("--no-numerics", action="store_true")
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.clock == "thread":
        if torch.get_num_threads() != 1:
            raise SystemExit("--clock thread times one thread: add --threads 1")
        global _clock
        _clock = time.thread_time
    model = ns.model
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        model = default_model_path()
    if ns.membw is None:
        ns.membw = read_gb_s()
    names = tuple(ns.variants.split(","))
    rows_list = [int(r) for r in ns.rows.split(",")]
    print(f"LOAD before={os.getloadavg()} threads={torch.get_num_threads()} "
          f"clock={ns.clock} membw_gb_s={ns.membw:.1f} isa={ck.cpu_isas()[0]}", flush=True)
    shapes = ns.shapes.split(",")
    weights = load_weights(model, shapes)
    summary: list[str] = []
    medians: dict[tuple[str, int, str], float] = {}  # (shape, rows, variant) -> seconds
    for shape in shapes:
        w = weights[shape]
        file_bytes = w.raw.nbytes
        t_bound = file_bytes / (ns.membw * 1e9)
        variants = make_variants(w, names)
        print(f"SHAPE {shape} type={w.qtype} n={w.n} k={w.k} file_bytes={file_bytes} "
              f"variants={','.join(variants)}", flush=True)
        if not ns.no_numerics:
            for vname, v in variants.items():
                exact, w_err, y_err = numerics(w, v)
                print(f"NUMERICS shape={shape} type={w.qtype} variant={vname} w_exact={exact} "
                      f"w_err={w_err:.2e} y_err={y_err:.2e}", flush=True)
        copies = {}
        for vname, v in variants.items():
            c = 1 if ns.cold_mib <= 0 else max(1, math.ceil(ns.cold_mib * 2**20 / v.nbytes))
            copies[vname] = [v.weights] + [_clone(v.weights) for _ in range(min(c, 256) - 1)]
        for rows in rows_list:
            if shape == "lm_head" and rows > 4:
                continue
            gen = torch.Generator().manual_seed(rows)
            x32 = torch.randn(rows, w.k, generator=gen)
            xs = {dt: x32.to(dt) for dt in (torch.float32, torch.bfloat16)}
            reps = {}
            for vname, v in variants.items():  # calibrate: ~target_ms per timing
                once = _timed(v, copies[vname], xs[v.x_dtype], 2, 0)
                reps[vname] = max(2, int(ns.target_ms / 1e3 / max(once, 1e-7)))
            times: dict[str, list[float]] = {vname: [] for vname in variants}
            pos = dict.fromkeys(variants, 0)
            for _ in range(ns.repeats):
                for vname, v in variants.items():
                    times[vname].append(_timed(v, copies[vname], xs[v.x_dtype], reps[vname],
                                               pos[vname]))
                    pos[vname] += reps[vname]
            line = []
            for vname, v in variants.items():
                t = statistics.median(times[vname])
                medians[shape, rows, vname] = t
                gflops = 2 * rows * w.n * w.k / t / 1e9
                print(f"RESULT shape={shape} type={w.qtype} rows={rows} variant={vname} "
                      f"us={t * 1e6:.1f} gb_s={v.nbytes / t / 1e9:.2f} "
                      f"of_bound={t_bound / t:.2f} gflops={gflops:.1f}", flush=True)
                line.append(f"{vname}={t * 1e6:.0f}")
            summary.append(f"{shape:8s} rows={rows:<4d} " + " ".join(line))
    print(f"LOAD after={os.getloadavg()}", flush=True)
    _decode_estimates(medians, shapes, rows_list, _layers(model))
    print("SUMMARY (us, median)")
    for s in summary:
        print("  " + s)


if __name__ == "__main__":
    main()
