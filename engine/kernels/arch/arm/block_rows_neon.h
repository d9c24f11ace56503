/* The NEON row kernels of the block products on AArch64 (block_rows.h, ROWS_NEON):
 * `rows` activation rows (rows <= ROW_TILE) against one weight row of K/32 GGUF-style
 * blocks, in fp32, four lanes per vector.
 *
 * As AVX2's kernels, each block is dequantized once for all rows of a tile and every
 * row then costs one FMA per four weights:
 *   q4: w = d * c + m (one FMA per vector), so no pass over the minima and no block
 *       sums are needed (Q4_SUMS_ROWS 0);
 *   q8: the codes as floats, a row's products summed per half block and scaled once
 *       (halves: each half by its own scale; q5's minima are added after the loop,
 *       q8_rows_impl).
 * NEON widens bytes in element order (uxtl/sxtl to 16 and 32 bits, then a conversion
 * to float), so vector i of a block holds elements 4i..4i+3 and x is read as it lies
 * (BLOCK_ORDER 0). A q4 block's low nibbles are elements 0-15 and its high ones
 * 16-31: vectors 0-3 and 4-7.
 */
#ifndef KVSERVE_BLOCK_ROWS_NEON_H
#define KVSERVE_BLOCK_ROWS_NEON_H

#include <arm_neon.h>
#include <stdint.h>

/* 16 unsigned bytes -> 4 vectors of 4 floats, in order. */
static inline void u8_floats(uint8x16_t bytes, float32x4_t *out) {
    const uint16x8_t low = vmovl_u8(vget_low_u8(bytes)), high = vmovl_high_u8(bytes);
    out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(low)));
    out[1] = vcvtq_f32_u32(vmovl_high_u16(low));
    out[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(high)));
    out[3] = vcvtq_f32_u32(vmovl_high_u16(high));
}

/* 16 signed bytes -> 4 vectors of 4 floats, in order. */
static inline void s8_floats(int8x16_t bytes, float32x4_t *out) {
    const int16x8_t low = vmovl_s8(vget_low_s8(bytes)), high = vmovl_high_s8(bytes);
    out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(low)));
    out[1] = vcvtq_f32_s32(vmovl_high_s16(low));
    out[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(high)));
    out[3] = vcvtq_f32_s32(vmovl_high_s16(high));
}

/* y[r * n] = sum over blocks of (d q + m) . x_r, for r < rows. One row keeps four
 * accumulators (two up to 4 rows): on one, the chain of dependent FMAs bounds it. */
static inline __attribute__((always_inline)) void q4_rows_neon(
        const uint8_t *q, const float *d, const float *m, const float *x, int64_t blocks,
        int64_t k, int64_t rows, float *y, int64_t n) {
    const int chains = rows == 1 ? 4 : rows <= 4 ? 2 : 1;
    float32x4_t acc[ROW_TILE][4];
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        if (rows == 1 && b % 4 == 0) {        /* a line of codes per 4 blocks */
            prefetch_line(q + (b + Q4_PREFETCH_BLOCKS) * 16);
            if (b % 8 == 0) {
                prefetch_line(d + b + Q4_PREFETCH_BLOCKS);
                prefetch_line(m + b + Q4_PREFETCH_BLOCKS);
            }
        }
        const uint8x16_t bytes = vld1q_u8(q + b * 16);
        float32x4_t w[8];
        u8_floats(vandq_u8(bytes, vdupq_n_u8(0x0F)), w);
        u8_floats(vshrq_n_u8(bytes, 4), w + 4);
        const float32x4_t minimum = vdupq_n_f32(m[b]);
        for (int j = 0; j < 8; j++) w[j] = vfmaq_n_f32(minimum, w[j], d[b]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            for (int j = 0; j < 8; j++)
                acc[r][j % chains] = vfmaq_f32(acc[r][j % chains], w[j], vld1q_f32(xb + 4 * j));
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float32x4_t total = acc[r][0];
        for (int j = 1; j < chains; j++) total = vaddq_f32(total, acc[r][j]);
        y[r * n] = vaddvq_f32(total);
    }
}

/* y[r * n] = sum over blocks of d * (q . x_r) (halves: a scale per 16 weights), for
 * r < rows. */
static inline __attribute__((always_inline)) void q8_rows_neon(
        const int8_t *q, const float *d, const float *x, int64_t blocks, int64_t k,
        int64_t rows, float *y, int64_t n, int halves) {
    float32x4_t acc[ROW_TILE];
    for (int64_t r = 0; r < rows; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        if (rows == 1 && !halves && b % 2 == 0) {   /* a line of codes per 2 blocks */
            prefetch_line(q + (b + Q8_PREFETCH_BLOCKS) * BLOCK);
            if (b % 8 == 0) prefetch_line(d + b + Q8_PREFETCH_BLOCKS);
        }
        float32x4_t w[8];
        s8_floats(vld1q_s8(q + b * BLOCK), w);
        s8_floats(vld1q_s8(q + b * BLOCK + 16), w + 4);
        const float first_scale = halves ? d[2 * b] : d[b];
        const float second_scale = halves ? d[2 * b + 1] : d[b];
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            float32x4_t half[2];                       /* elements 0-15, 16-31 */
            for (int h = 0; h < 2; h++) {
                const float32x4_t *wh = w + 4 * h;
                const float *xh = xb + 16 * h;
                float32x4_t even = vmulq_f32(wh[0], vld1q_f32(xh));
                float32x4_t odd = vmulq_f32(wh[1], vld1q_f32(xh + 4));
                even = vfmaq_f32(even, wh[2], vld1q_f32(xh + 8));
                odd = vfmaq_f32(odd, wh[3], vld1q_f32(xh + 12));
                half[h] = vaddq_f32(even, odd);
            }
            if (halves) {
                acc[r] = vfmaq_n_f32(acc[r], half[0], first_scale);
                acc[r] = vfmaq_n_f32(acc[r], half[1], second_scale);
            } else {
                acc[r] = vfmaq_n_f32(acc[r], vaddq_f32(half[0], half[1]), first_scale);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) y[r * n] = vaddvq_f32(acc[r]);
}

#endif
