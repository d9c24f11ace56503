/* The LM head's finish in dtype bf16-weights (models/mixed_precision.py,
 * Bf16RescoredHead), one pass per row instead of torch's five (topk, a cast of the
 * whole row to fp32, min, a minimum over the row, scatter).
 *
 * approx [rows, vocab] holds bf16 logits. For each row:
 *   1. its `candidates` largest bf16 logits (the first index wins a tie);
 *   2. their exact fp32 logits, hidden[row] . weight[token];
 *   3. logits[row] = min(approx, least exact candidate) as fp32, NaN kept, and the
 *      candidates' exact logits written over their places.
 * So no uncorrected logit passes a recomputed one, and the greedy pick is fp32's
 * whenever fp32's best token is among the candidates.
 *
 * NaN: a NaN bf16 logit is never a candidate and stays NaN in the output (torch's
 * topk would rank it first and recompute it); the cap ignores a NaN exact logit.
 * Either way such a row comes from a model that has already failed.
 *
 * Step 1 keeps a sorted list of the best so far and compares 16 logits at a time
 * with its least member: after the first few hundred logits of a row almost none
 * pass, so the scan costs about one compare per 16 logits.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

#define MAX_CANDIDATES 64

typedef struct {
    const uint16_t *approx;
    const float *hidden, *weight;
    int64_t rows, vocab, hidden_size, candidates;
    float *logits;
} RescoreJob;

/* Insert (value, index) into best[0..k) (descending), dropping the last member. */
static void insert(float *best, int64_t *where, int64_t k, float value, int64_t index) {
    int64_t slot = k - 1;
    while (slot > 0 && best[slot - 1] < value) {
        best[slot] = best[slot - 1];
        where[slot] = where[slot - 1];
        slot--;
    }
    best[slot] = value;
    where[slot] = index;
}

static void select_candidates(const uint16_t *row, int64_t vocab, int64_t k, int64_t *where) {
    float best[MAX_CANDIDATES];
    for (int64_t i = 0; i < k; i++) {
        best[i] = -INFINITY;
        where[i] = -1;
    }
    int64_t v = 0;
#ifdef __AVX512F__
    for (; v + 16 <= vocab; v += 16) {
        __mmask16 above = _mm512_cmp_ps_mask(load_bf16x16(row + v), _mm512_set1_ps(best[k - 1]),
                                             _CMP_GT_OQ);
        while (above) {
            const int lane = __builtin_ctz(above);
            const float value = bf16_to_float(row[v + lane]);
            if (value > best[k - 1]) insert(best, where, k, value, v + lane);
            above &= above - 1;
        }
    }
#endif
    for (; v < vocab; v++) {
        const float value = bf16_to_float(row[v]);
        if (value > best[k - 1]) insert(best, where, k, value, v);
    }
    for (int64_t i = 0, fill = 0; i < k; i++)   /* rows of -inf/NaN only: first indices */
        if (where[i] < 0) {
            while (fill < vocab) {
                int64_t taken = 0;
                for (int64_t j = 0; j < k; j++) taken |= where[j] == fill;
                if (!taken) break;
                fill++;
            }
            where[i] = fill++;
        }
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static void rescore_row(const RescoreJob *job, int64_t r) {
    const int64_t vocab = job->vocab, k = job->candidates;
    const uint16_t *row = job->approx + r * vocab;
    float *out = job->logits + r * vocab;
    int64_t where[MAX_CANDIDATES];
    float exact[MAX_CANDIDATES];
    select_candidates(row, vocab, k, where);
    float cap = INFINITY;
    for (int64_t i = 0; i < k; i++) {
        exact[i] = dot_f32(job->hidden + r * job->hidden_size,
                           job->weight + where[i] * job->hidden_size, job->hidden_size);
        cap = exact[i] < cap ? exact[i] : cap;
    }
    int64_t v = 0;
#ifdef __AVX512F__
    const __m512 caps = _mm512_set1_ps(cap);
    for (; v + 16 <= vocab; v += 16)   /* min_ps returns its second operand for a NaN */
        _mm512_storeu_ps(out + v, _mm512_min_ps(caps, load_bf16x16(row + v)));
#endif
    for (; v < vocab; v++) {
        const float value = bf16_to_float(row[v]);
        out[v] = value > cap ? cap : value;
    }
    for (int64_t i = 0; i < k; i++) out[where[i]] = exact[i];
}

static void rescore_part(const void *arg, int part, int parts) {
    const RescoreJob *job = arg;
    for (int64_t r = job->rows * part / parts; r < job->rows * (part + 1) / parts; r++)
        rescore_row(job, r);
}

/* Returns 0, or 1 when `candidates` is outside 1 .. min(vocab, MAX_CANDIDATES). */
int rescore_head(const uint16_t *approx, const float *hidden, const float *weight,
                 int64_t rows, int64_t vocab, int64_t hidden_size, int64_t candidates,
                 float *logits, int num_threads) {
    if (candidates < 1 || candidates > MAX_CANDIDATES || candidates > vocab) return 1;
    if (rows <= 0) return 0;
    RescoreJob job = {approx, hidden, weight, rows, vocab, hidden_size, candidates, logits};
    run_parallel(rescore_part, &job, num_threads);
    return 0;
}
