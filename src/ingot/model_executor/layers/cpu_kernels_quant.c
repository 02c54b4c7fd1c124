/* ingot's CPU kernels for GGUF-quantized weights served as they are (issue #33), built by
 * cpu_kernels.py (load_quant_kernels) per ISA over the vector layer of cpu_kernels_vec.h: its
 * 8-lane integer section (vq / vqf: vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with VNNI, lane
 * loops in the portable build).
 *
 * Weights: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and Q4_K, Q5_K as per-32 blocks, repacked once at
 * load (cpu_kernels.pack_quant_weight) into groups of QROWS = 8 rows. Group g, block b (32
 * weights of each of the 8 rows) is GB contiguous bytes:
 *   Q4_0 (144 B): d[8] f16 | qs[4][8 rows][4 bytes]
 *   Q4_1 (160 B): d[8] f16 | m[8] f16 | qs[4][8 rows][4 bytes]
 *   Q5_0 (176 B): d[8] f16 | qh[8 rows][4 bytes] | qs[4][8 rows][4 bytes]
 *   Q5_1 (192 B): d[8] f16 | m[8] f16 | qh[8 rows][4 bytes] | qs[4][8 rows][4 bytes]
 *   Q8_0 (272 B): d[8] f16 | qs[8][8 rows][4 int8]
 *   Q4_K (192 B): d[8] f32 | m[8] f32 | qs[4][8 rows][4 bytes]
 *   Q5_K (224 B): d[8] f32 | m[8] f32 | qh[8 rows][4 bytes] | qs[4][8 rows][4 bytes]
 *   Q6_K (320 B): d[8] f32 (weights 0-15) | d2[8] f32 (16-31) | qs[8][8 rows][4 int8]
 * Chunk c, row r, byte j of qs: low nibble = weight 8c + j, high nibble = weight 8c + 4 + j, so
 * one 32-byte load gives every lane 4 weights of its row, as llama.cpp's repacked (8x8) layouts
 * do; a 5-bit weight's fifth bit is bit 2c (low nibble) or 2c + 1 (high) of byte j of its row's
 * qh. The legacy types' bytes are the file's (the same f16 scales, the same bits): resident =
 * file size. A K-quant's 256-weight super-block (f16 d and dmin, 6-bit scale and min per 32)
 * becomes 8 blocks with d = d * scale and m = -(dmin * min) in float32 (both products exact),
 * so its blocks take the Q4_1 / Q5_1 arithmetic; resident is 4/3 (Q4_K) and 14/11 (Q5_K) of
 * the file. Q6_K's super-block (f16 d, an int8 scale per 16, 6-bit q - 32) becomes 8 blocks of
 * Q8_0's shape (q - 32 as int8) with two float32 scales d * sc, one per 16 weights (exact):
 * 320 bytes where the file has 210. Rows past N (the last group's padding) are zero blocks.
 *
 * Activations: quantized per row and per 32 (llama.cpp's Q8_1 scheme) by
 * ingot_quantize_q8_1: amax = max |x|, d = amax / 127, q = nearest-even(x * (127 / amax))
 * (0 where amax is 0), sum = sum q (int), s = d * sum.
 *
 * Each output (row n of the weight, row m of x) is, over blocks b in order, in float32 with
 * every operation rounded (this library is built with -ffp-contract=off: no fused multiply-add,
 * so every build gives the same bits, which tests/unit/test_quant_kernels.py restates):
 *   p = dw * dx;  acc = acc + p * (float)isum          (isum = sum of the 32 integer products;
 *                                                       Q4_0: sum (q - 8) qx = isum - 8 sum,
 *                                                       Q5_0: isum - 16 sum)
 *   with a min (Q4_1, Q5_1, Q4_K, Q5_K):  acc = acc + mw * sx
 *   Q6_K: the first 16 weights' sum with dw, then acc = acc + (dw2 * dx) * isum2 (the rest)
 * then + bias[n] where a bias is given. Rows are independent, so a row's result is the same
 * alone or batched, and whatever the thread count. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vec.h"

#define QROWS 8
#define QM 4 /* activation rows per tile: 4 accumulators + 4 integer sums fit the 16 ymm */
#define QPREFETCH_BYTES 2048
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q4_K = 12,
       QT_Q5_K = 13, QT_Q6_K = 14 }; /* GGML type ids */
/* A type's block layout (constants where QT is: every kernel is specialised per type) */
#define QT_F32(QT) ((QT) == QT_Q4_K || (QT) == QT_Q5_K || (QT) == QT_Q6_K) /* float32 scales */
#define QT_HALVES(QT) ((QT) == QT_Q6_K) /* a second scale for weights 16-31, after the first */
#define QT_BYTES(QT) ((QT) == QT_Q8_0 || (QT) == QT_Q6_K)      /* int8 weights, not nibbles */
#define QT_MIN(QT) ((QT) == QT_Q4_1 || (QT) == QT_Q5_1 || (QT) == QT_Q4_K || (QT) == QT_Q5_K)
#define QT_HIGH(QT) ((QT) == QT_Q5_0 || (QT) == QT_Q5_1 || (QT) == QT_Q5_K) /* 5-bit */
#define QT_OFFSET(QT) ((QT) == QT_Q4_0 ? 8 : (QT) == QT_Q5_0 ? 16 : 0)   /* q stored + offset */
#define QT_SCALES(QT) (QT_F32(QT) ? 32 : 16)                 /* bytes of 8 scales */
#define QT_HIGH_AT(QT) (QT_SCALES(QT) * (QT_MIN(QT) || QT_HALVES(QT) ? 2 : 1)) /* after scales */
#define QT_QS_AT(QT) (QT_HIGH_AT(QT) + (QT_HIGH(QT) ? 32 : 0))
#define QT_KNOWN(QT) ((QT) == QT_Q4_0 || (QT) == QT_Q4_1 || (QT) == QT_Q5_0 || (QT) == QT_Q5_1 || \
                      (QT) == QT_Q8_0 || (QT) == QT_Q4_K || (QT) == QT_Q5_K || (QT) == QT_Q6_K)

/* The 8 rows' scales (or mins) of a block at p, as float32 */
INL vqf qt_scales(const int QT, const uint8_t *p) {
    return QT_F32(QT) ? vqf_load(p) : vqf_load_f16(p);
}

int ingot_quant_lanes(void) { return VL; }
int ingot_quant_dot_kind(void) { return VQ_DOT_KIND; }

/* Bytes of one (group, block): 8 rows x 32 weights. 0 for a type this library does not take. */
int64_t ingot_quant_group_bytes(int qtype) {
    if (!QT_KNOWN(qtype)) return 0;
    return QT_QS_AT(qtype) + (QT_BYTES(qtype) ? 256 : 128);
}

/* x [M, K] (float32, or bf16 where x_bf16) -> per block of 32: xq int8 [M, K], d, s = d * sum,
   sum (int) [M, K/32]. K % 32 == 0. */
void ingot_quantize_q8_1(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *xd,
                         float *xs, int32_t *xsum, int nthreads) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t m = i / nb, b = i % nb;
        float v[32];
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + m * K + 32 * b;
            for (int j = 0; j < 32; j++) v[j] = from_bf16(src[j]);
        } else {
            memcpy(v, (const float *)x + m * K + 32 * b, sizeof v);
        }
        vf amax = vzero();
        for (int j = 0; j < 32; j += VL) amax = vmax(amax, vabs(vload(v + j)));
        const float a = vhmax(amax);
        const float d = a / 127.0f, id = a != 0.0f ? 127.0f / a : 0.0f;
        for (int j = 0; j < 32; j += VL) vstore(v + j, vround(vmul(vload(v + j), vset1(id))));
        int32_t sum = 0;
        int8_t *q = xq + m * K + 32 * b;
        for (int j = 0; j < 32; j++) {
            const int32_t qi = (int32_t)v[j];
            q[j] = (int8_t)qi;
            sum += qi;
        }
        xd[i] = d;
        xsum[i] = sum;
        xs[i] = d * (float)sum;
    }
}

/* One group (8 weight rows, nb blocks at g) against mt <= QM activation rows: acc[t] lane r =
   output (row m0 + t, weight row r). QT and mt are constants at each call (specialised). */
INL void qtile(const int QT, const int mt, const uint8_t *g, int64_t nb, int64_t GB,
               const int8_t *xq, const float *xd, const float *xs, const int32_t *xsum, int64_t K,
               int prefetch, vqf *acc) {
    for (int t = 0; t < mt; t++) acc[t] = vqf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b * GB;
        if (prefetch) vprefetch(gb + QPREFETCH_BYTES), vprefetch(gb + QPREFETCH_BYTES + 64),
                      vprefetch(gb + QPREFETCH_BYTES + 128), vprefetch(gb + QPREFETCH_BYTES + 192);
        vq isum[QM], isum2[QM];
        for (int t = 0; t < mt; t++) isum[t] = vq_set1(0);
        if (QT_HALVES(QT))
            for (int t = 0; t < mt; t++) isum2[t] = vq_set1(0);
        /* The chunk loops stay rolled (GCC otherwise computes every product of the block
           before summing, and the 4-row tiles spill to the stack). */
        if (QT_BYTES(QT)) {
#pragma GCC unroll 2
            for (int c = 0; c < 8; c++) {
                const vq w = vq_load(gb + QT_QS_AT(QT) + 32 * c);
                for (int t = 0; t < mt; t++) {
                    const vq x4 = vq_bcast4(xq + t * K + 32 * b + 4 * c);
                    if (QT_HALVES(QT) && c >= 4) isum2[t] = vq_dot_s8s8(isum2[t], w, x4);
                    else isum[t] = vq_dot_s8s8(isum[t], w, x4);
                }
            }
        } else {
            const uint8_t *qs = gb + QT_QS_AT(QT);
            const vq qh = QT_HIGH(QT) ? vq_load(gb + QT_HIGH_AT(QT)) : vq_set1(0);
#if VQ_DOT_KIND == 2
            for (int c = 0; c < 4; c++) {
                const vq p = vq_load(qs + 32 * c);
                vq lo = vq_lo_nibbles(p), hi = vq_hi_nibbles(p);
                if (QT_HIGH(QT)) lo = vq_or(lo, vq_bit4(qh, 2 * c)), hi = vq_or(hi, vq_bit4(qh, 2 * c + 1));
                for (int t = 0; t < mt; t++) {
                    const int8_t *xb = xq + t * K + 32 * b + 8 * c;
                    isum[t] = vq_dot_u8s8(isum[t], lo, vq_bcast4(xb));
                    isum[t] = vq_dot_u8s8(isum[t], hi, vq_bcast4(xb + 4));
                }
            }
#else
            /* Without VNNI: the 8 pair products per lane summed in int16 (4-bit: at most 8 x 2 x
               15 x 127 = 30480) and widened once per block (5-bit: 2 x 31 x 127 a pair, so
               once per 2 chunks, 31496): one vpmaddwd per block instead of 8, half the
               multiplier-port work that bounds the multi-row case. */
            vq s16[QM];
            for (int t = 0; t < mt; t++) s16[t] = vq_set1(0);
#pragma GCC unroll 1
            for (int c = 0; c < 4; c++) {
                const vq p = vq_load(qs + 32 * c);
                vq lo = vq_lo_nibbles(p), hi = vq_hi_nibbles(p);
                if (QT_HIGH(QT)) lo = vq_or(lo, vq_bit4(qh, 2 * c)), hi = vq_or(hi, vq_bit4(qh, 2 * c + 1));
                for (int t = 0; t < mt; t++) {
                    const int8_t *xb = xq + t * K + 32 * b + 8 * c;
                    s16[t] = vq_add_i16(s16[t], vq_mul_u8s8_i16(lo, vq_bcast4(xb)));
                    s16[t] = vq_add_i16(s16[t], vq_mul_u8s8_i16(hi, vq_bcast4(xb + 4)));
                }
                if (QT_HIGH(QT) && (c & 1))
                    for (int t = 0; t < mt; t++) isum[t] = vq_sum_i16(isum[t], s16[t]), s16[t] = vq_set1(0);
            }
            if (!QT_HIGH(QT))
                for (int t = 0; t < mt; t++) isum[t] = vq_sum_i16(isum[t], s16[t]);
#endif
        }
        const vqf dw = qt_scales(QT, gb);
        for (int t = 0; t < mt; t++) {
            const int64_t xb = t * (K / 32) + b;
            vq s = isum[t];
            if (QT_OFFSET(QT)) s = vq_sub(s, vq_set1(QT_OFFSET(QT) * xsum[xb]));
            acc[t] = vqf_add(acc[t], vqf_mul(vqf_mul(dw, vqf_set1(xd[xb])), vq_tofloat(s)));
        }
        if (QT_HALVES(QT)) {
            const vqf dw2 = qt_scales(QT, gb + QT_SCALES(QT));
            for (int t = 0; t < mt; t++)
                acc[t] = vqf_add(acc[t], vqf_mul(vqf_mul(dw2, vqf_set1(xd[t * (K / 32) + b])),
                                                 vq_tofloat(isum2[t])));
        }
        if (QT_MIN(QT)) {
            const vqf mw = qt_scales(QT, gb + QT_SCALES(QT));
            for (int t = 0; t < mt; t++)
                acc[t] = vqf_add(acc[t], vqf_mul(mw, vqf_set1(xs[t * (K / 32) + b])));
        }
    }
}

#define QTILE_CASES(QT)                                                                       \
    switch (mt) {                                                                             \
    case 4: qtile(QT, 4, g, nb, GB, xqm, xdm, xsm, xsumm, K, pf, acc); break;                 \
    case 3: qtile(QT, 3, g, nb, GB, xqm, xdm, xsm, xsumm, K, pf, acc); break;                 \
    case 2: qtile(QT, 2, g, nb, GB, xqm, xdm, xsm, xsumm, K, pf, acc); break;                 \
    default: qtile(QT, 1, g, nb, GB, xqm, xdm, xsm, xsumm, K, pf, acc); break;                \
    }

/* y [M, N] (float32, or bf16 where y_bf16) = x W^T (+ bias, float32 or NULL) from x's Q8_1
   blocks (ingot_quantize_q8_1) and W repacked (above). Threads take groups of 8 weight rows
   in guided chunks, each group against every activation row in tiles of QM (the group's bytes
   stay in L1 between tiles). Guided: the first chunks are long runs of the weight, which the
   hardware prefetcher streams best, and the last are short, so a thread another process
   preempts leaves its share to the others (measured, the default model's Q4_1 shapes from
   DRAM, 1 row, 2 threads: 1.10-1.13x dynamic chunks of 1/16 of the groups). Returns -1 for a
   type this library does not take, else 0. */
int ingot_quant_matmul(int qtype, const int8_t *xq, const float *xd, const float *xs,
                       const int32_t *xsum, const uint8_t *w, const float *bias, void *y,
                       int y_bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t GB = ingot_quant_group_bytes(qtype), nb = K / 32;
    if (GB == 0) return -1;
    const int64_t groups = (N + QROWS - 1) / QROWS;
#pragma omp parallel for schedule(guided, 2) num_threads(nthreads)
    for (int64_t gi = 0; gi < groups; gi++) {
        const uint8_t *g = w + gi * nb * GB;
        const int64_t rows = N - gi * QROWS < QROWS ? N - gi * QROWS : QROWS;
        for (int64_t m0 = 0; m0 < M; m0 += QM) {
            const int mt = M - m0 < QM ? (int)(M - m0) : QM;
            const int8_t *xqm = xq + m0 * K;
            const float *xdm = xd + m0 * nb, *xsm = xs + m0 * nb;
            const int32_t *xsumm = xsum + m0 * nb;
            const int pf = m0 == 0;
            vqf acc[QM];
            switch (qtype) {
            case QT_Q4_0: QTILE_CASES(QT_Q4_0) break;
            case QT_Q4_1: QTILE_CASES(QT_Q4_1) break;
            case QT_Q5_0: QTILE_CASES(QT_Q5_0) break;
            case QT_Q5_1: QTILE_CASES(QT_Q5_1) break;
            case QT_Q4_K: QTILE_CASES(QT_Q4_K) break;
            case QT_Q5_K: QTILE_CASES(QT_Q5_K) break;
            case QT_Q6_K: QTILE_CASES(QT_Q6_K) break;
            default: QTILE_CASES(QT_Q8_0) break;
            }
            for (int t = 0; t < mt; t++) {
                float out[QROWS];
                vqf_store(out, acc[t]);
                const int64_t base = (m0 + t) * N + gi * QROWS;
                for (int64_t r = 0; r < rows; r++) {
                    float v = out[r];
                    if (bias) v = v + bias[gi * QROWS + r];
                    if (y_bf16) ((uint16_t *)y)[base + r] = to_bf16(v);
                    else ((float *)y)[base + r] = v;
                }
            }
        }
    }
    return 0;
}

/* ---- AMX (Xeons with amx_int8; built where the CPU has it) --------------------------------
   A step of many rows multiplies each 32-weight block on AMX tiles: per block, a 16 x 16 tile of
   int32 dot products (16 activation rows x 16 weight rows, TDPBSUD: signed activations x the
   unsigned nibbles; TDPBSSD for Q8_0) is stored and scaled in the same float32 order as qtile's
   lanes (p = dw dx; acc = acc + p isum; Q4_1 acc = acc + mw sx). The integer sums are exact
   either way, so a row's bits are the integer dots' whatever the batch (tested). The B tile of
   a block is the repacked bytes as they lie: chunk c of two groups gives two tile rows (K
   quads 2c and 2c + 1: the low and the high nibbles). */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static int amx_min_rows = 0; /* 0: off (ingot_quant_amx_setup) */

/* Asks Linux once for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) and, where
   granted, serves steps of at least min_rows rows on AMX (0: never). Returns 1 where AMX is on. */
int ingot_quant_amx_setup(int min_rows) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_min_rows = granted ? min_rows : 0;
    return amx_min_rows > 0;
}

/* One item: 32 weight rows (4 groups, two 16-row n-tiles h) against every activation row.
   Its blocks' B tiles and scales are laid out once (bt, dw, mw: per block and n-tile); then per
   16-row m-tile and n-tile, 16 accumulators stay in registers across the blocks. */
INL void amx_item(int qtype, const int8_t *xq, const float *xd, const float *xs,
                  const int32_t *xsum, const uint8_t *w, const float *bias, void *y, int y_bf16,
                  int64_t M, int64_t N, int64_t K, int64_t it, uint8_t *bt, float *dw, float *mw) {
    const int64_t GB = ingot_quant_group_bytes(qtype), nb = K / 32;
    const int64_t groups = (N + QROWS - 1) / QROWS, mtiles = (M + 15) / 16;
    for (int64_t b = 0; b < nb; b++)
        for (int h = 0; h < 2; h++) {
            uint8_t *t = bt + (b * 2 + h) * 512;
            for (int q = 0; q < 2; q++) {
                const int64_t g = 4 * it + 2 * h + q;
                const uint8_t *gb = g < groups ? w + (g * nb + b) * GB : NULL;
                float *d = dw + (b * 2 + h) * 16 + 8 * q, *m = mw + (b * 2 + h) * 16 + 8 * q;
                _mm256_storeu_ps(d, gb ? qt_scales(qtype, gb) : _mm256_setzero_ps());
                _mm256_storeu_ps(m, gb && QT_MIN(qtype) ? qt_scales(qtype, gb + QT_SCALES(qtype))
                                                        : _mm256_setzero_ps());
                if (qtype == QT_Q8_0) {
                    for (int c = 0; c < 8; c++) {
                        const __m256i p = gb ? _mm256_loadu_si256((const __m256i *)(gb + 16 + 32 * c))
                                             : _mm256_setzero_si256();
                        _mm256_store_si256((__m256i *)(t + 64 * c + 32 * q), p);
                    }
                } else {
                    const uint8_t *qs = gb ? gb + QT_QS_AT(qtype) : NULL;
                    const vq qh = gb && QT_HIGH(qtype) ? vq_load(gb + QT_HIGH_AT(qtype)) : vq_set1(0);
                    for (int c = 0; c < 4; c++) {
                        const __m256i p = qs ? _mm256_loadu_si256((const __m256i *)(qs + 32 * c))
                                             : _mm256_setzero_si256();
                        __m256i lo = vq_lo_nibbles(p), hi = vq_hi_nibbles(p);
                        if (QT_HIGH(qtype)) lo = vq_or(lo, vq_bit4(qh, 2 * c)), hi = vq_or(hi, vq_bit4(qh, 2 * c + 1));
                        _mm256_store_si256((__m256i *)(t + 64 * (2 * c) + 32 * q), lo);
                        _mm256_store_si256((__m256i *)(t + 64 * (2 * c + 1) + 32 * q), hi);
                    }
                }
            }
        }
    int32_t isum[4][16][16] __attribute__((aligned(64)));
    for (int64_t mt = 0; mt < mtiles; mt++) {
        /* per-row scalars of the padding rows: the last real row's (their sums are 0, their
           outputs not written) */
        int64_t row[16];
        for (int i = 0; i < 16; i++) row[i] = mt * 16 + i < M ? mt * 16 + i : M - 1;
        const int8_t *xt = xq + mt * 16 * K;
        for (int h = 0; h < 2; h++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            /* 4 blocks' tiles in flight (C tiles 0-3, A/B pairs 4/5 and 6/7), then their sums
               scaled block by block in order: a tile's store is not waited on per block */
            for (int64_t b0 = 0; b0 < nb; b0 += 4) {
                const int64_t nj = nb - b0 < 4 ? nb - b0 : 4;
#define AMX_TDP(C, A, B, blk)                                                                    \
    do {                                                                                         \
        _tile_zero(C);                                                                           \
        _tile_loadd(A, xt + 32 * (blk), K);                                                      \
        _tile_loadd(B, bt + ((blk) * 2 + h) * 512, 64);                                          \
        if (qtype == QT_Q8_0) _tile_dpbssd(C, A, B);                                             \
        else _tile_dpbsud(C, A, B);                                                              \
    } while (0)
                AMX_TDP(0, 4, 5, b0);
                if (nj > 1) AMX_TDP(1, 6, 7, b0 + 1);
                if (nj > 2) AMX_TDP(2, 4, 5, b0 + 2);
                if (nj > 3) AMX_TDP(3, 6, 7, b0 + 3);
#undef AMX_TDP
                _tile_stored(0, isum[0], 64);
                if (nj > 1) _tile_stored(1, isum[1], 64);
                if (nj > 2) _tile_stored(2, isum[2], 64);
                if (nj > 3) _tile_stored(3, isum[3], 64);
                for (int64_t j = 0; j < nj; j++) {
                    const int64_t b = b0 + j;
                    const __m512 d = _mm512_loadu_ps(dw + (b * 2 + h) * 16);
                    const __m512 mn = _mm512_loadu_ps(mw + (b * 2 + h) * 16);
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) {
                        const int64_t xb = row[i] * nb + b;
                        __m512i si = _mm512_load_si512(isum[j][i]);
                        if (QT_OFFSET(qtype))
                            si = _mm512_sub_epi32(si, _mm512_set1_epi32(QT_OFFSET(qtype) * xsum[xb]));
                        const __m512 p = _mm512_mul_ps(d, _mm512_set1_ps(xd[xb]));
                        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(p, _mm512_cvtepi32_ps(si)));
                        if (QT_MIN(qtype))
                            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(mn, _mm512_set1_ps(xs[xb])));
                    }
                }
            }
            const int64_t n0 = it * 32 + 16 * h;
            for (int i = 0; i < 16 && mt * 16 + i < M; i++) {
                const int64_t m = mt * 16 + i;
                if (n0 + 16 <= N) { /* a whole tile's row: + bias, rounded as to_bf16, 16 at once */
                    __m512 v = acc[i];
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
                    if (y_bf16) vstore_bf16_part((uint16_t *)y + m * N + n0, vround_bf16(v), 16);
                    else _mm512_storeu_ps((float *)y + m * N + n0, v);
                    continue;
                }
                float out[16];
                _mm512_storeu_ps(out, acc[i]);
                for (int64_t j = 0; j < 16 && n0 + j < N; j++) {
                    float v = out[j];
                    if (bias) v = v + bias[n0 + j];
                    if (y_bf16) ((uint16_t *)y)[m * N + n0 + j] = to_bf16(v);
                    else ((float *)y)[m * N + n0 + j] = v;
                }
            }
        }
    }
}

#define AMX_ITEM_CASE(QT) amx_item(QT, xq, xd, xs, xsum, w, bias, y, y_bf16, M, N, K, it, bt, dw, mw)

/* xq has M rounded up to 16 rows (the padding rows zero). Threads take items of 32 weight rows
   (dynamic: a thread another process preempts leaves its share to the others). */
static int amx_matmul(int qtype, const int8_t *xq, const float *xd, const float *xs,
                      const int32_t *xsum, const uint8_t *w, const float *bias, void *y,
                      int y_bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / 32, groups = (N + QROWS - 1) / QROWS, items = (groups + 3) / 4;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* C: 16 x 16 int32 */
        for (int t = 4; t < 8; t += 2) {
            cfg.rows[t] = 16, cfg.colsb[t] = 32;        /* A: 16 activation rows x one block */
            cfg.rows[t + 1] = 8, cfg.colsb[t + 1] = 64; /* B: 8 quads of K x 16 weight rows */
        }
        _tile_loadconfig(&cfg);
        uint8_t *bt = aligned_alloc(64, (size_t)nb * 1024 + (size_t)nb * 256);
        float *dw = bt ? (float *)(bt + nb * 1024) : NULL, *mw = dw ? dw + nb * 32 : NULL;
        if (!bt) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!bt) continue;
            switch (qtype) {
            case QT_Q4_0: AMX_ITEM_CASE(QT_Q4_0); break;
            case QT_Q4_1: AMX_ITEM_CASE(QT_Q4_1); break;
            case QT_Q5_0: AMX_ITEM_CASE(QT_Q5_0); break;
            case QT_Q5_1: AMX_ITEM_CASE(QT_Q5_1); break;
            case QT_Q4_K: AMX_ITEM_CASE(QT_Q4_K); break;
            case QT_Q5_K: AMX_ITEM_CASE(QT_Q5_K); break;
            default: AMX_ITEM_CASE(QT_Q8_0); break;
            }
        }
        free(bt);
        _tile_release();
    }
    return failed ? -2 : 0;
}
#else
int ingot_quant_amx_setup(int min_rows) { (void)min_rows; return 0; }
#endif

/* Both steps in one call (one ctypes call per linear): x [M, K] (float32, or bf16 where
   x_bf16) quantized into buffers of its own, then ingot_quant_matmul (or, from the rows
   ingot_quant_amx_setup set, the AMX tiles). Returns -2 where the buffers could not be
   allocated, -1 for a type this library does not take, else 0. */
int ingot_quant_linear(int qtype, const void *x, int x_bf16, const uint8_t *w, const float *bias,
                       void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (ingot_quant_group_bytes(qtype) == 0) return -1;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    /* (Q6_K's two scales a block take the integer dots at every row count) */
    const int amx = amx_min_rows > 0 && M >= amx_min_rows && qtype != QT_Q6_K;
#else
    const int amx = 0;
#endif
    const int64_t Mp = amx ? (M + 15) / 16 * 16 : M; /* tiles read whole 16-row tiles */
    const int64_t nblk = M * (K / 32);
    int8_t *xq = malloc((size_t)(Mp * K) + (size_t)nblk * 12);
    if (!xq) return -2;
    float *xd = (float *)(xq + Mp * K), *xs = xd + nblk; /* Mp K is a multiple of 32: aligned */
    int32_t *xsum = (int32_t *)(xs + nblk);
    ingot_quantize_q8_1(x, x_bf16, M, K, xq, xd, xs, xsum, nthreads);
    int status;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (amx) {
        memset(xq + M * K, 0, (size_t)((Mp - M) * K));
        status = amx_matmul(qtype, xq, xd, xs, xsum, w, bias, y, y_bf16, M, N, K, nthreads);
    } else
#endif
        status = ingot_quant_matmul(qtype, xq, xd, xs, xsum, w, bias, y, y_bf16, M, N, K,
                                    nthreads);
    free(xq);
    return status;
}

/* Lane r of the (group, block) at gb, dequantized -> 32 values stored at y + at (float32, or
   bf16 where y_bf16): the gguf package's dequantization (Q8_0 d q, Q4_0 d (q - 8), Q5_0
   d (q - 16), Q4_1 / Q5_1 d q + m; Q4_K / Q5_K (d scale) q - dmin min, here d q + m with the
   block's float32 d and m), each value one rounding from the stored scales and integers (then
   once more to bf16). The row's 8 runs of 4 bytes are gathered in the file's weight order, then
   scaled VL at a time (the scalar version took ~2 cycles a weight: most of a 128-token
   prefill's time on AMX). QT is a constant at each call (specialised). */
INL void dequantize_lane(const int QT, const uint8_t *gb, int64_t r, void *y, int y_bf16,
                         int64_t at) {
    float sd, sm = 0.0f; /* sm: the min, or Q6_K's second scale */
    if (QT_F32(QT)) {
        memcpy(&sd, gb + 4 * r, 4);
        if (QT_MIN(QT) || QT_HALVES(QT)) memcpy(&sm, gb + 32 + 4 * r, 4);
    } else {
        uint16_t h;
        memcpy(&h, gb + 2 * r, 2);
        sd = from_fp16(h);
        if (QT_MIN(QT)) {
            memcpy(&h, gb + 16 + 2 * r, 2);
            sm = from_fp16(h);
        }
    }
    const vf d = vset1(sd), m = vset1(sm);
    uint8_t q[32] __attribute__((aligned(32)));
    if (QT_BYTES(QT)) {
        for (int c = 0; c < 8; c++) memcpy(q + 4 * c, gb + QT_QS_AT(QT) + 32 * c + 4 * r, 4);
    } else {
        const uint8_t *qs = gb + QT_QS_AT(QT);
        uint32_t qh = 0;
        if (QT_HIGH(QT)) memcpy(&qh, gb + QT_HIGH_AT(QT) + 4 * r, 4);
        for (int c = 0; c < 4; c++) {
            uint32_t v;
            memcpy(&v, qs + 32 * c + 4 * r, 4);
            /* byte j's bits 2c and 2c + 1 of qh, moved to bit 4 of byte j */
            const uint32_t lo = (v & 0x0f0f0f0fu) | (((qh >> (2 * c)) & 0x01010101u) << 4),
                           hi = ((v >> 4) & 0x0f0f0f0fu) | (((qh >> (2 * c + 1)) & 0x01010101u) << 4);
            memcpy(q + 8 * c, &lo, 4);
            memcpy(q + 8 * c + 4, &hi, 4);
        }
    }
    for (int i = 0; i < 32; i += VL) {
        vf v = QT_BYTES(QT) ? vload_s8((const int8_t *)q + i) : vload_u8(q + i);
        if (QT_OFFSET(QT)) v = vsub(v, vset1((float)QT_OFFSET(QT))); /* exact: small integers */
        v = vmul(QT_HALVES(QT) && i >= 16 ? m : d, v);
        if (QT_MIN(QT)) v = vadd(v, m);
        if (y_bf16) vstore_bf16_part((uint16_t *)y + at + i, vround_bf16(v), VL);
        else vstore((float *)y + at + i, v);
    }
}

#define DEQUANTIZE_LANE(qtype, ...)                                                            \
    switch (qtype) {                                                                           \
    case QT_Q4_0: dequantize_lane(QT_Q4_0, __VA_ARGS__); break;                                \
    case QT_Q4_1: dequantize_lane(QT_Q4_1, __VA_ARGS__); break;                                \
    case QT_Q5_0: dequantize_lane(QT_Q5_0, __VA_ARGS__); break;                                \
    case QT_Q5_1: dequantize_lane(QT_Q5_1, __VA_ARGS__); break;                                \
    case QT_Q4_K: dequantize_lane(QT_Q4_K, __VA_ARGS__); break;                                \
    case QT_Q5_K: dequantize_lane(QT_Q5_K, __VA_ARGS__); break;                                \
    case QT_Q6_K: dequantize_lane(QT_Q6_K, __VA_ARGS__); break;                                \
    default: dequantize_lane(QT_Q8_0, __VA_ARGS__); break;                                     \
    }

/* W repacked (above) -> dense y [N, K] (float32, or bf16 where y_bf16), each value the gguf
   package's dequantization in float32 rounded once (dequantize_lane): the weight a step of many
   rows multiplies by a dense GEMM (oneDNN's AMX bf16 is several times this library's integer
   dots at hundreds of rows), made per call instead of kept. Threads take groups of 8 rows.
   Returns -1 for a type this library does not take, else 0. */
int ingot_quant_dequantize(int qtype, const uint8_t *w, void *y, int y_bf16, int64_t N,
                           int64_t K, int nthreads) {
    const int64_t GB = ingot_quant_group_bytes(qtype), nb = K / 32;
    if (GB == 0) return -1;
    const int64_t groups = (N + QROWS - 1) / QROWS;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t rows = N - gi * QROWS < QROWS ? N - gi * QROWS : QROWS;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *gb = w + (gi * nb + b) * GB;
            for (int64_t r = 0; r < rows; r++)
                DEQUANTIZE_LANE(qtype, gb, r, y, y_bf16, (gi * QROWS + r) * K + 32 * b)
        }
    }
    return 0;
}

/* Rows ids[0..T) of W (N rows) dequantized as ingot_quant_dequantize's -> y [T, K]: the lookup
   of a quantized embedding table, which reads only those rows' blocks (15 torch ops had taken
   ~150 us per decode step on the default model). Returns -1 for a type this library does not
   take, -3 (nothing written) where an id is outside [0, N), else 0. */
int ingot_quant_dequantize_rows(int qtype, const uint8_t *w, int64_t N, const int64_t *ids,
                                int64_t T, void *y, int y_bf16, int64_t K, int nthreads) {
    const int64_t GB = ingot_quant_group_bytes(qtype), nb = K / 32;
    if (GB == 0) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -3;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * K >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const int64_t g = ids[t] / QROWS, r = ids[t] % QROWS;
        for (int64_t b = 0; b < nb; b++)
            DEQUANTIZE_LANE(qtype, w + (g * nb + b) * GB, r, y, y_bf16, t * K + 32 * b)
    }
    return 0;
}
