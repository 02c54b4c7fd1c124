/* ingot's CPU kernels for bf16 decode (built by cpu_kernels.py), written once over the vector
 * layer of cpu_kernels_vec.h and built per ISA: AVX-512 with AVX512-BF16 (q.k, p.v, the GEMV
 * and the MoE on vdpbf16ps), AVX-512F and AVX2 + FMA (bf16 widened to float32 in registers by
 * a 16-bit shift, float32 FMAs), and a portable build (plain C the compiler vectorises).
 *
 * Elementwise results are rounded to bf16 at the same points as the torch ops they replace
 * (products, sums, the normalised value before the RMSNorm weight), so outputs match torch's
 * eager bf16 path except where float32 reduction order or exp's last bit differ. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vec.h"

/* The vector width this build was compiled for, and whether its bf16 dot products are native
   (cpu_kernels.py checks both against the build it asked for). */
int ingot_cpu_lanes(void) { return VL; }
int ingot_cpu_native_bf16_dot(void) {
#ifdef VNATIVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* GEMV over a weight pre-packed in blocks of GEMV_ROWS rows: block b holds rows
   b*R .. b*R+R-1 as K/32 steps of [R][32] bf16, so each thread streams one contiguous range
   and the hardware prefetcher (helped by an explicit prefetch 4 KiB ahead) keeps the memory
   bus busy: 20 GB/s on the project machine against 13.5 GB/s for the row-major walk.
   Padding rows/columns are zero. x [M, K], y [M, N] bf16; bias float32 or NULL. A 32-wide
   step is GEMV_SUB pair vectors (1 on AVX-512, 2 with 8 lanes). */
#define GEMV_ROWS 8
#define GEMV_PREFETCH_BYTES 4096
#define GEMV_SUB (32 / (2 * VL))

void ingot_gemv_bf16(const uint16_t *x, const uint16_t *wb, const float *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t Kp = (K + 31) / 32 * 32, nblocks = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const uint16_t *blk = wb + nb * GEMV_ROWS * Kp;
        int64_t rows = N - nb * GEMV_ROWS;
        if (rows > GEMV_ROWS) rows = GEMV_ROWS;
        int64_t m = 0;
        /* Two rows at a time (a verification step of speculative decoding has 1 + k rows per
           request): each weight vector is loaded once for both, halving the loads that bound
           the multi-row case. Each output keeps its own accumulation order, so every row's
           result is the same as in a one-row call. */
        for (; m + 1 < M; m += 2) {
            const uint16_t *x0 = x + m * K, *x1 = x0 + K;
            vf a0[GEMV_ROWS], a1[GEMV_ROWS];
            for (int r = 0; r < GEMV_ROWS; r++) a0[r] = a1[r] = vzero();
            for (int64_t k = 0; k < Kp; k += 32) {
                vbx v0[GEMV_SUB], v1[GEMV_SUB];
                for (int c = 0; c < GEMV_SUB; c++) {
                    v0[c] = vprep(vloadb_part(x0 + k + 2 * VL * c, K - k - 2 * VL * c));
                    v1[c] = vprep(vloadb_part(x1 + k + 2 * VL * c, K - k - 2 * VL * c));
                }
                const uint16_t *wk = blk + k * GEMV_ROWS;
                if (m == 0)
                    for (int r = 0; r < GEMV_ROWS; r++)
                        vprefetch((const char *)(wk + r * 32) + GEMV_PREFETCH_BYTES);
                for (int r = 0; r < GEMV_ROWS; r++)
                    for (int c = 0; c < GEMV_SUB; c++) {
                        const vb w = vloadb(wk + r * 32 + 2 * VL * c);
                        a0[r] = vdot(a0[r], w, v0[c]);
                        a1[r] = vdot(a1[r], w, v1[c]);
                    }
            }
            for (int r = 0; r < rows; r++) {
                float s0 = vhsum(a0[r]), s1 = vhsum(a1[r]);
                if (bias) s0 += bias[nb * GEMV_ROWS + r], s1 += bias[nb * GEMV_ROWS + r];
                y[m * N + nb * GEMV_ROWS + r] = to_bf16(s0);
                y[(m + 1) * N + nb * GEMV_ROWS + r] = to_bf16(s1);
            }
        }
        for (; m < M; m++) {
            const uint16_t *xm = x + m * K;
            vf acc[GEMV_ROWS];
            for (int r = 0; r < GEMV_ROWS; r++) acc[r] = vzero();
            for (int64_t k = 0; k < Kp; k += 32) {
                const uint16_t *wk = blk + k * GEMV_ROWS;
                if (m == 0)
                    for (int r = 0; r < GEMV_ROWS; r++)
                        vprefetch((const char *)(wk + r * 32) + GEMV_PREFETCH_BYTES);
                /* one pair vector of x at a time (each accumulator still takes c in order):
                   with 8 lanes, x's widened halves for both c beside the 8 accumulators had
                   spilled accumulators */
                for (int c = 0; c < GEMV_SUB; c++) {
                    const vbx xv = vprep(vloadb_part(xm + k + 2 * VL * c, K - k - 2 * VL * c));
                    for (int r = 0; r < GEMV_ROWS; r++)
                        acc[r] = vdot(acc[r], vloadb(wk + r * 32 + 2 * VL * c), xv);
                }
            }
            for (int r = 0; r < rows; r++) {
                float s = vhsum(acc[r]);
                if (bias) s += bias[nb * GEMV_ROWS + r];
                y[m * N + nb * GEMV_ROWS + r] = to_bf16(s);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* RMSNorm of bf16 rows, h = x (+ residual, rounded to bf16 and also written to res_out when
   residual is given), r = rsqrt(mean(h^2) + eps); out may be x (in place). zero_centred = 0:
   out = bf16(w * bf16(h * r)), w bf16 (torch's Llama RMSNorm); 1: out = bf16(h * r * w1) in
   float32, w1 = 1 + weight as float32 (Gemma's RMSNorm, rounded once). */
INL void rmsnorm_rows(const uint16_t *x, const uint16_t *residual, const void *weight,
                      uint16_t *out, uint16_t *res_out, int64_t M, int64_t N, float eps,
                      int zero_centred, int nthreads) {
    const uint16_t *w = (const uint16_t *)weight;
    const float *w1 = (const float *)weight;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * N;
        const uint16_t *rr = residual ? residual + m * N : 0;
        uint16_t *hr = residual ? res_out + m * N : 0;
        vf ss = vzero();
        for (int64_t n = 0; n < N; n += VL) {
            vf h = vload_bf16_part(xr + n, N - n);
            if (rr) {
                h = vround_bf16(vadd(h, vload_bf16_part(rr + n, N - n)));
                vstore_bf16_part(hr + n, h, N - n);
            }
            ss = vfma(h, h, ss);
        }
        const float r = 1.0f / sqrtf(vhsum(ss) / (float)N + eps);
        const uint16_t *src = rr ? hr : xr;
        for (int64_t n = 0; n < N; n += VL) {
            const vf h = vmul(vload_bf16_part(src + n, N - n), vset1(r));
            const vf o = zero_centred ? vmul(h, vload_part(w1 + n, N - n))
                                      : vmul(vload_bf16_part(w + n, N - n), vround_bf16(h));
            vstore_bf16_part(out + m * N + n, vround_bf16(o), N - n);
        }
    }
}

void ingot_rmsnorm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w,
                        uint16_t *out, uint16_t *res_out, int64_t M, int64_t N, float eps,
                        int nthreads) {
    rmsnorm_rows(x, residual, w, out, res_out, M, N, eps, 0, nthreads);
}

void ingot_rmsnorm_zc_bf16(const uint16_t *x, const uint16_t *residual, const float *w1,
                           uint16_t *out, uint16_t *res_out, int64_t M, int64_t N, float eps,
                           int nthreads) {
    rmsnorm_rows(x, residual, w1, out, res_out, M, N, eps, 1, nthreads);
}

/* GELU's tanh form as torch computes it: x/2 (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3),
   with tanh(|y|) = 1 - 2 / (e^2|y| + 1), which rounds to exactly 1 where torch's does (so a
   very negative x gives 0, as torch's); |y| clamped at 20, past which tanh is 1 in float32. */
INL vf gelu_tanh(vf x) {
    const vf x3 = vmul(vmul(x, x), x);
    const vf y = vmul(vset1(0.7978845608028654f), vadd(x, vmul(vset1(0.044715f), x3)));
    const vf e = exp_ps(vmul(vset1(2.0f), vmin(vabs(y), vset1(20.0f))));
    const vf t = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(e, vset1(1.0f))));
    const vf tanh_y = vor(t, vand(y, vset1(-0.0f))); /* y's sign */
    return vmul(vmul(vset1(0.5f), x), vadd(vset1(1.0f), tanh_y));
}

/* out[m, i] = bf16(bf16(act(gate)) * up) with gate = gu[m, i], up = gu[m, I + i]; act 0: SiLU,
   1: GELU's tanh form (gelu_tanh). Threads take contiguous ranges of the (row, VL-column
   chunk) units, so one row at batch 1 still uses every core, and walk them incrementally (a
   64-bit division per vector had cost ~15% at 128 rows). */
INL void act_mul_rows(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I, int act,
                      int nthreads) {
    const int64_t chunks = (I + VL - 1) / VL, units = M * chunks;
#pragma omp parallel num_threads(nthreads) if (M * I >= 16384)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t u0 = units * tid / nt, u1 = units * (tid + 1) / nt;
        int64_t m = u0 / chunks, i = (u0 % chunks) * VL;
        for (int64_t u = u0; u < u1; u++) {
            const vf g = vload_bf16_part(gu + m * 2 * I + i, I - i);
            const vf up = vload_bf16_part(gu + m * 2 * I + I + i, I - i);
            const vf sg = vround_bf16(act ? gelu_tanh(g)
                                          : vdiv(g, vadd(vset1(1.0f), exp_ps(vsub(vzero(), g)))));
            vstore_bf16_part(out + m * I + i, vround_bf16(vmul(sg, up)), I - i);
            i += VL;
            if (i >= I) { i = 0; m++; }
        }
    }
}

void ingot_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I, int nthreads) {
    act_mul_rows(gu, out, M, I, 0, nthreads);
}

void ingot_gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I,
                              int nthreads) {
    act_mul_rows(gu, out, M, I, 1, nthreads);
}

/* ---------------------------------------------------------------------------------------- */
/* NeoX rotary on one head, bf16 in and out, rounding as torch's x*cos + cat(-x2, x1)*sin:
   each product and the sum rounded to bf16. cs = [cos(D), sin(D)] bf16 of this position;
   D % 32 == 0. */
INL void rope_head(const uint16_t *x, const uint16_t *cs, uint16_t *o, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d += VL) {
        const vf x1 = vload_bf16(x + d), x2 = vload_bf16(x + half + d);
        const vf c1 = vload_bf16(cs + d), c2 = vload_bf16(cs + half + d);
        const vf s1 = vload_bf16(cs + D + d), s2 = vload_bf16(cs + D + half + d);
        const vf a1 = vround_bf16(vmul(x1, c1));
        const vf b1 = vround_bf16(vmul(vneg(x2), s1));
        const vf a2 = vround_bf16(vmul(x2, c2));
        const vf b2 = vround_bf16(vmul(x1, s2));
        vstore_bf16_part(o + d, vround_bf16(vadd(a1, b1)), VL);
        vstore_bf16_part(o + half + d, vround_bf16(vadd(a2, b2)), VL);
    }
}

#define ATTN_MAX_D 256
#define ATTN_MAX_QH 64 /* query heads one task may hold */

/* Prefetch one key's rows (kv heads j0.., `lines` cache lines) into L1 and its value rows
   (vdelta elements further) into L2, then advance the (block, offset) walker. */
INL void prefetch_key(const uint16_t *kc, const int64_t *table, int64_t block_size, int64_t Hkv,
                      int64_t j0, int64_t D, int64_t lines, int64_t vdelta, int64_t *bi,
                      int64_t *off) {
    const char *r = (const char *)(kc + ((table[*bi] * block_size + *off) * Hkv + j0) * D);
    for (int64_t c = 0; c < lines; c++) {
        vprefetch(r + 64 * c);
        vprefetch_l2(r + 2 * vdelta + 64 * c);
    }
    if (++*off == block_size) { ++*bi; *off = 0; }
}

/* sc[(h * G + g) * npad + t - t0] = scale * q_(h, g) . k_(t, j0 + h) for keys t0 <= t < L and
   kv heads j0 .. j0 + nh - 1, VL keys at a time (vdot over QK_PAIRS(ST) pair vectors per key,
   ST = D/32, then one horizontal-sum tree for the VL). Keys are walked block by block (no
   division per key), all nh heads of a VL-key group at once so a block's rows are read in
   order; rows QK_PREFETCH_KEYS ahead are prefetched, and their value rows (vdelta elements
   further) into L2 for p.v. q = [nh * G][ATTN_MAX_D] bf16, 64-byte aligned rows. */
#define QK_PREFETCH_KEYS 32
#define QK_PAIRS(ST) ((ST) * 32 / (2 * VL))
#define QK_KERNEL(ST)                                                                            \
    static void qk_##ST(const uint16_t *kc, const int64_t *table, int64_t block_size,           \
                        int64_t Hkv, int64_t j0, int64_t nh, int64_t D, int64_t t0, int64_t L,  \
                        const uint16_t *q, int64_t G, float scale, float *sc, int64_t npad,     \
                        int64_t vdelta) {                                                        \
        const int64_t lines = (nh * D * 2 + 63) / 64; /* cache lines of one key's nh heads */    \
        int64_t bi = t0 / block_size, off = t0 % block_size; /* walks the keys */                \
        int64_t pbi = bi, poff = off, pt = t0;                /* walks ahead, prefetching */     \
        for (; pt < L && pt < t0 + QK_PREFETCH_KEYS; pt++)                                       \
            prefetch_key(kc, table, block_size, Hkv, j0, D, lines, vdelta, &pbi, &poff);         \
        for (int64_t t = t0; t < L; t += VL) {                                                   \
            const int cnt = L - t < VL ? (int)(L - t) : VL;                                      \
            const uint16_t *kp[VL];                                                              \
            for (int i = 0; i < cnt; i++) {                                                      \
                kp[i] = kc + ((table[bi] * block_size + off) * Hkv + j0) * D;                    \
                if (++off == block_size) { bi++; off = 0; }                                      \
            }                                                                                    \
            for (int i = cnt; i < VL; i++) kp[i] = kp[0];                                        \
            for (int i = 0; i < VL && pt < L; i++, pt++)                                         \
                prefetch_key(kc, table, block_size, Hkv, j0, D, lines, vdelta, &pbi, &poff);     \
            for (int64_t h = 0; h < nh; h++)                                                     \
                for (int64_t g = 0; g < G; g++) {                                                \
                    vbx qv[QK_PAIRS(ST)];                                                        \
                    for (int c = 0; c < QK_PAIRS(ST); c++)                                       \
                        qv[c] = vprep(vloadb(q + (h * G + g) * ATTN_MAX_D + 2 * VL * c));        \
                    vf acc[VL];                                                                  \
                    for (int i = 0; i < VL; i++) {                                               \
                        acc[i] = vzero();                                                        \
                        for (int c = 0; c < QK_PAIRS(ST); c++)                                   \
                            acc[i] = vdot(acc[i], vloadb(kp[i] + h * D + 2 * VL * c), qv[c]);    \
                    }                                                                            \
                    vstore(sc + (h * G + g) * npad + (t - t0), vmul(vhsum_vl(acc), vset1(scale))); \
                }                                                                                \
        }                                                                                        \
    }
QK_KERNEL(1)
QK_KERNEL(2)
QK_KERNEL(3)
QK_KERNEL(4)
QK_KERNEL(5)
QK_KERNEL(6)
QK_KERNEL(7)
QK_KERNEL(8)

/* out[g] = bf16(inv_sum[g] * sum_t p[g][t] v[t]) for the G query heads of one kv head. As in
   torch's CPU flash attention, the unnormalised probabilities are rounded to bf16 for this
   product (pb = [G][npad] bf16, zero past the last key) and accumulated in float32: vdot takes
   two keys per step, their rows interleaved into pairs by vpair (vunpair puts the results back
   in row order on store). PV_CD(ST) = D / VL accumulators per head, PV_HEADS(ST) heads per
   pass (PV_ACCS accumulators at most, at least one head). */
#if VL == 16
#define PV_ACCS 24
#else
#define PV_ACCS 12
#endif
#define PV_CD(ST) ((ST) * 32 / VL)
#define PV_HEADS(ST) (PV_ACCS / PV_CD(ST) > 0 ? PV_ACCS / PV_CD(ST) : 1)
#define PV_KERNEL(ST)                                                                            \
    static void pv_##ST(const uint16_t *vc, const int64_t *table, int64_t block_size,           \
                        int64_t row, int64_t j, int64_t D, int64_t t0, int64_t L,               \
                        const uint16_t *pb, int64_t npad, int64_t G, const float *inv_sum,      \
                        uint16_t *out) {                                                         \
        for (int64_t g0 = 0; g0 < G; g0 += PV_HEADS(ST)) {                                       \
            const int64_t gn = G - g0 < PV_HEADS(ST) ? G - g0 : PV_HEADS(ST);                    \
            vf acc[PV_HEADS(ST)][PV_CD(ST)];                                                     \
            for (int g = 0; g < PV_HEADS(ST); g++)                                               \
                for (int c = 0; c < PV_CD(ST); c++) acc[g][c] = vzero();                         \
            int64_t blk = t0 / block_size, off = t0 % block_size;                                \
            for (int64_t t = t0; t < L; t += 2) {                                                \
                const uint16_t *va = vc + ((table[blk] * block_size + off) * (row / D) + j) * D; \
                if (++off == block_size) { blk++; off = 0; }                                     \
                const uint16_t *vb_ = va;                                                        \
                if (t + 1 < L) {                                                                 \
                    vb_ = vc + ((table[blk] * block_size + off) * (row / D) + j) * D;            \
                    if (++off == block_size) { blk++; off = 0; }                                 \
                }                                                                                \
                vb pair[PV_CD(ST)];                                                              \
                for (int c = 0; c < PV_CD(ST) / 2; c++)                                          \
                    vpair(vloadb(va + 2 * VL * c), vloadb(vb_ + 2 * VL * c), &pair[2 * c],       \
                          &pair[2 * c + 1]);                                                     \
                const uint16_t *pt = pb + g0 * npad + (t - t0);                                  \
                for (int g = 0; g < PV_HEADS(ST); g++) {                                         \
                    if (g < gn) {                                                                \
                        const vbx p = vprep(vbcast_pair(pt + g * npad));                         \
                        for (int c = 0; c < PV_CD(ST); c++)                                      \
                            acc[g][c] = vdot(acc[g][c], pair[c], p);                             \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < gn; g++) {                                                       \
                const vf inv = vset1(inv_sum[g0 + g]);                                           \
                for (int c = 0; c < PV_CD(ST) / 2; c++) {                                        \
                    vf first, second;                                                            \
                    vunpair(acc[g][2 * c], acc[g][2 * c + 1], &first, &second);                  \
                    uint16_t *o = out + (g0 + g) * D + 2 * VL * c;                               \
                    vstore_bf16_part(o, vround_bf16(vmul(first, inv)), VL);                      \
                    vstore_bf16_part(o + VL, vround_bf16(vmul(second, inv)), VL);                \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
PV_KERNEL(1)
PV_KERNEL(2)
PV_KERNEL(3)
PV_KERNEL(4)
PV_KERNEL(5)
PV_KERNEL(6)
PV_KERNEL(7)
PV_KERNEL(8)

/* Decode attention (one query token per sequence) straight from the paged bf16 cache.
   Per (sequence b, kv head j): optionally rotates q and k (positions != NULL), writes the new
   k and v rows to the cache at slots[b] (skipped when -1), then attends over keys
   [max(0, L - window), L) with L = seq_lens[b] (window 0 = no window): q.k in float32,
   float32 softmax, float32 p.v; out [B, H*D] bf16.
   q/k/v rows are `*_stride` elements apart (so they can be views into a fused qkv output);
   caches [num_blocks, block_size, Hkv, D]; block_table [B, W]; cos_sin [positions, 2, D].
   scratch: `scratch_per_thread` floats per thread (>= 2 * H * (W * block_size + 16)). */
void ingot_decode_attention_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
    int64_t v_stride, const int64_t *positions, const uint16_t *cos_sin, uint16_t *kc,
    uint16_t *vc, const int64_t *slots, const int64_t *block_table, const int64_t *seq_lens,
    uint16_t *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t W,
    int64_t window, float scale, float *scratch, int64_t scratch_per_thread, int nthreads) {
    const int64_t G = H / Hkv, steps = D / 32;
    /* With enough sequences, one task takes all kv heads of a sequence and reads each block's
       rows in order (a token's heads share cache lines: split across cores, each line is read
       into both; measured 1.4x slower at 64 sequences). Few sequences split by kv head to keep
       every core busy. */
    const int64_t per_task = B >= 4 * nthreads && H <= ATTN_MAX_QH ? Hkv : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < B * Hkv / per_task; task++) {
        const int64_t b = task * per_task / Hkv, j0 = task * per_task % Hkv, nh = per_task;
        const uint16_t *cs = positions ? cos_sin + positions[b] * 2 * D : 0;
        /* 1. the new token's k and v into the cache */
        const int64_t slot = slots ? slots[b] : -1; /* NULL: already written */
        if (slot >= 0)
            for (int64_t j = j0; j < j0 + nh; j++) {
                uint16_t *kdst = kc + (slot * Hkv + j) * D;
                const uint16_t *ksrc = k + b * k_stride + j * D;
                if (cs) rope_head(ksrc, cs, kdst, D);
                else memcpy(kdst, ksrc, D * 2);
                memcpy(vc + (slot * Hkv + j) * D, v + b * v_stride + j * D, D * 2);
            }
        /* 2. the task's queries (heads j0*G ..), rotated, as bf16 pairs */
        uint16_t qh[ATTN_MAX_QH][ATTN_MAX_D] __attribute__((aligned(64)));
        for (int64_t h = 0; h < nh * G; h++) {
            const uint16_t *qsrc = q + b * q_stride + (j0 * G + h) * D;
            if (cs) rope_head(qsrc, cs, qh[h], D);
            else memcpy(qh[h], qsrc, D * 2);
        }
        int64_t L = seq_lens[b];
        if (L > W * block_size) L = W * block_size;
        if (L < 1) L = 1;
        const int64_t t0 = window > 0 && L > window ? L - window : 0, n = L - t0;
        const int64_t npad = (n + 15) / 16 * 16, rows = nh * G;
        float *sc = scratch + (int64_t)omp_get_thread_num() * scratch_per_thread; /* [rows, npad] */
        uint16_t *pb = (uint16_t *)(sc + rows * npad); /* [rows, npad] bf16 probabilities */
        const int64_t *table = block_table + b * W;
        const int64_t row = Hkv * D; /* elements between consecutive tokens of a block */
        /* 3. scores */
        const uint16_t *qq = &qh[0][0];
        const int64_t vd = vc - kc;
        switch (steps) {
        case 1: qk_1(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 2: qk_2(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 3: qk_3(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 4: qk_4(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 5: qk_5(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 6: qk_6(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        case 7: qk_7(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        default: qk_8(kc, table, block_size, Hkv, j0, nh, D, t0, L, qq, G, scale, sc, npad, vd); break;
        }
        /* 4. softmax in float32 */
        float inv_sum[ATTN_MAX_QH];
        for (int64_t g = 0; g < rows; g++) {
            float *sg = sc + g * npad;
            vf mx = vset1(-INFINITY);
            for (int64_t i = 0; i < n; i += VL) mx = vmax_in(mx, vtail(n - i), vload(sg + i));
            const vf m = vset1(vhmax(mx));
            vf z = vzero();
            for (int64_t i = 0; i < npad; i += VL) {
                const vf e = vkeep(vtail(n - i), exp_ps(vsub(vload(sg + i), m)));
                vstore_bf16_part(pb + g * npad + i, vround_bf16(e), VL);
                z = vadd(z, e);
            }
            inv_sum[g] = 1.0f / vhsum(z);
        }
        for (int64_t j = j0; j < j0 + nh; j++) {
            const uint16_t *pj = pb + (j - j0) * G * npad;
            const float *ij = inv_sum + (j - j0) * G;
            /* 5. p.v in float32 (D is a multiple of 32 and at most 256) */
            uint16_t *o = out + b * H * D + j * G * D;
            switch (steps) {
            case 1: pv_1(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 2: pv_2(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 3: pv_3(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 4: pv_4(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 5: pv_5(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 6: pv_6(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 7: pv_7(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            default: pv_8(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* out[m] = index of the largest of x[m, :N] (bf16), the first one on ties and the first NaN if
   any, as torch.argmax. Rows run in parallel; torch's own argmax takes ~9 ms on 64 x 49152 bf16
   logits here, this ~1 ms. Lane indices are kept as floats (exact below 2^24; longer rows take
   the scalar loop). */
void ingot_argmax_bf16(const uint16_t *x, int64_t *out, int64_t M, int64_t N, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * N;
        if (N >= (1 << 24)) {
            int64_t arg = 0;
            for (int64_t n = 0; n < N; n++) {
                const float f = from_bf16(row[n]);
                if (isnan(f)) { arg = n; break; }
                if (f > from_bf16(row[arg])) arg = n;
            }
            out[m] = arg;
            continue;
        }
        vf best = vset1(-INFINITY), best_i = vset1(-1.0f), idx = viota();
        vm any_nan = visnan(vzero());
        for (int64_t n = 0; n < N; n += VL) {
            const vm mk = vtail(N - n);
            const vf v = vload_bf16_part(row + n, N - n);
            any_nan = vmor(any_nan, vmand(mk, visnan(v)));
            /* strictly greater (or the lane's first value): keeps the first index on ties */
            const vm take = vmand(mk, vmor(vcmpgt(v, best), vcmpgt(vzero(), best_i)));
            best = vblend(take, best, v);
            best_i = vblend(take, best_i, idx);
            idx = vadd(idx, vset1((float)VL));
        }
        if (vmany(any_nan)) {
            int64_t n = 0;
            while (!isnan(from_bf16(row[n]))) n++;
            out[m] = n;
            continue;
        }
        float bv[VL], bi[VL];
        vstore(bv, best);
        vstore(bi, best_i);
        int64_t arg = -1;
        float top = -INFINITY;
        for (int l = 0; l < VL; l++) {
            if (bi[l] < 0) continue;
            if (arg < 0 || bv[l] > top || (bv[l] == top && (int64_t)bi[l] < arg)) {
                top = bv[l];
                arg = (int64_t)bi[l];
            }
        }
        out[m] = arg;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The paged cache write of a prefill chunk: k/v rows [T, Hkv*D] (row strides in elements) into
   caches [num_blocks * block_size, Hkv, D] at slots[t] (-1 = padding, not written). Replaces
   torch's where + index + index_copy_ per cache (~8 ms per 128-token step, measured). */
void ingot_write_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v,
                         int64_t v_stride, uint16_t *kc, uint16_t *vc, const int64_t *slots,
                         int64_t T, int64_t row, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(kc + slot * row, k + t * k_stride, row * 2);
        memcpy(vc + slot * row, v + t * v_stride, row * 2);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* A prefill chunk's rotary and cache write in one pass: q [T, H*D] and k [T, Hkv*D] rows (row
   strides in elements, so views into a fused qkv output) rotated at positions[t] into qo
   [T, H, D] and ko [T, Hkv, D]; ko's and v's rows then go to the caches at slots[t] (-1 = not
   written). Replaces torch's rotary (gather of cos/sin, cat, neg, 2 muls, add: ~5 ms per
   128-token step of the default model, measured) and the separate write. */
void ingot_rope_write_kv_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                              int64_t k_stride, const uint16_t *v, int64_t v_stride,
                              const int64_t *positions, const uint16_t *cos_sin, uint16_t *qo,
                              uint16_t *ko, uint16_t *kc, uint16_t *vc, const int64_t *slots,
                              int64_t T, int64_t H, int64_t Hkv, int64_t D, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *cs = cos_sin + positions[t] * 2 * D;
        for (int64_t h = 0; h < H; h++) rope_head(q + t * q_stride + h * D, cs, qo + (t * H + h) * D, D);
        for (int64_t h = 0; h < Hkv; h++)
            rope_head(k + t * k_stride + h * D, cs, ko + (t * Hkv + h) * D, D);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(kc + slot * Hkv * D, ko + t * Hkv * D, Hkv * D * 2);
        memcpy(vc + slot * Hkv * D, v + t * v_stride, Hkv * D * 2);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* A mixture-of-experts block in one call: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t]))
   * up_e(x[t])) over the slots j of token t whose expert e = ids[t, j] - e0 is one of the E
   local experts (0 <= e < E; other slots contribute nothing, so an EP/TP shard's partial sum
   is exactly zero where it holds none of a token's experts). w13 [E, 2I, H] (gate rows then
   up rows), w2 [E, H, I], x/out [T, H], ids int64 / w float32 [T, K].
   1. The (token, slot) assignments are grouped by expert (a counting sort, token order kept).
   2. Gate-up and SiLU-mul: one work item per (active expert, MOE_ICHUNK rows of I), taken
      dynamically, so a skewed routing (one expert with most tokens) still spreads over every
      thread; the activations of each assignment go to a [N, I] buffer (N <= T * K).
   3. Down: one item per MOE_HCHUNK columns of out, each over every active expert in id order
      (every item costs the same whatever the routing), so each output element is written by
      one thread and accumulated in the torch path's order (expert by expert).
   Rounding follows the torch path (fused_moe.py) in bf16: gate/up/down outputs, silu, the
   product and each scaled contribution rounded to bf16, the sum in bf16 like index_add_. */
#define MOE_ICHUNK 16
#define MOE_HCHUNK 32
/* Tokens per tile: 4, else 2 (decode batches put ~2 tokens on an expert), else 1; each weight
   vector loaded once serves all of them. */
#define MOE_NT(left) ((left) >= 4 ? 4 : (left) >= 2 ? 2 : 1)

/* res[t * 4 + r] = x_t . w_r over n elements for NT (1, 2 or 4) rows of x and 4 rows of w
   (float32: the bf16 kernel reads a packed layout instead, below). */
INL void moe_tile_f32(const float *const *xr, const int NT, const float *const *wr, int64_t n,
                      float *res) {
    vf acc[16];
    for (int i = 0; i < 16; i++) acc[i] = vzero();
    for (int64_t k = 0; k < n; k += VL) {
        vf w[4];
        for (int r = 0; r < 4; r++) w[r] = vload_part(wr[r] + k, n - k);
        for (int t = 0; t < NT; t++) {
            const vf xv = vload_part(xr[t] + k, n - k);
            for (int r = 0; r < 4; r++) acc[t * 4 + r] = vfma(w[r], xv, acc[t * 4 + r]);
        }
    }
    for (int i = 0; i < 16; i += VL) vstore(res + i, vhsum_vl(acc + i));
}

/* Step 1: order[offs[e] .. offs[e + 1]) = the assignments (t * K + j) of local expert e, in
   token order. Returns the number of local assignments. */
static int64_t moe_group(const int64_t *ids, int64_t TK, int64_t e0, int64_t E, int64_t *offs,
                         int64_t *order) {
    for (int64_t e = 0; e <= E; e++) offs[e] = 0;
    for (int64_t a = 0; a < TK; a++) {
        const int64_t e = ids[a] - e0;
        if (e >= 0 && e < E) offs[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) offs[e + 1] += offs[e];
    /* offs[e] walks to offs[e + 1] while placing e's assignments; then shift it back */
    for (int64_t a = 0; a < TK; a++) {
        const int64_t e = ids[a] - e0;
        if (e >= 0 && e < E) order[offs[e]++] = a;
    }
    for (int64_t e = E; e > 0; e--) offs[e] = offs[e - 1];
    offs[0] = 0;
    return offs[E];
}

/* The float32 kernel over the plain [E, 2I, H] / [E, H, I] weights; DT the element type, TILE
   the dot-product tile, ROUND/LOAD/STORE the conversions (identity for float32). */
#define MOE_KERNEL(NAME, DT, TILE, ROUND, LOAD, STORE)                                           \
    int NAME(const DT *x, const int64_t *ids, const float *topw, const DT *w13, const DT *w2,   \
             DT *out, int64_t T, int64_t K, int64_t e0, int64_t E, int64_t H, int64_t I,         \
             int nthreads) {                                                                     \
        int64_t *offs = (int64_t *)malloc((E + 1) * sizeof(int64_t));                            \
        int64_t *order = (int64_t *)malloc((T * K + 1) * sizeof(int64_t));                       \
        if (!offs || !order) { free(offs); free(order); return -1; }                             \
        const int64_t N = moe_group(ids, T * K, e0, E, offs, order);                             \
        const int64_t ichunks = (I + MOE_ICHUNK - 1) / MOE_ICHUNK;                               \
        int64_t *items = (int64_t *)malloc((E * ichunks + 1) * sizeof(int64_t));                 \
        int64_t nitems = 0;                                                                      \
        for (int64_t e = 0; e < E; e++)                                                          \
            if (offs[e + 1] > offs[e])                                                           \
                for (int64_t c = 0; c < ichunks; c++) items[nitems++] = e * ichunks + c;         \
        DT *act = (DT *)malloc((N * I + 1) * sizeof(DT));                                        \
        if (!items || !act) { free(items); free(act); free(order); free(offs); return -1; }     \
        const int64_t hchunks = (H + MOE_HCHUNK - 1) / MOE_HCHUNK;                               \
        _Pragma("omp parallel num_threads(nthreads) if (N * H * I >= 65536)")                   \
        {                                                                                        \
            /* 2. gate-up, silu * up: act[a, i] for the item's expert and rows */                \
            _Pragma("omp for schedule(dynamic, 1)")                                              \
            for (int64_t it = 0; it < nitems; it++) {                                            \
                const int64_t e = items[it] / ichunks, i0 = (items[it] % ichunks) * MOE_ICHUNK; \
                const int64_t i1 = i0 + MOE_ICHUNK < I ? i0 + MOE_ICHUNK : I;                    \
                const DT *we = w13 + e * 2 * I * H;                                              \
                for (int64_t a = offs[e]; a < offs[e + 1];) {                                    \
                    const int nt = MOE_NT(offs[e + 1] - a);                                      \
                    const DT *xr[4];                                                             \
                    for (int t = 0; t < nt; t++) xr[t] = x + (order[a + t] / K) * H;             \
                    for (int64_t i = i0; i < i1; i += 2) {                                       \
                        const int64_t i2 = i + 1 < i1 ? i + 1 : i; /* odd tail: row repeated */  \
                        const DT *wr[4] = {we + i * H, we + i2 * H, we + (I + i) * H,            \
                                           we + (I + i2) * H};                                   \
                        float res[16];                                                           \
                        if (nt == 4) TILE(xr, 4, wr, H, res);                                    \
                        else if (nt == 2) TILE(xr, 2, wr, H, res);                               \
                        else TILE(xr, 1, wr, H, res);                                            \
                        for (int t = 0; t < nt; t++)                                             \
                            for (int64_t r = 0; r <= i2 - i; r++) {                              \
                                const float g = ROUND(res[t * 4 + r]);                           \
                                const float u = ROUND(res[t * 4 + 2 + r]);                       \
                                const float s = ROUND(g / (1.0f + expf(-g)));                    \
                                act[(a + t) * I + i + r] = STORE(ROUND(s * u));                  \
                            }                                                                    \
                    }                                                                            \
                    a += nt;                                                                     \
                }                                                                                \
            }                                                                                    \
            /* 3. down and the weighted sum: columns h0 .. h1 of every token */                  \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t hc = 0; hc < hchunks; hc++) {                                           \
                const int64_t h0 = hc * MOE_HCHUNK;                                              \
                const int64_t h1 = h0 + MOE_HCHUNK < H ? h0 + MOE_HCHUNK : H;                    \
                for (int64_t t = 0; t < T; t++)                                                  \
                    for (int64_t h = h0; h < h1; h++) out[t * H + h] = STORE(0.0f);              \
                for (int64_t e = 0; e < E; e++) {                                                \
                    const DT *we = w2 + e * H * I;                                               \
                    for (int64_t a = offs[e]; a < offs[e + 1];) {                                \
                        const int nt = MOE_NT(offs[e + 1] - a);                                  \
                        const DT *ar[4];                                                         \
                        for (int t = 0; t < nt; t++) ar[t] = act + (a + t) * I;                  \
                        for (int64_t h = h0; h < h1; h += 4) {                                   \
                            const DT *wr[4];                                                     \
                            for (int r = 0; r < 4; r++)                                          \
                                wr[r] = we + (h + r < h1 ? h + r : h) * I;                       \
                            float res[16];                                                       \
                            if (nt == 4) TILE(ar, 4, wr, I, res);                                \
                            else if (nt == 2) TILE(ar, 2, wr, I, res);                           \
                            else TILE(ar, 1, wr, I, res);                                        \
                            for (int t = 0; t < nt; t++) {                                       \
                                const int64_t as = order[a + t];                                 \
                                DT *o = out + (as / K) * H;                                      \
                                for (int r = 0; r < 4 && h + r < h1; r++)                        \
                                    o[h + r] = STORE(ROUND(LOAD(o[h + r]) +                      \
                                                           ROUND(ROUND(res[t * 4 + r]) *         \
                                                                 topw[as])));                    \
                            }                                                                    \
                        }                                                                        \
                        a += nt;                                                                 \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        free(act);                                                                               \
        free(items);                                                                             \
        free(order);                                                                             \
        free(offs);                                                                              \
        return 0;                                                                                \
    }

static inline float moe_id(float f) { return f; }
MOE_KERNEL(ingot_fused_moe_f32, float, moe_tile_f32, moe_id, moe_id, moe_id)

/* The bf16 kernel reads the experts packed for vdpbf16ps with no horizontal sums
   (ingot_moe_pack_bf16): a matrix [N, K] as blocks of 16 rows, each K/2 steps of [16 rows][2]
   (row pairs of k interleaved), so one 64-byte load and a broadcast pair of x give 16 outputs'
   partial sums; a tiny hidden size (256) no longer spends most of its time reducing. w13p
   [E][2][ceil(I/16)][H/2][32] (gate, then up), w2p [E][ceil(H/16)][I/2][32]; H and I even. */
void ingot_moe_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = (N + 15) / 16, kp = K / 2;
#pragma omp parallel for schedule(static)
    for (int64_t mb = 0; mb < M * nb; mb++) {
        const int64_t m = mb / nb, b = mb % nb;
        uint16_t *dst = packed + mb * kp * 32;
        for (int64_t k = 0; k < kp; k++)
            for (int r = 0; r < 16; r++) {
                const int64_t n = b * 16 + r;
                dst[k * 32 + 2 * r] = n < N ? w[(m * N + n) * K + 2 * k] : 0;
                dst[k * 32 + 2 * r + 1] = n < N ? w[(m * N + n) * K + 2 * k + 1] : 0;
            }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* bf16 GEMM for steps of more rows than the GEMV serves (prefill, batched decode), on CPUs
   without AMX. There vdpbf16ps retires at about half the rate of float32 FMAs (measured here:
   oneDNN's bf16 GEMM ~75 GFLOP/s a core, MKL's float32 ~136), so this kernel widens the bf16
   weights to float32 in registers and multiplies with FMAs on every build: y = bf16(x . w^T +
   bias). w is packed as ingot_moe_pack_bf16 lays out one matrix ([N/16][K/2][16][2]): one pair
   vector becomes the even-k and odd-k weights of VL outputs with one shift and one mask. A
   tile is GEMM_MR rows x GEMM_NB blocks of 16 outputs (8 x 48 on AVX-512: 24 accumulators;
   4 x 16 with 8 lanes: 8 accumulators, the 4 widened weight vectors, the mask and a broadcast
   in AVX2's 16 registers; at 6 x 16 GCC spilled 4 accumulators and the model's linears at 128
   rows took 1.07-1.31 s on one Zen 3 thread against 0.84 s, MKL's float32 0.90-0.96 s); a work item is a chunk of rows x up to
   GEMM_ITEM_TILES tiles, its rows widened to float32 once per item into the thread's buffer.
   Each output is one FMA chain over k in order, the bias added before one rounding: a row's
   result does not depend on the other rows or on the tiling (batched equals alone, bit for
   bit). Items are handed out dynamically, so a thread preempted by another process leaves its
   share to the others. */
#define GEMM_SUB (16 / VL) /* pair vectors per 16-output block */
#if VL == 16
#define GEMM_MR 8
#define GEMM_NB 3
#else
#define GEMM_MR 4
#define GEMM_NB 1
#endif
#define GEMM_ITEM_TILES 4         /* tiles of outputs per work item */
#define GEMM_ITEM_ROWS 32

INL void gemm_tile_bf16(const float *xf, int64_t K, const int MR, const int NB, const uint16_t *wp,
                        int64_t kp, const float *bias, uint16_t *y, int64_t N, int64_t n0) {
    vf a[GEMM_MR][GEMM_NB * GEMM_SUB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB * GEMM_SUB; b++) a[m][b] = vzero();
    /* Each accumulator takes even then odd k, in order: a row's result does not depend on
       the tile. */
    for (int64_t k = 0; k < kp; k++) {
        vf we[GEMM_NB * GEMM_SUB], wo[GEMM_NB * GEMM_SUB];
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
#pragma GCC unroll 4
            for (int s = 0; s < GEMM_SUB; s++)
                vwiden_pairs(vloadb(wp + (b * kp + k) * 32 + 2 * VL * s), &we[b * GEMM_SUB + s],
                             &wo[b * GEMM_SUB + s]);
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
            const vf x0 = vset1(xf[m * K + 2 * k]);
#pragma GCC unroll 4
            for (int b = 0; b < NB * GEMM_SUB; b++) a[m][b] = vfma(we[b], x0, a[m][b]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
            const vf x1 = vset1(xf[m * K + 2 * k + 1]);
#pragma GCC unroll 4
            for (int b = 0; b < NB * GEMM_SUB; b++) a[m][b] = vfma(wo[b], x1, a[m][b]);
        }
    }
    for (int b = 0; b < NB * GEMM_SUB; b++) {
        const int64_t c = n0 + b * VL;
        if (c >= N) break;
        const vf bv = bias ? vload_part(bias + c, N - c) : vzero();
        for (int m = 0; m < MR; m++)
            vstore_bf16_part(y + m * N + c, vround_bf16(vadd(a[m][b], bv)), N - c);
    }
}

#if GEMM_NB == 3
#define GEMM_TILE_CASE(MR_)                                                                      \
    case MR_:                                                                                    \
        if (nbt == 3) gemm_tile_bf16(xf, K, MR_, 3, wt, kp, bias, yt, N, n0);                   \
        else if (nbt == 2) gemm_tile_bf16(xf, K, MR_, 2, wt, kp, bias, yt, N, n0);              \
        else gemm_tile_bf16(xf, K, MR_, 1, wt, kp, bias, yt, N, n0);                            \
        break;
#else
#define GEMM_TILE_CASE(MR_)                                                                      \
    case MR_: gemm_tile_bf16(xf, K, MR_, 1, wt, kp, bias, yt, N, n0); break;
#endif

int ingot_gemm_bf16(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t kp = K / 2, nblocks = (N + 15) / 16;
    const int64_t tiles = (nblocks + GEMM_NB - 1) / GEMM_NB;
    const int64_t chunks = (M + GEMM_ITEM_ROWS - 1) / GEMM_ITEM_ROWS;
    /* Narrower items for few rows (batched decode), so every thread gets several. */
    int64_t per_item = GEMM_ITEM_TILES;
    while (per_item > 1 && chunks * ((tiles + per_item - 1) / per_item) < 8 * nthreads) per_item /= 2;
    const int64_t groups = (tiles + per_item - 1) / per_item;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* this thread's float32 copy of an item's rows (kept across calls: no page faults) */
        static __thread float *xbuf = NULL;
        static __thread int64_t xcap = 0;
        if (xcap < GEMM_ITEM_ROWS * K) {
            free(xbuf);
            xbuf = (float *)aligned_alloc(64, (GEMM_ITEM_ROWS * K * sizeof(float) + 63) / 64 * 64);
            xcap = xbuf ? GEMM_ITEM_ROWS * K : 0;
        }
        if (!xbuf) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < chunks * groups; item++) {
            if (!xbuf) continue;
            const int64_t m0 = item / groups * GEMM_ITEM_ROWS;
            const int64_t rows = M - m0 < GEMM_ITEM_ROWS ? M - m0 : GEMM_ITEM_ROWS;
            const int64_t t0 = item % groups * per_item;
            const int64_t t1 = t0 + per_item < tiles ? t0 + per_item : tiles;
            /* (a partial last vector writes zeros up to the next VL floats: inside the
               64-byte-rounded buffer) */
            for (int64_t i = 0; i < rows * K; i += VL)
                vstore(xbuf + i, vload_bf16_part(x + m0 * K + i, rows * K - i));
            for (int64_t m = 0; m < rows; m += GEMM_MR) {
                const int mr = rows - m < GEMM_MR ? (int)(rows - m) : GEMM_MR;
                const float *xf = xbuf + m * K;
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t b0 = t * GEMM_NB, n0 = b0 * 16;
                    const int nbt = nblocks - b0 < GEMM_NB ? (int)(nblocks - b0) : GEMM_NB;
                    const uint16_t *wt = wp + b0 * kp * 32;
                    uint16_t *yt = y + (m0 + m) * N;
                    (void)nbt;
                    switch (mr) {
#if GEMM_MR == 8
                        GEMM_TILE_CASE(8) GEMM_TILE_CASE(7)
#endif
#if GEMM_MR >= 6
                        GEMM_TILE_CASE(6) GEMM_TILE_CASE(5)
#endif
                        GEMM_TILE_CASE(4) GEMM_TILE_CASE(3) GEMM_TILE_CASE(2) GEMM_TILE_CASE(1)
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* ag[t * MOE_SUB + s] / au[..] = x_t . (16 rows of block g / u) over kp pairs, for NT tokens
   (MOE_SUB vectors of VL rows each): two blocks and two accumulators each over even and odd
   pairs, so 4 * NT independent dot chains hide the latency (one chain per output block had
   bound the decode case on vdpbf16ps). */
#define MOE_SUB (16 / VL)
INL void moe_block2_bf16(const uint16_t *const *xr, const int NT, const uint16_t *g,
                         const uint16_t *u, int64_t kp, vf *ag, vf *au) {
    vf a[4][4][MOE_SUB];
    for (int t = 0; t < NT; t++)
        for (int j = 0; j < 4; j++)
            for (int s = 0; s < MOE_SUB; s++) a[t][j][s] = vzero();
    int64_t k = 0;
    for (; k + 1 < kp; k += 2) {
        vb wg0[MOE_SUB], wu0[MOE_SUB], wg1[MOE_SUB], wu1[MOE_SUB];
        for (int s = 0; s < MOE_SUB; s++) {
            wg0[s] = vloadb(g + k * 32 + 2 * VL * s);
            wu0[s] = vloadb(u + k * 32 + 2 * VL * s);
            wg1[s] = vloadb(g + k * 32 + 32 + 2 * VL * s);
            wu1[s] = vloadb(u + k * 32 + 32 + 2 * VL * s);
        }
        for (int t = 0; t < NT; t++) {
            const vbx x0 = vprep(vbcast_pair(xr[t] + 2 * k));
            const vbx x1 = vprep(vbcast_pair(xr[t] + 2 * k + 2));
            for (int s = 0; s < MOE_SUB; s++) {
                a[t][0][s] = vdot(a[t][0][s], wg0[s], x0);
                a[t][1][s] = vdot(a[t][1][s], wu0[s], x0);
                a[t][2][s] = vdot(a[t][2][s], wg1[s], x1);
                a[t][3][s] = vdot(a[t][3][s], wu1[s], x1);
            }
        }
    }
    if (k < kp) {
        for (int t = 0; t < NT; t++) {
            const vbx x0 = vprep(vbcast_pair(xr[t] + 2 * k));
            for (int s = 0; s < MOE_SUB; s++) {
                a[t][0][s] = vdot(a[t][0][s], vloadb(g + k * 32 + 2 * VL * s), x0);
                a[t][1][s] = vdot(a[t][1][s], vloadb(u + k * 32 + 2 * VL * s), x0);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int s = 0; s < MOE_SUB; s++) {
            ag[t * MOE_SUB + s] = vadd(a[t][0][s], a[t][2][s]);
            au[t * MOE_SUB + s] = vadd(a[t][1][s], a[t][3][s]);
        }
}

int ingot_fused_moe_bf16(const uint16_t *x, const int64_t *ids, const float *topw,
                         const uint16_t *w13p, const uint16_t *w2p, uint16_t *out, int64_t T,
                         int64_t K, int64_t e0, int64_t E, int64_t H, int64_t I, int nthreads) {
    int64_t *offs = (int64_t *)malloc((E + 1) * sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((T * K + 1) * sizeof(int64_t));
    if (!offs || !order) { free(offs); free(order); return -1; }
    const int64_t N = moe_group(ids, T * K, e0, E, offs, order);
    const int64_t ib = (I + 15) / 16, hb = (H + 15) / 16, kh = H / 2, ki = I / 2;
    int64_t *items = (int64_t *)malloc((E * ib + 1) * sizeof(int64_t));
    int64_t nitems = 0;
    for (int64_t e = 0; e < E; e++)
        if (offs[e + 1] > offs[e])
            for (int64_t c = 0; c < ib; c++) items[nitems++] = e * ib + c;
    uint16_t *act = (uint16_t *)malloc((N * I + 1) * sizeof(uint16_t));
    if (!items || !act) { free(items); free(act); free(order); free(offs); return -1; }
    const int64_t hitems = (hb + 1) / 2; /* two blocks (64 bytes of a row of out) per item */
#pragma omp parallel num_threads(nthreads) if (N * H * I >= 65536)
    {
        /* 2. gate-up, silu * up: 16 rows of act for the item's expert, every token of it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            const int64_t e = items[it] / ib, c = items[it] % ib;
            const uint16_t *g = w13p + ((e * 2 + 0) * ib + c) * kh * 32;
            const uint16_t *u = w13p + ((e * 2 + 1) * ib + c) * kh * 32;
            const int64_t cnt = I - c * 16 < 16 ? I - c * 16 : 16;
            for (int64_t a = offs[e]; a < offs[e + 1];) {
                const int nt = MOE_NT(offs[e + 1] - a);
                const uint16_t *xr[4];
                for (int t = 0; t < nt; t++) xr[t] = x + (order[a + t] / K) * H;
                vf ag[4 * MOE_SUB], au[4 * MOE_SUB];
                if (nt == 4) moe_block2_bf16(xr, 4, g, u, kh, ag, au);
                else if (nt == 2) moe_block2_bf16(xr, 2, g, u, kh, ag, au);
                else moe_block2_bf16(xr, 1, g, u, kh, ag, au);
                for (int t = 0; t < nt; t++)
                    for (int s = 0; s < MOE_SUB && s * VL < cnt; s++) {
                        const vf gv = vround_bf16(ag[t * MOE_SUB + s]), uv = vround_bf16(au[t * MOE_SUB + s]);
                        const vf e_ = exp_ps(vsub(vzero(), gv));
                        const vf sg = vround_bf16(vdiv(gv, vadd(vset1(1.0f), e_)));
                        vstore_bf16_part(act + (a + t) * I + c * 16 + s * VL, vround_bf16(vmul(sg, uv)),
                                         cnt - s * VL);
                    }
                a += nt;
            }
        }
        /* 3. down and the weighted sum: 32 columns (blocks b, b + 1) of out for every token,
           expert by expert; an odd last block is computed twice and stored once. */
#pragma omp for schedule(static)
        for (int64_t hi = 0; hi < hitems; hi++) {
            const int64_t b0 = 2 * hi, b1 = b0 + 1 < hb ? b0 + 1 : b0;
            const int64_t c0 = H - b0 * 16 < 16 ? H - b0 * 16 : 16;
            const int64_t c1 = H - b1 * 16 < 16 ? H - b1 * 16 : 16;
            for (int64_t t = 0; t < T; t++) {
                memset(out + t * H + b0 * 16, 0, (size_t)c0 * 2);
                memset(out + t * H + b1 * 16, 0, (size_t)c1 * 2);
            }
            for (int64_t e = 0; e < E; e++) {
                const uint16_t *w0 = w2p + (e * hb + b0) * ki * 32, *w1 = w2p + (e * hb + b1) * ki * 32;
                for (int64_t a = offs[e]; a < offs[e + 1];) {
                    const int nt = MOE_NT(offs[e + 1] - a);
                    const uint16_t *ar[4];
                    for (int t = 0; t < nt; t++) ar[t] = act + (a + t) * I;
                    vf y0[4 * MOE_SUB], y1[4 * MOE_SUB];
                    if (nt == 4) moe_block2_bf16(ar, 4, w0, w1, ki, y0, y1);
                    else if (nt == 2) moe_block2_bf16(ar, 2, w0, w1, ki, y0, y1);
                    else moe_block2_bf16(ar, 1, w0, w1, ki, y0, y1);
                    for (int t = 0; t < nt; t++) {
                        const int64_t as = order[a + t];
                        const vf sv = vset1(topw[as]);
                        uint16_t *o = out + (as / K) * H;
                        for (int s = 0; s < MOE_SUB; s++) {
                            const int64_t o0 = b0 * 16 + s * VL, o1 = b1 * 16 + s * VL;
                            if (c0 > s * VL) {
                                const vf v0 = vround_bf16(vmul(vround_bf16(y0[t * MOE_SUB + s]), sv));
                                vstore_bf16_part(o + o0, vround_bf16(vadd(vload_bf16_part(o + o0, c0 - s * VL), v0)),
                                                 c0 - s * VL);
                            }
                            if (b1 != b0 && c1 > s * VL) {
                                const vf v1 = vround_bf16(vmul(vround_bf16(y1[t * MOE_SUB + s]), sv));
                                vstore_bf16_part(o + o1, vround_bf16(vadd(vload_bf16_part(o + o1, c1 - s * VL), v1)),
                                                 c1 - s * VL);
                            }
                        }
                    }
                    a += nt;
                }
            }
        }
    }
    free(act);
    free(items);
    free(order);
    free(offs);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The CPU decode program's layer loop (layers/cpu_decode_program.py) in one call: the same
   kernel calls in the same order as its Python loop, so the same bits. Why: between two kernels
   the Python loop spent ~8 us per call, and in those gaps the OpenMP team went idle; a
   quantized linear after a 20 us gap measured 5 us slower than back to back (default model,
   AMX Xeon: 120 linears took 4.1 ms in the step against 2.9 ms back to back). A quantized
   linear is the quantized library's ingot_quant_linear, passed as a pointer (it is built with
   its own flags). Returns 0, or the first failing kernel's status (no memory). */
typedef int (*ingot_quant_linear_fn)(int, const void *, int, const uint8_t *, const float *,
                                     void *, int, int64_t, int64_t, int64_t, int);

typedef struct { /* one decoder layer; linears in the order qkv, o, gate_up, down */
    /* The RMSNorms' weights, as rmsnorm_rows takes them (bf16, or float32 1 + weight with
       zero_centred): in_w before attention, post_w before the MLP (its input adds the
       residual); q_w / k_w per head on q and k (NULL: none); attn_out_w / mlp_out_w on the
       attention's and the MLP's outputs before they join the residual (NULL: none; Gemma's
       sandwich norms). */
    const void *in_w, *post_w, *q_w, *k_w, *attn_out_w, *mlp_out_w;
    const void *gemv_w[4], *gemm_w[4], *quant_w[4];
    const float *bias[4];
    int32_t qtype[4]; /* GGML type id where the linear is quantized, else 0 */
    float in_eps, post_eps, qk_eps, attn_out_eps, mlp_out_eps, scale;
    int64_t window;
    const uint16_t *cos_sin; /* the layer's rotary table (Gemma's local and global differ) */
    int32_t zero_centred, act; /* act: 0 SiLU, 1 GELU (tanh) */
    uint16_t *kc, *vc;
} ingot_decode_layer_t;

typedef struct { /* one step: sizes, the step's buffers (decode program), attention metadata */
    int64_t rows, hidden, inter, qkv_size, heads, kv_heads, head_dim, block_size, width;
    const uint16_t *embedded;
    uint16_t *x, *h, *res, *qkv, *attn, *gate_up, *act, *q_rot, *k_rot; /* rot: write first */
    const int64_t *positions, *slots, *table, *seq_lens;
    float *scratch;
    int64_t per_thread;
    ingot_quant_linear_fn quant_linear;
    int32_t use_gemv, threads;
} ingot_decode_step_t;

static int decode_project(const ingot_decode_step_t *s, const ingot_decode_layer_t *l, int i,
                          const uint16_t *src, uint16_t *out, int64_t n_out, int64_t n_in) {
    if (l->qtype[i])
        return s->quant_linear(l->qtype[i], src, 1, l->quant_w[i], l->bias[i], out, 1, s->rows,
                               n_out, n_in, s->threads);
    if (s->use_gemv) {
        ingot_gemv_bf16(src, l->gemv_w[i], l->bias[i], out, s->rows, n_out, n_in, s->threads);
        return 0;
    }
    return ingot_gemm_bf16(src, l->gemm_w[i], l->bias[i], out, s->rows, n_out, n_in, s->threads);
}

int ingot_decode_layers_bf16(const ingot_decode_layer_t *layers, int64_t n_layers,
                             const ingot_decode_step_t *s) {
    const int64_t rows = s->rows, hidden = s->hidden, H = s->heads, Hkv = s->kv_heads,
                  D = s->head_dim, qkv_size = s->qkv_size;
    const int write_first = s->q_rot != NULL;
    const uint16_t *residual_in = s->embedded; /* layer 0: residual = the embedding, no add */
    int status = 0;
    for (int64_t i = 0; i < n_layers && !status; i++) {
        const ingot_decode_layer_t *l = layers + i;
        const int zc = l->zero_centred;
        if (residual_in == s->res)
            rmsnorm_rows(s->h, s->res, l->in_w, s->x, s->res, rows, hidden, l->in_eps, zc,
                         s->threads);
        else
            rmsnorm_rows(residual_in, NULL, l->in_w, s->x, NULL, rows, hidden, l->in_eps, zc,
                         s->threads);
        if ((status = decode_project(s, l, 0, s->x, s->qkv, qkv_size, hidden))) break;
        uint16_t *q = s->qkv, *k = s->qkv + H * D, *v = s->qkv + (H + Hkv) * D;
        if (l->q_w) /* per head, in place: each row's H query heads, then its Hkv key heads */
            for (int64_t m = 0; m < rows; m++) {
                rmsnorm_rows(q + m * qkv_size, NULL, l->q_w, q + m * qkv_size, NULL, H, D,
                             l->qk_eps, zc, s->threads);
                rmsnorm_rows(k + m * qkv_size, NULL, l->k_w, k + m * qkv_size, NULL, Hkv, D,
                             l->qk_eps, zc, s->threads);
            }
        if (write_first) {
            ingot_rope_write_kv_bf16(q, qkv_size, k, qkv_size, v, qkv_size, s->positions,
                                     l->cos_sin, s->q_rot, s->k_rot, l->kc, l->vc, s->slots,
                                     rows, H, Hkv, D, s->threads);
            ingot_decode_attention_bf16(s->q_rot, H * D, NULL, 0, NULL, 0, NULL, NULL, l->kc,
                                        l->vc, NULL, s->table, s->seq_lens, s->attn, rows, H, Hkv,
                                        D, s->block_size, s->width, l->window, l->scale,
                                        s->scratch, s->per_thread, s->threads);
        } else {
            ingot_decode_attention_bf16(q, qkv_size, k, qkv_size, v, qkv_size, s->positions,
                                        l->cos_sin, l->kc, l->vc, s->slots, s->table, s->seq_lens,
                                        s->attn, rows, H, Hkv, D, s->block_size, s->width,
                                        l->window, l->scale, s->scratch, s->per_thread,
                                        s->threads);
        }
        if ((status = decode_project(s, l, 1, s->attn, s->h, hidden, H * D))) break;
        if (l->attn_out_w)
            rmsnorm_rows(s->h, NULL, l->attn_out_w, s->h, NULL, rows, hidden, l->attn_out_eps,
                         zc, s->threads);
        rmsnorm_rows(s->h, residual_in, l->post_w, s->x, s->res, rows, hidden, l->post_eps, zc,
                     s->threads);
        residual_in = s->res;
        if ((status = decode_project(s, l, 2, s->x, s->gate_up, 2 * s->inter, hidden))) break;
        act_mul_rows(s->gate_up, s->act, rows, s->inter, l->act, s->threads);
        if ((status = decode_project(s, l, 3, s->act, s->h, hidden, s->inter))) break;
        if (l->mlp_out_w)
            rmsnorm_rows(s->h, NULL, l->mlp_out_w, s->h, NULL, rows, hidden, l->mlp_out_eps, zc,
                         s->threads);
    }
    return status;
}
