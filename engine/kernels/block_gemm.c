/* Matrix products of a few activation rows against weights kept in GGUF-style blocks
 * of 32, accumulated in fp32: y[M, N] = x[M, K] @ W^T.
 *
 * Row n of W is K/32 blocks. q4 (GGUF Q4_1, and Q4_0 and Q4_K converted to it at
 * load): 16 bytes per block, byte j holding element j in its low nibble and element
 * j+16 in its high one, with a scale d and a minimum m per block: w = d * q + m. q8
 * (GGUF Q8_0, and Q5_0 converted to it): 32 signed bytes and a scale d per block:
 * w = d * q. q8 in halves (GGUF Q6_K converted: its scales cover 16 weights): the same
 * bytes with a scale per 16 weights. Scales and minima arrive as fp32 arrays [N, K/32]
 * ([N, K/16] for halves).
 *
 * Per block the kernel forms d * (q . x) + m * sum(x) (AVX2 builds' Q4_1: the
 * dequantized weights d q + m, formed once per block for all rows, dotted with x),
 * the same value as the dot product with the dequantized weights up to rounding. It
 * is meant for decode steps (M of 1 to a few dozen rows), where the product is bound
 * by reading W: a Q4_1 weight costs 5 bits against fp32's 32. Each block is unpacked
 * once for up to ROW_TILE rows of x. Columns are shared out between `num_threads`
 * threads in chunks of COLUMN_CHUNK (worker_pool.h's WorkRanges: a thread that
 * finishes its own chunks takes the others', so a helper that starts late does not
 * hold the call; one-request steps 17.6-21.2 -> 13.9-18.2 ms against an even split,
 * five alternations on a 2-vCPU Zen 3).
 * Built at run time with -march=native (engine/kernels/build.py): AVX-512 vectors of
 * 16 lanes, else AVX2 (with FMA) of 8, else a portable loop doing the same arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BLOCK 32

#define ROW_TILE 8   /* activation rows sharing one pass over a weight row */
#define COLUMN_CHUNK 32   /* columns per work item: a late thread's share is taken over */

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 builds: eight lanes, a block as four vectors of eight weights. */
static inline __m256 bytes8_unsigned(__m128i bytes) {    /* the low 8 bytes, as floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __m256 bytes8_signed(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}
#endif

/* sum over blocks of m[b] * sum(x's block b): the minima's share of a Q4_1 row's dot product. */
static inline float minima_part(const float *m, const float *block_sums, int64_t blocks) {
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) total += m[b] * block_sums[b];
    return total;
}

/* y[r * n] (r < rows <= ROW_TILE) = sum over the row's blocks of
 * d * (q . x_r) + m * sum(x_r): each block is unpacked once for all rows. */
static inline __attribute__((always_inline)) void q4_rows_impl(const uint8_t *q, const float *d, const float *m, const float *x,
                    const float *xsum, int64_t blocks, int64_t k, int64_t rows, float *y,
                    int64_t n) {
#ifdef __AVX512F__
    __m512 acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + b * 16));
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low_mask)));
        __m512 high = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask)));
        __m512 scale = _mm512_set1_ps(d[b]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            __m512 block = _mm512_mul_ps(low, _mm512_loadu_ps(xb));
            block = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16), block);
            acc[r] = _mm512_fmadd_ps(block, scale, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        y[r * n] = _mm512_reduce_add_ps(acc[r]) + minima_part(m, xsum + r * blocks, blocks);
#elif defined(__AVX2__) && defined(__FMA__)
    /* Each block is dequantized once for all rows, w = d q + m (an FMA per 8 weights),
     * so a row costs four FMAs per block and no pass over the minima: AVX2 has half
     * AVX-512's lanes, and the FMAs, not the weight bytes, bound steps of a few rows.
     * Up to 4 rows each keep two accumulators (two chains of two FMAs per block, not
     * one of four); more rows are enough independent chains themselves. */
    (void)xsum;
    const int split = rows <= 4;
    __m256 acc[ROW_TILE], acc2[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = acc2[r] = _mm256_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + b * 16));
        const __m128i low = _mm_and_si128(bytes, low_mask);              /* elements 0..15 */
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  /* 16..31 */
        const __m256 scale = _mm256_set1_ps(d[b]), minimum = _mm256_set1_ps(m[b]);
        const __m256 w0 = _mm256_fmadd_ps(bytes8_unsigned(low), scale, minimum);
        const __m256 w1 = _mm256_fmadd_ps(bytes8_unsigned(_mm_srli_si128(low, 8)), scale, minimum);
        const __m256 w2 = _mm256_fmadd_ps(bytes8_unsigned(high), scale, minimum);
        const __m256 w3 = _mm256_fmadd_ps(bytes8_unsigned(_mm_srli_si128(high, 8)), scale,
                                          minimum);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), acc[r]);
            if (split) {
                acc2[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), acc2[r]);
                acc[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), acc[r]);
                acc2[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), acc2[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), acc[r]);
                acc[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), acc[r]);
                acc[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), acc[r]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) y[r * n] = sum8(_mm256_add_ps(acc[r], acc2[r]));
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

/* halves: d holds a scale per 16 weights (two per block), else one per block. */
static inline __attribute__((always_inline)) void q8_rows_impl(const int8_t *q, const float *d, const float *x, int64_t blocks,
                    int64_t k, int64_t rows, float *y, int64_t n, int halves) {
#ifdef __AVX512F__
    __m512 acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(q + b * BLOCK))));
        __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(q + b * BLOCK + 16))));
        if (halves) {
            const __m512 first_scale = _mm512_set1_ps(d[2 * b]);
            const __m512 second_scale = _mm512_set1_ps(d[2 * b + 1]);
            for (int64_t r = 0; r < rows; r++) {
                const float *xb = x + r * k + b * BLOCK;
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(first, _mm512_loadu_ps(xb)),
                                         first_scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(second, _mm512_loadu_ps(xb + 16)),
                                         second_scale, acc[r]);
            }
            continue;
        }
        __m512 scale = _mm512_set1_ps(d[b]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            __m512 block = _mm512_mul_ps(first, _mm512_loadu_ps(xb));
            block = _mm512_fmadd_ps(second, _mm512_loadu_ps(xb + 16), block);
            acc[r] = _mm512_fmadd_ps(block, scale, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) y[r * n] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *qb = q + b * BLOCK;
        const __m256 w0 = bytes8_signed(qb), w1 = bytes8_signed(qb + 8);
        const __m256 w2 = bytes8_signed(qb + 16), w3 = bytes8_signed(qb + 24);
        const __m256 first_scale = _mm256_set1_ps(halves ? d[2 * b] : d[b]);
        const __m256 second_scale = _mm256_set1_ps(halves ? d[2 * b + 1] : d[b]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            __m256 first = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
            first = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), first);
            __m256 second = _mm256_mul_ps(w2, _mm256_loadu_ps(xb + 16));
            second = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), second);
            acc[r] = _mm256_fmadd_ps(first, first_scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(second, second_scale, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) y[r * n] = sum8(acc[r]);
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
}

/* Constant row counts let the compiler keep the accumulators in registers. */
static void q4_rows(const uint8_t *q, const float *d, const float *m, const float *x,
                    const float *xsum, int64_t blocks, int64_t k, int64_t rows, float *y,
                    int64_t n) {
    switch (rows) {
    case 1: q4_rows_impl(q, d, m, x, xsum, blocks, k, 1, y, n); break;
    case 2: q4_rows_impl(q, d, m, x, xsum, blocks, k, 2, y, n); break;
    case 4: q4_rows_impl(q, d, m, x, xsum, blocks, k, 4, y, n); break;
    case 8: q4_rows_impl(q, d, m, x, xsum, blocks, k, 8, y, n); break;
    default: q4_rows_impl(q, d, m, x, xsum, blocks, k, rows, y, n);
    }
}

static void q8_rows(const int8_t *q, const float *d, const float *x, int64_t blocks,
                    int64_t k, int64_t rows, float *y, int64_t n, int halves) {
    switch (rows) {
    case 1: q8_rows_impl(q, d, x, blocks, k, 1, y, n, halves); break;
    case 2: q8_rows_impl(q, d, x, blocks, k, 2, y, n, halves); break;
    case 4: q8_rows_impl(q, d, x, blocks, k, 4, y, n, halves); break;
    case 8: q8_rows_impl(q, d, x, blocks, k, 8, y, n, halves); break;
    default: q8_rows_impl(q, d, x, blocks, k, rows, y, n, halves);
    }
}

typedef struct {
    const float *x, *d, *m, *xsum;
    const void *q;
    int64_t rows, k, n;
    float *y;
    int64_t ldy;                     /* y's row stride (>= n) */
    int halves;                      /* q8: a scale per 16 weights */
    WorkRanges *items;               /* column chunks of COLUMN_CHUNK, shared by the parts */
} GemmJob;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define Q4_USES_BLOCK_SUMS 0    /* AVX2: the minima are in the dequantized weights */
#else
#define Q4_USES_BLOCK_SUMS 1
#endif

/* *sums <- per-block sums of x [rows, k/32], the minima's factor in q4_rows_impl, or
 * NULL where this build's kernel does not read them. Returns 1 when out of memory. */
static int block_sums(const float *x, int64_t rows, int64_t k, float **sums) {
    const int64_t blocks = k / BLOCK;
    *sums = NULL;
    if (!Q4_USES_BLOCK_SUMS) return 0;
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

/* The columns of y this part takes (take_columns). */
static void q4_part(const void *arg, int part, int parts) {
    const GemmJob *job = arg;
    const int64_t k = job->k, n = job->n, rows = job->rows, blocks = k / BLOCK;
    const uint8_t *q = job->q;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, n, &first, &last)) {
        for (int64_t col = first; col < last; col++)
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
                q4_rows(q + col * (k / 2), job->d + col * blocks, job->m + col * blocks,
                        job->x + r0 * k, sums_from(job->xsum, r0, blocks), blocks, k,
                        rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE,
                        job->y + r0 * job->ldy + col, job->ldy);
    }
}

static void q8_part(const void *arg, int part, int parts) {
    const GemmJob *job = arg;
    const int64_t k = job->k, n = job->n, rows = job->rows, blocks = k / BLOCK;
    const int64_t scales_per_row = job->halves ? 2 * blocks : blocks;
    const int8_t *q = job->q;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, n, &first, &last)) {
        for (int64_t col = first; col < last; col++)
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
                q8_rows(q + col * k, job->d + col * scales_per_row, job->x + r0 * k, blocks,
                        k, rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE,
                        job->y + r0 * job->ldy + col, job->ldy, job->halves);
    }
}

/* y[r * ldy + c] for c < n: x @ W^T for W of `kind` (BLOCKS_Q4, BLOCKS_Q8,
 * BLOCKS_Q8_HALVES; kernels.h). 1 for K not a multiple of 32 or an unknown kind, 2
 * when out of memory. */
int block_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
               const float *d, const float *m, int64_t n, float *y, int64_t ldy,
               int num_threads) {
    if (k % BLOCK || ldy < n
        || (kind != BLOCKS_Q4 && kind != BLOCKS_Q8 && kind != BLOCKS_Q8_HALVES)) return 1;
    if (rows <= 0 || n <= 0) return 0;
    WorkRanges items;
    work_ranges_init(&items, (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
    GemmJob job = {x, d, m, NULL, q, rows, k, n, y, ldy, kind == BLOCKS_Q8_HALVES, &items};
    if (kind != BLOCKS_Q4) {
        run_parallel(q8_part, &job, num_threads);
        return 0;
    }
    float *xsum;
    if (block_sums(x, rows, k, &xsum)) return 2;
    job.xsum = xsum;
    run_parallel(q4_part, &job, num_threads);
    free(xsum);
    return 0;
}

/* Lanes of the vectors this build's block kernels use: 16 (AVX-512), 8 (AVX2 and
 * FMA) or 1 (the portable loop). Where the kernels stop beating the dense matmuls
 * depends on it (models/block_weights.py). */
int block_gemm_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 1;
#endif
}

int q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *d,
            const float *m, int64_t n, float *y, int num_threads) {
    return block_gemm(BLOCKS_Q4, x, rows, k, q, d, m, n, y, n, num_threads);
}

int q8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *d,
            int64_t n, float *y, int num_threads) {
    return block_gemm(BLOCKS_Q8, x, rows, k, q, d, NULL, n, y, n, num_threads);
}

/* The gated MLP of a decoder layer in one call: h = silu(x W_gate^T) * (x W_up^T),
 * y = h W_down^T, with W_gate and W_up the two halves of one fused Q4_1 weight
 * [2I, K] (gate rows first) and W_down a Q4_1 weight [N, I]. */
typedef struct {
    const float *x, *xsum;
    const uint8_t *q;
    const float *d, *m;
    int64_t rows, k, intermediate;
    float *h;                                    /* [rows, I] */
    WorkRanges *items;                           /* chunks of COLUMN_CHUNK of I */
} GateUpJob;

/* h[:, col] = silu(gate column col) * (up column col) for every row. */
static void gate_up_column(const GateUpJob *job, int64_t col) {
    const int64_t k = job->k, inter = job->intermediate, blocks = k / BLOCK, up_col = inter + col;
    for (int64_t r0 = 0; r0 < job->rows; r0 += ROW_TILE) {
        const int64_t tile = job->rows - r0 < ROW_TILE ? job->rows - r0 : ROW_TILE;
        float gate[ROW_TILE], up[ROW_TILE];
        q4_rows(job->q + col * (k / 2), job->d + col * blocks, job->m + col * blocks,
                job->x + r0 * k, sums_from(job->xsum, r0, blocks), blocks, k, tile, gate, 1);
        q4_rows(job->q + up_col * (k / 2), job->d + up_col * blocks, job->m + up_col * blocks,
                job->x + r0 * k, sums_from(job->xsum, r0, blocks), blocks, k, tile, up, 1);
        for (int64_t t = 0; t < tile; t++)
            job->h[(r0 + t) * inter + col] = gate[t] / (1.0f + expf(-gate[t])) * up[t];
    }
}

static void gate_up_part(const void *arg, int part, int parts) {
    const GateUpJob *job = arg;
    (void)parts;
    int64_t first, last;
    while (take_columns(job->items, part, job->intermediate, &first, &last))
        for (int64_t col = first; col < last; col++) gate_up_column(job, col);
}

int q4_gated_mlp(const float *x, int64_t rows, int64_t k, const uint8_t *gate_up_q,
                 const float *gate_up_d, const float *gate_up_m, int64_t intermediate,
                 const uint8_t *down_q, const float *down_d, const float *down_m, int64_t n,
                 float *y, int num_threads) {
    if (k % BLOCK || intermediate % BLOCK) return 1;
    if (rows <= 0 || n <= 0) return 0;
    float *h = malloc(sizeof(float) * rows * intermediate);
    float *xsum = NULL, *hsum = NULL;
    int status = 2;
    if (h && !block_sums(x, rows, k, &xsum)) {
        WorkRanges chunks;
        work_ranges_init(&chunks, (intermediate + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
        GateUpJob first = {x, xsum, gate_up_q, gate_up_d, gate_up_m, rows, k, intermediate, h,
                           &chunks};
        run_parallel(gate_up_part, &first, num_threads);
        if (!block_sums(h, rows, intermediate, &hsum)) {
            WorkRanges items;
            work_ranges_init(&items, (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, num_threads);
            GemmJob second = {h, down_d, down_m, hsum, down_q, rows, intermediate, n, y, n, 0,
                              &items};
            run_parallel(q4_part, &second, num_threads);
            status = 0;
        }
    }
    free(h);
    free(xsum);
    free(hsum);
    return status;
}
