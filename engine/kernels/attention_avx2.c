/* The two passes of decode attention over one request's context range on CPUs with
 * AVX2 and FMA but no AVX-512, for head sizes that are a multiple of 8 up to 256
 * (attention_vectors.c has the AVX-512 ones; paged_attention.c calls either, and its
 * scalar loops serve other sizes and CPUs). The plan is attention_vectors.c's on
 * eight lanes:
 *
 * Scores: keys are taken 8 at a time. For one query head, 8 registers accumulate
 * q * k of the 8 keys (8 independent FMA chains, each D / 8 long), and one
 * transpose-and-add (sum_lanes8) turns them into the 8 dot products. The scalar loop
 * it replaces is one chain of D dependent multiply-adds per key. A bf16 cache's keys
 * are widened to fp32 once per KV head for all the query heads sharing it (GQA).
 *
 * Values: AVX2 has 16 vector registers, so a sweep over the range keeps at most 8
 * accumulators: one query head of D = 64 (8 vectors), two of D = 32, four of D = 16;
 * larger heads are swept 64 columns at a time. Each value vector loaded is used by
 * every head of the sweep. The first sweep prefetches the records the later ones
 * find in the caches.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

#define KEYS_PER_BLOCK 8
#define PREFETCH_AHEAD 64
#define SWEEP_VECTORS 8          /* accumulators one values sweep keeps in registers */

int attention_vectors_apply(int64_t dim) { return dim % 8 == 0 && dim <= 256; }

/* Element `index` of a flat cache of fp32 or bf16 values, 8 lanes as fp32. */
static inline __m256 load_cached8(const void *cache, int64_t index, const int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)cache + index)
                : _mm256_loadu_ps((const float *)cache + index);
}

static inline __attribute__((always_inline)) void scores_pass(
        const float *q, const void *keys, const int64_t *row, int64_t count, int64_t heads,
        int64_t kv_heads, int64_t dim, float scale, float *scores, const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, vectors = dim / 8;
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    const __m256 scales = _mm256_set1_ps(scale);
    float widened[KEYS_PER_BLOCK * 256];       /* bf16: one KV head of the block, as fp32 */
    prefetch_records(keys, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD, record_bytes);
    for (int64_t l = 0; l < count; l += KEYS_PER_BLOCK) {
        const int64_t n = count - l < KEYS_PER_BLOCK ? count - l : KEYS_PER_BLOCK;
        const int64_t from = l + PREFETCH_AHEAD < count ? l + PREFETCH_AHEAD : count;
        prefetch_records(keys, row, from, from + KEYS_PER_BLOCK < count ? from + KEYS_PER_BLOCK
                         : count, record_bytes);
        int64_t block[KEYS_PER_BLOCK];          /* past the range: its last key, not stored */
        for (int j = 0; j < KEYS_PER_BLOCK; j++) block[j] = row[l + (j < n ? j : n - 1)] * record;
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *key[KEYS_PER_BLOCK];   /* head g of each key, fp32 */
            for (int j = 0; j < KEYS_PER_BLOCK; j++) {
                if (!bf16) {
                    key[j] = (const float *)keys + block[j] + g * dim;
                    continue;
                }
                for (int64_t c = 0; c < vectors; c++)
                    _mm256_storeu_ps(widened + j * dim + 8 * c,
                                     load_cached8(keys, block[j] + g * dim + 8 * c, 1));
                key[j] = widened + j * dim;
            }
            for (int64_t hq = g * group; hq < (g + 1) * group; hq++) {
                const float *query = q + hq * dim;
                __m256 sums[KEYS_PER_BLOCK];    /* 8 independent FMA chains */
                for (int j = 0; j < KEYS_PER_BLOCK; j++) sums[j] = _mm256_setzero_ps();
                for (int64_t c = 0; c < vectors; c++) {
                    const __m256 part = _mm256_loadu_ps(query + 8 * c);
                    for (int j = 0; j < KEYS_PER_BLOCK; j++)
                        sums[j] = _mm256_fmadd_ps(part, _mm256_loadu_ps(key[j] + 8 * c), sums[j]);
                }
                const __m256 dots = _mm256_mul_ps(sum_lanes8(sums), scales);
                if (n == KEYS_PER_BLOCK) {
                    _mm256_storeu_ps(scores + hq * count + l, dots);
                } else {
                    float tail[KEYS_PER_BLOCK];
                    _mm256_storeu_ps(tail, dots);
                    memcpy(scores + hq * count + l, tail, sizeof(float) * n);
                }
            }
        }
    }
}

/* scores[hq * count + l] = scale * q[hq] . key(row[l])[hq / group], l < count.
 * q [H, D]; keys the flat cache [slots, KVH, D], fp32 or (kv_bf16) bf16. */
void attention_scores_vector(const float *q, const void *keys, int kv_bf16, const int64_t *row,
                             int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                             float scale, float *scores) {
    if (kv_bf16)
        scores_pass(q, keys, row, count, heads, kv_heads, dim, scale, scores, 1);
    else
        scores_pass(q, keys, row, count, heads, kv_heads, dim, scale, scores, 0);
}

/* For `count_heads` query heads sharing one KV head (their probabilities `probs`,
 * count apart; outputs `out`, out_stride apart): out[h][0 .. 8 * vectors) =
 * sum_l probs[h][l] * value(row[l]) from `offset` within each record. */
static inline __attribute__((always_inline)) void weigh_heads(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, const int count_heads, const int vectors, int prefetch,
        float *out, int64_t out_stride, const int bf16) {
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    __m256 acc[SWEEP_VECTORS];
    for (int i = 0; i < count_heads * vectors; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t l = 0; l < count; l++) {
        if (prefetch && l + PREFETCH_AHEAD < count)
            prefetch_records(values, row, l + PREFETCH_AHEAD, l + PREFETCH_AHEAD + 1,
                             record_bytes);
        __m256 p[4];
        for (int h = 0; h < count_heads; h++) p[h] = _mm256_broadcast_ss(probs + h * count + l);
        const int64_t start = row[l] * record + offset;
        for (int c = 0; c < vectors; c++) {
            const __m256 v = load_cached8(values, start + 8 * c, bf16);
            for (int h = 0; h < count_heads; h++)
                acc[h * vectors + c] = _mm256_fmadd_ps(p[h], v, acc[h * vectors + c]);
        }
    }
    for (int h = 0; h < count_heads; h++)
        for (int c = 0; c < vectors; c++)
            _mm256_storeu_ps(out + h * out_stride + 8 * c, acc[h * vectors + c]);
}

/* One sweep: heads [first, first + n) of one KV head over `vectors` * 8 columns from
 * `column`; n * vectors <= SWEEP_VECTORS. The common shapes are constants, so their
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void sweep(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, int64_t n, int64_t vectors, int prefetch, float *out,
        int64_t out_stride, const int bf16) {
#define WEIGH(heads_n, vectors_n) weigh_heads(probs, count, values, row, record, offset, \
        heads_n, vectors_n, prefetch, out, out_stride, bf16)
    if (vectors == 8 && n == 1) WEIGH(1, 8);
    else if (vectors == 4 && n == 2) WEIGH(2, 4);
    else if (vectors == 2 && n == 4) WEIGH(4, 2);
    else if (vectors == 2 && n == 2) WEIGH(2, 2);
    else {
        for (int64_t h = 0; h < n; h++)
            weigh_heads(probs + h * count, count, values, row, record, offset, 1, (int)vectors,
                        prefetch && h == 0, out + h * out_stride, out_stride, bf16);
    }
#undef WEIGH
}

static inline __attribute__((always_inline)) void values_pass(
        const float *probs, const void *values, const int64_t *row, int64_t count,
        int64_t heads, int64_t kv_heads, int64_t dim, float *out, int64_t out_stride,
        const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim;
    const int64_t piece = dim < 8 * SWEEP_VECTORS ? dim : 8 * SWEEP_VECTORS;  /* columns */
    const int64_t most = SWEEP_VECTORS / (piece / 8);                         /* heads */
    prefetch_records(values, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD,
                     record * (bf16 ? 2 : 4));
    for (int64_t hq = 0; hq < heads;) {
        const int64_t g = hq / group, left = (g + 1) * group - hq;
        const int64_t n = left < most ? left : most;
        for (int64_t column = 0; column < dim; column += piece) {
            const int64_t width = dim - column < piece ? dim - column : piece;
            sweep(probs + hq * count, count, values, row, record, g * dim + column, n,
                  width / 8, hq == 0 && column == 0 /* brings the records in */,
                  out + hq * out_stride + column, out_stride, bf16);
        }
        hq += n;
    }
}

/* out[hq] (D floats, out_stride apart) = sum_l probs[hq * count + l] * value(row[l])[hq / group]. */
void attention_values_vector(const float *probs, const void *values, int kv_bf16,
                             const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                             int64_t dim, float *out, int64_t out_stride) {
    if (kv_bf16)
        values_pass(probs, values, row, count, heads, kv_heads, dim, out, out_stride, 1);
    else
        values_pass(probs, values, row, count, heads, kv_heads, dim, out, out_stride, 0);
}

#endif
