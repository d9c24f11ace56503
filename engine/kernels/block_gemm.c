/* Matrix products of a few activation rows against weights kept in GGUF-style blocks
 * of 32, accumulated in fp32: y[M, N] = x[M, K] @ W^T (the block forms and the row
 * kernels: block_rows.h).
 *
 * Meant for decode steps (M of 1 to a few dozen rows), where the product is bound by
 * reading W: a Q4_1 weight costs 5 bits against fp32's 32. Columns are shared out
 * between `num_threads` threads in chunks of COLUMN_CHUNK (worker_pool.h's WorkRanges:
 * a thread that finishes its own chunks takes the others', so a helper that starts
 * late does not hold the call, as it would with an even split). Each chunk is swept a
 * tile of ROW_TILE rows at a time (q4_columns). AVX2 builds hand steps of
 * PANEL_MIN_ROWS rows and more to block_panels.c, whose register tiles need the
 * arithmetic of many rows to repay dequantizing the weights once per step.
 * Built at run time with -march=native (engine/kernels/build.py).
 */
#include <stdint.h>
#include <stdlib.h>

#include "block_rows.h"
#include "kernels.h"
#include "worker_pool.h"

typedef struct {
    const float *x, *d, *m, *xsum;
    const void *q;
    int64_t rows, k, n;
    float *y;
    int64_t ldy;                     /* y's row stride (>= n) */
    int halves;                      /* q8: a scale per 16 weights */
    WorkRanges *items;               /* column chunks of COLUMN_CHUNK, shared by the parts */
} GemmJob;

/* The columns of y this part takes (take_columns). */
static void q4_part(const void *arg, int part, int parts) {
    const GemmJob *job = arg;
    const int64_t k = job->k, n = job->n, rows = job->rows, blocks = k / BLOCK;
    const uint8_t *q = job->q;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, n, &first, &last)) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
            q4_columns(q, job->d, job->m, job->x + r0 * k, sums_from(job->xsum, r0, blocks),
                       k, rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE, first, last,
                       job->y + r0 * job->ldy + first, job->ldy);
    }
}

static void q8_part(const void *arg, int part, int parts) {
    const GemmJob *job = arg;
    const int64_t k = job->k, n = job->n, rows = job->rows;
    const int64_t blocks = k / BLOCK;
    const int8_t *q = job->q;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, n, &first, &last)) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
            q8_columns(q, job->d, job->m, job->x + r0 * k, sums_from(job->xsum, r0, blocks),
                       k, rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE, first, last,
                       job->y + r0 * job->ldy + first, job->ldy, job->halves);
    }
}

/* y[r * ldy + c] for c < n: x @ W^T for W of `kind` (BLOCKS_Q4, BLOCKS_Q8,
 * BLOCKS_Q8_HALVES, BLOCKS_Q5, kernels.h; m: the minima of Q4 and Q5, else unread; or
 * an int8-activation form, block_int8.c). 1
 * for K not a multiple of 32 or an unknown kind, 2 when out of memory. */
int block_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
               const float *d, const float *m, int64_t n, float *y, int64_t ldy,
               int num_threads) {
    if (k % BLOCK || ldy < n || kind < BLOCKS_FIRST || kind > BLOCKS_LAST) return 1;
    if (rows <= 0 || n <= 0) return 0;
    if (kind >= BLOCKS_I8_Q4)
        return int8_block_gemm(kind, x, rows, k, q, d, m, n, y, ldy, num_threads);
#if PANEL_KERNELS
    if (rows >= PANEL_MIN_ROWS && kind != BLOCKS_Q5) {    /* q5: row tiles at any size */
        block_panel_gemm(kind, x, rows, k, q, d, m, n, y, ldy, num_threads);
        return 0;
    }
#endif
    float *ordered, *xsum = NULL;
    if (block_order(x, rows, k, &ordered)) return 2;
    const int minima = kind == BLOCKS_Q4 || kind == BLOCKS_Q5;
    if (block_sums(x, rows, k, kind == BLOCKS_Q5 || (minima && q4_reads_block_sums(rows)),
                   &xsum)) {
        free(ordered);
        return 2;
    }
    WorkRanges items;
    work_ranges_init(&items, (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
    GemmJob job = {ordered ? ordered : x, d, minima ? m : NULL, xsum, q, rows, k, n, y, ldy,
                   kind == BLOCKS_Q8_HALVES, &items};
    run_parallel(kind == BLOCKS_Q4 ? q4_part : q8_part, &job, num_threads);
    free(xsum);
    free(ordered);
    return 0;
}

/* Lanes of the vectors this build's block kernels use: 16 (AVX-512), 8 (AVX2 and
 * FMA), 4 (AArch64's NEON) or 1 (the portable loop). Where the kernels stop beating
 * the dense matmuls depends on it (models/block_weights.py). */
int block_gemm_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#elif ROWS_NEON
    return 4;
#else
    return 1;
#endif
}

/* 1 for a weight of no parts (or more than MAX_WEIGHT_PARTS), else block_gemm's status
 * for the first part that fails. */
int block_weight_gemm(const BlockWeight *w, const float *x, int64_t rows, int64_t k, float *y,
                      int64_t ldy, int num_threads) {
    if (w->num_parts < 1 || w->num_parts > MAX_WEIGHT_PARTS) return 1;
    int64_t offset = 0;
    for (int64_t p = 0; p < w->num_parts; p++) {
        const BlockPart *part = &w->parts[p];
        if (offset + part->columns > ldy) return 1;
        const int status = block_gemm((int)part->kind, x, rows, k, part->q, part->d, part->m,
                                      part->columns, y + offset, ldy, num_threads);
        if (status) return status;
        offset += part->columns;
    }
    return 0;
}

int q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *d,
            const float *m, int64_t n, float *y, int num_threads) {
    return block_gemm(BLOCKS_Q4, x, rows, k, q, d, m, n, y, n, num_threads);
}

int q8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *d,
            int64_t n, float *y, int num_threads) {
    return block_gemm(BLOCKS_Q8, x, rows, k, q, d, NULL, n, y, n, num_threads);
}

