/* Attention read straight from the paged KV cache (fp32 or bf16 elements, fp32
 * arithmetic), one query row at a time.
 *
 * Every query b (a decode request, or one row of a prefill chunk) has one query per
 * head, q[b, H, D], and a context of lengths[b] cache slots listed in its row of
 * slots (row b, or slot_rows[b] when the rows of one prefill chunk share their
 * request's row), from entry starts[b] (0 without starts). Full attention: query i of
 * a chunk starting at position s reads entries 0 .. s + i (causal). A sliding window
 * W starts each query further in: with the row holding positions f, f + 1, ..., the
 * query at position p reads max(0, p - W + 1) - f onwards, min(p + 1, W) entries.
 * Padding around a context is never read. The caches are flat
 * [num_slots, KVH, D]: slot s of KV head h starts at (s * KVH + h) * D. Query heads
 * h*G .. h*G+G-1 share KV head h (G = H / KVH, GQA).
 *
 * For each query: scores of every query head against every context key, a softmax
 * per query head, and the probability-weighted sum of the values, written to
 * out[b, H, D]. Keys and values are read in place, once per query: no gathered copy
 * of the context, no padded matmuls. Over a bf16 cache the rows of a prefill chunk
 * (8 or more, step_runs.c) go to prefill_attention.c's blocked tiles instead, where a
 * block of queries shares each key it loads; one at a time, each row would re-read its
 * request's context (docs/cpu-kernels.md, PREFILL_RUN_MIN_ROWS). Requests are split
 * over `num_threads` threads (worker_pool.h); when there are too few to keep the
 * threads busy (one request, long context), each context is cut into chunks whose
 * partial softmaxes are merged at the end, as flash-decoding does. Head sizes that are a multiple of 16
 * (AVX-512) or 8 (AVX2 and FMA) run the per-range passes of attention_vectors.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

typedef struct {
    const float *q;
    const void *keys, *values;  /* fp32, or bf16 when kv_bf16 */
    int kv_bf16;
    const int64_t *slots, *lengths;
    const int64_t *slot_rows; /* query b reads slots row slot_rows[b]; NULL: row b */
    const int64_t *starts;    /* from entry starts[b] of that row; NULL: entry 0 */
    const int64_t *order;     /* the queries this job attends (rows of q), or NULL: 0 .. */
    int64_t batch, width, heads, kv_heads, dim;   /* batch: how many it attends */
    int64_t q_stride;        /* floats from one request's queries to the next's */
    float scale;
    float *out;
    int64_t chunks;          /* context pieces per request */
    int64_t span;            /* the longest piece: ceil(longest context / chunks) */
    float *scratch;          /* per part: H * span scores, then H * (span + 1) words for
                                attention_bf16.c's values pass */
    float *partials;         /* H * (D + 2) (max, sum, unnormalised output) per work item,
                                or per part when chunks == 1 (finished in place) */
    WorkRanges *items;       /* batch * chunks work items, shared out between the parts */
} AttentionJob;

/* Element i of a cache of fp32 or bf16 values, as fp32 (the scalar path). */
static inline float cached(const void *cache, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

static float dot_cached(const float *a, const void *cache, int64_t start, int64_t n, int bf16) {
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += a[i] * cached(cache, start + i, bf16);
    return total;
}

static void add_scaled(float alpha, const float *x, float *y, int64_t n) {   /* y += alpha x */
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}


/* s[0..count) <- exp(s - max s); returns the max in *top and the sum of the exps. */
static float softmax_numerators(float *s, int64_t count, float *top) {
    float peak = -INFINITY, total = 0.0f;
    int64_t l = 0;
#ifdef __AVX512F__
    /* the last count % 16 scores by a masked step, not scalar expf: short contexts
     * (a prefill chunk's first queries) are mostly tail */
    const __mmask16 tail = (__mmask16)((1u << (count % 16)) - 1u);
    __m512 peaks = _mm512_set1_ps(-INFINITY);
    for (; l + 16 <= count; l += 16) peaks = _mm512_max_ps(peaks, _mm512_loadu_ps(s + l));
    if (tail) peaks = _mm512_mask_max_ps(peaks, tail, peaks, _mm512_maskz_loadu_ps(tail, s + l));
    peak = _mm512_reduce_max_ps(peaks);
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 sums = _mm512_setzero_ps();
    for (l = 0; l + 16 <= count; l += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), shift));
        _mm512_storeu_ps(s + l, e);
        sums = _mm512_add_ps(sums, e);
    }
    if (tail) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), shift));
        _mm512_mask_storeu_ps(s + l, tail, e);
        sums = _mm512_mask_add_ps(sums, tail, sums, e);
        l = count;
    }
    total = _mm512_reduce_add_ps(sums);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 peaks = _mm256_set1_ps(-INFINITY);
    for (; l + 8 <= count; l += 8) peaks = _mm256_max_ps(peaks, _mm256_loadu_ps(s + l));
    float lanes[8];
    _mm256_storeu_ps(lanes, peaks);
    for (int j = 0; j < 8; j++) peak = lanes[j] > peak ? lanes[j] : peak;
    for (; l < count; l++) peak = s[l] > peak ? s[l] : peak;
    const __m256 shift = _mm256_set1_ps(peak);
    __m256 sums = _mm256_setzero_ps();
    for (l = 0; l + 8 <= count; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), shift));
        _mm256_storeu_ps(s + l, e);
        sums = _mm256_add_ps(sums, e);
    }
    if (l < count) {            /* the tail through the same exp as the rest, not expf */
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = l + j < count ? s[l + j] : peak;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
        for (; l < count; l++) s[l] = tail[l % 8];
    }
    total = sum8(sums);
    for (int64_t j = count - count % 8; j < count; j++) total += s[j];
#else
    for (; l < count; l++) peak = s[l] > peak ? s[l] : peak;
    l = 0;
#endif
    for (; l < count; l++) {
        s[l] = expf(s[l] - peak);
        total += s[l];
    }
    *top = peak;
    return total;
}

/* Context positions [start, end) of request b, all heads at once: each slot's keys
 * (and later values) of every KV head are one contiguous record of KVH * D floats,
 * read front to back, so the hardware prefetcher streams a request's pages instead
 * of striding through them once per KV head. Per query head hq it writes result[hq]
 * = {max score, sum of exp(score - max), sum of exp(score - max) * v} (D + 2 floats),
 * the pieces a softmax over several ranges merges from. scores: [H, count]. */
static void attend_range(const AttentionJob *job, int64_t b, int64_t start, int64_t end,
                         float *scores, float *result) {
    const int64_t heads = job->heads, group = heads / job->kv_heads, dim = job->dim;
    const int64_t count = end - start, record = job->kv_heads * dim;
    const int64_t *row = job->slots + (job->slot_rows ? job->slot_rows[b] : b) * job->width
                         + (job->starts ? job->starts[b] : 0) + start;
    const float *q = job->q + b * job->q_stride;                        /* [H, D] */
    const int bf16 = job->kv_bf16, dot_bf16 = bf16 && attention_bf16_apply(dim);
    const int vector = dot_bf16 || attention_vectors_apply(dim);
    if (dot_bf16)
        attention_scores_bf16(q, job->keys, job->values, row, count, heads, job->kv_heads, dim,
                              job->scale, scores);
    else if (vector)
        attention_scores_vector(q, job->keys, bf16, row, count, heads, job->kv_heads, dim,
                                job->scale, scores);
    for (int64_t l = 0; !vector && l < count; l++) {
        for (int64_t hq = 0; hq < heads; hq++)              /* key record [KVH, D] */
            scores[hq * count + l] = dot_cached(q + hq * dim, job->keys,
                                                row[l] * record + (hq / group) * dim, dim,
                                                bf16) * job->scale;
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        float top;
        const float total = softmax_numerators(scores + hq * count, count, &top);
        result[hq * (dim + 2)] = top;
        result[hq * (dim + 2) + 1] = total;
        if (!vector) memset(result + hq * (dim + 2) + 2, 0, sizeof(float) * dim);
    }
    if (dot_bf16) {      /* the words go after the H * span scores */
        attention_values_bf16(scores, job->values, row, count, heads, job->kv_heads, dim,
                              (uint32_t *)(scores + heads * job->span), result + 2, dim + 2);
        return;
    }
    if (vector) {
        attention_values_vector(scores, job->values, bf16, row, count, heads, job->kv_heads,
                                dim, result + 2, dim + 2);
        return;
    }
    for (int64_t l = 0; l < count; l++) {
        for (int64_t hq = 0; hq < heads; hq++) {            /* value record [KVH, D] */
            const int64_t first = row[l] * record + (hq / group) * dim;
            float *out = result + hq * (dim + 2) + 2;
            for (int64_t d = 0; d < dim; d++)
                out[d] += scores[hq * count + l] * cached(job->values, first + d, bf16);
        }
    }
}

/* Item i is chunk i % chunks of query i / chunks; parts take items from job->items
 * (worker_pool.h: their own range first, then the others'). A prefill chunk's queries
 * cost their position (query i reads i + 1 keys): taking items one at a time evens
 * that out. With one chunk per query the result is normalised in place. */
static void attention_part(const void *arg, int part, int parts) {
    (void)parts;
    const AttentionJob *job = arg;
    const int64_t heads = job->heads, dim = job->dim;
    float *scores = job->scratch + (int64_t)part * heads * (2 * job->span + 1);
    int64_t item, limit;
    while ((item = work_ranges_take(job->items, part, &limit)) >= 0) {
        const int64_t i = item / job->chunks, chunk = item % job->chunks;
        const int64_t b = job->order ? job->order[i] : i;
        const int64_t length = job->lengths[b];
        if (job->chunks > 1) {
            attend_range(job, b, length * chunk / job->chunks,
                         length * (chunk + 1) / job->chunks, scores,
                         job->partials + item * heads * (dim + 2));
            continue;
        }
        float *result = job->partials + (int64_t)part * heads * (dim + 2);
        attend_range(job, b, 0, length, scores, result);
        for (int64_t hq = 0; hq < heads; hq++) {
            const float *piece = result + hq * (dim + 2);
            float *out = job->out + (b * heads + hq) * dim;
            for (int64_t d = 0; d < dim; d++) out[d] = piece[2 + d] / piece[1];
        }
    }
}

/* out = the softmax-weighted values, merging each request's chunks per head:
 * M = max of the chunks' maxima, weight_c = exp(max_c - M),
 * out = sum_c weight_c * acc_c / sum_c weight_c * sum_c. */
static void merge(const AttentionJob *job) {
    const int64_t heads = job->heads, dim = job->dim;
    for (int64_t i = 0; i < job->batch; i++) {
        const int64_t b = job->order ? job->order[i] : i;
        for (int64_t hq = 0; hq < heads; hq++) {
            float *out = job->out + (b * heads + hq) * dim;
            float top = -INFINITY, total = 0.0f;
            for (int64_t c = 0; c < job->chunks; c++) {
                const float *piece = job->partials + ((i * job->chunks + c) * heads + hq) * (dim + 2);
                if (piece[1] > 0.0f && piece[0] > top) top = piece[0];
            }
            memset(out, 0, sizeof(float) * dim);
            for (int64_t c = 0; c < job->chunks; c++) {
                const float *piece = job->partials + ((i * job->chunks + c) * heads + hq) * (dim + 2);
                if (piece[1] <= 0.0f) continue;           /* an empty chunk */
                const float weight = expf(piece[0] - top);
                total += weight * piece[1];
                add_scaled(weight, piece + 2, out, dim);
            }
            for (int64_t d = 0; d < dim; d++) out[d] /= total;
        }
    }
}

/* Few requests: split each context so every thread has work (chunks of >= 32). */
static int64_t choose_chunks(int64_t requests, int64_t longest, int parts) {
    if (parts <= 1 || requests >= 4 * (int64_t)parts || longest < 64) return 1;
    int64_t chunks = (4 * (int64_t)parts + requests - 1) / requests;
    return chunks > longest / 32 ? longest / 32 : chunks;
}

/* The queries in order[0 .. count) (all `batch` without order), one row at a time. */
static int attend_rows(const float *q, int64_t q_stride, const void *keys,
                       const void *values, int kv_bf16, const int64_t *slots,
                       const int64_t *slot_rows, const int64_t *starts, const int64_t *order,
                       const int64_t *lengths, int64_t count, int64_t width, int64_t heads,
                       int64_t kv_heads, int64_t dim, float scale, float *out, int parts) {
    int64_t longest = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t length = lengths[order ? order[i] : i];
        longest = length > longest ? length : longest;
    }
    const int64_t chunks = choose_chunks(count, longest, parts);
    const int64_t span = (longest + chunks - 1) / chunks;
    float *scratch = malloc(sizeof(float) * parts * heads * (2 * span + 1));
    float *partials = malloc(sizeof(float) * (chunks > 1 ? count * chunks : parts) * heads *
                             (dim + 2));
    if (!scratch || !partials) {
        free(scratch);
        free(partials);
        return 2;
    }
    WorkRanges items;
    work_ranges_init(&items, count * chunks, parts);
    AttentionJob job = {q, keys, values, kv_bf16, slots, lengths, slot_rows, starts, order,
                        count, width, heads, kv_heads, dim, q_stride, scale, out, chunks, span,
                        scratch, partials, &items};
    run_parallel(attention_part, &job, parts);
    if (chunks > 1) merge(&job);
    free(scratch);
    free(partials);
    return 0;
}

/* STATUS_SLOT_OUTSIDE_CACHE when a slot some query may read lies outside the cache's
 * [0, num_slots), else 0 (2 out of memory). Each row of slots is checked once, over
 * entries [0, end) where end is the furthest entry its queries read: the rows of a
 * prefill chunk share their request's row, and checking per query would cost the
 * chunk's length squared. From entry 0, not from a window's start: a blocked prefill
 * run (find_prefill_runs) packs its row's keys from entry 0. E.g. a chunk of queries
 * at positions 4..7 reads entries [0, 5) .. [0, 8) of its row: [0, 8) is checked. */
static int check_slots(const int64_t *slots, const int64_t *slot_rows, const int64_t *starts,
                       int64_t num_rows, int64_t num_slots, const int64_t *lengths,
                       int64_t batch, int64_t width) {
    int64_t *end = calloc((size_t)num_rows, sizeof(int64_t));
    if (!end) return 2;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t r = slot_rows ? slot_rows[b] : b, start = starts ? starts[b] : 0;
        if (start + lengths[b] > end[r]) end[r] = start + lengths[b];
    }
    int bad = 0;
    for (int64_t r = 0; r < num_rows; r++)
        bad |= any_slot_outside(slots + r * width, end[r], num_slots);
    free(end);
    return bad ? STATUS_SLOT_OUTSIDE_CACHE : 0;
}

/* Attention of `batch` requests whose queries start q_stride floats apart; out is
 * [batch, heads, dim]. Over a bf16 cache, prefill chunks' runs of rows go to the
 * blocked kernel (find_prefill_runs), the other rows one at a time. Returns 0; 1 bad
 * head counts; 2 out of memory; 3 a length or start outside its row of slots; 4 a
 * slot row outside [0, num_rows), or fewer rows than queries without slot_rows;
 * STATUS_SLOT_OUTSIDE_CACHE a slot outside the cache (check_slots). */
static int attention_run(const float *q, int64_t q_stride, const void *keys,
                         const void *values, int kv_bf16, const int64_t *slots,
                         const int64_t *slot_rows, const int64_t *starts, int64_t num_rows,
                         int64_t num_slots, const int64_t *lengths, int64_t batch,
                         int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                         float scale, float *out, int num_threads) {
    if (batch <= 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads) return 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t first = starts ? starts[b] : 0;
        if (lengths[b] < 1 || first < 0 || first > width || lengths[b] > width - first)
            return 3;
        if (slot_rows && (slot_rows[b] < 0 || slot_rows[b] >= num_rows)) return 4;
    }
    if (!slot_rows && num_rows < batch) return 4;
    const int bad_slots = check_slots(slots, slot_rows, starts, num_rows, num_slots, lengths,
                                      batch, width);
    if (bad_slots) return bad_slots;
    const int parts = num_threads < 1 ? 1 : num_threads;
    if (!(kv_bf16 && slot_rows && batch >= PREFILL_RUN_MIN_ROWS && prefill_attention_apply(dim)))
        return attend_rows(q, q_stride, keys, values, kv_bf16, slots, slot_rows, starts, NULL,
                           lengths, batch, width, heads, kv_heads, dim, scale, out, parts);
    PrefillRun *runs = malloc(sizeof(PrefillRun) * (batch / PREFILL_RUN_MIN_ROWS));
    int64_t *order = malloc(sizeof(int64_t) * batch), rest = 0;
    int status = runs && order ? 0 : 2;
    const int64_t num_runs = status ? 0
        : find_prefill_runs(q, q_stride, out, heads * dim, slots, slot_rows, starts, lengths, batch,
                    width, runs, order, &rest);
    if (!status && rest)
        status = attend_rows(q, q_stride, keys, values, kv_bf16, slots, slot_rows, starts, order,
                             lengths, rest, width, heads, kv_heads, dim, scale, out, parts);
    if (!status && num_runs)
        status = prefill_attention_runs(runs, num_runs, q_stride, heads * dim, keys, values,
                                        heads, kv_heads, dim, scale, parts);
    free(runs);
    free(order);
    return status;
}

/* q: query b's [H, D] start at q + b * q_stride (a step's fused qkv rows serve as they
 * are). slot_rows (or NULL: row b) names the row of slots [num_rows, width] query b
 * reads: the rows of one prefill chunk share their request's row, each with its own
 * length (its position + 1, or its window's part) and, in a sliding window, start
 * (starts, or NULL: 0), so a whole mixed step is one call. */
int paged_decode_attention(const float *q, int64_t q_stride, const void *keys,
                           const void *values, int kv_bf16, const int64_t *slots,
                           const int64_t *slot_rows, const int64_t *starts, int64_t num_rows,
                           int64_t num_slots, const int64_t *lengths, int64_t batch,
                           int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                           float scale, float *out, int num_threads) {
    return attention_run(q, q_stride, keys, values, kv_bf16, slots, slot_rows, starts, num_rows,
                         num_slots, lengths, batch, width, heads, kv_heads, dim, scale, out,
                         num_threads);
}
