/* The AVX-512 half of block_panels.c: panels of 16 columns are one vector per value
 * of K, and a tile of up to PANEL_TILE_ROWS rows runs over both panels of a chunk.
 *
 * Unpacking: the 16 columns are the 16 lanes; one gather per dword of their blocks
 * gives 4 values of K in every column, so each panel row is formed in place, with no
 * transpose (unpack_panel_avx512).
 *
 * Tile: 12 rows x 32 columns, 24 accumulators; per value of K two panel loads and 12
 * broadcasts of x feed 24 independent FMAs. Alone, with its panels in cache, such a
 * tile outruns oneDNN's fp32 product on a packed weight at 16 and 32 rows
 * (docs/cpu-kernels.md, PANEL_KERNEL_ROWS, has whole products).
 * Columns past the weight's last (a last chunk of fewer than 32) are masked off. Each
 * output sums K in slices of SUM_SLICE values, added to y one after another.
 * Included by block_panels.c, which defines PANEL_COLS, PANEL_K and Panel first.
 */
#ifndef KVSERVE_BLOCK_PANELS_AVX512_H
#define KVSERVE_BLOCK_PANELS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "block_rows.h"
#include "kernels.h"

#define PANEL_TILE_ROWS 12

/* Lanes of the columns [c0, c0 + 16) that are below `cols`. */
static inline __mmask16 columns_mask(int64_t cols, int64_t c0) {
    const int64_t live = cols - c0;
    return live >= 16 ? (__mmask16)0xFFFF : live <= 0 ? 0 : (__mmask16)((1u << live) - 1u);
}

/* A panel's 16 columns are 16 lanes: lane c reads column first + c's block, `blocks`
 * blocks (of `bytes` bytes each) after lane c - 1's; the lanes past `cols` read
 * nothing (masked) and give zeros. */
typedef struct {
    __m512i block_index;       /* c * blocks, to gather the blocks' scales and minima */
    __m512i byte_offset;       /* c * blocks * bytes, to gather their codes */
    __mmask16 live;
} PanelLanes;

static inline PanelLanes panel_lanes(int64_t blocks, int bytes, int64_t cols) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)blocks));
    return (PanelLanes){index, _mm512_mullo_epi32(index, _mm512_set1_epi32(bytes)),
                        columns_mask(cols, 0)};
}

/* Dword `word` of each live column's block (block `at` of the panel's first column). */
static inline __m512i gather_words(const PanelLanes *lanes, const uint8_t *codes, int64_t at,
                                   int bytes, int word) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes->live, lanes->byte_offset,
                                       codes + at * bytes + 4 * word, 1);
}

/* Each live column's scale (or minimum) of one block: `from` at the panel's first
 * column's, `stride` floats per block (2 where a block has a scale per 16 weights). */
static inline __m512 gather_scales(const PanelLanes *lanes, const float *from, int stride) {
    const __m512i index = stride == 1 ? lanes->block_index
                                      : _mm512_slli_epi32(lanes->block_index, 1);
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes->live, index, from, 4);
}

/* panel[kk * 16 + c] = W[first + c, k0 + kk] for kk < count (a multiple of 32), W of
 * `kind` (codes q, scales d, minima m for q4; K = k); columns from `cols` on are
 * zeros. Each panel row is formed in lanes straight from the 16 columns' blocks: a
 * gather of one dword of codes per column gives 4 values of K (q8: 4 bytes; q4: 4
 * bytes' low nibbles, elements 4t .. 4t + 3, and high ones, 16 + 4t ..), then the
 * weights are formed as the loader forms them (q4: d * c + m, a product then a sum; q8:
 * d * q), bit for bit its fp32 weights. (The compiler may fuse q4's product and sum,
 * but d * c is exact in fp32 for the loader's scales, fp16 values or a Q4_K's fp16
 * scale times its 6-bit one, at most 17 + 4 bits, so the fused result is the same;
 * tests/engine/test_block_weights.py checks it.) This beats dequantizing each column's
 * block in its own vector and transposing 16 x 16, whose shuffles all wait for one
 * port. */
static void unpack_panel_avx512(int kind, const void *q, const float *d, const float *m,
                                int64_t k, int64_t first, int64_t cols, int64_t k0,
                                int64_t count, float *panel) {
    const int64_t blocks = k / BLOCK;
    const int bytes = kind == BLOCKS_Q4 ? 16 : BLOCK, halves = kind == BLOCKS_Q8_HALVES;
    const PanelLanes lanes = panel_lanes(blocks, bytes, cols);
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    for (int64_t b = k0 / BLOCK; b < (k0 + count) / BLOCK; b++) {
        const int64_t at = first * blocks + b;
        float *out = panel + (b * BLOCK - k0) * PANEL_COLS;
        if (kind == BLOCKS_Q4) {
            const __m512 scale = gather_scales(&lanes, d + at, 1);
            const __m512 minimum = gather_scales(&lanes, m + at, 1);
            for (int t = 0; t < 4; t++) {
                const __m512i words = gather_words(&lanes, q, at, bytes, t);
                for (int e = 0; e < 4; e++) {
                    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(words, 8 * e), nibble);
                    const __m512i high =
                        _mm512_and_si512(_mm512_srli_epi32(words, 8 * e + 4), nibble);
                    _mm512_store_ps(out + (4 * t + e) * PANEL_COLS,
                                    _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(low), scale),
                                                  minimum));
                    _mm512_store_ps(out + (16 + 4 * t + e) * PANEL_COLS,
                                    _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(high), scale),
                                                  minimum));
                }
            }
            continue;
        }
        const __m512 first_scale = gather_scales(&lanes, d + (halves ? 2 * at : at), 1 + halves);
        const __m512 second_scale = halves ? gather_scales(&lanes, d + 2 * at + 1, 2) : first_scale;
        for (int t = 0; t < 8; t++) {
            const __m512i words = gather_words(&lanes, q, at, bytes, t);
            const __m512 scale = t < 4 ? first_scale : second_scale;
            for (int e = 0; e < 4; e++) {
                const __m512i code = _mm512_srai_epi32(_mm512_slli_epi32(words, 24 - 8 * e), 24);
                _mm512_store_ps(out + (4 * t + e) * PANEL_COLS,
                                _mm512_mul_ps(_mm512_cvtepi32_ps(code), scale));
            }
        }
    }
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
        const float *x, int64_t k, const Panel *panels, int64_t count, float *y,
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

static void chunk_tile(const float *x, int64_t k, const Panel *panels, int64_t count, float *y,
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
