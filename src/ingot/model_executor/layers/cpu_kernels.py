"""ingot's own CPU kernel for single-sequence decode on CPUs with AVX512-BF16.

Why: at batch 1 a decode step is a chain of ~120 GEMVs whose cost is reading the weights.
oneDNN's pre-packed linear reaches ~8.5 GB/s on these 0.6-3.5 MB matrices on the project
machine (per-call overhead, poor two-core scaling), while two cores stream ~14 GB/s.
``ingot_gemv_bf16`` walks the weight once with both cores (OpenMP, the libgomp torch already
loaded) and ``vdpbf16ps``: bf16 products, float32 accumulation, one rounding to bf16, as oneDNN
and MKL do. (A fused residual-add + RMSNorm kernel was tried too and measured no faster than
torch's nine ops, so it is not here.)

The C source is built once per machine with the system C compiler into the ingot cache
(``$INGOT_CACHE_ROOT/kernels``) and loaded with ctypes. Without a compiler, without AVX512-BF16,
or with ``INGOT_CPU_KERNELS=0``, :func:`load_cpu_kernels` returns None and oneDNN runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("ingot")

# Rows of x handled by the kernel. Measured over a model's worth of weights: faster than oneDNN's
# packed linear at 1 row, slower from 2 rows on (oneDNN's AMX path takes over there).
GEMV_MAX_ROWS = 1

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* y[m, n] = bf16(sum_k x[m, k] * w[n, k] (+ bias[n])); x [M, K], w [N, K], y [M, N] row-major
   bf16; bias float32 or NULL. A block of 4 weight rows is loaded once per 32-wide K step and used
   by up to 4 rows of x (16 accumulators), so the weight is read from memory once whatever M is. */
void ingot_gemv_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t tail = K % 32, kmain = K - tail;
    const __mmask32 tmask = tail ? (__mmask32)((1u << tail) - 1u) : 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n += 4) {
        const int64_t rows = N - n < 4 ? N - n : 4;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mrows = M - m0 < 4 ? M - m0 : 4;
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const int full = k < kmain;
                __m512bh wv[4];
                for (int r = 0; r < rows; r++) {
                    const uint16_t *wp = w + (n + r) * K + k;
                    wv[r] = full ? (__m512bh)_mm512_loadu_si512((const void *)wp)
                                 : (__m512bh)_mm512_maskz_loadu_epi16(tmask, wp);
                }
                for (int i = 0; i < mrows; i++) {
                    const uint16_t *xp = x + (m0 + i) * K + k;
                    __m512bh xv = full ? (__m512bh)_mm512_loadu_si512((const void *)xp)
                                       : (__m512bh)_mm512_maskz_loadu_epi16(tmask, xp);
                    for (int r = 0; r < rows; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[r], xv);
                }
            }
            for (int i = 0; i < mrows; i++)
                for (int r = 0; r < rows; r++) {
                    float s = _mm512_reduce_add_ps(acc[i][r]);
                    if (bias) s += bias[n + r];
                    y[(m0 + i) * N + n + r] = to_bf16(s);
                }
        }
    }
}

static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* Decode attention straight from the paged cache (one query token per sequence), no gather:
   q [B, H, D], k/v cache [num_blocks, block_size, Hkv, D], block_table [B, W] int64, seq_lens
   [B] int64 (keys 0..seq_len-1), out [B, H, D]; all bf16 but the tables. Scores and softmax in
   float32; query heads h = j*G .. j*G+G-1 share kv head j. D must be a multiple of 16, G <= 16. */
void ingot_paged_decode_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                             const int64_t *block_table, const int64_t *seq_lens, uint16_t *out,
                             int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                             int64_t W, float scale, float *scratch, int64_t scratch_per_task,
                             int nthreads) {
    const int64_t G = H / Hkv;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < B * Hkv; task++) {
        const int64_t b = task / Hkv, j = task % Hkv;
        int64_t L = seq_lens[b];
        if (L > W * block_size) L = W * block_size;
        if (L < 1) L = 1;
        float *sc = scratch + (int64_t)omp_get_thread_num() * scratch_per_task;  /* [G, L] */
        float qf[16][256];
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) {
                uint32_t u = (uint32_t)q[(b * H + j * G + g) * D + d] << 16;
                __builtin_memcpy(&qf[g][d], &u, 4);
            }
        float mx[16];
        for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
        const int64_t *table = block_table + b * W;
        for (int64_t t = 0; t < L; t++) {
            const uint16_t *kp = kc + ((table[t / block_size] * block_size + t % block_size) * Hkv + j) * D;
            for (int64_t g = 0; g < G; g++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16)
                    acc = _mm512_fmadd_ps(bf16x16_to_ps(kp + d), _mm512_loadu_ps(&qf[g][d]), acc);
                float s = _mm512_reduce_add_ps(acc) * scale;
                sc[g * L + t] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
        float sum[16];
        for (int64_t g = 0; g < G; g++) {
            float z = 0.0f;
            for (int64_t t = 0; t < L; t++) {
                float e = expf(sc[g * L + t] - mx[g]);
                sc[g * L + t] = e;
                z += e;
            }
            sum[g] = z;
        }
        __m512 acc[16][16];  /* [G][D/16] */
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t++) {
            const uint16_t *vp = vc + ((table[t / block_size] * block_size + t % block_size) * Hkv + j) * D;
            for (int64_t c = 0; c < D / 16; c++) {
                __m512 vv = bf16x16_to_ps(vp + c * 16);
                for (int64_t g = 0; g < G; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(sc[g * L + t]), vv, acc[g][c]);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float inv = 1.0f / sum[g];
            float tmp[256];
            for (int64_t c = 0; c < D / 16; c++)
                _mm512_storeu_ps(tmp + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
            for (int64_t d = 0; d < D; d++) out[(b * H + j * G + g) * D + d] = to_bf16(tmp[d]);
        }
    }
}
"""

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC", "-lm"]
_UNSET = object()
_loaded: object = _UNSET


class CpuKernels:
    """The loaded library's entry points, with their ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.gemv = lib.ingot_gemv_bf16
        self.gemv.restype = None
        self.gemv.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
        self.paged_decode = lib.ingot_paged_decode_bf16
        self.paged_decode.restype = None
        self.paged_decode.argtypes = [p] * 6 + [i64] * 6 + [ctypes.c_float, p, i64, ctypes.c_int]


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags


def _kernel_dir() -> Path:
    from ingot.compilation.cache import default_cache_root

    return default_cache_root() / "kernels"


def _build(compiler: str) -> Path:
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + compiler).encode()).hexdigest()[:16]
    target = _kernel_dir() / f"ingot_cpu_kernels_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_SOURCE)
        staged = Path(tmp) / target.name
        subprocess.run(
            [compiler, str(src), "-o", str(staged), *_FLAGS],
            check=True, capture_output=True, text=True, timeout=120,
        )
        os.replace(staged, target)  # atomic: a concurrent process sees all of it or nothing
    logger.info("built ingot's CPU kernels: %s", target)
    return target


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None where they cannot be used."""
    global _loaded
    if _loaded is not _UNSET:
        return _loaded  # type: ignore[return-value]
    _loaded = None
    if os.environ.get("INGOT_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: decode uses torch ops and oneDNN only")
        return None
    try:
        kernels = CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("ingot's CPU kernels are unavailable (%s): using torch ops", detail)
        return None
    _loaded = kernels
    return kernels


def gemv_bf16(
    kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] bf16 (M <= GEMV_MAX_ROWS), weight [N, K] bf16 contiguous, bias float32 or None
    -> [M, N] bf16."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    bias_ptr = bias.data_ptr() if bias is not None else None
    kernels.gemv(
        x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, torch.get_num_threads()
    )
    return y



# Limits of the decode-attention kernel's fixed-size buffers.
PAGED_DECODE_MAX_HEAD_DIM, PAGED_DECODE_MAX_GROUP = 256, 16


def paged_decode_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return head_dim % 16 == 0 and head_dim <= PAGED_DECODE_MAX_HEAD_DIM and group <= PAGED_DECODE_MAX_GROUP


def paged_decode_bf16(
    kernels: CpuKernels,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [B, H, D] bf16 (one token per sequence), kv_cache [2, num_blocks, block_size, Hkv,
    D] bf16, block_table [B, W] int64, seq_lens [B] int64 -> [B, H * D] bf16."""
    query = query.contiguous()
    num_reqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    block_table = block_table.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    width = block_table.shape[1]
    threads = torch.get_num_threads()
    per_task = (num_heads // num_kv_heads) * width * block_size
    scratch = torch.empty(threads * per_task, dtype=torch.float32)
    out = torch.empty(num_reqs, num_heads * head_dim, dtype=torch.bfloat16)
    kernels.paged_decode(
        query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim,
        block_size, width, scale, scratch.data_ptr(), per_task, threads,
    )
    return out
