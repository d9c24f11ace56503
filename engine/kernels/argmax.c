/* Greedy picks: the index of each row's largest value, as torch.argmax gives it (the
 * first index among equal maxima; a NaN counts as the largest, the first NaN wins).
 * torch's CPU argmax over the vocabulary compares one value at a time; 16 lanes at a
 * time (8 on AVX2) read the rows at memory speed. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "worker_pool.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

typedef struct {
    const float *x;
    int64_t rows, n;
    int64_t *out;
} ArgmaxJob;

static int64_t argmax_scalar(const float *x, int64_t from, int64_t n, int64_t best) {
    for (int64_t i = from; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0, best = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        const __m512i step = _mm512_set1_epi32(16);
        __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 top = _mm512_loadu_ps(x);
        __m512i top_index = lane_index;
        __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            lane_index = _mm512_add_epi32(lane_index, step);
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);   /* strict: first wins */
            top = _mm512_mask_mov_ps(top, above, v);
            top_index = _mm512_mask_mov_epi32(top_index, above, lane_index);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) return argmax_scalar(x, 0, n, 0);          /* rare: find the first NaN */
        const float peak = _mm512_reduce_max_ps(top);
        const __mmask16 at_peak = _mm512_cmp_ps_mask(top, _mm512_set1_ps(peak), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(at_peak, top_index);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        const __m256i step = _mm256_set1_epi32(8);
        __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 top = _mm256_loadu_ps(x);
        __m256i top_index = lane_index;
        __m256 nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            lane_index = _mm256_add_epi32(lane_index, step);
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 above = _mm256_cmp_ps(v, top, _CMP_GT_OQ);        /* strict: first wins */
            top = _mm256_blendv_ps(top, v, above);
            top_index = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(top_index), _mm256_castsi256_ps(lane_index), above));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(nan)) return argmax_scalar(x, 0, n, 0);
        float tops[8];
        int32_t indices[8];
        _mm256_storeu_ps(tops, top);
        _mm256_storeu_si256((__m256i *)indices, top_index);
        best = indices[0];              /* the largest lane; among equal ones the first index */
        for (int j = 1; j < 8; j++)
            if (tops[j] > x[best] || (tops[j] == x[best] && indices[j] < best)) best = indices[j];
    }
#endif
    return argmax_scalar(x, i, n, best);
}

static void argmax_part(const void *arg, int part, int parts) {
    const ArgmaxJob *job = arg;
    for (int64_t r = job->rows * part / parts; r < job->rows * (part + 1) / parts; r++)
        job->out[r] = argmax_row(job->x + r * job->n, job->n);
}

/* out[r] = argmax of x[r, 0..n); n >= 1 and below 2^31. */
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    if (n < 1 || n >= INT32_MAX) return 1;
    if (rows <= 0) return 0;
    ArgmaxJob job = {x, rows, n, out};
    run_parallel(argmax_part, &job, rows >= 8 ? num_threads : 1);
    return 0;
}
