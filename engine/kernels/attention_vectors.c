/* The two passes of decode attention over one request's context range, on AVX-512,
 * for head sizes that are a multiple of 16 up to 256 (paged_attention.c calls them;
 * attention_avx2.c has the AVX2 ones; other sizes and CPUs take its scalar loops).
 *
 * Scores: keys are taken 16 at a time. For one query head, 16 registers accumulate
 * q * k of the 16 keys (16 independent FMA chains, each D / 16 long); one
 * transpose-and-add tree then turns them into one register holding the 16 dot
 * products (45 shuffles and adds, where 16 separate horizontal sums take ~130). A bf16
 * cache's keys are widened to fp32 once per KV head, for all the query heads sharing
 * it (GQA). Values: the query heads sharing a KV head sweep the range together, each
 * value vector loaded (and widened) once for all of them, their D / 16 accumulators
 * each in registers. The cache element type is fp32 or bf16; the arithmetic is fp32.
 *
 * Both passes read the cache from memory (a step's K/V far exceeds the caches), and
 * the hardware prefetcher loses the stream at every page jump: each pass prefetches
 * the records (all KV heads of a slot, KVH * D floats) PREFETCH_AHEAD keys ahead into
 * L2. Prefetched, the passes come closer to a plain read of the cache than the scalar
 * loops; with the context in L1 the gain from the FMA chains and the one reduction
 * tree per 16 keys is larger.
 */
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

#ifdef __AVX512F__
#include <immintrin.h>

#define KEYS_PER_BLOCK 16
#define PREFETCH_AHEAD 64       /* 16 to 128 ahead, L1 or L2 hints: about even */

int attention_vectors_apply(int64_t dim) { return dim % 16 == 0 && dim <= 256; }

/* Element `index` of a flat cache of fp32 or bf16 values, 16 lanes as fp32. */
static inline __m512 load_cached(const void *cache, int64_t index, const int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)cache + index)
                : _mm512_loadu_ps((const float *)cache + index);
}

static inline __attribute__((always_inline)) void scores_pass(
        const float *q, const void *keys, const int64_t *row, int64_t count, int64_t heads,
        int64_t kv_heads, int64_t dim, float scale, float *scores, const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, vectors = dim / 16;
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    const __m512 scales = _mm512_set1_ps(scale);
    float widened[KEYS_PER_BLOCK * 256];       /* bf16: one KV head of the block, as fp32 */
    prefetch_records(keys, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD, record_bytes);
    for (int64_t l = 0; l < count; l += KEYS_PER_BLOCK) {
        const int64_t n = count - l < KEYS_PER_BLOCK ? count - l : KEYS_PER_BLOCK;
        const int64_t from = l + PREFETCH_AHEAD < count ? l + PREFETCH_AHEAD : count;
        prefetch_records(keys, row, from, from + KEYS_PER_BLOCK < count ? from + KEYS_PER_BLOCK
                         : count, record_bytes);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
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
                    _mm512_storeu_ps(widened + j * dim + 16 * c,
                                     load_cached(keys, block[j] + g * dim + 16 * c, 1));
                key[j] = widened + j * dim;
            }
            for (int64_t hq = g * group; hq < (g + 1) * group; hq++) {
                const float *query = q + hq * dim;
                __m512 sums[KEYS_PER_BLOCK];    /* 16 independent FMA chains */
                for (int j = 0; j < KEYS_PER_BLOCK; j++) sums[j] = _mm512_setzero_ps();
                for (int64_t c = 0; c < vectors; c++) {
                    const __m512 part = _mm512_loadu_ps(query + 16 * c);
                    for (int j = 0; j < KEYS_PER_BLOCK; j++)
                        sums[j] = _mm512_fmadd_ps(part, _mm512_loadu_ps(key[j] + 16 * c), sums[j]);
                }
                _mm512_mask_storeu_ps(scores + hq * count + l, valid,
                                      _mm512_mul_ps(sum_lanes16(sums), scales));
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
 * count apart; outputs `out`, out_stride apart): out[h] = sum_l probs[h][l] * value(row[l])
 * at `offset` within each record. Each value vector is loaded (and widened) once for
 * all of them; count_heads * vectors <= 16 accumulators stay in registers. */
static inline __attribute__((always_inline)) void weigh_heads(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, const int count_heads, const int vectors, int prefetch,
        float *out, int64_t out_stride, const int bf16) {
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    __m512 acc[16];
    for (int i = 0; i < count_heads * vectors; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l++) {
        if (prefetch && l + PREFETCH_AHEAD < count)
            prefetch_records(values, row, l + PREFETCH_AHEAD, l + PREFETCH_AHEAD + 1,
                             record_bytes);
        __m512 p[4];
        for (int h = 0; h < count_heads; h++) p[h] = _mm512_set1_ps(probs[h * count + l]);
        const int64_t start = row[l] * record + offset;
        for (int c = 0; c < vectors; c++) {
            const __m512 v = load_cached(values, start + 16 * c, bf16);
            for (int h = 0; h < count_heads; h++)
                acc[h * vectors + c] = _mm512_fmadd_ps(p[h], v, acc[h * vectors + c]);
        }
    }
    for (int h = 0; h < count_heads; h++)
        for (int c = 0; c < vectors; c++)
            _mm512_storeu_ps(out + h * out_stride + 16 * c, acc[h * vectors + c]);
}

/* The heads [first, first + n) of one KV head, n <= 4 (D = 64) or 2 (D = 128) or 1:
 * constant sizes, so each variant keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void weigh_group(
        const float *probs, int64_t count, const void *values, const int64_t *row,
        int64_t record, int64_t offset, int64_t n, int64_t dim, int prefetch, float *out,
        int64_t out_stride, const int bf16) {
#define WEIGH(heads_n, vectors_n) weigh_heads(probs, count, values, row, record, offset, \
        heads_n, vectors_n, prefetch, out, out_stride, bf16)
    if (dim == 64) {
        switch (n) {
            case 4: WEIGH(4, 4); return;
            case 3: WEIGH(3, 4); return;
            case 2: WEIGH(2, 4); return;
            default: WEIGH(1, 4); return;
        }
    }
    if (dim == 128) {
        if (n == 2) WEIGH(2, 8); else WEIGH(1, 8);
        return;
    }
    WEIGH(1, (int)(dim / 16));
#undef WEIGH
}

static inline __attribute__((always_inline)) void values_pass(
        const float *probs, const void *values, const int64_t *row, int64_t count,
        int64_t heads, int64_t kv_heads, int64_t dim, float *out, int64_t out_stride,
        const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim;
    const int64_t most = dim == 64 ? 4 : dim == 128 ? 2 : 1;     /* heads per sweep */
    prefetch_records(values, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD,
                     record * (bf16 ? 2 : 4));
    for (int64_t hq = 0; hq < heads;) {
        const int64_t g = hq / group, n = (g + 1) * group - hq < most ? (g + 1) * group - hq : most;
        weigh_group(probs + hq * count, count, values, row, record, g * dim, n, dim,
                    hq == 0 /* the first sweep brings the records in */, out + hq * out_stride,
                    out_stride, bf16);
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

#elif !(defined(__AVX2__) && defined(__FMA__))   /* AVX2: attention_avx2.c */

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
