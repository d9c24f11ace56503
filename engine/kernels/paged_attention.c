/* Decode attention read straight from the paged KV cache, in fp32.
 *
 * Every decode request b has one query per head, q[b, H, D], and a context of
 * lengths[b] cache slots listed in slots[b, 0 .. lengths[b]-1] (padding after them is
 * never read). The caches are flat [num_slots, KVH, D]: slot s of KV head h starts at
 * (s * KVH + h) * D. Query heads h*G .. h*G+G-1 share KV head h (G = H / KVH, GQA).
 *
 * For each (request, KV head) pair: scores of its G query heads against every
 * context key, a softmax per query head, and the probability-weighted sum of the
 * values, written to out[b, H, D]. Keys and values are read in place, once per pair:
 * no gathered copy of the context, no padded matmuls. Pairs are split over
 * `num_threads` threads (worker_pool.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "worker_pool.h"

typedef struct {
    const float *q, *keys, *values;
    const int64_t *slots, *lengths;
    int64_t batch, width, heads, kv_heads, dim;
    float scale;
    float *out;
    float *scratch;          /* per part: G * width scores */
} AttentionJob;

static float dot(const float *a, const float *b, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

static void add_scaled(float alpha, const float *x, float *y, int64_t n) {   /* y += alpha x */
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

static void attend(const AttentionJob *job, int64_t b, int64_t h, float *scores) {
    const int64_t group = job->heads / job->kv_heads, dim = job->dim;
    const int64_t length = job->lengths[b];
    const int64_t *row = job->slots + b * job->width;
    const float *q = job->q + (b * job->heads + h * group) * dim;       /* [G, D] */
    float *out = job->out + (b * job->heads + h * group) * dim;         /* [G, D] */
    for (int64_t l = 0; l < length; l++) {
        const float *key = job->keys + (row[l] * job->kv_heads + h) * dim;
        for (int64_t g = 0; g < group; g++)
            scores[g * length + l] = dot(q + g * dim, key, dim) * job->scale;
    }
    for (int64_t g = 0; g < group; g++) {            /* softmax, normalised at the end */
        float *s = scores + g * length, top = -INFINITY, total = 0.0f;
        for (int64_t l = 0; l < length; l++) top = s[l] > top ? s[l] : top;
        for (int64_t l = 0; l < length; l++) {
            s[l] = expf(s[l] - top);
            total += s[l];
        }
        const float inverse = 1.0f / total;
        for (int64_t l = 0; l < length; l++) s[l] *= inverse;
    }
    memset(out, 0, sizeof(float) * group * dim);
    for (int64_t l = 0; l < length; l++) {
        const float *value = job->values + (row[l] * job->kv_heads + h) * dim;
        for (int64_t g = 0; g < group; g++) add_scaled(scores[g * length + l], value, out + g * dim, dim);
    }
}

/* (request, KV head) pairs [pairs * part / parts, pairs * (part + 1) / parts). */
static void attention_part(const void *arg, int part, int parts) {
    const AttentionJob *job = arg;
    const int64_t pairs = job->batch * job->kv_heads;
    const int64_t group = job->heads / job->kv_heads;
    float *scores = job->scratch + (int64_t)part * group * job->width;
    for (int64_t pair = pairs * part / parts; pair < pairs * (part + 1) / parts; pair++)
        attend(job, pair / job->kv_heads, pair % job->kv_heads, scores);
}

int paged_decode_attention(const float *q, const float *keys, const float *values,
                           const int64_t *slots, const int64_t *lengths, int64_t batch,
                           int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                           float scale, float *out, int num_threads) {
    if (batch <= 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads) return 1;
    for (int64_t b = 0; b < batch; b++)
        if (lengths[b] < 1 || lengths[b] > width) return 3;
    const int parts = num_threads < 1 ? 1 : num_threads;
    float *scratch = malloc(sizeof(float) * parts * (heads / kv_heads) * width);
    if (!scratch) return 2;
    AttentionJob job = {q, keys, values, slots, lengths, batch, width, heads, kv_heads, dim,
                        scale, out, scratch};
    run_parallel(attention_part, &job, parts);
    free(scratch);
    return 0;
}
