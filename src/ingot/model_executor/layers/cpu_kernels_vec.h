/* The small vector layer ingot's CPU kernels are written over, one section per ISA a build
 * targets, each giving the same names:
 *   float vectors  vf (VL lanes): vload/vstore/vfma/... ; lane masks vm; vhsum/vhmax;
 *   bf16           vload_bf16_part / vstore_bf16_part (VL bf16 widened by a 16-bit shift /
 *                  a vector already on the bf16 grid narrowed), vround_bf16 (nearest even);
 *   bf16 pairs     vb (VL pairs of bf16, 2 VL elements), vbx (a pair operand prepared once,
 *                  e.g. a broadcast x pair), vdot (acc + w.even * x.even + w.odd * x.odd per
 *                  lane: AVX512-BF16's vdpbf16ps, elsewhere widened to float32 and two FMAs),
 *                  vpair / vunpair (two rows of bf16 interleaved into pairs, and the float32
 *                  results put back in row order);
 *   reductions     vhsum_vl (lane i = the sum of vector i, for VL vectors);
 * and the vector e^x every kernel uses. Sections:
 *   AVX-512 (16 lanes, k-masks), with vdpbf16ps where __AVX512BF16__, widening otherwise;
 *   AVX2 + FMA (8 lanes, masks as all-ones lanes, bf16 always widened);
 *   portable (GCC vector extensions, 8 lanes: plain C the compiler vectorises for whatever
 *   target it builds for; the reference, and the build for CPUs with none of the above).
 * An ARM build (NEON: 4 lanes, vfmaq_f32, BFMMLA/BFDOT where FEAT_BF16; SVE: sizeless types,
 * predicates as vm) would be one more section here giving these names; the kernels in
 * cpu_kernels.c and cpu_kernels_f32.c would not change. */
#ifndef INGOT_CPU_KERNELS_VEC_H
#define INGOT_CPU_KERNELS_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INL static inline __attribute__((always_inline))

/* ---- scalar bf16 ------------------------------------------------------------------------- */
INL uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

INL float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INL float round_bf16(float f) { return from_bf16(to_bf16(f)); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* ---- AVX-512: 16 lanes, k-masks ---------------------------------------------------------- */
#define VL 16
typedef __m512 vf;
typedef __mmask16 vm;
INL vf vzero(void) { return _mm512_setzero_ps(); }
INL vf vset1(float a) { return _mm512_set1_ps(a); }
INL vf vload(const float *p) { return _mm512_loadu_ps(p); }
INL void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
INL vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INL vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INL vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INL vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
INL vf vneg(vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u))); }
INL vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
INL vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INL vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c */
INL vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
INL vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INL vf vrcp(vf a) { return _mm512_rcp14_ps(a); } /* ~14 bits */
INL vf vabs(vf a) { return _mm512_abs_ps(a); }
INL vf vand(vf a, vf b) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
INL vf vor(vf a, vf b) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
INL vf vldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p 2^n, n integral */
INL float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
INL float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
INL vm vtail(int64_t left) { /* first min(left, 16) lanes (none for left <= 0) */
    return (vm)(left >= 16 ? 0xffffu : left <= 0 ? 0u : (1u << left) - 1u);
}
INL vf vloadz(vm m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
INL void vstorem(float *p, vm m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
INL vf vkeep(vm m, vf v) { return _mm512_maskz_mov_ps(m, v); }               /* lanes not in m: 0 */
INL vf vmax_in(vf acc, vm m, vf v) { return _mm512_mask_max_ps(acc, m, acc, v); } /* max over m */
/* rows i * stride of a column, i < VL; int32 lane offsets: stride < 2^31 / VL */
/* kt[d][0..VL) = scale * keys[0..n)[d] for d < D (rows n.. zero): VL keys, row stride
   `stride`, transposed by gathers (a scalar transpose had cost as much as the scores); lane
   offsets are int32: stride < 2^31 / 16. */
INL void vkeys_t(const float *kb, int64_t stride, int64_t n, float *kt, int64_t Lp, int64_t D, vf scale) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)stride));
    const vm m = n > 0 ? vtail(n) : (vm)0;
    for (int64_t d = 0; d < D; d++)
        vstore(kt + d * Lp, vmul(scale, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, kb + d, 4)));
}
/* bf16 */
INL vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INL vf vload_bf16_part(const uint16_t *p, int64_t left) {
    if (left >= 16) return vload_bf16(p);
    const __m256i v = _mm256_maskz_loadu_epi16(vtail(left), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
/* VL bytes widened to float32 (exact): unsigned, signed */
INL vf vload_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INL vf vload_s8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INL vf vround_bf16(vf v) { /* nearest even, as to_bf16; NaN stays (quiet) NaN */
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    u = _mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(u), v);
}
INL void vstore_bf16_part(uint16_t *p, vf v, int64_t left) { /* v on the bf16 grid */
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    if (left >= 16) _mm256_storeu_si256((__m256i *)p, h);
    else if (left > 0) _mm256_mask_storeu_epi16(p, vtail(left), h);
}
typedef __m512i vb;
INL vb vloadb(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
INL vb vloadb_part(const uint16_t *p, int64_t left) { /* first min(left, 32) elements */
    if (left >= 32) return vloadb(p);
    return _mm512_maskz_loadu_epi16(left <= 0 ? 0u : (__mmask32)((1ull << left) - 1u), p);
}
INL vb vbcast_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, 4);
    return _mm512_set1_epi32((int)pair);
}
INL void vwiden_pairs(vb w, vf *even, vf *odd) { /* the pairs' first and second elements */
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}
#if defined(__AVX512BF16__)
#define VNATIVE_BF16_DOT 1
typedef __m512bh vbx;
INL vbx vprep(vb x) { return (vbx)x; }
INL vf vdot(vf acc, vb w, vbx x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, x); }
#else
typedef struct { vf e, o; } vbx;
INL vbx vprep(vb x) {
    const vbx r = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                   _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)))};
    return r;
}
INL vf vdot(vf acc, vb w, vbx x) {
    acc = vfma(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), x.e, acc);
    return vfma(_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u))), x.o, acc);
}
#endif
/* unpacklo/hi pair within 128-bit lanes: lane 4l + e of lo is d = 8l + e, of hi d = 8l + 4 + e */
INL void vpair(vb a, vb b, vb *lo, vb *hi) {
    *lo = _mm512_unpacklo_epi16(a, b);
    *hi = _mm512_unpackhi_epi16(a, b);
}
INL void vunpair(vf lo, vf hi, vf *first, vf *second) {
    *first = _mm512_permutex2var_ps(lo, _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0), hi);
    *second = _mm512_permutex2var_ps(lo, _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8), hi);
}
/* Lane i = horizontal sum of v[i]: a shuffle tree (45 shuffles/adds for 16 sums instead of 16
   separate reductions). The tree leaves sum(v[4e + l]) at lane 4l + e. */
INL vf vhsum_vl(const vf *v) {
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
/* masks */
INL vm vcmpgt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
INL vm visnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
INL vm vmand(vm a, vm b) { return a & b; }
INL vm vmor(vm a, vm b) { return a | b; }
INL int vmany(vm a) { return a != 0; }
INL vf vblend(vm m, vf a, vf b) { return _mm512_mask_blend_ps(m, a, b); } /* m ? b : a */
INL vf viota(void) { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
INL void vprefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
INL void vprefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* ---- AVX2 + FMA: 8 lanes, masks as all-ones lanes ----------------------------------------- */
#define VL 8
typedef __m256 vf;
typedef __m256 vm;
INL vf vzero(void) { return _mm256_setzero_ps(); }
INL vf vset1(float a) { return _mm256_set1_ps(a); }
INL vf vload(const float *p) { return _mm256_loadu_ps(p); }
INL void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
INL vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INL vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INL vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INL vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
INL vf vneg(vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
INL vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
INL vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INL vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INL vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
INL vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INL vf vrcp(vf a) { return _mm256_rcp_ps(a); } /* ~12 bits */
INL vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
INL vf vand(vf a, vf b) { return _mm256_and_ps(a, b); }
INL vf vor(vf a, vf b) { return _mm256_or_ps(a, b); }
INL vf vpow2i(vf n) { /* 2^n for integral n in [-126, 127]: n + 127 into the exponent field */
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
INL vf vldexp(vf p, vf n) { /* in two halves, each in the normal range, as scalef's one rounding */
    const vf h = vround(vmul(n, vset1(0.5f)));
    return vmul(vmul(p, vpow2i(h)), vpow2i(vsub(n, h)));
}
INL float vhsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INL float vhmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
INL vm vtail(int64_t left) {
    const int n = left >= 8 ? 8 : (int)left;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
INL vf vloadz(vm m, const float *p) { return _mm256_maskload_ps(p, _mm256_castps_si256(m)); }
INL void vstorem(float *p, vm m, vf v) { _mm256_maskstore_ps(p, _mm256_castps_si256(m), v); }
INL vf vkeep(vm m, vf v) { return _mm256_and_ps(m, v); }
INL vf vmax_in(vf acc, vm m, vf v) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, v), m); }
/* As the AVX-512 vkeys_t, by 8 x 8 register transposes: AVX2 gathers are slow (on Zen 3 they
   took a quarter of the attention's time). */
INL void vkeys_t(const float *kb, int64_t stride, int64_t n, float *kt, int64_t Lp, int64_t D, vf scale) {
    for (int64_t d = 0; d < D; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = i < n ? _mm256_loadu_ps(kb + i * stride + d) : _mm256_setzero_ps();
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
        const __m256 c[8] = {
            _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        for (int i = 0; i < 8; i++) vstore(kt + (d + i) * Lp, vmul(scale, c[i]));
    }
}
/* bf16 (always widened: no bf16 arithmetic on these CPUs) */
INL vf vwiden8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
INL vf vload_bf16(const uint16_t *p) { return vwiden8(_mm_loadu_si128((const __m128i *)p)); }
INL vf vload_bf16_part(const uint16_t *p, int64_t left) {
    if (left >= 8) return vload_bf16(p);
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)(left > 0 ? left : 0) * 2);
    return vwiden8(_mm_loadu_si128((const __m128i *)t));
}
INL vf vload_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INL vf vload_s8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INL vf vround_bf16(vf v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    u = _mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(u), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
INL void vstore_bf16_part(uint16_t *p, vf v, int64_t left) {
    const __m256i w = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    if (left >= 8) _mm_storeu_si128((__m128i *)p, h);
    else {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, h);
        memcpy(p, t, (size_t)(left > 0 ? left : 0) * 2);
    }
}
typedef __m256i vb;
INL vb vloadb(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INL vb vloadb_part(const uint16_t *p, int64_t left) {
    if (left >= 16) return vloadb(p);
    uint16_t t[16] = {0};
    memcpy(t, p, (size_t)(left > 0 ? left : 0) * 2);
    return vloadb(t);
}
INL vb vbcast_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, 4);
    return _mm256_set1_epi32((int)pair);
}
INL void vwiden_pairs(vb w, vf *even, vf *odd) {
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}
typedef struct { vf e, o; } vbx;
INL vbx vprep(vb x) {
    const vbx r = {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
                   _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)))};
    return r;
}
INL vf vdot(vf acc, vb w, vbx x) {
    acc = vfma(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), x.e, acc);
    return vfma(_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))), x.o, acc);
}
/* unpacklo/hi pair within 128-bit lanes: lo holds d 0-3 and 8-11, hi d 4-7 and 12-15 */
INL void vpair(vb a, vb b, vb *lo, vb *hi) {
    *lo = _mm256_unpacklo_epi16(a, b);
    *hi = _mm256_unpackhi_epi16(a, b);
}
INL void vunpair(vf lo, vf hi, vf *first, vf *second) {
    *first = _mm256_permute2f128_ps(lo, hi, 0x20);
    *second = _mm256_permute2f128_ps(lo, hi, 0x31);
}
INL vf vhsum_vl(const vf *v) { /* lane i = sum of v[i] */
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
INL vm vcmpgt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
INL vm visnan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
INL vm vmand(vm a, vm b) { return _mm256_and_ps(a, b); }
INL vm vmor(vm a, vm b) { return _mm256_or_ps(a, b); }
INL int vmany(vm a) { return _mm256_movemask_ps(a) != 0; }
INL vf vblend(vm m, vf a, vf b) { return _mm256_blendv_ps(a, b, m); }
INL vf viota(void) { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
INL void vprefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
INL void vprefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
#else
/* ---- portable: GCC vector extensions, 8 lanes ---------------------------------------------
   Lane loops the compiler turns into the target's vectors (SSE2 on any x86-64); no FMA
   contraction is assumed, so vfma is a multiply and an add. The reference build. */
#define VL 8
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef vi vm;
#define VLANES(expr) do { for (int i_ = 0; i_ < VL; i_++) { expr; } } while (0)
INL vf vzero(void) { vf r = {0}; return r; }
INL vf vset1(float a) { vf r; VLANES(r[i_] = a); return r; }
INL vf vload(const float *p) { vf r; memcpy(&r, p, sizeof r); return r; }
INL void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
INL vf vadd(vf a, vf b) { return a + b; }
INL vf vsub(vf a, vf b) { return a - b; }
INL vf vmul(vf a, vf b) { return a * b; }
INL vf vdiv(vf a, vf b) { return a / b; }
INL vf vneg(vf a) { return -a; }
INL vf vmin(vf a, vf b) { vf r; VLANES(r[i_] = a[i_] < b[i_] ? a[i_] : b[i_]); return r; }
INL vf vmax(vf a, vf b) { vf r; VLANES(r[i_] = a[i_] > b[i_] ? a[i_] : b[i_]); return r; }
INL vf vfma(vf a, vf b, vf c) { return a * b + c; }
INL vf vfnma(vf a, vf b, vf c) { return c - a * b; }
INL vf vround(vf a) { vf r; VLANES(r[i_] = rintf(a[i_])); return r; }
INL vf vrcp(vf a) { return vset1(1.0f) / a; }
INL vf vabs(vf a) { vf r; VLANES(r[i_] = fabsf(a[i_])); return r; }
INL vf vand(vf a, vf b) { return (vf)((vi)a & (vi)b); }
INL vf vor(vf a, vf b) { return (vf)((vi)a | (vi)b); }
INL vf vldexp(vf p, vf n) { vf r; VLANES(r[i_] = ldexpf(p[i_], (int)n[i_])); return r; }
INL float vhsum(vf a) { /* pairwise, as the AVX2 section's tree */
    const float s0 = (a[0] + a[4]) + (a[2] + a[6]), s1 = (a[1] + a[5]) + (a[3] + a[7]);
    return s0 + s1;
}
INL float vhmax(vf a) { float m = a[0]; for (int i = 1; i < VL; i++) m = a[i] > m ? a[i] : m; return m; }
INL vm vtail(int64_t left) { vm r; VLANES(r[i_] = i_ < left ? -1 : 0); return r; }
INL vf vloadz(vm m, const float *p) { vf r; VLANES(r[i_] = m[i_] ? p[i_] : 0.0f); return r; }
INL void vstorem(float *p, vm m, vf v) { VLANES(if (m[i_]) p[i_] = v[i_]); }
INL vf vkeep(vm m, vf v) { return (vf)((vi)v & m); }
INL vf vmax_in(vf acc, vm m, vf v) { vf r; VLANES(r[i_] = m[i_] && v[i_] > acc[i_] ? v[i_] : acc[i_]); return r; }
INL void vkeys_t(const float *kb, int64_t stride, int64_t n, float *kt, int64_t Lp, int64_t D, vf scale) {
    for (int64_t d = 0; d < D; d++)
        for (int i = 0; i < VL; i++) kt[d * Lp + i] = i < n ? scale[0] * kb[i * stride + d] : 0.0f;
}
/* bf16 */
INL vf vload_bf16_part(const uint16_t *p, int64_t left) {
    vf r; VLANES(r[i_] = i_ < left ? from_bf16(p[i_]) : 0.0f); return r;
}
INL vf vload_bf16(const uint16_t *p) { return vload_bf16_part(p, VL); }
INL vf vload_u8(const uint8_t *p) { vf r; VLANES(r[i_] = (float)p[i_]); return r; }
INL vf vload_s8(const int8_t *p) { vf r; VLANES(r[i_] = (float)p[i_]); return r; }
INL vf vround_bf16(vf v) { vf r; VLANES(r[i_] = round_bf16(v[i_])); return r; }
INL void vstore_bf16_part(uint16_t *p, vf v, int64_t left) { VLANES(if (i_ < left) p[i_] = to_bf16(v[i_])); }
typedef uint16_t vb __attribute__((vector_size(32))); /* VL pairs */
INL vb vloadb_part(const uint16_t *p, int64_t left) {
    vb r = {0};
    for (int i = 0; i < 2 * VL && i < left; i++) r[i] = p[i];
    return r;
}
INL vb vloadb(const uint16_t *p) { vb r; memcpy(&r, p, sizeof r); return r; }
INL vb vbcast_pair(const uint16_t *p) { vb r; VLANES(r[2 * i_] = p[0]; r[2 * i_ + 1] = p[1]); return r; }
typedef struct { vf e, o; } vbx;
INL vbx vprep(vb x) {
    vbx r;
    VLANES(r.e[i_] = from_bf16(x[2 * i_]); r.o[i_] = from_bf16(x[2 * i_ + 1]));
    return r;
}
INL void vwiden_pairs(vb w, vf *even, vf *odd) {
    const vbx r = vprep(w);
    *even = r.e;
    *odd = r.o;
}
INL vf vdot(vf acc, vb w, vbx x) {
    const vbx wx = vprep(w);
    return vfma(wx.o, x.o, vfma(wx.e, x.e, acc));
}
/* pairs in row order: lo holds d 0 .. VL-1, hi d VL .. 2 VL-1 */
INL void vpair(vb a, vb b, vb *lo, vb *hi) {
    VLANES((*lo)[2 * i_] = a[i_]; (*lo)[2 * i_ + 1] = b[i_];
           (*hi)[2 * i_] = a[VL + i_]; (*hi)[2 * i_ + 1] = b[VL + i_]);
}
INL void vunpair(vf lo, vf hi, vf *first, vf *second) { *first = lo; *second = hi; }
INL vf vhsum_vl(const vf *v) { vf r; VLANES(r[i_] = vhsum(v[i_])); return r; }
INL vm vcmpgt(vf a, vf b) { return a > b; }
INL vm visnan(vf a) { return a != a; }
INL vm vmand(vm a, vm b) { return a & b; }
INL vm vmor(vm a, vm b) { return a | b; }
INL int vmany(vm a) { int any = 0; VLANES(any |= a[i_] != 0); return any; }
INL vf vblend(vm m, vf a, vf b) { return (vf)(((vi)b & m) | ((vi)a & ~m)); }
INL vf viota(void) { vf r; VLANES(r[i_] = (float)i_); return r; }
INL void vprefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
INL void vprefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }
#endif


/* The first min(left, VL) floats at p (the rest zero), and their store: whole vectors take
   plain loads and stores (AVX2's masked store is slow on some CPUs even with every lane set). */
INL vf vload_part(const float *p, int64_t left) { return left >= VL ? vload(p) : vloadz(vtail(left), p); }
INL void vstore_part(float *p, vf v, int64_t left) {
    if (left >= VL) vstore(p, v);
    else vstorem(p, vtail(left), v);
}

/* ---- quantized weights: 8 lanes, one interleaved weight row per 32-bit lane ----------------
   The GGUF kernels (cpu_kernels_quant.c) interleave 8 weight rows so that each 32-bit lane of
   a 256-bit vector holds 4 consecutive int8 (or 4-bit) weights of one row; a broadcast 4
   activation bytes then gives each lane its row's dot product with no horizontal sum. These
   names are 8 lanes whatever the build's VL (AVX-512 builds run them on ymm registers, with
   vpdpbusd where AVX512-VNNI or AVX-VNNI is present):
     vq   8 x int32 (32 bytes): vq_load, vq_bcast4 (4 bytes to every lane), vq_set1, vq_add,
          vq_sub, vq_or, vq_lo_nibbles / vq_hi_nibbles (each byte's low / high 4 bits, 0..15),
          vq_bit4 (each byte's bit s as 16 or 0: a 5-bit weight's fifth bit),
          vq_dot_u8s8 (acc + per lane sum of 4 products unsigned byte x signed byte; on AVX2
          vpmaddubsw's int16 pair sums must not saturate: a <= 128 and |b| <= 127 keep them
          inside), vq_dot_s8s8 (both signed: |a| as the unsigned side, b given a's sign);
     vqf  8 x float32: vqf_zero/set1/add/mul/load/store, vq_tofloat (exact below 2^24),
          vqf_load_f16 (8 IEEE halves widened, F16C where the build has it). */
INL float from_fp16(uint16_t h) { /* exact, subnormals included */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {
        float f = ldexpf((float)man, -24);
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((e + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX2__)
typedef __m256i vq;
typedef __m256 vqf;
INL vq vq_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INL vq vq_bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
INL vq vq_set1(int32_t a) { return _mm256_set1_epi32(a); }
INL vq vq_add(vq a, vq b) { return _mm256_add_epi32(a, b); }
INL vq vq_sub(vq a, vq b) { return _mm256_sub_epi32(a, b); }
INL vq vq_lo_nibbles(vq p) { return _mm256_and_si256(p, _mm256_set1_epi8(15)); }
INL vq vq_hi_nibbles(vq p) { return _mm256_and_si256(_mm256_srli_epi16(p, 4), _mm256_set1_epi8(15)); }
INL vq vq_or(vq a, vq b) { return _mm256_or_si256(a, b); }
/* each byte's bit s (0..7) as 16 or 0: the fifth bit of a 5-bit weight (bits stay inside their
   byte: the mask keeps bit 4, which both shifts took from bit s of the same byte) */
INL vq vq_bit4(vq v, int s) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(v, s), 4), _mm256_set1_epi8(16));
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VQ_DOT_KIND 2 /* vpdpbusd */
INL vq vq_dot_u8s8(vq acc, vq a, vq b) { return _mm256_dpbusd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
#define VQ_DOT_KIND 2
INL vq vq_dot_u8s8(vq acc, vq a, vq b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
#define VQ_DOT_KIND 1 /* vpmaddubsw + vpmaddwd */
INL vq vq_dot_u8s8(vq acc, vq a, vq b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
#endif
INL vq vq_dot_s8s8(vq acc, vq a, vq b) {
    return vq_dot_u8s8(acc, _mm256_abs_epi8(a), _mm256_sign_epi8(b, a));
}
INL vq vq_mul_u8s8_i16(vq a, vq b) { return _mm256_maddubs_epi16(a, b); }
INL vq vq_add_i16(vq a, vq b) { return _mm256_add_epi16(a, b); }
INL vq vq_sum_i16(vq acc, vq v) { return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi16(1))); }
INL vqf vqf_zero(void) { return _mm256_setzero_ps(); }
INL vqf vqf_set1(float a) { return _mm256_set1_ps(a); }
INL vqf vqf_add(vqf a, vqf b) { return _mm256_add_ps(a, b); }
INL vqf vqf_mul(vqf a, vqf b) { return _mm256_mul_ps(a, b); }
INL void vqf_store(float *p, vqf v) { _mm256_storeu_ps(p, v); }
INL vqf vqf_load(const void *p) { return _mm256_loadu_ps((const float *)p); }
INL vqf vq_tofloat(vq a) { return _mm256_cvtepi32_ps(a); }
INL vqf vqf_load_f16(const void *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    uint16_t h[8];
    memcpy(h, p, 16);
    return _mm256_setr_ps(from_fp16(h[0]), from_fp16(h[1]), from_fp16(h[2]), from_fp16(h[3]),
                          from_fp16(h[4]), from_fp16(h[5]), from_fp16(h[6]), from_fp16(h[7]));
#endif
}
#else
/* portable: lane loops (the reference; GCC vectorises what it can for the target) */
#define VQ_DOT_KIND 0
typedef int32_t vq __attribute__((vector_size(32)));
typedef float vqf __attribute__((vector_size(32)));
typedef uint8_t vq_u8 __attribute__((vector_size(32)));
INL vq vq_load(const void *p) { vq r; memcpy(&r, p, 32); return r; }
INL vq vq_set1(int32_t a) { vq r; for (int i = 0; i < 8; i++) r[i] = a; return r; }
INL vq vq_bcast4(const void *p) { int32_t v; memcpy(&v, p, 4); return vq_set1(v); }
INL vq vq_add(vq a, vq b) { return a + b; }
INL vq vq_sub(vq a, vq b) { return a - b; }
INL vq vq_lo_nibbles(vq p) { return (vq)((vq_u8)p & 15); }
INL vq vq_hi_nibbles(vq p) { return (vq)((vq_u8)p >> 4); }
INL vq vq_or(vq a, vq b) { return a | b; }
INL vq vq_bit4(vq v, int s) { return (vq)((((vq_u8)v >> s) & 1) << 4); }
INL vq vq_dot_u8s8(vq acc, vq a, vq b) {
    uint8_t ab[32];
    int8_t bb[32];
    memcpy(ab, &a, 32);
    memcpy(bb, &b, 32);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) acc[i] += (int32_t)ab[4 * i + j] * (int32_t)bb[4 * i + j];
    return acc;
}
INL vq vq_dot_s8s8(vq acc, vq a, vq b) {
    int8_t ab[32], bb[32];
    memcpy(ab, &a, 32);
    memcpy(bb, &b, 32);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) acc[i] += (int32_t)ab[4 * i + j] * (int32_t)bb[4 * i + j];
    return acc;
}
typedef int16_t vq_i16 __attribute__((vector_size(32)));
INL vq vq_mul_u8s8_i16(vq a, vq b) {
    uint8_t ab[32];
    int8_t bb[32];
    memcpy(ab, &a, 32);
    memcpy(bb, &b, 32);
    vq_i16 r;
    for (int i = 0; i < 16; i++) {
        const int32_t v = (int32_t)ab[2 * i] * bb[2 * i] + (int32_t)ab[2 * i + 1] * bb[2 * i + 1];
        r[i] = (int16_t)(v > 32767 ? 32767 : v < -32768 ? -32768 : v); /* vpmaddubsw saturates */
    }
    return (vq)r;
}
INL vq vq_add_i16(vq a, vq b) { return (vq)((vq_i16)a + (vq_i16)b); }
INL vq vq_sum_i16(vq acc, vq v) {
    const vq_i16 h = (vq_i16)v;
    for (int i = 0; i < 8; i++) acc[i] += (int32_t)h[2 * i] + (int32_t)h[2 * i + 1];
    return acc;
}
INL vqf vqf_zero(void) { vqf r = {0}; return r; }
INL vqf vqf_set1(float a) { vqf r; for (int i = 0; i < 8; i++) r[i] = a; return r; }
INL vqf vqf_add(vqf a, vqf b) { return a + b; }
INL vqf vqf_mul(vqf a, vqf b) { return a * b; }
INL void vqf_store(float *p, vqf v) { memcpy(p, &v, 32); }
INL vqf vqf_load(const void *p) { vqf r; memcpy(&r, p, 32); return r; }
INL vqf vq_tofloat(vq a) { return __builtin_convertvector(a, vqf); }
INL vqf vqf_load_f16(const void *p) {
    uint16_t h[8];
    memcpy(h, p, 16);
    vqf r;
    for (int i = 0; i < 8; i++) r[i] = from_fp16(h[i]);
    return r;
}
#endif

/* e^x: range reduction by ln 2 and a degree-7 Taylor polynomial on [-ln2/2, ln2/2] (relative
   error < 2e-7, about one float32 ulp). */
INL vf exp_ps(vf x) {
    x = vmax(vmin(x, vset1(88.7f)), vset1(-103.0f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.0f / 5040);
    p = vfma(p, r, vset1(1.0f / 720));
    p = vfma(p, r, vset1(1.0f / 120));
    p = vfma(p, r, vset1(1.0f / 24));
    p = vfma(p, r, vset1(1.0f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vldexp(p, n);
}

#endif /* INGOT_CPU_KERNELS_VEC_H */
