/* Block matrix products for steps of many rows: y[M, N] = x[M, K] @ W^T with W in q4
 * or q8 blocks (block_rows.h), for steps of PANEL_MIN_ROWS rows and more, where the
 * arithmetic, not the weight bytes, bounds the product.
 *
 * The row kernels (block_rows.h) dot each weight row with up to 8 rows of x, so every
 * FMA also loads a vector of x, and each row's sums end in a horizontal reduction per
 * column. Here the weights are dequantized once per step into panels: 16 columns of W
 * by up to PANEL_K values of K, stored k-major (panel[kk * 16 + c] = W[first + c, k0 +
 * kk]), two per chunk of 32 columns, at most 256 KiB in L2. Tiles of rows of x then run
 * over the panels with register blocking (BLIS's scheme): per k, the panel loads and
 * one broadcast of x per row feed independent FMAs.
 *   AVX2 (here): tiles of 6 rows over one panel, 12 accumulators (6 rows x 2 vectors
 *     of 8 columns), BLIS's 6x16 kernel.
 *   AVX-512 (block_panels_avx512.h): tiles of 12 rows over both panels of a chunk, 24
 *     accumulators (12 rows x 2 vectors of 16 columns).
 * The sums run in k order per output (AVX2: one running total, continued through y
 * across slices of K where K > PANEL_K; AVX-512: fresh accumulators per SUM_SLICE
 * values of K, each slice added to y), so they equal the dense fp32 product up to
 * rounding.
 *
 * Each tile runs over all panels of a chunk, up to PANEL_K values of K each, before
 * the next tile, so x is read once per chunk of 32 columns. Short panels (256 values
 * of K) taking every tile in turn would read all of x once per 16 columns and per
 * slice of K, and add into y per slice: at 4,096 rows (x 9-25 MB) that streams from
 * memory.
 *
 * AVX2: dequantizing costs about one operation per weight (8 weights of a column per
 * vector, then an 8x8 transpose), a fixed cost per step that only many rows of tiles
 * repay, hence panels from 32 rows on (docs/cpu-kernels.md, PANEL_MIN_ROWS). At large
 * steps the tile loop takes nearly all the time.
 * Columns are shared out in chunks of COLUMN_CHUNK through WorkRanges, as in
 * block_gemm.c.
 */
#include <stdint.h>

#include "block_rows.h"
#include "kernels.h"
#include "worker_pool.h"

#if PANEL_KERNELS

#define PANEL_COLS 16
#define PANEL_K 2048       /* values of K per panel, at most: 2048 x 16 floats, 128 KiB */
#define CHUNK_PANELS (COLUMN_CHUNK / PANEL_COLS)
typedef float Panel[PANEL_K * PANEL_COLS];    /* one panel: [PANEL_K][PANEL_COLS] */

typedef struct {
    int kind;                        /* BLOCKS_Q4, BLOCKS_Q8 or BLOCKS_Q8_HALVES */
    const float *x, *d, *m;
    const void *q;
    int64_t rows, k, n;
    float *y;
    int64_t ldy;
    WorkRanges *items;
} PanelJob;

#ifdef __AVX512F__
#include "block_panels_avx512.h"
#define TILE_ROWS PANEL_TILE_ROWS
#else
#define TILE_ROWS 6

/* rows[j] <- column j of the 8x8 matrix whose row i was rows[i]. */
static inline void transpose8(__m256 rows[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        rows[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Stores the 8 vectors rows[i] (8 weights of column c0 + i each) as rows kk..kk+7 of
 * the panel's columns c0..c0+7. */
static inline void store_transposed(__m256 rows[8], float *panel, int64_t kk, int64_t c0) {
    transpose8(rows);                     /* rows[j]: weight j of the 8 columns */
    for (int j = 0; j < 8; j++) _mm256_store_ps(panel + (kk + j) * PANEL_COLS + c0, rows[j]);
}

/* panel[kk * 16 + c] = W[first + c, k0 + kk] for kk < count (a multiple of 32), W in
 * q4 blocks; the columns from `cols` to 16 are zeros. Per block and 8 columns, bytes
 * 0..7 (then 8..15) give two vectors per column, weights 0..7 from the low nibbles
 * and 16..23 from the high ones (then 8..15 and 24..31). */
static void q4_panel(const PanelJob *job, int64_t first, int64_t cols, int64_t k0,
                     int64_t count, float *panel) {
    const int64_t k = job->k, blocks = k / BLOCK;
    const uint8_t *q = job->q;
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t c0 = 0; c0 < PANEL_COLS; c0 += 8)
        for (int64_t b = k0 / BLOCK; b < (k0 + count) / BLOCK; b++)
            for (int half = 0; half < 2; half++) {
                __m256 low[8], high[8];
                for (int i = 0; i < 8; i++) {
                    const int64_t col = first + c0 + i;
                    if (c0 + i >= cols) {
                        low[i] = high[i] = _mm256_setzero_ps();
                        continue;
                    }
                    const __m128i bytes =
                        _mm_loadl_epi64((const __m128i *)(q + col * (k / 2) + b * 16 + half * 8));
                    const __m256 scale = _mm256_set1_ps(job->d[col * blocks + b]);
                    const __m256 minimum = _mm256_set1_ps(job->m[col * blocks + b]);
                    low[i] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask))),
                        scale, minimum);
                    high[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                  _mm_and_si128(_mm_srli_epi16(bytes, 4), mask))),
                                              scale, minimum);
                }
                const int64_t kk = b * BLOCK - k0 + half * 8;
                store_transposed(low, panel, kk, c0);
                store_transposed(high, panel, kk + 16, c0);
            }
}

/* The same for q8 blocks (halves: a scale per 16 weights). */
static void q8_panel(const PanelJob *job, int64_t first, int64_t cols, int64_t k0,
                     int64_t count, float *panel) {
    const int64_t k = job->k, blocks = k / BLOCK;
    const int8_t *q = job->q;
    const int halves = job->kind == BLOCKS_Q8_HALVES;
    for (int64_t c0 = 0; c0 < PANEL_COLS; c0 += 8)
        for (int64_t b = k0 / BLOCK; b < (k0 + count) / BLOCK; b++)
            for (int g = 0; g < 4; g++) {
                __m256 rows[8];
                for (int i = 0; i < 8; i++) {
                    const int64_t col = first + c0 + i;
                    if (c0 + i >= cols) {
                        rows[i] = _mm256_setzero_ps();
                        continue;
                    }
                    const float scale = halves ? job->d[(col * blocks + b) * 2 + g / 2]
                                               : job->d[col * blocks + b];
                    const __m128i codes =
                        _mm_loadl_epi64((const __m128i *)(q + col * k + b * BLOCK + g * 8));
                    rows[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                                            _mm256_set1_ps(scale));
                }
                store_transposed(rows, panel, b * BLOCK - k0 + g * 8, c0);
            }
}

/* y[r * ldy + c] (+)= x_r[0:count] . panel[:, c] for r < tile_rows, c < cols, added to
 * y when `accumulate` (the slices of K after the first). x at the tile's first row,
 * its rows k apart. */
static inline __attribute__((always_inline)) void panel_tile_impl(
        const float *x, int64_t k, const float *panel, int64_t count, float *y, int64_t ldy,
        int tile_rows, int64_t cols, int accumulate) {
    float partial[TILE_ROWS * PANEL_COLS];    /* a tile of fewer than 16 columns */
    float *out = y;
    int64_t ld = ldy;
    if (cols < PANEL_COLS) {
        out = partial, ld = PANEL_COLS;
        for (int r = 0; r < tile_rows; r++)
            for (int64_t c = 0; c < PANEL_COLS; c++)
                partial[r * PANEL_COLS + c] = accumulate && c < cols ? y[r * ldy + c] : 0.0f;
    }
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < tile_rows; r++) {
        acc[r][0] = accumulate ? _mm256_loadu_ps(out + r * ld) : _mm256_setzero_ps();
        acc[r][1] = accumulate ? _mm256_loadu_ps(out + r * ld + 8) : _mm256_setzero_ps();
    }
    /* Unrolled by 4, the loop's counter and address updates stop costing issue slots
     * beside its 12 FMAs per k. */
#pragma GCC unroll 4
    for (int64_t i = 0; i < count; i++) {
        const __m256 w0 = _mm256_load_ps(panel + i * PANEL_COLS);
        const __m256 w1 = _mm256_load_ps(panel + i * PANEL_COLS + 8);
        for (int r = 0; r < tile_rows; r++) {
            const __m256 value = _mm256_broadcast_ss(x + r * k + i);
            acc[r][0] = _mm256_fmadd_ps(value, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(value, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < tile_rows; r++) {
        _mm256_storeu_ps(out + r * ld, acc[r][0]);
        _mm256_storeu_ps(out + r * ld + 8, acc[r][1]);
    }
    if (cols < PANEL_COLS)
        for (int r = 0; r < tile_rows; r++)
            for (int64_t c = 0; c < cols; c++) y[r * ldy + c] = partial[r * PANEL_COLS + c];
}

/* Constant row counts keep the 12 accumulators in registers. */
static void panel_tile(const float *x, int64_t k, const float *panel, int64_t count, float *y,
                       int64_t ldy, int tile_rows, int64_t cols, int accumulate) {
    switch (tile_rows) {
    case 6: panel_tile_impl(x, k, panel, count, y, ldy, 6, cols, accumulate); break;
    case 5: panel_tile_impl(x, k, panel, count, y, ldy, 5, cols, accumulate); break;
    case 4: panel_tile_impl(x, k, panel, count, y, ldy, 4, cols, accumulate); break;
    case 3: panel_tile_impl(x, k, panel, count, y, ldy, 3, cols, accumulate); break;
    case 2: panel_tile_impl(x, k, panel, count, y, ldy, 2, cols, accumulate); break;
    default: panel_tile_impl(x, k, panel, count, y, ldy, 1, cols, accumulate);
    }
}

/* The tile against every panel of a chunk in turn (cols: the chunk's columns). */
static void chunk_tile(const float *x, int64_t k, const Panel *panels, int64_t count, float *y,
                       int64_t ldy, int tile_rows, int64_t cols, int accumulate) {
    for (int64_t p0 = 0; p0 < cols; p0 += PANEL_COLS)
        panel_tile(x, k, panels[p0 / PANEL_COLS], count, y + p0, ldy, tile_rows,
                   cols - p0 < PANEL_COLS ? cols - p0 : PANEL_COLS, accumulate);
}
#endif

/* One panel of the job's weight: columns [p0, p0 + cols), values k0 .. k0 + count. */
static void unpack_panel(const PanelJob *job, int64_t p0, int64_t cols, int64_t k0,
                         int64_t count, float *panel) {
#ifdef __AVX512F__
    unpack_panel_avx512(job->kind, job->q, job->d, job->m, job->k, p0, cols, k0, count, panel);
#else
    if (job->kind == BLOCKS_Q4) q4_panel(job, p0, cols, k0, count, panel);
    else q8_panel(job, p0, cols, k0, count, panel);
#endif
}

/* Each part's panels: CHUNK_PANELS of up to PANEL_K values of K each (256 KiB, in L2),
 * per thread: libgomp's helpers and the pool's run the parts, and their stacks may be
 * small. */
static _Thread_local Panel chunk_panels[CHUNK_PANELS] __attribute__((aligned(64)));

/* One chunk of columns [first, last), up to CHUNK_PANELS panels wide: per slice of K,
 * its panels are unpacked, then each tile of rows runs over all of them in turn, so
 * the tile's x is read from memory once per chunk, and y is written once per slice
 * (AVX2: once in all where K <= PANEL_K; AVX-512: once per SUM_SLICE values of K). */
static void panel_chunk(const PanelJob *job, int64_t first, int64_t last) {
    const int64_t k = job->k, rows = job->rows;
    const int panels = (int)((last - first + PANEL_COLS - 1) / PANEL_COLS);
    for (int64_t k0 = 0; k0 < k; k0 += PANEL_K) {
        const int64_t count = k - k0 < PANEL_K ? k - k0 : PANEL_K;
        for (int p = 0; p < panels; p++) {
            const int64_t p0 = first + p * PANEL_COLS;
            const int64_t cols = last - p0 < PANEL_COLS ? last - p0 : PANEL_COLS;
            unpack_panel(job, p0, cols, k0, count, chunk_panels[p]);
        }
        /* tiles of even sizes (AVX-512, tiles of up to 12: 16 rows 8 + 8, not 12 + 4;
         * AVX2, up to 6: 16 rows 6 + 5 + 5, not 6 + 6 + 4): a small last tile would
         * run its panel loads for few FMAs */
        const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int tile_rows = (int)(rows / tiles + (t < rows % tiles));
            chunk_tile(job->x + r0 * k + k0, k, chunk_panels, count,
                       job->y + r0 * job->ldy + first, job->ldy, tile_rows, last - first, k0 > 0);
            r0 += tile_rows;
        }
    }
}

static void panel_part(const void *arg, int part, int parts) {
    const PanelJob *job = arg;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, job->n, &first, &last)) panel_chunk(job, first, last);
}

/* block_gemm's product through panels (kind, shapes and strides as there; K a
 * multiple of 32, checked by the caller). */
void block_panel_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
                      const float *d, const float *m, int64_t n, float *y, int64_t ldy,
                      int num_threads) {
    WorkRanges items;
    work_ranges_init(&items, (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
    PanelJob job = {kind, x, d, m, q, rows, k, n, y, ldy, &items};
    run_parallel(panel_part, &job, num_threads);
}

#endif
