/* ingot's float32 CPU kernels (encoder-only models: attention, bias + GELU, bias + residual +
 * LayerNorm) and OpenMP thread pinning, built by cpu_kernels.py for the widest vector ISA the
 * CPU runs: AVX-512 (16 lanes), AVX2 + FMA (8 lanes, e.g. AMD Zen 2/3, older Xeons) or the
 * portable build. Like the bf16 decode kernels (cpu_kernels.c) they are written once over the
 * vector layer of cpu_kernels_vec.h, and each build picks its lane width and tile sizes. */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET: ingot_bind_threads */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vec.h"

/* The vector width this build was compiled for (cpu_kernels.py checks it against the ISA it
   asked for). */
int ingot_f32_lanes(void) { return VL; }

/* ---------------------------------------------------------------------------------------- */
/* Bidirectional attention of an encoder's packed prefill, float32: sequence b is rows
   starts[b] .. starts[b+1]-1 of q/k/v (row stride `stride`, head h at columns h*D ..), and
   each of its rows attends to exactly those rows. One task per (sequence, head) reads its
   rows in place (no [B, Lmax] grid, no padded keys: the work is sum L^2, not B * Lmax^2) and
   depends on nothing else in the batch, so a sequence's output is the same alone or packed.
   Tiles of EA_ROWS query rows x 2 vectors of keys (scores, keys transposed to [D][L]: no
   horizontal sums) and EA_ROWS rows x 2 vectors of output columns (p.v) keep 2 EA_ROWS
   independent FMA chains in flight per EA_ROWS + 2 loads (4-row tiles had a load per FMA and
   4 latency-bound chains); on AVX-512 with the gathered transpose, MiniLM's shapes (60
   sequences of 8-128 rows, 12 heads of 32) took 11.8 ms on one thread and 6.4 on two, from
   12.9 and 7.8. Each output is one chain over d (scores) or over keys (p.v), in order.
   Softmax in float32. D a multiple of 16; scratch: per thread
   >= (D + 8) * (Lmax + 32) floats (encoder_attention_f32 sizes it; EA_ROWS <= 8, 2 VL <= 32). */
#if VL == 16
#define EA_ROWS 8 /* attention tile rows: 8 x 2 accumulators of the 32 zmm registers */
#else
#define EA_ROWS 6 /* 6 x 2 accumulators + 2 key vectors + a broadcast fit the 16 ymm registers */
#endif
#define EA_KEYS (2 * VL) /* keys per score tile, and the padding of the transposed keys */

INL void ea_scores(const float *const *qr, const float *kt, int64_t Lp, int64_t D, int64_t j,
                   const int NV, float *sc) {
    vf a[EA_ROWS][2];
    for (int t = 0; t < EA_ROWS; t++)
        for (int c = 0; c < NV; c++) a[t][c] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vf kv[2];
        for (int c = 0; c < NV; c++) kv[c] = vload(kt + d * Lp + j + VL * c);
#pragma GCC unroll 8
        for (int t = 0; t < EA_ROWS; t++) {
            const vf x = vset1(qr[t][d]);
            for (int c = 0; c < NV; c++) a[t][c] = vfma(x, kv[c], a[t][c]);
        }
    }
    for (int t = 0; t < EA_ROWS; t++)
        for (int c = 0; c < NV; c++) vstore(sc + t * Lp + j + VL * c, a[t][c]);
}

INL void ea_pv(const float *sc, int64_t Lp, int64_t L, const float *v, int64_t stride,
               const int NV, const float *inv, int r, float *o, int64_t out_stride) {
    vf a[EA_ROWS][2];
    for (int t = 0; t < EA_ROWS; t++)
        for (int c = 0; c < NV; c++) a[t][c] = vzero();
    for (int64_t j = 0; j < L; j++) {
        vf vv[2];
        for (int c = 0; c < NV; c++) vv[c] = vload(v + j * stride + VL * c);
#pragma GCC unroll 8
        for (int t = 0; t < EA_ROWS; t++) {
            const vf p = vset1(sc[t * Lp + j]);
            for (int c = 0; c < NV; c++) a[t][c] = vfma(p, vv[c], a[t][c]);
        }
    }
    for (int t = 0; t < r; t++)
        for (int c = 0; c < NV; c++)
            vstore(o + t * out_stride + VL * c, vmul(a[t][c], vset1(inv[t])));
}

void ingot_encoder_attention_f32(const float *q, const float *k, const float *v, int64_t stride,
                                 float *out, int64_t out_stride, const int64_t *starts, int64_t B,
                                 int64_t H, int64_t D, float scale, float *scratch,
                                 int64_t scratch_per_thread, int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < B * H; task++) {
        const int64_t b = task / H, h = task % H, s0 = starts[b], L = starts[b + 1] - s0;
        if (L <= 0) continue;
        const int64_t Lp = (L + EA_KEYS - 1) / EA_KEYS * EA_KEYS;
        float *kt = scratch + (int64_t)omp_get_thread_num() * scratch_per_thread; /* [D][Lp] */
        float *sc = kt + D * Lp;                                           /* [EA_ROWS][Lp] */
        const vf sv = vset1(scale); /* keys transposed VL at a time; keys past L are zero */
        for (int64_t j = 0; j < Lp; j += VL)
            vkeys_t(k + (s0 + j) * stride + h * D, stride, L - j, kt + j, Lp, D, sv);
        for (int64_t i = 0; i < L; i += EA_ROWS) {
            const int r = L - i < EA_ROWS ? (int)(L - i) : EA_ROWS;
            const float *qr[EA_ROWS];
            for (int t = 0; t < EA_ROWS; t++) /* rows past the end repeat the last (unused) */
                qr[t] = q + (s0 + i + (t < r ? t : r - 1)) * stride + h * D;
            for (int64_t j = 0; j < L; j += EA_KEYS) {
                if (L - j > VL) ea_scores(qr, kt, Lp, D, j, 2, sc);
                else ea_scores(qr, kt, Lp, D, j, 1, sc);
            }
            float inv[EA_ROWS];
            for (int t = 0; t < r; t++) {
                float *st = sc + t * Lp;
                vf mx = vset1(-INFINITY);
                for (int64_t j = 0; j < L; j += VL) mx = vmax_in(mx, vtail(L - j), vload(st + j));
                const vf m = vset1(vhmax(mx));
                vf z = vzero();
                for (int64_t j = 0; j < L; j += VL) {
                    const vf e = vkeep(vtail(L - j), exp_ps(vsub(vload(st + j), m)));
                    vstore(st + j, e);
                    z = vadd(z, e);
                }
                inv[t] = 1.0f / vhsum(z);
            }
            const float *vh = v + s0 * stride + h * D;
            float *oh = out + (s0 + i) * out_stride + h * D;
            for (int64_t d = 0; d < D; d += 2 * VL) {
                if (D - d >= 2 * VL) ea_pv(sc, Lp, L, vh + d, stride, 2, inv, r, oh + d, out_stride);
                else ea_pv(sc, Lp, L, vh + d, stride, 1, inv, r, oh + d, out_stride);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Epilogues of a float32 linear computed without its bias (BERT encoders): one pass over the
   rows instead of torch's bias copy (addmm), add and norm passes, each a full sweep of the
   activations and its own OpenMP region. */

/* erf as torch's Vectorized<float>::erf: Abramowitz-Stegun 7.1.26, |error| < 1.5e-7. */
INL vf erf_ps(vf x) {
    const vf one = vset1(1.0f);
    const vf d = vfma(vset1(0.3275911f), vabs(x), one);
    /* t = 1 / d: the reciprocal estimate and one Newton step (~23 bits; a division would cost
       more than all the rest of the GELU). */
    vf t = vrcp(d);
    t = vmul(t, vfnma(d, t, vset1(2.0f)));
    vf r = vfma(vset1(1.061405429f), t, vset1(-1.453152027f));
    r = vfma(r, t, vset1(1.421413741f));
    r = vfma(r, t, vset1(-0.284496736f));
    r = vfma(r, t, vset1(0.254829592f));
    /* Past x^2 = 80, 1 - e t r rounds to 1 in float32 anyway; clamping keeps e normal
       (a denormal e costs a microcode assist per lane). */
    const vf x2 = vmin(vmul(x, x), vset1(80.0f));
    const vf e = exp_ps(vsub(vzero(), x2));
    const vf y = vfnma(vmul(e, t), r, one); /* 1 - e t r, >= 0 */
    return vor(y, vand(x, vset1(-0.0f)));   /* x's sign */
}

/* x[m, n] = gelu(x[m, n] + bias[n]) in place, GELU with erf as torch's: x/2 (1 + erf(x/sqrt2)). */
void ingot_bias_gelu_f32(float *x, const float *bias, int64_t M, int64_t N, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 32768)
    for (int64_t m = 0; m < M; m++) {
        float *row = x + m * N;
        for (int64_t n = 0; n < N; n += VL) {
            const vf h = vadd(vload_part(row + n, N - n), vload_part(bias + n, N - n));
            const vf g = vmul(vmul(h, vset1(0.5f)),
                              vadd(vset1(1.0f), erf_ps(vmul(h, vset1(0.70710678118654752f)))));
            vstore_part(row + n, g, N - n);
        }
    }
}

/* out[m] = LayerNorm(x[m] + bias + residual[m]) * w + b over rows of N floats (bias and
   residual may be NULL; out may be x): two passes over the row for mean then variance (biased,
   as torch), the row staying in L1 between them. */
void ingot_add_layernorm_f32(const float *x, const float *bias, const float *residual,
                             const float *w, const float *b, float *out, int64_t M, int64_t N,
                             float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * N;
        const float *rr = residual ? residual + m * N : 0;
        float *o = out + m * N;
        vf s = vzero();
        for (int64_t n = 0; n < N; n += VL) {
            vf h = vload_part(xr + n, N - n);
            if (bias) h = vadd(h, vload_part(bias + n, N - n));
            if (rr) h = vadd(h, vload_part(rr + n, N - n));
            vstore_part(o + n, h, N - n);
            s = vadd(s, h);
        }
        const float mean = vhsum(s) / (float)N;
        const vf mv = vset1(mean);
        vf var = vzero();
        for (int64_t n = 0; n < N; n += VL) {
            const vf d = vkeep(vtail(N - n), vsub(vload_part(o + n, N - n), mv));
            var = vfma(d, d, var);
        }
        const vf rstd = vset1(1.0f / sqrtf(vhsum(var) / (float)N + eps));
        for (int64_t n = 0; n < N; n += VL) {
            const vf d = vmul(vsub(vload_part(o + n, N - n), mv), rstd);
            vstore_part(o + n, vfma(d, vload_part(w + n, N - n), vload_part(b + n, N - n)), N - n);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Pin the calling thread's OpenMP team of n threads: thread i to CPU cpus[i] (what
   --cpu-threads-bind / VLLM_CPU_OMP_THREADS_BIND ask for). libgomp keeps one team per master
   thread and reuses it, so later regions of up to n threads run where this put them. Returns
   the number of threads that could not be bound. */
int ingot_bind_threads(const int *cpus, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        if (omp_get_num_threads() != n || sched_setaffinity(0, sizeof(set), &set) != 0) failed++;
    }
    return failed;
}
