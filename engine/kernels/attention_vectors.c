/* The two passes of decode attention over one request's context range, on AVX-512,
 * for head sizes that are a multiple of 16 up to 256 (paged_attention.c calls them;
 * other sizes and CPUs take its scalar loops).
 *
 * Scores: keys are taken 16 at a time. For one query head, 16 registers accumulate
 * q * k of the 16 keys (16 independent FMA chains, each D / 16 long); one
 * transpose-and-add tree then turns them into one register holding the 16 dot
 * products (45 shuffles and adds, where 16 separate horizontal sums take ~130). Values:
 * per query head, D / 16 registers accumulate p[l] * v[l] over the whole range.
 *
 * Both passes read the cache from memory (a step's K/V far exceeds the caches), and
 * the hardware prefetcher loses the stream at every page jump: each pass prefetches
 * the records (all KV heads of a slot, KVH * D floats) PREFETCH_AHEAD keys ahead into
 * L2. Measured, 64 requests x 192 tokens per layer, caches in DRAM, 2 threads: the
 * scalar loops 1.3-1.4 ms, these passes 1.0 ms (a plain read of the same bytes takes
 * 0.46 ms); with the context in L1, 64 x 128: 0.65 -> 0.32 ms on one thread.
 */
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

#ifdef __AVX512F__
#include <immintrin.h>

#define KEYS_PER_BLOCK 16
#define PREFETCH_AHEAD 64       /* 16, 32, 64, 128 ahead and L1 / L2 hints: within 10% */
#define PREFETCH_HINT _MM_HINT_T1

int attention_vectors_apply(int64_t dim) { return dim % 16 == 0 && dim <= 256; }

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

/* Element `index` of a flat cache of fp32 or bf16 values, 16 lanes as fp32. */
static inline __m512 load_cached(const void *cache, int64_t index, const int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)cache + index)
                : _mm512_loadu_ps((const float *)cache + index);
}

static inline void prefetch_records(const void *cache, const int64_t *row, int64_t from,
                                    int64_t to, int64_t record_bytes) {
    for (int64_t l = from; l < to; l++) {
        const char *start = (const char *)cache + row[l] * record_bytes;
        for (int64_t byte = 0; byte < record_bytes; byte += 64)
            _mm_prefetch(start + byte, PREFETCH_HINT);
    }
}

static inline __attribute__((always_inline)) void scores_pass(
        const float *q, const void *keys, const int64_t *row, int64_t count, int64_t heads,
        int64_t kv_heads, int64_t dim, float scale, float *scores, const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, vectors = dim / 16;
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    const __m512 scales = _mm512_set1_ps(scale);
    prefetch_records(keys, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD, record_bytes);
    for (int64_t l = 0; l < count; l += KEYS_PER_BLOCK) {
        const int64_t n = count - l < KEYS_PER_BLOCK ? count - l : KEYS_PER_BLOCK;
        const int64_t from = l + PREFETCH_AHEAD < count ? l + PREFETCH_AHEAD : count;
        prefetch_records(keys, row, from, from + KEYS_PER_BLOCK < count ? from + KEYS_PER_BLOCK
                         : count, record_bytes);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        int64_t block[KEYS_PER_BLOCK];          /* past the range: its last key, not stored */
        for (int j = 0; j < KEYS_PER_BLOCK; j++) block[j] = row[l + (j < n ? j : n - 1)] * record;
        for (int64_t hq = 0; hq < heads; hq++) {
            const float *query = q + hq * dim;
            const int64_t offset = (hq / group) * dim;
            __m512 sums[KEYS_PER_BLOCK];        /* 16 independent FMA chains */
            for (int j = 0; j < KEYS_PER_BLOCK; j++) sums[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < vectors; c++) {
                const __m512 part = _mm512_loadu_ps(query + 16 * c);
                for (int j = 0; j < KEYS_PER_BLOCK; j++)
                    sums[j] = _mm512_fmadd_ps(
                        part, load_cached(keys, block[j] + offset + 16 * c, bf16), sums[j]);
            }
            _mm512_mask_storeu_ps(scores + hq * count + l, valid,
                                  _mm512_mul_ps(sum_lanes16(sums), scales));
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

/* out (D floats) = sum_l probs[l] * value(row[l]) at `offset` within each record. */
static inline __attribute__((always_inline)) void weigh_head(
        const float *probs, const void *values, const int64_t *row, int64_t count,
        int64_t record, int64_t offset, const int vectors, int prefetch, float *out,
        const int bf16) {
    const int64_t record_bytes = record * (bf16 ? 2 : 4);
    __m512 acc[16];
    for (int c = 0; c < vectors; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l++) {
        if (prefetch && l + PREFETCH_AHEAD < count)
            prefetch_records(values, row, l + PREFETCH_AHEAD, l + PREFETCH_AHEAD + 1,
                             record_bytes);
        const __m512 p = _mm512_set1_ps(probs[l]);
        const int64_t start = row[l] * record + offset;
        for (int c = 0; c < vectors; c++)
            acc[c] = _mm512_fmadd_ps(p, load_cached(values, start + 16 * c, bf16), acc[c]);
    }
    for (int c = 0; c < vectors; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

static inline __attribute__((always_inline)) void values_pass(
        const float *probs, const void *values, const int64_t *row, int64_t count,
        int64_t heads, int64_t kv_heads, int64_t dim, float *out, int64_t out_stride,
        const int bf16) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim;
    prefetch_records(values, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD,
                     record * (bf16 ? 2 : 4));
    for (int64_t hq = 0; hq < heads; hq++) {
        const float *p = probs + hq * count;
        const int64_t offset = (hq / group) * dim;
        const int ahead = hq == 0;        /* the first head's pass brings the records in */
        float *target = out + hq * out_stride;
        switch (dim / 16) {      /* constant sizes keep the accumulators in registers */
            case 4: weigh_head(p, values, row, count, record, offset, 4, ahead, target, bf16); break;
            case 8: weigh_head(p, values, row, count, record, offset, 8, ahead, target, bf16); break;
            default:
                weigh_head(p, values, row, count, record, offset, (int)(dim / 16), ahead, target,
                           bf16);
        }
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

#else

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
