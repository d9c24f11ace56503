/* The AVX-512 row kernels of the block products (block_rows.h): `rows` activation rows
 * (rows <= ROW_TILE) against one weight row of K/32 GGUF-style blocks, in fp32.
 *
 * Steps of 2 and more rows dequantize each block once for all of them and dot the
 * weights with every row: a row then costs two FMAs per block (the low and high 16
 * weights, each into its own accumulator).
 *   q4: the block's 16 possible weights d * c + m (c = 0..15, formed as the loader
 *       forms the fp32 weights: a product, then a sum) are a table, and `vpermps`
 *       looks each code up in it (it reads the low 4 bits of each index lane, so the
 *       low nibbles need no mask).
 *   q8: d * q (halves: the first 16 weights' scale, then the second's).
 * One row would spend as much on dequantizing as on its products, so it keeps
 * d * (q . x) per block (q4: + m * sum(x), from the block sums; codes looked up as
 * floats 0..15), with even and odd blocks in two accumulators: on one accumulator the
 * chain of one FMA per block (4 cycles) bounds the loop.
 */
#ifndef KVSERVE_BLOCK_ROWS_AVX512_H
#define KVSERVE_BLOCK_ROWS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* The codes 0..15 as floats: `vpermps` of a code vector in it gives the codes' values. */
static inline __m512 code_values(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* A q4 block's 16 bytes, byte j in dword lane j (its low nibble: element j; its high
 * one: element j + 16). */
static inline __m512i q4_block_lanes(const uint8_t *block) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block));
}

/* q . x over one q4 block, in lanes (the codes unscaled, no minimum). */
static inline __m512 q4_block_dot(const uint8_t *block, const float *xb, __m512 values) {
    const __m512i lanes = q4_block_lanes(block);
    const __m512 low = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, values), _mm512_loadu_ps(xb));
    return _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), values),
                           _mm512_loadu_ps(xb + 16), low);
}

/* 16 signed codes from `codes` as floats. */
static inline __m512 q8_values(const int8_t *codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
}

/* q . x over one q8 block, in lanes. */
static inline __m512 q8_block_dot(const int8_t *block, const float *xb) {
    return _mm512_fmadd_ps(q8_values(block + 16), _mm512_loadu_ps(xb + 16),
                           _mm512_mul_ps(q8_values(block), _mm512_loadu_ps(xb)));
}

/* acc + m[b] * block_sums[b] in lanes b % 16, for every block: the minima's share. */
static inline __m512 add_minima(__m512 acc, const float *m, const float *block_sums,
                                int64_t blocks) {
    for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = blocks - b >= 16 ? (__mmask16)0xFFFF
                                                 : (__mmask16)((1u << (blocks - b)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(valid, m + b),
                              _mm512_maskz_loadu_ps(valid, block_sums + b), acc);
    }
    return acc;
}

/* One row of x against a q4 weight row: sum of d * (q . x) + m * sum(x) per block. */
static inline float q4_one_row(const uint8_t *q, const float *d, const float *m,
                               const float *x, const float *xsum, int64_t blocks) {
    const __m512 values = code_values();
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        prefetch_line(q + (b + Q4_PREFETCH_BLOCKS) * 16);
        if (b % 8 == 0) {
            prefetch_line(d + b + Q4_PREFETCH_BLOCKS);
            prefetch_line(m + b + Q4_PREFETCH_BLOCKS);
        }
        const __m512 first = q4_block_dot(q + b * 16, x + b * BLOCK, values);
        const __m512 second = q4_block_dot(q + b * 16 + 16, x + b * BLOCK + BLOCK, values);
        even = _mm512_fmadd_ps(first, _mm512_set1_ps(d[b]), even);
        odd = _mm512_fmadd_ps(second, _mm512_set1_ps(d[b + 1]), odd);
    }
    if (b < blocks)
        even = _mm512_fmadd_ps(q4_block_dot(q + b * 16, x + b * BLOCK, values),
                               _mm512_set1_ps(d[b]), even);
    return _mm512_reduce_add_ps(add_minima(_mm512_add_ps(even, odd), m, xsum, blocks));
}

/* The same for a q8 weight row with a scale per block, plus m * sum(x) per block where
 * m (a q5 row's minima; xsum: x's block sums) is not NULL. */
static inline float q8_one_row(const int8_t *q, const float *d, const float *m,
                               const float *x, const float *xsum, int64_t blocks) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        prefetch_line(q + (b + Q8_PREFETCH_BLOCKS) * BLOCK);
        if (b % 8 == 0) prefetch_line(d + b + Q8_PREFETCH_BLOCKS);
        even = _mm512_fmadd_ps(q8_block_dot(q + b * BLOCK, x + b * BLOCK),
                               _mm512_set1_ps(d[b]), even);
        odd = _mm512_fmadd_ps(q8_block_dot(q + b * BLOCK + BLOCK, x + b * BLOCK + BLOCK),
                              _mm512_set1_ps(d[b + 1]), odd);
    }
    if (b < blocks)
        even = _mm512_fmadd_ps(q8_block_dot(q + b * BLOCK, x + b * BLOCK),
                               _mm512_set1_ps(d[b]), even);
    const __m512 total = _mm512_add_ps(even, odd);
    return _mm512_reduce_add_ps(m ? add_minima(total, m, xsum, blocks) : total);
}

/* One block's dequantized weights (first and second 16) against `rows` rows of x
 * (xb: the block's place in row 0, rows k apart), into each row's two accumulators. */
static inline __attribute__((always_inline)) void accumulate_rows(
        __m512 first, __m512 second, const float *xb, int64_t k, int64_t rows,
        __m512 *first_acc, __m512 *second_acc) {
    for (int64_t r = 0; r < rows; r++) {
        first_acc[r] = _mm512_fmadd_ps(first, _mm512_loadu_ps(xb + r * k), first_acc[r]);
        second_acc[r] = _mm512_fmadd_ps(second, _mm512_loadu_ps(xb + r * k + 16),
                                        second_acc[r]);
    }
}

/* y[r * n] = the sum of row r's two accumulators. */
static inline __attribute__((always_inline)) void store_rows(
        const __m512 *first_acc, const __m512 *second_acc, int64_t rows, float *y,
        int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(first_acc[r], second_acc[r]));
}

/* y[r * n] (r < rows) = the dot product of x's row r with a q4 weight row. */
static inline __attribute__((always_inline)) void q4_rows_avx512(
        const uint8_t *q, const float *d, const float *m, const float *x, const float *xsum,
        int64_t blocks, int64_t k, int64_t rows, float *y, int64_t n) {
    if (rows == 1) {
        y[0] = q4_one_row(q, d, m, x, xsum, blocks);
        return;
    }
    const __m512 values = code_values();
    __m512 low_acc[ROW_TILE], high_acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) low_acc[r] = high_acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (b % 4 == 0) prefetch_line(q + (b + Q4_PREFETCH_BLOCKS) * 16);
        if (b % 16 == 0) {
            prefetch_line(d + b + Q4_PREFETCH_BLOCKS);
            prefetch_line(m + b + Q4_PREFETCH_BLOCKS);
        }
        const __m512i lanes = q4_block_lanes(q + b * 16);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(values, _mm512_set1_ps(d[b])),
                                           _mm512_set1_ps(m[b]));
        accumulate_rows(_mm512_permutexvar_ps(lanes, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table),
                        x + b * BLOCK, k, rows, low_acc, high_acc);
    }
    store_rows(low_acc, high_acc, rows, y, n);
}

/* y[r * n] (r < rows) for a q8 weight row (halves: a scale per 16 weights), steps of
 * 2 rows and more, or halves (q8_rows_impl takes one row of one scale per block). */
static inline __attribute__((always_inline)) void q8_rows_avx512(
        const int8_t *q, const float *d, const float *x, int64_t blocks, int64_t k,
        int64_t rows, float *y, int64_t n, int halves) {
    __m512 first_acc[ROW_TILE], second_acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) first_acc[r] = second_acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const float *scales = halves ? d + 2 * b : d + b;
        if (b % 2 == 0) prefetch_line(q + (b + Q8_PREFETCH_BLOCKS) * BLOCK);
        if (b % 8 == 0) prefetch_line(scales + (halves ? 2 : 1) * Q8_PREFETCH_BLOCKS);
        const __m512 first = _mm512_mul_ps(q8_values(q + b * BLOCK), _mm512_set1_ps(scales[0]));
        const __m512 second = _mm512_mul_ps(q8_values(q + b * BLOCK + 16),
                                            _mm512_set1_ps(scales[halves ? 1 : 0]));
        accumulate_rows(first, second, x + b * BLOCK, k, rows, first_acc, second_acc);
    }
    store_rows(first_acc, second_acc, rows, y, n);
}

#endif
