/* Vector math shared by the kernel files. */
#ifndef KVSERVE_VECTOR_MATH_H
#define KVSERVE_VECTOR_MATH_H

#ifdef __AVX512F__
#include <immintrin.h>

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
#endif

#endif
