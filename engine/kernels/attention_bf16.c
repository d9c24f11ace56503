/* The two passes of decode attention over a bf16 cache with AVX512-BF16 dot products
 * (vdpbf16ps), for head sizes that are a multiple of 32 up to 256. On CPUs without
 * them, and for fp32 caches, attention_vectors.c's passes serve.
 *
 * vdpbf16ps multiplies 32 bf16 pairs exactly and adds each adjacent pair of products
 * into one of 16 fp32 lanes: no widening of the cache's values, half the multiply
 * instructions of fp32 FMAs. The fp32 side of each product (a query, a probability)
 * is carried as two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), so x is kept to
 * ~16 significant bits (relative error <= 2^-17) instead of bf16's 8: each product
 * costs two dot-product steps and the arithmetic stays within a few fp32 ulps of
 * attention_vectors.c's.
 *
 * Scores: 16 keys at a time, as in attention_vectors.c (16 accumulators, one
 * transpose-and-add tree), each key's 2 x 32 bf16 loaded straight from the cache.
 * Values: keys taken in pairs (l, l + 1); interleaving their value vectors puts
 * (v[l][d], v[l + 1][d]) in lane d's pair, and one broadcast pair of probabilities
 * (p[l], p[l + 1]) weighs both keys in one step. The interleave permutes dimensions
 * within each 128-bit lane (see unpermute), undone once per head at the end.
 *
 * Each pass prefetches what it reads, PREFETCH_AHEAD keys ahead into L2: the scores
 * pass the key records, the values pass its KV head's lines of the value records.
 * Prefetching keys and values both in the scores pass would ask for twice the
 * bandwidth in one pass and none in the other; split, each pass streams its own.
 */
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define KEYS_PER_BLOCK 16
#define MAX_DIM 256
#define PREFETCH_AHEAD 32      /* keys ahead, in both passes */

/* Records (all KV heads of a slot) of row[from .. to) into L2. */
static inline void prefetch_slots(const uint16_t *cache, const int64_t *row, int64_t from,
                                  int64_t to, int64_t record) {
    for (int64_t l = from; l < to; l++)
        for (int64_t byte = 0; byte < record * 2; byte += 64)
            _mm_prefetch((const char *)(cache + row[l] * record) + byte, _MM_HINT_T1);
}

int attention_bf16_apply(int64_t dim) { return dim % 32 == 0 && dim <= MAX_DIM; }

static inline __m512bh load_pairs(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

static inline __m512 widen_bf16(__m256bh x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)x), 16));
}

/* q [H, D] -> hi, lo [H, D] bf16 with q ~= hi + lo, in q's order (D % 32 == 0). */
static void split_query(const float *q, int64_t size, uint16_t *hi, uint16_t *lo) {
    for (int64_t i = 0; i < size; i += 16) {
        const __m512 x = _mm512_loadu_ps(q + i);
        const __m256bh top = _mm512_cvtneps_pbh(x);
        _mm256_storeu_si256((__m256i *)(hi + i), (__m256i)top);
        _mm256_storeu_si256((__m256i *)(lo + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, widen_bf16(top))));
    }
}

/* scores[hq * count + l] = scale * q[hq] . key(row[l])[hq / group], l < count;
 * keys, values: the flat bf16 caches [slots, KVH, D]. Prefetches the keys only (and,
 * at the end, the first values the values pass reads): that pass brings its own. */
void attention_scores_bf16(const float *q, const uint16_t *keys, const uint16_t *values,
                           const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                           int64_t dim, float scale, float *scores) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, pieces = dim / 32;
    uint16_t q_hi[heads * dim], q_lo[heads * dim];
    split_query(q, heads * dim, q_hi, q_lo);
    const __m512 scales = _mm512_set1_ps(scale);
    prefetch_slots(keys, row, 0, count < PREFETCH_AHEAD ? count : PREFETCH_AHEAD, record);
    for (int64_t l = 0; l < count; l += KEYS_PER_BLOCK) {
        const int64_t n = count - l < KEYS_PER_BLOCK ? count - l : KEYS_PER_BLOCK;
        const int64_t ahead = l + PREFETCH_AHEAD, until = ahead + KEYS_PER_BLOCK;
        if (ahead < count) prefetch_slots(keys, row, ahead, until < count ? until : count, record);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const uint16_t *key[KEYS_PER_BLOCK];   /* past the range: its last key, not stored */
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int j = 0; j < KEYS_PER_BLOCK; j++)
                key[j] = keys + row[l + (j < n ? j : n - 1)] * record + g * dim;
            for (int64_t hq = g * group; hq < (g + 1) * group; hq++) {
                __m512 sums[KEYS_PER_BLOCK];
                for (int j = 0; j < KEYS_PER_BLOCK; j++) sums[j] = _mm512_setzero_ps();
                for (int64_t c = 0; c < pieces; c++) {
                    const __m512bh hi = load_pairs(q_hi + hq * dim + 32 * c);
                    const __m512bh lo = load_pairs(q_lo + hq * dim + 32 * c);
                    for (int j = 0; j < KEYS_PER_BLOCK; j++) {
                        const __m512bh k = load_pairs(key[j] + 32 * c);
                        sums[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sums[j], hi, k), lo, k);
                    }
                }
                _mm512_mask_storeu_ps(scores + hq * count + l, valid,
                                      _mm512_mul_ps(sum_lanes16(sums), scales));
            }
        }
    }
    /* the values pass starts on the first KV head's values of the first keys */
    for (int64_t l = 0; l < count && l < PREFETCH_AHEAD; l++)
        for (int64_t byte = 0; byte < dim * 2; byte += 64)
            _mm_prefetch((const char *)(values + row[l] * record) + byte, _MM_HINT_T1);
}

/* One head's probabilities p[0..count) -> words[0..count rounded up to even): for the
 * keys (l, l + 1), l even, word l = (hi(p[l]), hi(p[l + 1])) and word l + 1 =
 * (lo(p[l]), lo(p[l + 1])), as 32-bit lanes of bf16 pairs; p past count is 0. */
static void split_probabilities(const float *p, int64_t count, uint32_t *words) {
    const __m512i order = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                            7, 23);
    for (int64_t l = 0; l < count; l += 16) {
        const int64_t m = count - l < 16 ? count - l : 16, written = (m + 1) & ~(int64_t)1;
        const __m512 x = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1u), p + l);
        const __m256bh hi = _mm512_cvtneps_pbh(x);
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(x, widen_bf16(hi)));
        const __m512i pairs = _mm512_permutex2var_epi32(
            _mm512_castsi256_si512((__m256i)hi), order, _mm512_castsi256_si512((__m256i)lo));
        _mm512_mask_storeu_epi32(words + l, (__mmask16)((1u << written) - 1u), pairs);
    }
}

/* acc holds dimension 8k + p (lo) and 8k + 4 + p (hi) of 128-bit lane k in lane 4k + p
 * (the unpack order); out[0..32) gets them in dimension order: 128-bit lanes
 * lo0 hi0 lo1 hi1 | lo2 hi2 lo3 hi3. */
static inline void unpermute(__m512 lo, __m512 hi, float *out) {
    const __m512 front = _mm512_shuffle_f32x4(lo, hi, 0x44);      /* lo0 lo1 hi0 hi1 */
    const __m512 back = _mm512_shuffle_f32x4(lo, hi, 0xee);       /* lo2 lo3 hi2 hi3 */
    _mm512_storeu_ps(out, _mm512_shuffle_f32x4(front, front, 0xd8));
    _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(back, back, 0xd8));
}

/* The query heads [first, first + n) of one KV head (n * pieces <= 8): words are their
 * probabilities as split_probabilities writes them, `stride` words apart per head;
 * out[h] (D floats, out_stride apart) = sum_l p[h][l] * value(row[l]). */
static inline __attribute__((always_inline)) void weigh_pairs(
        const uint32_t *words, int64_t stride, int64_t count, const uint16_t *values,
        const int64_t *row, int64_t record, int64_t offset, const int n, const int pieces,
        float *out, int64_t out_stride) {
    __m512 acc_lo[8], acc_hi[8];
    for (int i = 0; i < n * pieces; i++) acc_lo[i] = acc_hi[i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l += 2) {
        if (l + PREFETCH_AHEAD < count) {     /* this KV head's lines of keys further on */
            const uint16_t *ahead = values + row[l + PREFETCH_AHEAD] * record + offset;
            const uint16_t *after = values + row[l + PREFETCH_AHEAD + 1 < count
                                                 ? l + PREFETCH_AHEAD + 1 : l] * record + offset;
            for (int64_t byte = 0; byte < pieces * 64; byte += 64) {
                _mm_prefetch((const char *)ahead + byte, _MM_HINT_T1);
                _mm_prefetch((const char *)after + byte, _MM_HINT_T1);
            }
        }
        const uint16_t *first = values + row[l] * record + offset;
        const uint16_t *second = l + 1 < count ? values + row[l + 1] * record + offset : first;
        __m512bh weight_hi[4], weight_lo[4];
        for (int h = 0; h < n; h++) {
            weight_hi[h] = (__m512bh)_mm512_set1_epi32((int)words[h * stride + l]);
            weight_lo[h] = (__m512bh)_mm512_set1_epi32((int)words[h * stride + l + 1]);
        }
        for (int c = 0; c < pieces; c++) {
            const __m512i a = _mm512_loadu_si512((const void *)(first + 32 * c));
            const __m512i b = _mm512_loadu_si512((const void *)(second + 32 * c));
            const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int h = 0; h < n; h++) {
                __m512 *lo = &acc_lo[h * pieces + c], *hi = &acc_hi[h * pieces + c];
                *lo = _mm512_dpbf16_ps(_mm512_dpbf16_ps(*lo, weight_hi[h], low), weight_lo[h], low);
                *hi = _mm512_dpbf16_ps(_mm512_dpbf16_ps(*hi, weight_hi[h], high), weight_lo[h], high);
            }
        }
    }
    for (int h = 0; h < n; h++)
        for (int c = 0; c < pieces; c++)
            unpermute(acc_lo[h * pieces + c], acc_hi[h * pieces + c],
                      out + h * out_stride + 32 * c);
}

/* out[hq] (D floats, out_stride apart) = sum_l probs[hq * count + l] * value(row[l])[hq / group].
 * words: scratch of heads * (count + 1) 32-bit words. */
void attention_values_bf16(const float *probs, const uint16_t *values, const int64_t *row,
                           int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                           uint32_t *words, float *out, int64_t out_stride) {
    const int64_t group = heads / kv_heads, record = kv_heads * dim, stride = count + 1;
    const int pieces = (int)(dim / 32), most = pieces <= 2 ? 4 : pieces <= 4 ? 2 : 1;
    for (int64_t hq = 0; hq < heads; hq++)
        split_probabilities(probs + hq * count, count, words + hq * stride);
    for (int64_t hq = 0; hq < heads;) {
        const int64_t g = hq / group, left = (g + 1) * group - hq;
        const int n = left < most ? (int)left : most;
#define WEIGH(n_, pieces_) weigh_pairs(words + hq * stride, stride, count, values, row, \
        record, g * dim, n_, pieces_, out + hq * out_stride, out_stride)
#define SWEEP(pieces_) switch (n) { \
        case 4: WEIGH(4, pieces_); break; case 3: WEIGH(3, pieces_); break; \
        case 2: WEIGH(2, pieces_); break; default: WEIGH(1, pieces_); }
#define SWEEP_TWO(pieces_) if (n == 2) WEIGH(2, pieces_); else WEIGH(1, pieces_)
        switch (pieces) {       /* n <= most: n * pieces <= 8 accumulators */
            case 1: SWEEP(1); break;
            case 2: SWEEP(2); break;
            case 3: SWEEP_TWO(3); break;
            case 4: SWEEP_TWO(4); break;
            default: WEIGH(1, pieces);
        }
#undef SWEEP_TWO
#undef SWEEP
#undef WEIGH
        hq += n;
    }
}

#else

int attention_bf16_apply(int64_t dim) { (void)dim; return 0; }

void attention_scores_bf16(const float *q, const uint16_t *keys, const uint16_t *values,
                           const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                           int64_t dim, float scale, float *scores) {
    (void)q; (void)keys; (void)values; (void)row; (void)count; (void)heads; (void)kv_heads;
    (void)dim; (void)scale; (void)scores;
}

void attention_values_bf16(const float *probs, const uint16_t *values, const int64_t *row,
                           int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                           uint32_t *words, float *out, int64_t out_stride) {
    (void)probs; (void)values; (void)row; (void)count; (void)heads; (void)kv_heads; (void)dim;
    (void)words; (void)out; (void)out_stride;
}

#endif
