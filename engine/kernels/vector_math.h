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
 * e^r from Cephes' degree-6 expf polynomial, times 2^n by scalef (which overflows to
 * +inf as expf does). Within ~2 ulp of expf down to e^-87 (1.6e-38); below that the
 * result is 0 where expf gives a denormal (EXP_FLOOR). */
#define EXP_FLOOR (-87.0f)
/* Why a floor: x86 cores take a microcode assist (~100+ cycles) for every result
 * that comes out denormal, and a masked score (-inf) would cost one in each of its
 * lanes: the prefill tiles' causal masks make many of them. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(EXP_FLOOR), x);   /* NaN stays NaN (second operand) */
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
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The same helpers on eight lanes: AVX2 builds' own, and in AVX-512 builds those of
 * the tiles kept at 256 bits (bf16_tile_256.h where AVX512-BF16 is missing). */

static inline float sum8(__m256 v) {        /* the sum of the 8 lanes */
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* Lane j of the result is the sum of the 8 lanes of v[j]. hadd works per 128-bit
 * lane: hadd(a, b) = a0+a1 a2+a3 b0+b1 b2+b3, so two rounds leave, in the low lane of
 * hadd(hadd(v0, v1), hadd(v2, v3)), the sums of lanes 0-3 of v0 .. v3, and in its high
 * lane the sums of lanes 4-7; the last step adds the two halves. */
static inline __m256 sum_lanes8(const __m256 *v) {
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}

static inline __m256 load_bf16x8(const uint16_t *p) {       /* exact, as load_bf16x16 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void store_bf16x8(uint16_t *p, __m256 v) {    /* as float_to_bf16 rounds */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                   _mm256_castsi256_ps(quiet),
                                                   _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    rounded = _mm256_srli_epi32(rounded, 16);             /* 0 .. 0xffff: packus keeps it */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                                    _mm256_extracti128_si256(rounded, 1)));
}

/* exp on 8 lanes: exp16's reduction and polynomial. AVX2 has no scalef, so 2^n is
 * two factors 2^(n >> 1) and 2^(n - (n >> 1)), each a normal float for every n the
 * clamp allows (-150 .. 129); multiplying by them in turn underflows to subnormals
 * and 0, and overflows to +inf, as expf does. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);        /* NaN stays NaN (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);          /* e^89 is +inf in fp32 */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i whole = _mm256_cvtps_epi32(n), first = _mm256_srai_epi32(whole, 1);
    const __m256i second = _mm256_sub_epi32(whole, first), bias = _mm256_set1_epi32(127);
    const __m256 first_power = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
    const __m256 second_power = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first_power), second_power);
}

static inline __m256 silu_times8(__m256 gate, __m256 up) {     /* as silu_times16 */
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

static inline __m256 gelu_tanh_times8(__m256 gate, __m256 up) {  /* as gelu_tanh_times16 */
    const __m256 squared = _mm256_mul_ps(gate, gate);
    const __m256 twice_u = _mm256_mul_ps(gate, _mm256_fmadd_ps(
        squared, _mm256_set1_ps(2.0f * 0.7978845608028654f * 0.044715f),
        _mm256_set1_ps(2.0f * 0.7978845608028654f)));
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), twice_u));
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* Into L2: the cache records (row[l] * record_bytes on, record_bytes each) of
 * l in [from, to), ahead of an attention pass that jumps between pages. */
static inline void prefetch_records(const void *cache, const int64_t *row, int64_t from,
                                    int64_t to, int64_t record_bytes) {
    for (int64_t l = from; l < to; l++) {
        const char *start = (const char *)cache + row[l] * record_bytes;
        for (int64_t byte = 0; byte < record_bytes; byte += 64)
            _mm_prefetch(start + byte, _MM_HINT_T1);
    }
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
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) store_bf16x8(out + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; i++) out[i] = float_to_bf16(src[i]);
}

#endif
