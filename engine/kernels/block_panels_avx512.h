/* The AVX-512 half of block_panels.c: panels of 16 columns are one vector per value
 * of K, and a tile of up to PANEL_TILE_ROWS rows runs over both panels of a chunk.
 *
 * Unpacking: each column's block is dequantized as the row kernels do it
 * (block_rows_avx512.h: q4 codes looked up in the block's table of d * c + m, a product
 * then a sum, so the weights equal the loader's fp32 weights bit for bit; q8 as d * q),
 * into two vectors of 16 consecutive values of K; the 16 columns' vectors are then
 * transposed (transpose16), so panel row kk holds W[first .. first + 15, k0 + kk].
 * About 0.5 operations per weight.
 *
 * Tile: 12 rows x 32 columns, 24 accumulators; per value of K two panel loads and 12
 * broadcasts of x feed 24 independent FMAs. Alone, with its panels in cache, such a
 * tile ran at ~200 GFLOP/s on one thread of a 2-vCPU Xeon, where oneDNN's fp32 product
 * on a packed weight ran at 117 (16 rows) and 147 (32 rows) GFLOP/s for 576 -> 3072.
 * Columns past the weight's last (a last chunk of fewer than 32) are masked off. Each
 * output sums K in slices of SUM_SLICE values, added to y one after another.
 */
#ifndef KVSERVE_BLOCK_PANELS_AVX512_H
#define KVSERVE_BLOCK_PANELS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "block_rows.h"
#include "kernels.h"

#define PANEL_TILE_ROWS 12

/* rows[j] <- column j of the 16 x 16 matrix whose row i was rows[i]. Worked through
 * for one output: after the unpacks and shuffles, vector 4g + j holds, in its 128-bit
 * lane L, rows 4g .. 4g + 3 at column 4L + j; the two rounds of 128-bit shuffles then
 * gather lane L of vectors j, 4 + j, 8 + j, 12 + j into output 4L + j. */
static inline void transpose16(__m512 rows[16]) {
    __m512 t[16], s[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {
        s[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
        s[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
        s[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        s[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        const __m512 ab01 = _mm512_shuffle_f32x4(s[j], s[4 + j], 0x44);
        const __m512 ab23 = _mm512_shuffle_f32x4(s[j], s[4 + j], 0xEE);
        const __m512 cd01 = _mm512_shuffle_f32x4(s[8 + j], s[12 + j], 0x44);
        const __m512 cd23 = _mm512_shuffle_f32x4(s[8 + j], s[12 + j], 0xEE);
        rows[j] = _mm512_shuffle_f32x4(ab01, cd01, 0x88);
        rows[4 + j] = _mm512_shuffle_f32x4(ab01, cd01, 0xDD);
        rows[8 + j] = _mm512_shuffle_f32x4(ab23, cd23, 0x88);
        rows[12 + j] = _mm512_shuffle_f32x4(ab23, cd23, 0xDD);
    }
}

/* Panel rows kk .. kk + 15 from the 16 columns' vectors (column c's values of K in
 * vectors[c]). */
static inline void store_columns(__m512 vectors[16], float *panel, int64_t kk) {
    transpose16(vectors);
    for (int j = 0; j < 16; j++) _mm512_store_ps(panel + (kk + j) * PANEL_COLS, vectors[j]);
}

/* Block `at` (column * blocks + block) of a weight of `kind` as its 32 fp32 weights:
 * *low the first 16, *high the second. q4: the codes looked up in the block's table
 * (values: code_values()); q8: d * q, with a scale per 16 for BLOCKS_Q8_HALVES. */
static inline void unpack_block(int kind, const void *q, const float *d, const float *m,
                                int64_t at, __m512 values, __m512 *low, __m512 *high) {
    if (kind == BLOCKS_Q4) {
        const __m512i lanes = q4_block_lanes((const uint8_t *)q + at * 16);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(values, _mm512_set1_ps(d[at])),
                                           _mm512_set1_ps(m[at]));
        *low = _mm512_permutexvar_ps(lanes, table);
        *high = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);
        return;
    }
    const int halves = kind == BLOCKS_Q8_HALVES;
    const int8_t *codes = (const int8_t *)q + at * BLOCK;
    const float *scales = halves ? d + 2 * at : d + at;
    *low = _mm512_mul_ps(q8_values(codes), _mm512_set1_ps(scales[0]));
    *high = _mm512_mul_ps(q8_values(codes + 16), _mm512_set1_ps(scales[halves]));
}

/* panel[kk * 16 + c] = W[first + c, k0 + kk] for kk < count (a multiple of 32), W of
 * `kind` (codes q, scales d, minima m for q4; K = k); columns from `cols` on are
 * zeros. */
static void unpack_panel_avx512(int kind, const void *q, const float *d, const float *m,
                                int64_t k, int64_t first, int64_t cols, int64_t k0,
                                int64_t count, float *panel) {
    const int64_t blocks = k / BLOCK;
    const __m512 values = code_values();
    for (int64_t b = k0 / BLOCK; b < (k0 + count) / BLOCK; b++) {
        __m512 low[PANEL_COLS], high[PANEL_COLS];
        for (int64_t c = 0; c < PANEL_COLS; c++) {
            if (c < cols) unpack_block(kind, q, d, m, (first + c) * blocks + b, values,
                                       &low[c], &high[c]);
            else low[c] = high[c] = _mm512_setzero_ps();
        }
        store_columns(low, panel, b * BLOCK - k0);
        store_columns(high, panel, b * BLOCK - k0 + 16);
    }
}

/* Lanes of the columns [c0, c0 + 16) that are below `cols`. */
static inline __mmask16 columns_mask(int64_t cols, int64_t c0) {
    const int64_t live = cols - c0;
    return live >= 16 ? (__mmask16)0xFFFF : live <= 0 ? 0 : (__mmask16)((1u << live) - 1u);
}

/* Values of K summed into fresh accumulators before they are added to y: a sum of K
 * terms in one running total collects ~K roundings; in slices, ~SUM_SLICE + K /
 * SUM_SLICE. Against float64, K = 1,536: mean error 1.30e-7 of the terms' magnitude
 * in one total, 2.1e-8 in slices of 128 (oneDNN's fp32 product 7.8e-8, the row
 * kernels' 16-lane sums 1.1e-8). */
#define SUM_SLICE 128

/* y[r * ldy + c] (+)= x_r[0:count] . panel column c, for r < tile_rows and c < cols
 * (cols <= 32: panels[0] holds columns 0-15, panels[1] 16-31 where cols > 16), added
 * to y when `accumulate`. x at the tile's first row, its rows k apart. */
static inline __attribute__((always_inline)) void chunk_tile_impl(
        const float *x, int64_t k, float *const *panels, int64_t count, float *y,
        int64_t ldy, int tile_rows, int two, int64_t cols, int accumulate) {
    const __mmask16 mask0 = columns_mask(cols, 0), mask1 = columns_mask(cols, 16);
    const float *panel0 = panels[0], *panel1 = panels[two];
    __m512 acc[PANEL_TILE_ROWS][2];
    for (int64_t start = 0; start < count; start += SUM_SLICE) {
        const int64_t end = count - start < SUM_SLICE ? count : start + SUM_SLICE;
        for (int r = 0; r < tile_rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int64_t i = start; i < end; i++) {
            const __m512 w0 = _mm512_load_ps(panel0 + i * PANEL_COLS);
            const __m512 w1 = two ? _mm512_load_ps(panel1 + i * PANEL_COLS) : w0;
            for (int r = 0; r < tile_rows; r++) {
                const __m512 value = _mm512_set1_ps(x[r * k + i]);
                acc[r][0] = _mm512_fmadd_ps(value, w0, acc[r][0]);
                if (two) acc[r][1] = _mm512_fmadd_ps(value, w1, acc[r][1]);
            }
        }
        const int add = accumulate || start > 0;
        for (int r = 0; r < tile_rows; r++) {
            float *out = y + r * ldy;
            if (add) acc[r][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, out), acc[r][0]);
            _mm512_mask_storeu_ps(out, mask0, acc[r][0]);
            if (!two) continue;
            if (add) acc[r][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, out + 16), acc[r][1]);
            _mm512_mask_storeu_ps(out + 16, mask1, acc[r][1]);
        }
    }
}

/* Constant row counts and panel counts keep the accumulators in registers. */
#define CHUNK_TILE_CASE(rows)                                                              \
    case rows:                                                                             \
        if (two) chunk_tile_impl(x, k, panels, count, y, ldy, rows, 1, cols, accumulate); \
        else chunk_tile_impl(x, k, panels, count, y, ldy, rows, 0, cols, accumulate);     \
        break;

static void chunk_tile(const float *x, int64_t k, float *const *panels, int64_t count, float *y,
                       int64_t ldy, int tile_rows, int64_t cols, int accumulate) {
    const int two = cols > PANEL_COLS;
    switch (tile_rows) {
    CHUNK_TILE_CASE(12) CHUNK_TILE_CASE(11) CHUNK_TILE_CASE(10) CHUNK_TILE_CASE(9)
    CHUNK_TILE_CASE(8) CHUNK_TILE_CASE(7) CHUNK_TILE_CASE(6) CHUNK_TILE_CASE(5)
    CHUNK_TILE_CASE(4) CHUNK_TILE_CASE(3) CHUNK_TILE_CASE(2)
    default:
        if (two) chunk_tile_impl(x, k, panels, count, y, ldy, 1, 1, cols, accumulate);
        else chunk_tile_impl(x, k, panels, count, y, ldy, 1, 0, cols, accumulate);
    }
}
#undef CHUNK_TILE_CASE

#endif
