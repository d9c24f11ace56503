/* Elementwise pieces of a decoder layer for steps of any size, each one native call
 * where torch spends several ops (each with its own dispatch and a pass over
 * memory): the RMSNorm, and RoPE with the cache write.
 *
 * rms_norm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, fp32 arithmetic, the
 * sum of squares over 16 lanes (8 on AVX2); out is fp32 or bf16 (rounded to nearest even).
 *
 * rope_store: qkv [T, (H + 2 KVH) * D] is one step's fused projection output. Its q
 * and k heads are rotated in place (rotate-half RoPE, the full head), then each
 * token's k and v are copied to its cache slot (fp32, or rounded to a bf16 cache). The rotation is computed as torch's
 * `x * cos + rotate_half(x) * sin`, each product rounded before the sum (no FMA), so it
 * equals the module path bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

typedef struct {
    const float *x, *weight;
    int64_t rows, n;
    float eps;
    void *out;
    int bf16;
} NormJob;

static float sum_of_squares(const float *row, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    total = sum8(acc);
#endif
    for (; i < n; i++) total += row[i] * row[i];
    return total;
}

void rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps,
                   float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        const float inverse = 1.0f / sqrtf(sum_of_squares(row, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[r * n + i] = row[i] * inverse * weight[i];
    }
}

static void rms_norm_rows_bf16(const float *x, int64_t rows, int64_t n, const float *weight,
                               float eps, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++, out += n) {
        const float *row = x + r * n;
        const float inverse = 1.0f / sqrtf(sum_of_squares(row, n) / (float)n + eps);
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 scale = _mm512_set1_ps(inverse);
        for (; i + 16 <= n; i += 16)
            store_bf16x16(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + i), scale),
                                                 _mm512_loadu_ps(weight + i)));
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 scale = _mm256_set1_ps(inverse);
        for (; i + 8 <= n; i += 8)
            store_bf16x8(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i), scale),
                                                _mm256_loadu_ps(weight + i)));
#endif
        for (; i < n; i++) out[i] = float_to_bf16(row[i] * inverse * weight[i]);
    }
}

static void norm_part(const void *arg, int part, int parts) {
    const NormJob *job = arg;
    const int64_t first = job->rows * part / parts, last = job->rows * (part + 1) / parts;
    if (job->bf16)
        rms_norm_rows_bf16(job->x + first * job->n, last - first, job->n, job->weight, job->eps,
                           (uint16_t *)job->out + first * job->n);
    else
        rms_norm_rows(job->x + first * job->n, last - first, job->n, job->weight, job->eps,
                      (float *)job->out + first * job->n);
}

int rms_norm(const float *x, int64_t rows, int64_t n, const float *weight, float eps,
             void *out, int bf16, int num_threads) {
    if (rows <= 0 || n <= 0) return 0;
    NormJob job = {x, weight, rows, n, eps, out, bf16};
    run_parallel(norm_part, &job, rows >= 16 ? num_threads : 1);
    return 0;
}

/* Rotate `count` heads of `dim` floats in place, as torch does (see the top). */
__attribute__((optimize("fp-contract=off")))
static void rotate_heads(float *x, int64_t count, int64_t dim, const float *cos,
                         const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < count; h++, x += dim) {
        for (int64_t i = 0; i < half; i++) {
            const float first = x[i], second = x[i + half];
            const float first_cos = first * cos[i], second_sin = second * sin[i];
            const float second_cos = second * cos[i + half], first_sin = first * sin[i + half];
            x[i] = first_cos - second_sin;
            x[i + half] = second_cos + first_sin;
        }
    }
}

typedef struct {
    float *qkv;
    int64_t tokens, heads, kv_heads, dim;
    const float *cos, *sin;
    const int64_t *slot_mapping;
    void *keys, *values;     /* fp32, or bf16 when kv_bf16 */
    int kv_bf16;
} RopeJob;

void rope_store_rows(float *qkv, int64_t first, int64_t last, int64_t heads, int64_t kv_heads,
                     int64_t dim, const float *cos, const float *sin,
                     const int64_t *slot_mapping, void *keys, void *values, int kv_bf16) {
    const int64_t kv_size = kv_heads * dim, width = (heads + 2 * kv_heads) * dim;
    for (int64_t t = first; t < last; t++) {
        float *row = qkv + t * width;
        rotate_heads(row, heads + kv_heads, dim, cos + t * dim, sin + t * dim);
        store_cached(keys, kv_bf16, slot_mapping[t] * kv_size, row + heads * dim, kv_size);
        store_cached(values, kv_bf16, slot_mapping[t] * kv_size, row + heads * dim + kv_size,
                     kv_size);
    }
}

static void rope_part(const void *arg, int part, int parts) {
    const RopeJob *job = arg;
    rope_store_rows(job->qkv, job->tokens * part / parts, job->tokens * (part + 1) / parts,
                    job->heads, job->kv_heads, job->dim, job->cos, job->sin, job->slot_mapping,
                    job->keys, job->values, job->kv_bf16);
}

/* Returns 0, 1 for an odd head size, or STATUS_SLOT_OUTSIDE_CACHE for a slot outside
 * [0, num_slots). */
int rope_store(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
               const float *cos, const float *sin, const int64_t *slot_mapping,
               void *keys, void *values, int64_t num_slots, int kv_bf16, int num_threads) {
    if (dim % 2) return 1;
    if (any_slot_outside(slot_mapping, tokens, num_slots)) return STATUS_SLOT_OUTSIDE_CACHE;
    if (tokens <= 0) return 0;
    RopeJob job = {qkv, tokens, heads, kv_heads, dim, cos, sin, slot_mapping, keys, values,
                   kv_bf16};
    run_parallel(rope_part, &job, tokens >= 16 ? num_threads : 1);
    return 0;
}
