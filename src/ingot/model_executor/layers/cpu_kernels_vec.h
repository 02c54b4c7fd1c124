/* The small vector layer ingot's CPU kernels are written over, for the ISA a build targets:
 * AVX-512 (16 lanes, k-masks) or AVX2 + FMA (8 lanes, masks as all-ones lanes); and the
 * vector e^x both libraries use. Included by cpu_kernels.c (AVX512-BF16 builds only) and
 * cpu_kernels_f32.c (either ISA). */
#ifndef INGOT_CPU_KERNELS_VEC_H
#define INGOT_CPU_KERNELS_VEC_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define INL static inline __attribute__((always_inline))

#if defined(__AVX512F__)
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
INL vm vtail(int64_t left) { return (vm)(left >= 16 ? 0xffffu : (1u << left) - 1u); } /* first min(left, 16) lanes */
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
#elif defined(__AVX2__) && defined(__FMA__)
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
#else
#error "ingot's float32 kernels need AVX-512 or AVX2 + FMA"
#endif

/* The first min(left, VL) floats at p (the rest zero), and their store: whole vectors take
   plain loads and stores (AVX2's masked store is slow on some CPUs even with every lane set). */
INL vf vload_part(const float *p, int64_t left) { return left >= VL ? vload(p) : vloadz(vtail(left), p); }
INL void vstore_part(float *p, vf v, int64_t left) {
    if (left >= VL) vstore(p, v);
    else vstorem(p, vtail(left), v);
}

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
