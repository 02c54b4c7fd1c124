/* ingot's CPU kernels for bf16 decode on CPUs with AVX512-BF16 (built by cpu_kernels.py).
 *
 * Elementwise results are rounded to bf16 at the same points as the torch ops they replace
 * (products, sums, the normalised value before the RMSNorm weight), so outputs match torch's
 * eager bf16 path except where float32 reduction order or exp's last bit differ. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vec.h" /* exp_ps */

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 maskload_bf16x16(const uint16_t *p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* Round 16 floats to bf16 (nearest even, as to_bf16) and back to float. */
static inline __m512 round_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    u = _mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u));
    /* NaN inputs keep a quiet NaN */
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(u), v);
}

/* 16 floats already on the bf16 grid -> 16 bf16 stored at p (first `n` of them). */
static inline void store_bf16x16(uint16_t *p, __m512 v, int n) {
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    if (n >= 16) _mm256_storeu_si256((__m256i *)p, h);
    else _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1u), h);
}

/* ---------------------------------------------------------------------------------------- */
/* GEMV over a weight pre-packed in blocks of GEMV_ROWS rows: block b holds rows
   b*R .. b*R+R-1 as K/32 steps of [R][32] bf16, so each thread streams one contiguous range
   and the hardware prefetcher (helped by an explicit prefetch 4 KiB ahead) keeps the memory
   bus busy: 20 GB/s on the project machine against 13.5 GB/s for the row-major walk.
   Padding rows/columns are zero. x [M, K], y [M, N] bf16; bias float32 or NULL. */
#define GEMV_ROWS 8
#define GEMV_PREFETCH_BYTES 4096

void ingot_gemv_bf16(const uint16_t *x, const uint16_t *wb, const float *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t Kp = (K + 31) / 32 * 32, nblocks = (N + GEMV_ROWS - 1) / GEMV_ROWS;
    const int64_t tail = K % 32;
    const __mmask32 tmask = tail ? (__mmask32)((1u << tail) - 1u) : 0xffffffffu;
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
            __m512 a0[GEMV_ROWS], a1[GEMV_ROWS];
            for (int r = 0; r < GEMV_ROWS; r++) a0[r] = a1[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < Kp; k += 32) {
                const __mmask32 mk = k + 32 <= K ? 0xffffffffu : tmask;
                __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(mk, x0 + k);
                __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(mk, x1 + k);
                const uint16_t *wk = blk + k * GEMV_ROWS;
                if (m == 0)
                    for (int r = 0; r < GEMV_ROWS; r++)
                        _mm_prefetch((const char *)(wk + r * 32) + GEMV_PREFETCH_BYTES, _MM_HINT_T0);
                for (int r = 0; r < GEMV_ROWS; r++) {
                    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(wk + r * 32));
                    a0[r] = _mm512_dpbf16_ps(a0[r], w, v0);
                    a1[r] = _mm512_dpbf16_ps(a1[r], w, v1);
                }
            }
            for (int r = 0; r < rows; r++) {
                float s0 = _mm512_reduce_add_ps(a0[r]), s1 = _mm512_reduce_add_ps(a1[r]);
                if (bias) s0 += bias[nb * GEMV_ROWS + r], s1 += bias[nb * GEMV_ROWS + r];
                y[m * N + nb * GEMV_ROWS + r] = to_bf16(s0);
                y[(m + 1) * N + nb * GEMV_ROWS + r] = to_bf16(s1);
            }
        }
        for (; m < M; m++) {
            const uint16_t *xm = x + m * K;
            __m512 acc[GEMV_ROWS];
            for (int r = 0; r < GEMV_ROWS; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < Kp; k += 32) {
                const __mmask32 mk = k + 32 <= K ? 0xffffffffu : tmask;
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, xm + k);
                const uint16_t *wk = blk + k * GEMV_ROWS;
                if (m == 0)
                    for (int r = 0; r < GEMV_ROWS; r++)
                        _mm_prefetch((const char *)(wk + r * 32) + GEMV_PREFETCH_BYTES, _MM_HINT_T0);
                for (int r = 0; r < GEMV_ROWS; r++)
                    acc[r] = _mm512_dpbf16_ps(
                        acc[r], (__m512bh)_mm512_loadu_si512((const void *)(wk + r * 32)), xv);
            }
            for (int r = 0; r < rows; r++) {
                float s = _mm512_reduce_add_ps(acc[r]);
                if (bias) s += bias[nb * GEMV_ROWS + r];
                y[m * N + nb * GEMV_ROWS + r] = to_bf16(s);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* out = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))) per row, h = x (+ residual, rounded to bf16
   and also written to res_out when residual is given): torch's RMSNorm with its residual add. */
void ingot_rmsnorm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w,
                        uint16_t *out, uint16_t *res_out, int64_t M, int64_t N, float eps,
                        int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * N;
        const uint16_t *rr = residual ? residual + m * N : 0;
        uint16_t *hr = residual ? res_out + m * N : 0;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t n = 0; n < N; n += 16) {
            const int cnt = N - n < 16 ? (int)(N - n) : 16;
            const __mmask16 mk = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            __m512 h = maskload_bf16x16(xr + n, mk);
            if (rr) {
                h = round_bf16x16(_mm512_add_ps(h, maskload_bf16x16(rr + n, mk)));
                store_bf16x16(hr + n, h, cnt);
            }
            ss = _mm512_fmadd_ps(h, h, ss);
        }
        const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps);
        const uint16_t *src = rr ? hr : xr;
        for (int64_t n = 0; n < N; n += 16) {
            const int cnt = N - n < 16 ? (int)(N - n) : 16;
            const __mmask16 mk = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            __m512 h = round_bf16x16(_mm512_mul_ps(maskload_bf16x16(src + n, mk), _mm512_set1_ps(r)));
            __m512 o = round_bf16x16(_mm512_mul_ps(maskload_bf16x16(w + n, mk), h));
            store_bf16x16(out + m * N + n, o, cnt);
        }
    }
}

/* out[m, i] = bf16(bf16(silu(gate)) * up) with gate = gu[m, i], up = gu[m, I + i]. Threads
   take contiguous ranges of the (row, 16-column chunk) units, so one row at batch 1 still
   uses every core, and walk them incrementally (a 64-bit division per vector had cost ~15% at
   128 rows). */
void ingot_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I, int nthreads) {
    const int64_t chunks = (I + 15) / 16, units = M * chunks;
#pragma omp parallel num_threads(nthreads) if (M * I >= 16384)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t u0 = units * tid / nt, u1 = units * (tid + 1) / nt;
        int64_t m = u0 / chunks, i = (u0 % chunks) * 16;
        for (int64_t u = u0; u < u1; u++) {
            const int cnt = I - i < 16 ? (int)(I - i) : 16;
            const __mmask16 mk = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            const __m512 g = maskload_bf16x16(gu + m * 2 * I + i, mk);
            const __m512 up = maskload_bf16x16(gu + m * 2 * I + I + i, mk);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 sg = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store_bf16x16(out + m * I + i, round_bf16x16(_mm512_mul_ps(sg, up)), cnt);
            i += 16;
            if (i >= I) { i = 0; m++; }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Lane i of the result = horizontal sum of v[i]: a shuffle tree (45 shuffles/adds for 16
   sums instead of 16 separate reductions). The tree leaves sum(v[4e + l]) at lane 4l + e. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++)
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(s4[2 * i], s4[2 * i + 1]),
                              _mm512_unpackhi_ps(s4[2 * i], s4[2 * i + 1]));
    __m512 s1 = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, s1);
}

/* NeoX rotary on one head, bf16 in and out, rounding as torch's x*cos + cat(-x2, x1)*sin:
   each product and the sum rounded to bf16. cs = [cos(D), sin(D)] bf16 of this position;
   D % 32 == 0. */
static inline void rope_head(const uint16_t *x, const uint16_t *cs, uint16_t *o, int64_t D) {
    const int64_t half = D / 2;
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t d = 0; d < half; d += 16) {
        const __m512 x1 = load_bf16x16(x + d), x2 = load_bf16x16(x + half + d);
        const __m512 c1 = load_bf16x16(cs + d), c2 = load_bf16x16(cs + half + d);
        const __m512 s1 = load_bf16x16(cs + D + d), s2 = load_bf16x16(cs + D + half + d);
        const __m512 a1 = round_bf16x16(_mm512_mul_ps(x1, c1));
        const __m512 b1 = round_bf16x16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign)), s1));
        const __m512 a2 = round_bf16x16(_mm512_mul_ps(x2, c2));
        const __m512 b2 = round_bf16x16(_mm512_mul_ps(x1, s2));
        store_bf16x16(o + d, round_bf16x16(_mm512_add_ps(a1, b1)), 16);
        store_bf16x16(o + half + d, round_bf16x16(_mm512_add_ps(a2, b2)), 16);
    }
}

#define ATTN_MAX_D 256
#define ATTN_MAX_QH 64 /* query heads one task may hold */

/* sc[(h * G + g) * npad + t - t0] = scale * q_(h, g) . k_(t, j0 + h) for keys t0 <= t < L and
   kv heads j0 .. j0 + nh - 1, 16 keys at a time (vdpbf16ps, ST = D/32 steps per key, then one
   shuffle-tree sum for the 16). Keys are walked block by block (no division per key), all nh
   heads of a 16-key group at once so a block's rows are read in order; rows QK_PREFETCH_KEYS
   ahead are prefetched, and their value rows (vdelta elements further) into L2 for p.v.
   q = [nh * G][ATTN_MAX_D] bf16, 64-byte aligned rows. */
/* Prefetch one key's rows (kv heads j0.., `lines` cache lines) into L1 and its value rows
   (vdelta elements further) into L2, then advance the (block, offset) walker. */
static inline void prefetch_key(const uint16_t *kc, const int64_t *table, int64_t block_size,
                                int64_t Hkv, int64_t j0, int64_t D, int64_t lines,
                                int64_t vdelta, int64_t *bi, int64_t *off) {
    const char *r = (const char *)(kc + ((table[*bi] * block_size + *off) * Hkv + j0) * D);
    for (int64_t c = 0; c < lines; c++) {
        _mm_prefetch(r + 64 * c, _MM_HINT_T0);
        _mm_prefetch(r + 2 * vdelta + 64 * c, _MM_HINT_T1);
    }
    if (++*off == block_size) { ++*bi; *off = 0; }
}

#define QK_PREFETCH_KEYS 32
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
        for (int64_t t = t0; t < L; t += 16) {                                                   \
            const int cnt = L - t < 16 ? (int)(L - t) : 16;                                      \
            const uint16_t *kp[16];                                                              \
            for (int i = 0; i < cnt; i++) {                                                      \
                kp[i] = kc + ((table[bi] * block_size + off) * Hkv + j0) * D;                    \
                if (++off == block_size) { bi++; off = 0; }                                      \
            }                                                                                    \
            for (int i = cnt; i < 16; i++) kp[i] = kp[0];                                        \
            for (int i = 0; i < 16 && pt < L; i++, pt++)                                         \
                prefetch_key(kc, table, block_size, Hkv, j0, D, lines, vdelta, &pbi, &poff);     \
            for (int64_t h = 0; h < nh; h++)                                                     \
                for (int64_t g = 0; g < G; g++) {                                                \
                    __m512bh qv[ST];                                                             \
                    for (int c = 0; c < ST; c++)                                                 \
                        qv[c] = (__m512bh)_mm512_load_si512(                                     \
                            (const void *)(q + (h * G + g) * ATTN_MAX_D + 32 * c));              \
                    __m512 acc[16];                                                              \
                    for (int i = 0; i < 16; i++) {                                               \
                        acc[i] = _mm512_setzero_ps();                                            \
                        for (int c = 0; c < ST; c++)                                             \
                            acc[i] = _mm512_dpbf16_ps(                                           \
                                acc[i],                                                          \
                                (__m512bh)_mm512_loadu_si512(                                    \
                                    (const void *)(kp[i] + h * D + 32 * c)),                     \
                                qv[c]);                                                          \
                    }                                                                            \
                    _mm512_storeu_ps(sc + (h * G + g) * npad + (t - t0),                         \
                                     _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));         \
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
   product (pb = [G][npad] bf16, zero past the last key) and accumulated in float32: vdpbf16ps
   takes two keys per instruction, their rows interleaved by unpacklo/hi (which leaves lane
   4l+e of the "lo" accumulator at d = 8l+e and of "hi" at d = 8l+4+e, undone on store).
   CD = D/16 accumulators per head, PV_HEADS(CD) heads per pass (24 accumulators). */
#define PV_HEADS(CD) (24 / (CD))
#define PV_KERNEL(CD)                                                                            \
    static void pv_##CD(const uint16_t *vc, const int64_t *table, int64_t block_size,           \
                        int64_t row, int64_t j, int64_t D, int64_t t0, int64_t L,               \
                        const uint16_t *pb, int64_t npad, int64_t G, const float *inv_sum,      \
                        uint16_t *out) {                                                         \
        const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16,     \
                                                3, 2, 1, 0);                                     \
        const __m512i hi_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, \
                                                11, 10, 9, 8);                                   \
        for (int64_t g0 = 0; g0 < G; g0 += PV_HEADS(CD)) {                                       \
            const int64_t gn = G - g0 < PV_HEADS(CD) ? G - g0 : PV_HEADS(CD);                    \
            __m512 acc[PV_HEADS(CD)][CD];                                                        \
            for (int g = 0; g < PV_HEADS(CD); g++)                                               \
                for (int c = 0; c < CD; c++) acc[g][c] = _mm512_setzero_ps();                    \
            int64_t blk = t0 / block_size, off = t0 % block_size;                                \
            for (int64_t t = t0; t < L; t += 2) {                                                \
                const uint16_t *va = vc + ((table[blk] * block_size + off) * (row / D) + j) * D; \
                if (++off == block_size) { blk++; off = 0; }                                     \
                const uint16_t *vb = va;                                                         \
                if (t + 1 < L) {                                                                 \
                    vb = vc + ((table[blk] * block_size + off) * (row / D) + j) * D;             \
                    if (++off == block_size) { blk++; off = 0; }                                 \
                }                                                                                \
                __m512i pair[CD];                                                                \
                for (int c = 0; c < CD / 2; c++) {                                               \
                    const __m512i a = _mm512_loadu_si512((const void *)(va + 32 * c));           \
                    const __m512i b = _mm512_loadu_si512((const void *)(vb + 32 * c));           \
                    pair[2 * c] = _mm512_unpacklo_epi16(a, b);                                   \
                    pair[2 * c + 1] = _mm512_unpackhi_epi16(a, b);                               \
                }                                                                                \
                const uint16_t *pt = pb + g0 * npad + (t - t0);                                  \
                for (int g = 0; g < PV_HEADS(CD); g++) {                                         \
                    if (g < gn) {                                                                \
                        uint32_t pp;                                                             \
                        memcpy(&pp, pt + g * npad, 4);                                           \
                        const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp);                 \
                        for (int c = 0; c < CD; c++)                                             \
                            acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)pair[c], p);       \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < gn; g++) {                                                       \
                const __m512 inv = _mm512_set1_ps(inv_sum[g0 + g]);                              \
                for (int c = 0; c < CD / 2; c++) {                                               \
                    const __m512 lo = acc[g][2 * c], hi = acc[g][2 * c + 1];                     \
                    uint16_t *o = out + (g0 + g) * D + 32 * c;                                   \
                    store_bf16x16(o, round_bf16x16(_mm512_mul_ps(                                \
                                         _mm512_permutex2var_ps(lo, lo_idx, hi), inv)), 16);     \
                    store_bf16x16(o + 16, round_bf16x16(_mm512_mul_ps(                           \
                                              _mm512_permutex2var_ps(lo, hi_idx, hi), inv)), 16);\
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
PV_KERNEL(2)
PV_KERNEL(4)
PV_KERNEL(6)
PV_KERNEL(8)
PV_KERNEL(10)
PV_KERNEL(12)
PV_KERNEL(14)
PV_KERNEL(16)


/* Decode attention (one query token per sequence) straight from the paged bf16 cache.
   Per (sequence b, kv head j): optionally rotates q and k (positions != NULL), writes the new
   k and v rows to the cache at slots[b] (skipped when -1), then attends over keys
   [max(0, L - window), L) with L = seq_lens[b] (window 0 = no window): q.k with vdpbf16ps in
   float32, float32 softmax, float32 p.v; out [B, H*D] bf16.
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
        /* 2. the task's queries (heads j0*G ..), rotated, as bf16 pairs for vdpbf16ps */
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
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 mk = (__mmask16)(n - i >= 16 ? 0xffffu : (1u << (n - i)) - 1u);
                mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_loadu_ps(sg + i));
            }
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 z = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 mk = (__mmask16)(n - i >= 16 ? 0xffffu : (1u << (n - i)) - 1u);
                __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + i), m));
                e = _mm512_maskz_mov_ps(mk, e);
                store_bf16x16(pb + g * npad + i, round_bf16x16(e), 16);
                z = _mm512_add_ps(z, e);
            }
            inv_sum[g] = 1.0f / _mm512_reduce_add_ps(z);
        }
        for (int64_t j = j0; j < j0 + nh; j++) {
            const uint16_t *pj = pb + (j - j0) * G * npad;
            const float *ij = inv_sum + (j - j0) * G;
            /* 5. p.v in float32 (D is a multiple of 32 and at most 256) */
            uint16_t *o = out + b * H * D + j * G * D;
            switch (D / 16) {
            case 2: pv_2(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 4: pv_4(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 6: pv_6(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 8: pv_8(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 10: pv_10(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 12: pv_12(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            case 14: pv_14(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            default: pv_16(vc, table, block_size, row, j, D, t0, L, pj, npad, G, ij, o); break;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* out[m] = index of the largest of x[m, :N] (bf16), the first one on ties and the first NaN if
   any, as torch.argmax. Rows run in parallel; torch's own argmax takes ~9 ms on 64 x 49152 bf16
   logits here, this ~1 ms. */
void ingot_argmax_bf16(const uint16_t *x, int64_t *out, int64_t M, int64_t N, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * N;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_i = _mm512_set1_epi32(-1);
        __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __mmask16 any_nan = 0;
        for (int64_t n = 0; n < N; n += 16) {
            const int cnt = N - n < 16 ? (int)(N - n) : 16;
            const __mmask16 mk = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            const __m512 v = maskload_bf16x16(row + n, mk);
            any_nan |= _mm512_mask_cmp_ps_mask(mk, v, v, _CMP_UNORD_Q);
            /* strictly greater (or the lane's first value): keeps the first index on ties */
            const __mmask16 take = _mm512_mask_cmp_ps_mask(mk, v, best, _CMP_GT_OQ) |
                                   (mk & _mm512_cmpeq_epi32_mask(best_i, _mm512_set1_epi32(-1)));
            best = _mm512_mask_mov_ps(best, take, v);
            best_i = _mm512_mask_mov_epi32(best_i, take, idx);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        if (any_nan) {
            int64_t n = 0;
            while (!isnan(from_bf16(row[n]))) n++;
            out[m] = n;
            continue;
        }
        float bv[16];
        int32_t bi[16];
        _mm512_storeu_ps(bv, best);
        _mm512_storeu_si512((void *)bi, best_i);
        int64_t arg = -1;
        float top = -INFINITY;
        for (int l = 0; l < 16; l++) {
            if (bi[l] < 0) continue;
            if (arg < 0 || bv[l] > top || (bv[l] == top && bi[l] < arg)) {
                top = bv[l];
                arg = bi[l];
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
static inline __attribute__((always_inline)) void moe_tile_f32(
    const float *const *xr, const int NT, const float *const *wr, int64_t n, float *res) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 mk = n - k >= 16 ? 0xffffu : (__mmask16)((1u << (n - k)) - 1u);
        __m512 w[4];
        for (int r = 0; r < 4; r++) w[r] = _mm512_maskz_loadu_ps(mk, wr[r] + k);
        for (int t = 0; t < NT; t++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mk, xr[t] + k);
            for (int r = 0; r < 4; r++) acc[t * 4 + r] = _mm512_fmadd_ps(w[r], xv, acc[t * 4 + r]);
        }
    }
    _mm512_storeu_ps(res, hsum16(acc));
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
   weights to float32 in registers and multiplies with FMAs: y = bf16(x . w^T + bias).
   w is packed as ingot_moe_pack_bf16 lays out one matrix ([N/16][K/2][16][2]): one 64-byte
   load becomes the even-k and odd-k weights of 16 outputs with one shift and one mask. A tile
   is 8 rows x 48 outputs (24 accumulators); a work item is a chunk of rows x up to 192
   outputs, its rows widened to float32 once per item into the thread's buffer. Each output is one FMA
   chain over k in order, the bias added before one rounding: a row's result does not depend
   on the other rows or on the tiling (batched equals alone, bit for bit). Items are handed
   out dynamically, so a thread preempted by another process leaves its share to the others. */
#define GEMM_MR 8
#define GEMM_NB 3                 /* 16-output blocks per tile */
#define GEMM_ITEM_TILES 4         /* tiles of outputs per work item */
#define GEMM_ITEM_ROWS 32

static inline __attribute__((always_inline)) void gemm_tile_bf16(
    const float *xf, int64_t K, const int MR, const int NB, const uint16_t *wp, int64_t kp,
    const float *bias, uint16_t *y, int64_t N, int64_t n0) {
    __m512 a[GEMM_MR][GEMM_NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) a[m][b] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t k = 0; k < kp; k++) {
        __m512 we[GEMM_NB], wo[GEMM_NB];
        for (int b = 0; b < NB; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wp + (b * kp + k) * 32));
            we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
        for (int m = 0; m < MR; m++) {
            const __m512 x0 = _mm512_set1_ps(xf[m * K + 2 * k]);
            const __m512 x1 = _mm512_set1_ps(xf[m * K + 2 * k + 1]);
            for (int b = 0; b < NB; b++) {
                a[m][b] = _mm512_fmadd_ps(we[b], x0, a[m][b]);
                a[m][b] = _mm512_fmadd_ps(wo[b], x1, a[m][b]);
            }
        }
    }
    for (int b = 0; b < NB; b++) {
        const int64_t c = n0 + b * 16;
        const int cnt = N - c < 16 ? (int)(N - c) : 16;
        const __mmask16 mask = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++)
            store_bf16x16(y + m * N + c, round_bf16x16(_mm512_add_ps(a[m][b], bv)), cnt);
    }
}

#define GEMM_TILE_CASE(MR_)                                                                      \
    case MR_:                                                                                    \
        if (nbt == 3) gemm_tile_bf16(xf, K, MR_, 3, wt, kp, bias, yt, N, n0);                   \
        else if (nbt == 2) gemm_tile_bf16(xf, K, MR_, 2, wt, kp, bias, yt, N, n0);              \
        else gemm_tile_bf16(xf, K, MR_, 1, wt, kp, bias, yt, N, n0);                            \
        break;

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
            for (int64_t i = 0; i < rows * K; i += 16) {
                const int n = rows * K - i < 16 ? (int)(rows * K - i) : 16;
                _mm512_storeu_ps(xbuf + i, n == 16 ? load_bf16x16(x + m0 * K + i)
                                                   : maskload_bf16x16(x + m0 * K + i, (__mmask16)((1u << n) - 1u)));
            }
            for (int64_t m = 0; m < rows; m += GEMM_MR) {
                const int mr = rows - m < GEMM_MR ? (int)(rows - m) : GEMM_MR;
                const float *xf = xbuf + m * K;
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t b0 = t * GEMM_NB, n0 = b0 * 16;
                    const int nbt = nblocks - b0 < GEMM_NB ? (int)(nblocks - b0) : GEMM_NB;
                    const uint16_t *wt = wp + b0 * kp * 32;
                    uint16_t *yt = y + (m0 + m) * N;
                    switch (mr) {
                        GEMM_TILE_CASE(8) GEMM_TILE_CASE(7) GEMM_TILE_CASE(6) GEMM_TILE_CASE(5)
                        GEMM_TILE_CASE(4) GEMM_TILE_CASE(3) GEMM_TILE_CASE(2) GEMM_TILE_CASE(1)
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* ag[t] / au[t] = x_t . (16 rows of block g / u) over kp pairs, for NT tokens: two blocks and
   two accumulators each over even and odd pairs, so 4 * NT independent vdpbf16ps chains hide
   its latency (one chain per output block had bound the decode case). */
static inline __attribute__((always_inline)) void moe_block2_bf16(
    const uint16_t *const *xr, const int NT, const uint16_t *g, const uint16_t *u, int64_t kp,
    __m512 *ag, __m512 *au) {
    __m512 a[4][4];
    for (int t = 0; t < NT; t++)
        for (int j = 0; j < 4; j++) a[t][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < kp; k += 2) {
        const __m512bh wg0 = (__m512bh)_mm512_loadu_si512((const void *)(g + k * 32));
        const __m512bh wu0 = (__m512bh)_mm512_loadu_si512((const void *)(u + k * 32));
        const __m512bh wg1 = (__m512bh)_mm512_loadu_si512((const void *)(g + k * 32 + 32));
        const __m512bh wu1 = (__m512bh)_mm512_loadu_si512((const void *)(u + k * 32 + 32));
        for (int t = 0; t < NT; t++) {
            uint32_t p0, p1;
            memcpy(&p0, xr[t] + 2 * k, 4);
            memcpy(&p1, xr[t] + 2 * k + 2, 4);
            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)p0);
            const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)p1);
            a[t][0] = _mm512_dpbf16_ps(a[t][0], wg0, x0);
            a[t][1] = _mm512_dpbf16_ps(a[t][1], wu0, x0);
            a[t][2] = _mm512_dpbf16_ps(a[t][2], wg1, x1);
            a[t][3] = _mm512_dpbf16_ps(a[t][3], wu1, x1);
        }
    }
    if (k < kp) {
        const __m512bh wg0 = (__m512bh)_mm512_loadu_si512((const void *)(g + k * 32));
        const __m512bh wu0 = (__m512bh)_mm512_loadu_si512((const void *)(u + k * 32));
        for (int t = 0; t < NT; t++) {
            uint32_t p0;
            memcpy(&p0, xr[t] + 2 * k, 4);
            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)p0);
            a[t][0] = _mm512_dpbf16_ps(a[t][0], wg0, x0);
            a[t][1] = _mm512_dpbf16_ps(a[t][1], wu0, x0);
        }
    }
    for (int t = 0; t < NT; t++) {
        ag[t] = _mm512_add_ps(a[t][0], a[t][2]);
        au[t] = _mm512_add_ps(a[t][1], a[t][3]);
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
            const int cnt = I - c * 16 < 16 ? (int)(I - c * 16) : 16;
            for (int64_t a = offs[e]; a < offs[e + 1];) {
                const int nt = MOE_NT(offs[e + 1] - a);
                const uint16_t *xr[4];
                for (int t = 0; t < nt; t++) xr[t] = x + (order[a + t] / K) * H;
                __m512 ag[4], au[4];
                if (nt == 4) moe_block2_bf16(xr, 4, g, u, kh, ag, au);
                else if (nt == 2) moe_block2_bf16(xr, 2, g, u, kh, ag, au);
                else moe_block2_bf16(xr, 1, g, u, kh, ag, au);
                for (int t = 0; t < nt; t++) {
                    const __m512 gv = round_bf16x16(ag[t]), uv = round_bf16x16(au[t]);
                    const __m512 e_ = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                    const __m512 sg = round_bf16x16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e_)));
                    store_bf16x16(act + (a + t) * I + c * 16, round_bf16x16(_mm512_mul_ps(sg, uv)), cnt);
                }
                a += nt;
            }
        }
        /* 3. down and the weighted sum: 32 columns (blocks b, b + 1) of out for every token,
           expert by expert; an odd last block is computed twice and stored once. */
#pragma omp for schedule(static)
        for (int64_t hi = 0; hi < hitems; hi++) {
            const int64_t b0 = 2 * hi, b1 = b0 + 1 < hb ? b0 + 1 : b0;
            const int c0 = H - b0 * 16 < 16 ? (int)(H - b0 * 16) : 16;
            const int c1 = H - b1 * 16 < 16 ? (int)(H - b1 * 16) : 16;
            const __mmask16 m0 = (__mmask16)(c0 == 16 ? 0xffffu : (1u << c0) - 1u);
            const __mmask16 m1 = (__mmask16)(c1 == 16 ? 0xffffu : (1u << c1) - 1u);
            for (int64_t t = 0; t < T; t++) {
                store_bf16x16(out + t * H + b0 * 16, _mm512_setzero_ps(), c0);
                store_bf16x16(out + t * H + b1 * 16, _mm512_setzero_ps(), c1);
            }
            for (int64_t e = 0; e < E; e++) {
                const uint16_t *w0 = w2p + (e * hb + b0) * ki * 32, *w1 = w2p + (e * hb + b1) * ki * 32;
                for (int64_t a = offs[e]; a < offs[e + 1];) {
                    const int nt = MOE_NT(offs[e + 1] - a);
                    const uint16_t *ar[4];
                    for (int t = 0; t < nt; t++) ar[t] = act + (a + t) * I;
                    __m512 y0[4], y1[4];
                    if (nt == 4) moe_block2_bf16(ar, 4, w0, w1, ki, y0, y1);
                    else if (nt == 2) moe_block2_bf16(ar, 2, w0, w1, ki, y0, y1);
                    else moe_block2_bf16(ar, 1, w0, w1, ki, y0, y1);
                    for (int t = 0; t < nt; t++) {
                        const int64_t as = order[a + t];
                        const __m512 s = _mm512_set1_ps(topw[as]);
                        uint16_t *o = out + (as / K) * H;
                        const __m512 v0 = round_bf16x16(_mm512_mul_ps(round_bf16x16(y0[t]), s));
                        store_bf16x16(o + b0 * 16, round_bf16x16(_mm512_add_ps(maskload_bf16x16(o + b0 * 16, m0), v0)), c0);
                        if (b1 != b0) {
                            const __m512 v1 = round_bf16x16(_mm512_mul_ps(round_bf16x16(y1[t]), s));
                            store_bf16x16(o + b1 * 16, round_bf16x16(_mm512_add_ps(maskload_bf16x16(o + b1 * 16, m1), v1)), c1);
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
