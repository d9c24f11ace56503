/* Causal attention of prefill chunks over a bf16 cache, flash-attention style, on
 * AVX512-BF16 dot products (vdpbf16ps): one long chunk (prefill_attention_bf16, from
 * attention/native_prefill.py), or the chunks of a mixed step in one job
 * (prefill_attention_runs, from paged_attention.c: runs of 8 rows or more).
 *
 * A chunk's n queries sit at positions start .. start + n - 1; its context is the
 * num_keys cache slots slots[0 ..), holding positions first_key .. first_key +
 * num_keys - 1 (first_key > 0 when a sliding window dropped the oldest). The query at
 * position p sees the keys at positions k with k <= p, and k > p - window when
 * window > 0. paged_attention.c reads a context once per query row, which suits
 * decodes and short chunks; here a block of queries shares every key it loads.
 *
 * Two passes:
 * 1. Pack each KV head's context (keys and values gathered from their slots) into the
 *    layouts of the dot products, zero past num_keys:
 *    keys   [KVH][keys / 16][D / 2][16] words: word (j, p, c) = (K[16 j + c][2 p],
 *           K[16 j + c][2 p + 1]); one vdpbf16ps of a broadcast query word p with the
 *           16 words (j, p, .) adds pair p's products to 16 keys' scores;
 *    values [KVH][keys / 2][D] words: word (q, d) = (V[2 q][d], V[2 q + 1][d]); one
 *           vdpbf16ps of a broadcast probability word (P[2 q], P[2 q + 1]) with 16 such
 *           words adds two keys' weighted values to 16 output dimensions.
 *    A job of several chunks packs them all first, into one buffer.
 * 2. Work items of QUERY_BLOCK positions x one KV head of a chunk (a job's items are
 *    its chunks' in turn, shared out between the threads); each runs micro tiles of
 *    TILE_ROWS rows (a row: one position and one of the KV head's G query heads), over
 *    key blocks of KEY_BLOCK with an online softmax (running max m, sum l, output O
 *    rescaled by e^(m_old - m_new) whenever the max grows). Blocks wholly past a
 *    tile's visible keys are never visited; blocks a tile only partly sees are masked.
 *
 * Precision: the query (times the scale) and each block's probabilities are rounded
 * to bf16 once, as flash attention does on GPUs; the keys and values are the cache's
 * bf16; products are exact, sums, max and softmax fp32. Against fp32 attention over
 * the same cache the error is ~3e-3 of the output for scores of order 1 and grows
 * with their spread (~2.5e-2 at a standard deviation of 30), as the error the cache's
 * own rounding of K puts in the scores does. attention_bf16.c carries its decode
 * queries in two bf16 halves instead, which costs nothing there (decodes wait on
 * memory); here it would double the dot products, and the default model's logits come
 * out no closer to fp32's (docs/benchmarks.md, Accuracy of the fast modes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

#define TILE_ROWS 8
#define KEY_BLOCK 32
#define QUERY_BLOCK 16
#define MAX_DIM 256

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "prefill_tiles.h"

int prefill_attention_apply(int64_t dim) { return dim % 32 == 0 && dim <= MAX_DIM; }

/* One run of a job: a chunk's queries and where its packed context goes. */
typedef struct {
    PrefillRun run;
    int64_t padded;                   /* num_keys rounded up to KEY_BLOCK */
    uint32_t *packed_keys, *packed_values;
    int64_t first_pack, first_item;   /* its first pack and attend items in the job's */
} JobRun;

typedef struct {
    int64_t q_stride, out_stride;     /* floats from one position's queries (outputs) on */
    const uint16_t *keys, *values;    /* flat bf16 caches [slots, KVH, D] */
    int64_t heads, kv_heads, dim;
    float scale;
    const JobRun *runs;
    int64_t num_runs;
    struct Tile *tiles;               /* one per part */
    WorkRanges *items;
} PrefillJob;

/* The run holding job item `item`, whose first items `first(run)` are ascending
 * (binary search: a step may hold a few hundred runs). */
static const JobRun *run_of(const PrefillJob *job, int64_t item, int pack) {
    int64_t low = 0, high = job->num_runs - 1;
    while (low < high) {
        const int64_t middle = (low + high + 1) / 2;
        const int64_t first = pack ? job->runs[middle].first_pack : job->runs[middle].first_item;
        if (first <= item) low = middle;
        else high = middle - 1;
    }
    return &job->runs[low];
}

/* Pass 1, one item: KEY_BLOCK keys (block b) of KV head g of a run, keys and values. */
static void pack_block(const PrefillJob *job, const JobRun *jr, int64_t g, int64_t b) {
    const int64_t dim = job->dim, pairs = dim / 2, record = job->kv_heads * dim;
    const int64_t num_keys = jr->run.num_keys;
    const int64_t *slots = jr->run.slots;
    uint32_t *keys = jr->packed_keys + (g * (jr->padded / 16) + b * (KEY_BLOCK / 16)) * pairs * 16;
    uint32_t *values = jr->packed_values + (g * (jr->padded / 2) + b * (KEY_BLOCK / 2)) * dim;
    for (int64_t c = 0; c < KEY_BLOCK; c++) {
        const int64_t key = b * KEY_BLOCK + c;
        uint32_t *column = keys + (c / 16) * pairs * 16 + c % 16;
        if (key >= num_keys) {
            for (int64_t p = 0; p < pairs; p++) column[p * 16] = 0;
            continue;
        }
        const uint16_t *key_row = job->keys + slots[key] * record + g * dim;
        for (int64_t p = 0; p < pairs; p++) memcpy(column + p * 16, key_row + 2 * p, 4);
    }
    static const uint16_t zeros[MAX_DIM];
    for (int64_t q = 0; q < KEY_BLOCK / 2; q++) {
        const int64_t key = b * KEY_BLOCK + 2 * q;
        const uint16_t *even = key < num_keys ? job->values + slots[key] * record + g * dim : zeros;
        const uint16_t *odd = key + 1 < num_keys
            ? job->values + slots[key + 1] * record + g * dim : zeros;
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + d)));
            const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(odd + d)));
            _mm512_storeu_si512((void *)(values + q * dim + d),
                                _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
    }
}

static void pack_part(const void *arg, int part, int parts) {
    const PrefillJob *job = arg;
    const JobRun *last = &job->runs[job->num_runs - 1];
    const int64_t items = last->first_pack + job->kv_heads * (last->padded / KEY_BLOCK);
    for (int64_t i = items * part / parts; i < items * (part + 1) / parts; i++) {
        const JobRun *jr = run_of(job, i, 1);
        const int64_t blocks = jr->padded / KEY_BLOCK, local = i - jr->first_pack;
        pack_block(job, jr, local / blocks, local % blocks);
    }
}

/* Rows [row, row + count) of work item (g, positions from i0) of a run: row r is
 * position i0 + r / G, query head g G + r % G; rows past count repeat the last (not
 * stored). */
static void attend_tile(const PrefillJob *job, const JobRun *jr, Tile *tile, int64_t g,
                        int64_t i0, int64_t row, int64_t count) {
    const PrefillRun *run = &jr->run;
    const int64_t group = job->heads / job->kv_heads, dim = job->dim;
    int64_t lowest = INT64_MAX, highest = 0, narrowest_first = 0, earliest_last = INT64_MAX;
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t k = row + (r < count ? r : count - 1), i = i0 + k / group;
        const float *q = run->q + i * job->q_stride + (g * group + k % group) * dim;
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_set1_ps(job->scale));
            _mm256_storeu_si256((__m256i *)(tile->q[r] + d / 2), (__m256i)_mm512_cvtneps_pbh(x));
            _mm512_storeu_ps(tile->o[r] + d, _mm512_setzero_ps());
        }
        const int64_t position = run->start + i;
        tile->last[r] = position - run->first_key;
        tile->first[r] = run->window > 0 && position - run->window + 1 > run->first_key
            ? position - run->window + 1 - run->first_key : 0;
        tile->m[r] = -1e30f;
        tile->l[r] = _mm512_setzero_ps();
        lowest = tile->first[r] < lowest ? tile->first[r] : lowest;
        highest = tile->last[r] > highest ? tile->last[r] : highest;
        narrowest_first = tile->first[r] > narrowest_first ? tile->first[r] : narrowest_first;
        earliest_last = tile->last[r] < earliest_last ? tile->last[r] : earliest_last;
    }
    const int64_t pairs = dim / 2, vectors = dim / 16;
    for (int64_t kb = lowest / KEY_BLOCK * KEY_BLOCK; kb <= highest; kb += KEY_BLOCK) {
        __m512 s[TILE_ROWS][2];
        tile_scores(tile, job->dim, jr->packed_keys + (g * (jr->padded / 16) + kb / 16) * pairs * 16, s);
        tile_softmax(tile, s, kb, kb < narrowest_first || kb + KEY_BLOCK - 1 > earliest_last);
        const uint32_t *values = jr->packed_values + (g * (jr->padded / 2) + kb / 2) * dim;
        for (int r0 = 0; r0 < TILE_ROWS; r0 += 4)
            for (int64_t c0 = 0; c0 < vectors; c0 += 4) {
                if (vectors - c0 >= 4) tile_weigh(tile, values, dim, r0, c0, 4);
                else tile_weigh(tile, values, dim, r0, c0, 2);    /* dim % 32 == 0 */
            }
    }
    for (int r = 0; r < count; r++) {
        const int64_t k = row + r, i = i0 + k / group;
        float *out = run->out + i * job->out_stride + (g * group + k % group) * dim;
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(tile->l[r]));
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(tile->o[r] + d), inverse));
    }
}

static void attend_part(const void *arg, int part, int parts) {
    (void)parts;
    const PrefillJob *job = arg;
    const int64_t group = job->heads / job->kv_heads;
    Tile *tile = job->tiles + part;
    int64_t limit, item;
    while ((item = work_ranges_take(job->items, part, &limit)) >= 0) {
        const JobRun *jr = run_of(job, item, 0);
        const int64_t n = jr->run.n, blocks = (n + QUERY_BLOCK - 1) / QUERY_BLOCK;
        const int64_t local = item - jr->first_item;
        const int64_t g = local / blocks, i0 = (local % blocks) * QUERY_BLOCK;
        const int64_t positions = n - i0 < QUERY_BLOCK ? n - i0 : QUERY_BLOCK;
        const int64_t rows = positions * group;
        for (int64_t row = 0; row < rows; row += TILE_ROWS)
            attend_tile(job, jr, tile, g, i0, row, rows - row < TILE_ROWS ? rows - row : TILE_ROWS);
    }
}

/* The runs' attention in one job: every run's context packed (pass 1), then every
 * run's work items (pass 2), shared out between the parts. Returns 0, 1 (a run
 * without keys or too long), 2 (out of memory). */
static int attend_runs(const PrefillRun *runs, int64_t num_runs, int64_t q_stride,
                       int64_t out_stride, const uint16_t *keys, const uint16_t *values,
                       int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                       int num_threads) {
    const int parts = num_threads < 1 ? 1 : num_threads;
    JobRun *job_runs = malloc(sizeof(JobRun) * num_runs);
    if (!job_runs) return 2;
    int64_t words = 0, packs = 0, items = 0;
    for (int64_t r = 0; r < num_runs; r++) {
        JobRun *jr = &job_runs[r];
        jr->run = runs[r];
        if (runs[r].num_keys <= 0 || runs[r].num_keys > INT32_MAX - 2 * KEY_BLOCK) {
            free(job_runs);
            return 1;
        }
        jr->padded = (runs[r].num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
        jr->first_pack = packs;
        jr->first_item = items;
        packs += kv_heads * (jr->padded / KEY_BLOCK);
        items += kv_heads * ((runs[r].n + QUERY_BLOCK - 1) / QUERY_BLOCK);
        words += kv_heads * jr->padded * dim / 2;     /* keys; as many for values */
    }
    uint32_t *packed = aligned_alloc(64, (2 * (size_t)words * sizeof(uint32_t) + 63) / 64 * 64);
    Tile *tiles = aligned_alloc(64, parts * sizeof(Tile));
    if (!packed || !tiles) {
        free(packed);
        free(tiles);
        free(job_runs);
        return 2;
    }
    for (int64_t r = 0, offset = 0; r < num_runs; r++) {
        const int64_t size = kv_heads * job_runs[r].padded * dim / 2;
        job_runs[r].packed_keys = packed + offset;
        job_runs[r].packed_values = packed + words + offset;
        offset += size;
    }
    WorkRanges work;
    work_ranges_init(&work, items, parts);
    PrefillJob job = {q_stride, out_stride, keys, values, heads, kv_heads, dim, scale, job_runs,
                      num_runs, tiles, &work};
    run_parallel(pack_part, &job, parts);
    run_parallel(attend_part, &job, parts);
    free(packed);
    free(tiles);
    free(job_runs);
    return 0;
}

#else

int prefill_attention_apply(int64_t dim) { (void)dim; return 0; }

#endif

/* out[i] (heads x dim floats, out_stride apart) = attention of the queries q[i] (heads
 * x dim floats, q_stride apart), position start + i, over the chunk's context.
 * slots index the flat caches' num_slots slots. Returns 0; 1 bad shapes (or no
 * AVX512-BF16 in this build); 2 out of memory; 3 a query outside the context; 4 a
 * slot outside the cache. */
int prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *keys,
                           const uint16_t *values, const int64_t *slots, int64_t num_keys,
                           int64_t num_slots, int64_t first_key, int64_t start, int64_t n,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t window,
                           float scale, float *out, int64_t out_stride, int num_threads) {
    if (n <= 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads || !prefill_attention_apply(dim) || num_keys <= 0
        || num_keys > INT32_MAX - 2 * KEY_BLOCK) return 1;
    if (start < first_key || start + n - first_key > num_keys) return 3;
    for (int64_t j = 0; j < num_keys; j++)
        if (slots[j] < 0 || slots[j] >= num_slots) return 4;
    const PrefillRun run = {q, out, slots, num_keys, first_key, start, n, window};
    return prefill_attention_runs(&run, 1, q_stride, out_stride, keys, values, heads, kv_heads,
                                  dim, scale, num_threads);
}

/* Several chunks' attention in one job (see kernels.h); the caller has checked each
 * run's queries lie in its context and its slots in the cache. */
int prefill_attention_runs(const PrefillRun *runs, int64_t num_runs, int64_t q_stride,
                           int64_t out_stride, const uint16_t *keys, const uint16_t *values,
                           int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           int num_threads) {
    if (num_runs <= 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads || !prefill_attention_apply(dim)) return 1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return attend_runs(runs, num_runs, q_stride, out_stride, keys, values, heads, kv_heads, dim,
                       scale, num_threads);
#else
    (void)runs; (void)q_stride; (void)out_stride; (void)keys; (void)values; (void)scale;
    (void)num_threads;
    return 1;
#endif
}
