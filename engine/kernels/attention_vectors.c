/* The two passes of decode attention over one request's context range, on vectors of
 * LANES floats: 16 on AVX-512, 8 on AVX2 with FMA (the `vec_*` helpers below are the
 * only difference), for head sizes that are a multiple of LANES up to 256
 * (paged_attention.c calls them; other sizes and CPUs take its scalar loops).
 *
 * Scores: keys are taken LANES at a time. For one query head, LANES registers
 * accumulate q * k of those keys (independent FMA chains, each D / LANES long); one
 * transpose-and-add tree then turns them into one register holding their dot products
 * (for 16 lanes 45 shuffles and adds, where 16 separate horizontal sums take ~130). A
 * bf16 cache's keys are widened to fp32 once per KV head, for all the query heads
 * sharing it (GQA).
 *
 * Values: the query heads sharing a KV head sweep the range together, each value
 * vector loaded (and widened) once for all of them, with at most SWEEP_VECTORS
 * accumulators (half the vector registers: 16 of AVX-512's 32, 8 of AVX2's 16), so
 * D = 64 takes 4 heads a sweep on AVX-512 and 1 on AVX2; heads wider than a sweep go
 * a piece of columns at a time. The cache element type is fp32 or bf16; the
 * arithmetic is fp32.
 *
 * Both passes read the cache from memory (a step's K/V far exceeds the caches), and
 * the hardware prefetcher loses the stream at every page jump: each pass prefetches
 * the records (all KV heads of a slot, KVH * D values) PREFETCH_AHEAD keys ahead into
 * L2; the first values sweep brings the records the later ones find in the caches.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#ifdef __AVX512F__
#define LANES 16
#define SWEEP_VECTORS 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vec_load_bf16(const uint16_t *p) { return load_bf16x16(p); }
static inline vec vec_broadcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vec_sum_lanes(const vec *v) { return sum_lanes16(v); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline void vec_store_first(float *p, vec v, int64_t n) {     /* lanes [0, n) */
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v);
}
#else
#define LANES 8
#define SWEEP_VECTORS 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vec_load_bf16(const uint16_t *p) { return load_bf16x8(p); }
static inline vec vec_broadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vec_sum_lanes(const vec *v) { return sum_lanes8(v); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline void vec_store_first(float *p, vec v, int64_t n) {     /* lanes [0, n) */
    float lanes[LANES];
    _mm256_storeu_ps(lanes, v);
    memcpy(p, lanes, sizeof(float) * (size_t)n);
}
#endif

#define KEYS_PER_BLOCK LANES
#define PREFETCH_AHEAD 64       /* 16 to 128 ahead, L1 or L2 hints: about even */

int attention_vectors_apply(int64_t dim) { return dim % LANES == 0 && dim <= 256; }

/* Element `index` of a flat cache of fp32 or bf16 values, LANES lanes as fp32. */
static inline vec load_cached(const void *cache, int64_t index, const int bf16) {
    return bf16 ? vec_load_bf16((const uint16_t *)cache + index)
                : vec_load((const float *)cache + index);
}

static inline __attribute__((always_inline)) void scores_pass(
        const float *q, const void *keys, const int64_t *row, int64_t count, int64_t heads,
        int64_t kv_heads, int64_t dim, float scale, float *scores, const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, vectors = dim / LANES;
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    const vec scales = vec_broadcast(&scale);
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
                /* widened once here, read by all `group` query heads below */
                for (int64_t c = 0; c < vectors; c++)
                    vec_store(widened + j * dim + LANES * c,
                              load_cached(keys, block[j] + g * dim + LANES * c, 1));
                key[j] = widened + j * dim;
            }
            for (int64_t hq = g * group; hq < (g + 1) * group; hq++) {
                const float *query = q + hq * dim;
                vec sums[KEYS_PER_BLOCK];       /* independent FMA chains */
                for (int j = 0; j < KEYS_PER_BLOCK; j++) sums[j] = vec_zero();
                for (int64_t c = 0; c < vectors; c++) {
                    const vec part = vec_load(query + LANES * c);
                    for (int j = 0; j < KEYS_PER_BLOCK; j++)
                        sums[j] = vec_fma(part, vec_load(key[j] + LANES * c), sums[j]);
                }
                vec_store_first(scores + hq * count + l, vec_mul(vec_sum_lanes(sums), scales), n);
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
 * count apart; outputs `out`, out_stride apart): out[h][0 .. LANES * vectors) =
 * sum_l probs[h][l] * value(row[l]) from `offset` within each record. Each value
 * vector is loaded (and widened) once for all of them. */
static inline __attribute__((always_inline)) void weigh_heads(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, const int count_heads, const int vectors, int prefetch,
        float *out, int64_t out_stride, const int bf16) {
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    vec acc[SWEEP_VECTORS];
    for (int i = 0; i < count_heads * vectors; i++) acc[i] = vec_zero();
    for (int64_t l = 0; l < count; l++) {
        if (prefetch && l + PREFETCH_AHEAD < count)
            prefetch_records(values, row, l + PREFETCH_AHEAD, l + PREFETCH_AHEAD + 1,
                             record_bytes);
        vec p[4];
        for (int h = 0; h < count_heads; h++) p[h] = vec_broadcast(probs + h * count + l);
        const int64_t start = row[l] * record + offset;
        for (int c = 0; c < vectors; c++) {
            const vec v = load_cached(values, start + LANES * c, bf16);
            for (int h = 0; h < count_heads; h++)
                acc[h * vectors + c] = vec_fma(p[h], v, acc[h * vectors + c]);
        }
    }
    for (int h = 0; h < count_heads; h++)
        for (int c = 0; c < vectors; c++)
            vec_store(out + h * out_stride + LANES * c, acc[h * vectors + c]);
}

/* One sweep: heads [first, first + n) of one KV head over `vectors` * LANES columns
 * from `offset`; n <= 4 and n * vectors <= SWEEP_VECTORS. Shapes that fill the
 * accumulators are constants, so they stay in registers; the rest sweep one head at
 * a time. */
static inline __attribute__((always_inline)) void sweep(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, int64_t n, int64_t vectors, int prefetch, float *out,
        int64_t out_stride, const int bf16) {
#define WEIGH(heads_n, vectors_n) weigh_heads(probs, count, values, row, record, offset, \
        heads_n, vectors_n, prefetch, out, out_stride, bf16)
    if (vectors == SWEEP_VECTORS && n == 1) WEIGH(1, SWEEP_VECTORS);
    else if (vectors == SWEEP_VECTORS / 2 && n == 2) WEIGH(2, SWEEP_VECTORS / 2);
    else if (vectors == SWEEP_VECTORS / 2 && n == 1) WEIGH(1, SWEEP_VECTORS / 2);
    else if (vectors == SWEEP_VECTORS / 4 && n == 4) WEIGH(4, SWEEP_VECTORS / 4);
    else if (vectors == SWEEP_VECTORS / 4 && n == 3) WEIGH(3, SWEEP_VECTORS / 4);
    else if (vectors == SWEEP_VECTORS / 4 && n == 2) WEIGH(2, SWEEP_VECTORS / 4);
    else if (vectors == SWEEP_VECTORS / 4 && n == 1) WEIGH(1, SWEEP_VECTORS / 4);
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
    const int64_t piece = dim < LANES * SWEEP_VECTORS ? dim : LANES * SWEEP_VECTORS;
    const int64_t fit = SWEEP_VECTORS / (piece / LANES);          /* heads a sweep holds */
    const int64_t most = fit < 4 ? fit : 4;
    prefetch_records(values, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD,
                     record * (bf16 ? 2 : 4));
    for (int64_t hq = 0; hq < heads;) {
        const int64_t g = hq / group, left = (g + 1) * group - hq;
        const int64_t n = left < most ? left : most;
        for (int64_t column = 0; column < dim; column += piece) {
            const int64_t width = dim - column < piece ? dim - column : piece;
            sweep(probs + hq * count, count, values, row, record, g * dim + column, n,
                  width / LANES, hq == 0 && column == 0 /* brings the records in */,
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

#else                           /* no vector passes: paged_attention.c's scalar loops */

int attention_vectors_apply(int64_t dim) { (void)dim; return 0; }

void attention_scores_vector(const float *q, const void *keys, int kv_bf16, const int64_t *row,
                             int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                             float scale, float *scores) {
    (void)q; (void)keys; (void)kv_bf16; (void)row; (void)count; (void)heads; (void)kv_heads; (void)dim;
    (void)scale; (void)scores;
}

void attention_values_vector(const float *probs, const void *values, int kv_bf16,
                             const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                             int64_t dim, float *out, int64_t out_stride) {
    (void)probs; (void)values; (void)kv_bf16; (void)row; (void)count; (void)heads; (void)kv_heads;
    (void)dim; (void)out; (void)out_stride;
}

#endif
