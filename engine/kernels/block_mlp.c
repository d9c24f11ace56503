/* The gated MLP of a decoder layer on Q4_1 blocks in one call:
 * h = silu(x W_gate^T) * (x W_up^T), y = h W_down^T, with W_gate and W_up the two
 * halves of one fused weight [2I, K] (gate rows first) and W_down a weight [N, I].
 *
 * Steps of a few rows form the gate and up products of a chunk of COLUMN_CHUNK
 * columns of I a tile of rows at a time into small buffers (the same sweep as
 * block_gemm's), and write h's chunk from them, so gate and up never exist as whole
 * [rows, I] arrays; threads share the chunks through WorkRanges, as block_gemm's do.
 * On AVX2 builds, steps of PANEL_MIN_ROWS rows and more take the panels instead
 * (panel_gated_mlp). The down product is block_gemm's (or the panels') either way.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "block_rows.h"
#include "kernels.h"
#include "worker_pool.h"

typedef struct {
    const float *x, *xsum;
    const uint8_t *q;
    const float *d, *m;
    int64_t rows, k, intermediate;
    float *h;                                    /* [rows, I] */
    WorkRanges *items;                           /* chunks of COLUMN_CHUNK of I */
} GateUpJob;

/* h[:, first:last] = silu(gate) * up for every row, a tile of ROW_TILE rows at a time. */
static void gate_up_chunk(const GateUpJob *job, int64_t first, int64_t last) {
    const int64_t k = job->k, inter = job->intermediate, blocks = k / BLOCK;
    const int64_t up_offset = inter * (k / 2), up_scales = inter * blocks;
    float gate[ROW_TILE * COLUMN_CHUNK], up[ROW_TILE * COLUMN_CHUNK];   /* [tile, chunk] */
    for (int64_t r0 = 0; r0 < job->rows; r0 += ROW_TILE) {
        const int64_t tile = job->rows - r0 < ROW_TILE ? job->rows - r0 : ROW_TILE;
        const float *x = job->x + r0 * k, *xsum = sums_from(job->xsum, r0, blocks);
        q4_columns(job->q, job->d, job->m, x, xsum, k, tile, first, last, gate, COLUMN_CHUNK);
        q4_columns(job->q + up_offset, job->d + up_scales, job->m + up_scales, x, xsum, k,
                   tile, first, last, up, COLUMN_CHUNK);
        for (int64_t t = 0; t < tile; t++)
            for (int64_t col = first; col < last; col++) {
                const float g = gate[t * COLUMN_CHUNK + col - first];
                job->h[(r0 + t) * inter + col] =
                    g / (1.0f + expf(-g)) * up[t * COLUMN_CHUNK + col - first];
            }
    }
}

static void gate_up_part(const void *arg, int part, int parts) {
    const GateUpJob *job = arg;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, job->intermediate, &first, &last))
        gate_up_chunk(job, first, last);
}

#if PANEL_KERNELS
/* Steps of many rows: gate and up as one panel product into [rows, 2I], then h and
 * the down product; the row tiles' fusion saves nothing once panels carry the work. */
static int panel_gated_mlp(const float *x, int64_t rows, int64_t k, const uint8_t *gate_up_q,
                           const float *gate_up_d, const float *gate_up_m,
                           int64_t intermediate, const uint8_t *down_q, const float *down_d,
                           const float *down_m, int64_t n, float *y, int num_threads) {
    float *gate_up = malloc(sizeof(float) * rows * 2 * intermediate);
    float *h = malloc(sizeof(float) * rows * intermediate);
    int status = 2;
    if (gate_up && h) {
        block_panel_gemm(BLOCKS_Q4, x, rows, k, gate_up_q, gate_up_d, gate_up_m,
                         2 * intermediate, gate_up, 2 * intermediate, num_threads);
        gated_activation(gate_up, rows, intermediate, 0, ACTIVATION_SILU, h, num_threads);
        block_panel_gemm(BLOCKS_Q4, h, rows, intermediate, down_q, down_d, down_m, n, y, n,
                         num_threads);
        status = 0;
    }
    free(h);
    free(gate_up);
    return status;
}
#endif

/* 1 for K or I not a multiple of 32, 2 when out of memory. */
int q4_gated_mlp(const float *x, int64_t rows, int64_t k, const uint8_t *gate_up_q,
                 const float *gate_up_d, const float *gate_up_m, int64_t intermediate,
                 const uint8_t *down_q, const float *down_d, const float *down_m, int64_t n,
                 float *y, int num_threads) {
    if (k % BLOCK || intermediate % BLOCK) return 1;
    if (rows <= 0 || n <= 0) return 0;
#if PANEL_KERNELS
    if (rows >= PANEL_MIN_ROWS) return panel_gated_mlp(x, rows, k, gate_up_q, gate_up_d,
                                                       gate_up_m, intermediate, down_q,
                                                       down_d, down_m, n, y, num_threads);
#endif
    float *h = malloc(sizeof(float) * rows * intermediate);
    float *xsum = NULL, *ordered = NULL;
    int status = 2;
    if (h && !block_sums(x, rows, k, q4_reads_block_sums(rows), &xsum)
        && !block_order(x, rows, k, &ordered)) {
        WorkRanges chunks;
        work_ranges_init(&chunks, (intermediate + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
        GateUpJob job = {ordered ? ordered : x, xsum, gate_up_q, gate_up_d, gate_up_m, rows,
                         k, intermediate, h, &chunks};
        run_parallel(gate_up_part, &job, num_threads);
        status = block_gemm(BLOCKS_Q4, h, rows, intermediate, down_q, down_d, down_m, n, y, n,
                            num_threads);
    }
    free(h);
    free(xsum);
    free(ordered);
    return status;
}

/* The same MLP on weights of any kinds (kernels.h's BlockWeight) and either activation:
 * SiLU on Q4_1 blocks throughout, q4_gated_mlp; otherwise gate and up into [rows, 2I],
 * act(gate) * up (activations.c's gated_activation), then the down product. 2 when out
 * of memory, else the kernels' status (1 for an unknown activation). */
int blocks_gated_mlp(const float *x, int64_t rows, int64_t k, const BlockWeight *gate_up,
                     int64_t intermediate, const BlockWeight *down, int64_t n, int activation,
                     float *y, int num_threads) {
    const BlockPart *gu = &gate_up->parts[0], *dn = &down->parts[0];
    if (activation == ACTIVATION_SILU && gate_up->num_parts == 1 && down->num_parts == 1
        && gu->kind == BLOCKS_Q4 && dn->kind == BLOCKS_Q4)
        return q4_gated_mlp(x, rows, k, gu->q, gu->d, gu->m, intermediate, dn->q, dn->d, dn->m,
                            n, y, num_threads);
    if (rows <= 0 || n <= 0) return 0;
    float *both = malloc(sizeof(float) * rows * 2 * intermediate);
    float *h = malloc(sizeof(float) * rows * intermediate);
    int status = both && h ? 0 : 2;
    if (!status)
        status = block_weight_gemm(gate_up, x, rows, k, both, 2 * intermediate, num_threads);
    if (!status)
        status = gated_activation(both, rows, intermediate, 0, activation, h, num_threads);
    if (!status) status = block_weight_gemm(down, h, rows, intermediate, y, n, num_threads);
    free(both);
    free(h);
    return status;
}
