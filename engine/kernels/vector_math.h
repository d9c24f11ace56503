/* Vector math shared by the kernel files. */
#ifndef KVSERVE_VECTOR_MATH_H
#define KVSERVE_VECTOR_MATH_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {   /* round to nearest even; NaN kept */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 values -> 16 floats (exact: bf16 is fp32's upper half). */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats -> 16 bf16 values, each as float_to_bf16 rounds it. */
static inline void store_bf16x16(uint16_t *p, __m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan,
                                    _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

/* Lane j of the result is the sum of the 16 lanes of v[j]. Worked for 128-bit lane 0
 * of a pair (a, b): unpacklo gives a0 b0 a1 b1, unpackhi a2 b2 a3 b3, their sum
 * (a0+a2) (b0+b2) (a1+a3) (b1+b3); the next level pairs those 64-bit halves, and the
 * last two fold the four 128-bit lanes, leaving v[4i..4i+3]'s sums in lane i. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                         _mm512_shuffle_f32x4(low, high, 0xdd));
}

/* exp on 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite),
 * e^r from Cephes' degree-6 expf polynomial, times 2^n by scalef (which also
 * underflows to 0 and overflows to +inf as expf does). Within ~2 ulp of expf. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);   /* e^-104 is 0 in fp32; NaN stays NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* silu(gate) * up on 16 lanes, silu(g) = g / (1 + e^-g) (the gated MLP's activation). */
static inline __m512 silu_times16(__m512 gate, __m512 up) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(one, e)), up);
}

/* gelu(gate) * up with GELU's tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(u)),
 * u = sqrt(2 / pi) (g + 0.044715 g^3), written as g / (1 + e^-2u) (the same value:
 * 0.5 (1 + tanh(u)) is the logistic function of 2u), which needs one exp. */
static inline __m512 gelu_tanh_times16(__m512 gate, __m512 up) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 squared = _mm512_mul_ps(gate, gate);
    const __m512 twice_u = _mm512_mul_ps(gate, _mm512_fmadd_ps(
        squared, _mm512_set1_ps(2.0f * 0.7978845608028654f * 0.044715f),
        _mm512_set1_ps(2.0f * 0.7978845608028654f)));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), twice_u));
    return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(one, e)), up);
}
#endif

/* cache[start .. start + n) <- src as fp32, or rounded to bf16 when bf16 (a K/V
 * cache's element type). */
static inline void store_cached(void *cache, int bf16, int64_t start, const float *src,
                                int64_t n) {
    if (!bf16) {
        memcpy((float *)cache + start, src, sizeof(float) * n);
        return;
    }
    uint16_t *out = (uint16_t *)cache + start;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) store_bf16x16(out + i, _mm512_loadu_ps(src + i));
#endif
    for (; i < n; i++) out[i] = float_to_bf16(src[i]);
}

#endif
