/* The row kernels of the block matrix products (block_gemm.c, block_mlp.c): a few
 * activation rows against weight rows kept in GGUF-style blocks of 32, in fp32.
 *
 * Row n of W is K/32 blocks. q4 (GGUF Q4_1, and Q4_0 and Q4_K converted to it at
 * load): 16 bytes per block, byte j holding element j in its low nibble and element
 * j+16 in its high one, with a scale d and a minimum m per block: w = d * q + m. q8
 * (GGUF Q8_0, and Q5_0 converted to it): 32 signed bytes and a scale d per block:
 * w = d * q. q8 in halves (GGUF Q6_K converted: its scales cover 16 weights): the same
 * bytes with a scale per 16 weights. q5 (GGUF Q5_1, and Q5_K converted to it): codes
 * 0..31 a byte each, as q8's, with a scale and a minimum per block: w = d * q + m, the
 * q8 kernel's sum plus m * sum(x) per block (q8_columns). Scales and minima arrive as
 * fp32 arrays [N, K/32] ([N, K/16] for halves).
 *
 * Per block the kernel forms d * (q . x) + m * sum(x) (the portable loop, and
 * AVX-512 steps of one row), or dots x with the dequantized weights d q + m, formed
 * once per block for all rows (AVX2 builds' Q4_1; AVX-512 steps of several rows, whose
 * q8 weights are d q too): the same value up to rounding. Each block is unpacked once
 * for up to ROW_TILE rows of x (a tile), and a tile meets a chunk of columns one after
 * another (q4_columns).
 * AVX-512 vectors of 16 lanes (block_rows_avx512.h), else AVX2 (with FMA) of 8, else
 * AArch64's NEON of 4 (block_rows_neon.h; not the ARM generic level, KVSERVE_PLAIN_C),
 * else a portable loop.
 */
#ifndef KVSERVE_BLOCK_ROWS_H
#define KVSERVE_BLOCK_ROWS_H

#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"
#include "worker_pool.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__ARM_NEON) && defined(__aarch64__) && !defined(KVSERVE_PLAIN_C)
#define ROWS_NEON 1
#else
#define ROWS_NEON 0
#endif

#define BLOCK 32

#define ROW_TILE 8   /* activation rows sharing one pass over a weight row */
#define COLUMN_CHUNK 32   /* columns per work item: a late thread's share is taken over */

/* How far ahead a sweep prefetches its weights: 2 KB of codes (128 q4 blocks, 64 q8
 * ones) and the scales and minima of the same blocks. A step of a few rows reads each
 * weight once, and the hardware prefetcher alone keeps too few lines in flight: one-row
 * sweeps and the AVX-512 tiles of 2-7 rows wait on memory without it. Tiles of 8 rows
 * are bound by their arithmetic and gain nothing from it. */
#define Q4_PREFETCH_BLOCKS 128
#define Q8_PREFETCH_BLOCKS 64

static inline void prefetch_line(const void *at) {
    __builtin_prefetch(at, 0, 3);
}

#ifdef __AVX512F__
#include "block_rows_avx512.h"
#endif
#if ROWS_NEON
#include "block_rows_neon.h"
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 builds: eight lanes, a block as four vectors of eight weights in block order:
 * vector t holds elements 4L + t in lanes L = 0..7 (elements 0, 4, .., 28, then 1,
 * 5, .., 29, ...), and the kernels read x in that order too (block_order). Lane L
 * then works on the block's dword L (q8) or the low and high nibbles of dword L % 4
 * (q4) with shifts and masks alone: the widening `vpmovzxbd` of byte order issues at
 * under one per cycle on Zen 3, six per block, and bounds a one-row step; these shifts
 * issue at two per cycle. */
#define BLOCK_ORDER 1

/* codes[L] >> 8t, a block's weights t (t < 4) as unsigned codes in bits 0..3 of lane
 * L: lanes 0-3 hold dwords 0-3 of its 16 bytes (low nibbles: elements 4L + t), lanes
 * 4-7 the same dwords shifted by 4 (high nibbles: elements 16 + 4(L - 4) + t). */
static inline __m256i q4_codes(const uint8_t *block) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)block));
    return _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
}

static inline __m256 q4_weights(__m256i codes, int t) {
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srli_epi32(codes, 8 * t), _mm256_set1_epi32(0x0F)));
}

/* Byte t of each dword of a q8 block's 32 bytes, sign-extended: elements 4L + t. */
static inline __m256 q8_weights(__m256i codes, int t) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(codes, 24 - 8 * t), 24));
}
#else
#define BLOCK_ORDER 0
#endif

/* y[r * n] (r < rows <= ROW_TILE) = sum over the row's blocks of
 * d * (q . x_r) + m * sum(x_r): each block is unpacked once for all rows. */
static inline __attribute__((always_inline)) void q4_rows_impl(
        const uint8_t *q, const float *d, const float *m, const float *x, const float *xsum,
        int64_t blocks, int64_t k, int64_t rows, float *y, int64_t n) {
#ifdef __AVX512F__
    q4_rows_avx512(q, d, m, x, xsum, blocks, k, rows, y, n);
#elif defined(__AVX2__) && defined(__FMA__)
    /* Each block is dequantized once for all rows, w = d q + m (an FMA per 8 weights),
     * so a row costs four FMAs per block and no pass over the minima: AVX2 has half
     * AVX-512's lanes, and the FMAs, not the weight bytes, bound steps of a few rows.
     * A row's four FMAs per block go into `chains` accumulators in turn: four for one
     * row (one FMA per block each), two up to 4 rows; more rows are enough independent
     * chains themselves. x is in block order (block_order). */
    (void)xsum;
    const int chains = rows == 1 ? 4 : rows <= 4 ? 2 : 1;
    __m256 acc[ROW_TILE][4];
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (rows == 1 && b % 4 == 0) {        /* a line of codes per 4 blocks */
            prefetch_line(q + (b + Q4_PREFETCH_BLOCKS) * 16);
            if (b % 8 == 0) {
                prefetch_line(d + b + Q4_PREFETCH_BLOCKS);
                prefetch_line(m + b + Q4_PREFETCH_BLOCKS);
            }
        }
        const __m256i codes = q4_codes(q + b * 16);
        const __m256 scale = _mm256_set1_ps(d[b]), minimum = _mm256_set1_ps(m[b]);
        const __m256 w[4] = {_mm256_fmadd_ps(q4_weights(codes, 0), scale, minimum),
                             _mm256_fmadd_ps(q4_weights(codes, 1), scale, minimum),
                             _mm256_fmadd_ps(q4_weights(codes, 2), scale, minimum),
                             _mm256_fmadd_ps(q4_weights(codes, 3), scale, minimum)};
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            for (int j = 0; j < 4; j++)
                acc[r][j % chains] =
                    _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % chains]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        __m256 total = acc[r][0];
        for (int j = 1; j < chains; j++) total = _mm256_add_ps(total, acc[r][j]);
        y[r * n] = sum8(total);
    }
#elif ROWS_NEON
    (void)xsum;
    q4_rows_neon(q, d, m, x, blocks, k, rows, y, n);
#else
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            float block = 0.0f;
            for (int j = 0; j < 16; j++)
                block += (float)(q[b * 16 + j] & 0x0F) * x[r * k + b * BLOCK + j]
                       + (float)(q[b * 16 + j] >> 4) * x[r * k + b * BLOCK + j + 16];
            total += d[b] * block + m[b] * xsum[r * blocks + b];
        }
        y[r * n] = total;
    }
#endif
}

/* sum over blocks of m[b] * sums[b]: a q5 row's minima against one row's block sums. */
static inline float minima_dot(const float *m, const float *sums, int64_t blocks) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps(add_minima(_mm512_setzero_ps(), m, sums, blocks));
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) total += m[b] * sums[b];
    return total;
#endif
}

/* halves: d holds a scale per 16 weights (two per block), else one per block. m: a q5
 * row's minima, added as m * sum(x) per block from x's block sums (xsum [rows, blocks]),
 * or NULL. */
static inline __attribute__((always_inline)) void q8_rows_impl(
        const int8_t *q, const float *d, const float *m, const float *x, const float *xsum,
        int64_t blocks, int64_t k, int64_t rows, float *y, int64_t n, int halves) {
#ifdef __AVX512F__
    if (rows == 1 && !halves) {               /* the minima in the row's accumulator */
        y[0] = q8_one_row(q, d, m, x, xsum, blocks);
        return;
    }
    q8_rows_avx512(q, d, x, blocks, k, rows, y, n, halves);
#elif defined(__AVX2__) && defined(__FMA__)
    /* In block order lanes 0-3 hold elements 0..15 and lanes 4-7 16..31, so halves'
     * two scales form one vector. */
    __m256 acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (rows == 1 && !halves && b % 2 == 0) {   /* a line of codes per 2 blocks */
            prefetch_line(q + (b + Q8_PREFETCH_BLOCKS) * BLOCK);
            if (b % 8 == 0) prefetch_line(d + b + Q8_PREFETCH_BLOCKS);
        }
        const __m256i codes = _mm256_loadu_si256((const __m256i *)(q + b * BLOCK));
        const __m256 w0 = q8_weights(codes, 0), w1 = q8_weights(codes, 1);
        const __m256 w2 = q8_weights(codes, 2), w3 = q8_weights(codes, 3);
        const __m256 scale = halves ? _mm256_blend_ps(_mm256_set1_ps(d[2 * b]),
                                                      _mm256_set1_ps(d[2 * b + 1]), 0xF0)
                                    : _mm256_set1_ps(d[b]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            __m256 first = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
            __m256 second = _mm256_mul_ps(w1, _mm256_loadu_ps(xb + 8));
            first = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), first);
            second = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), second);
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(first, second), scale, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) y[r * n] = sum8(acc[r]);
#elif ROWS_NEON
    q8_rows_neon(q, d, x, blocks, k, rows, y, n, halves);
#else
    const int group = halves ? 16 : BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < blocks * BLOCK / group; g++) {
            float part = 0.0f;
            for (int j = 0; j < group; j++) part += (float)q[g * group + j] * x[r * k + g * group + j];
            total += d[g] * part;
        }
        y[r * n] = total;
    }
#endif
    if (m)
        for (int64_t r = 0; r < rows; r++) y[r * n] += minima_dot(m, xsum + r * blocks, blocks);
}

/* Constant row counts let the compiler keep the accumulators in registers. */
static __attribute__((noinline, unused)) void q4_rows(
        const uint8_t *q, const float *d, const float *m, const float *x, const float *xsum,
        int64_t blocks, int64_t k, int64_t rows, float *y, int64_t n) {
    switch (rows) {     /* every tile size: the accumulators' chains are constants too */
    case 1: q4_rows_impl(q, d, m, x, xsum, blocks, k, 1, y, n); break;
    case 2: q4_rows_impl(q, d, m, x, xsum, blocks, k, 2, y, n); break;
    case 3: q4_rows_impl(q, d, m, x, xsum, blocks, k, 3, y, n); break;
    case 4: q4_rows_impl(q, d, m, x, xsum, blocks, k, 4, y, n); break;
    case 5: q4_rows_impl(q, d, m, x, xsum, blocks, k, 5, y, n); break;
    case 6: q4_rows_impl(q, d, m, x, xsum, blocks, k, 6, y, n); break;
    case 7: q4_rows_impl(q, d, m, x, xsum, blocks, k, 7, y, n); break;
    default: q4_rows_impl(q, d, m, x, xsum, blocks, k, ROW_TILE, y, n);
    }
}

static __attribute__((noinline, unused)) void q8_rows(
        const int8_t *q, const float *d, const float *m, const float *x, const float *xsum,
        int64_t blocks, int64_t k, int64_t rows, float *y, int64_t n, int halves) {
    switch (rows) {     /* as q4_rows: every tile size */
    case 1: q8_rows_impl(q, d, m, x, xsum, blocks, k, 1, y, n, halves); break;
    case 2: q8_rows_impl(q, d, m, x, xsum, blocks, k, 2, y, n, halves); break;
    case 3: q8_rows_impl(q, d, m, x, xsum, blocks, k, 3, y, n, halves); break;
    case 4: q8_rows_impl(q, d, m, x, xsum, blocks, k, 4, y, n, halves); break;
    case 5: q8_rows_impl(q, d, m, x, xsum, blocks, k, 5, y, n, halves); break;
    case 6: q8_rows_impl(q, d, m, x, xsum, blocks, k, 6, y, n, halves); break;
    case 7: q8_rows_impl(q, d, m, x, xsum, blocks, k, 7, y, n, halves); break;
    default: q8_rows_impl(q, d, m, x, xsum, blocks, k, ROW_TILE, y, n, halves);
    }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define Q4_SUMS_ROWS 0          /* AVX2: the minima are in the dequantized weights */
#define PANEL_KERNELS 1         /* steps of many rows go through block_panels.c */
#define PANEL_MIN_ROWS 32       /* panels even with the row kernels from here
                                   (docs/cpu-kernels.md, PANEL_MIN_ROWS) */
void block_panel_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
                      const float *d, const float *m, int64_t n, float *y, int64_t ldy,
                      int num_threads);
#elif defined(__AVX512F__)
#define Q4_SUMS_ROWS 1          /* AVX-512: only tiles of one row read block sums */
#define PANEL_KERNELS 1         /* steps of many rows go through block_panels.c */
#define PANEL_MIN_ROWS 10       /* panels ahead of the row kernels from here
                                   (docs/cpu-kernels.md, PANEL_MIN_ROWS) */
void block_panel_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
                      const float *d, const float *m, int64_t n, float *y, int64_t ldy,
                      int num_threads);
#elif ROWS_NEON
#define Q4_SUMS_ROWS 0          /* NEON: the minima are in the dequantized weights */
#define PANEL_KERNELS 0
#else
#define Q4_SUMS_ROWS ROW_TILE   /* the portable loop: every tile */
#define PANEL_KERNELS 0
#endif

/* Whether a step of `rows` rows has a tile whose q4 kernel reads block sums: one of
 * at most Q4_SUMS_ROWS rows (the tiles: ROW_TILE rows each, then the rest). */
static inline int q4_reads_block_sums(int64_t rows) {
    return Q4_SUMS_ROWS >= ROW_TILE || (Q4_SUMS_ROWS > 0 && rows % ROW_TILE > 0
                                        && rows % ROW_TILE <= Q4_SUMS_ROWS);
}

/* *sums <- per-block sums of x [rows, k/32], the minima's factor (q4_rows_impl, q5 in
 * q8_columns), or NULL where the step's kernels do not read them (`needed` 0). Returns
 * 1 when out of memory. */
static inline int block_sums(const float *x, int64_t rows, int64_t k, int needed,
                             float **sums) {
    const int64_t blocks = k / BLOCK;
    *sums = NULL;
    if (!needed) return 0;
    float *out = malloc(sizeof(float) * rows * blocks);
    if (!out) return 1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int j = 0; j < BLOCK; j++) s += x[r * k + b * BLOCK + j];
            out[r * blocks + b] = s;
        }
    *sums = out;
    return 0;
}

/* Row r0's block sums, or NULL without them. */
static inline const float *sums_from(const float *sums, int64_t r0, int64_t blocks) {
    return sums ? sums + r0 * blocks : NULL;
}

/* *ordered <- x [rows, k] in block order where this build's row kernels read it so
 * (BLOCK_ORDER: within each block of 32, element 4L + t at 8t + L; e.g. elements 0,
 * 4, .., 28 first, then 1, 5, .., 29), else NULL: the kernels read x itself. Returns
 * 1 when out of memory. */
static inline int block_order(const float *x, int64_t rows, int64_t k, float **ordered) {
    *ordered = NULL;
    if (!BLOCK_ORDER) return 0;
    float *out = malloc(sizeof(float) * rows * k);
    if (!out) return 1;
    for (int64_t i = 0; i < rows * k; i += BLOCK)
        for (int t = 0; t < 4; t++)
            for (int lane = 0; lane < 8; lane++) out[i + 8 * t + lane] = x[i + 4 * lane + t];
    *ordered = out;
    return 0;
}

/* The next chunk of columns [*first, *last) of n for `part`; 0 once all are taken. */
static inline int take_columns(WorkRanges *items, int part, int64_t n, int64_t *first,
                               int64_t *last) {
    int64_t limit;
    const int64_t item = work_ranges_take(items, part, &limit);
    if (item < 0) return 0;
    *first = item * COLUMN_CHUNK;
    *last = *first + COLUMN_CHUNK < n ? *first + COLUMN_CHUNK : n;
    return 1;
}

/* A tile of rows (x and its block sums from the tile's first row; tile <= ROW_TILE)
 * against the columns [first, last) of a q4 weight: y[r * ldy + col - first], for y
 * at the tile's first row and column `first`. A step's later tiles meet the same
 * columns again, whose few KB of blocks are then still in L2, while the tile's x is
 * read by every column of the chunk. This beats taking all tiles per column. */
static inline void q4_columns(const uint8_t *q, const float *d, const float *m,
                              const float *x, const float *xsum, int64_t k, int64_t tile,
                              int64_t first, int64_t last, float *y, int64_t ldy) {
    const int64_t blocks = k / BLOCK;
    for (int64_t col = first; col < last; col++)
        q4_rows(q + col * (k / 2), d + col * blocks, m + col * blocks, x, xsum, blocks, k,
                tile, y + col - first, ldy);
}

/* The same for a q8 weight (halves: a scale per 16 weights), or a q5 one: m its
 * minima and xsum the tile's block sums (else both NULL). */
static inline void q8_columns(const int8_t *q, const float *d, const float *m,
                              const float *x, const float *xsum, int64_t k, int64_t tile,
                              int64_t first, int64_t last, float *y, int64_t ldy,
                              int halves) {
    const int64_t blocks = k / BLOCK, scales = halves ? 2 * blocks : blocks;
    for (int64_t col = first; col < last; col++)
        q8_rows(q + col * k, d + col * scales, m ? m + col * blocks : NULL, x, xsum, blocks,
                k, tile, y + col - first, ldy, halves);
}

#endif
