/* A mixed step's rows cut into prefill runs (paged_attention.c's dispatch).
 *
 * The step attention call (paged_decode_attention) sees every row of a step as one
 * query: row b reads lengths[b] entries of its slots row slot_rows[b], from entry
 * starts[b] (0 without starts). The rows of one prefill chunk share their request's
 * slots row and each sees one key more than the row before, until a sliding window
 * fills and each then starts one entry further in. Such a run of PREFILL_RUN_MIN_ROWS
 * rows or more becomes one PrefillRun for prefill_attention.c's blocked tiles; every
 * other row (a decode, a short chunk) stays a single query for the row kernel.
 *
 * Pure index work: no vectors, no threads; which thread calls it is the caller's.
 */
#include <stdint.h>
#include "kernels.h"

/* Whether query b continues the run of chunk rows ending at b - 1: the same slot row,
 * one key further, and the run's window (*window, 0 while none is seen) fits its start:
 * a row ending at key e starts at max(0, e - window). The window is learnt from the
 * first row that starts past entry 0: that row starts at 1, and its length is the
 * window. */
static int continues_run(const int64_t *slot_rows, const int64_t *starts,
                         const int64_t *lengths, int64_t b, int64_t *window) {
    const int64_t first = starts ? starts[b] : 0, end = first + lengths[b];
    const int64_t before_end = (starts ? starts[b - 1] : 0) + lengths[b - 1];
    if (slot_rows[b] != slot_rows[b - 1] || end != before_end + 1) return 0;
    if (*window > 0) return first == (end > *window ? end - *window : 0);
    if (first == 0) return 1;
    if (before_end > lengths[b]) return 0;         /* the earlier rows saw more keys */
    *window = lengths[b];
    return 1;
}

/* Worked example: rows of slot rows {0, 1, 1, ..., 1} (a decode, then a 20-row chunk
 * at positions 30 .. 49) with lengths {7, 31, 32, ..., 50}: order = {0}, one run of
 * 20 queries at positions 30 .. 49 over the row's first 50 keys. */
int64_t find_prefill_runs(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                          const int64_t *slots, const int64_t *slot_rows,
                          const int64_t *starts, const int64_t *lengths, int64_t batch,
                          int64_t width, PrefillRun *runs, int64_t *order, int64_t *rest) {
    int64_t num_runs = 0;
    *rest = 0;
    for (int64_t b = 0; b < batch;) {
        int64_t window = starts && starts[b] > 0 ? lengths[b] : 0, next = b + 1;
        while (next < batch && continues_run(slot_rows, starts, lengths, next, &window)) next++;
        if (next - b < PREFILL_RUN_MIN_ROWS) {
            for (; b < next; b++) order[(*rest)++] = b;
            continue;
        }
        const int64_t end = (starts ? starts[b] : 0) + lengths[b];   /* keys of query b */
        runs[num_runs++] = (PrefillRun){q + b * q_stride, out + b * out_stride,
                                        slots + slot_rows[b] * width,
                                        end + next - b - 1, 0, end - 1, next - b, window};
        b = next;
    }
    return num_runs;
}
