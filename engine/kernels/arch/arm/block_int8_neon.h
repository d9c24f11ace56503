/* The int8-activation group tile on AArch64 (block_int8.c's INT8_NEON and
 * INT8_DOTPROD paths; included there after Int8Job, whose layout it reads).
 *
 * A NEON vector is 128 bits: four 32-bit lanes, so a group's 16 columns are four
 * quarters, quarter h being bytes 16h..16h+15 of each 64-byte vector of the repacked
 * layout (block_int8.c's header): lane j of it holds dword t of column 4h + j. As on
 * x86, lane j accumulates column 4h + j and x's dword t is the same for every lane.
 *
 * AArch64 has signed x signed (`sdot`) and unsigned x unsigned (`udot`) byte dot
 * products but, before the i8mm extension, no unsigned x signed one. The weights are
 * therefore made signed: Q4 nibbles (0..15) as they are, the unsigned byte forms
 * shifted to c - 128 (c ^ 0x80, exact for every code 0..255), with 128 * sum(x) added
 * back per half block from the quantized rows' code sums. The integers are those of the
 * portable loop, for any codes (not only Q6_K's range in the halves form).
 *
 * With the dotprod extension `sdot` sums 4 byte products into each 32-bit lane, x's
 * dword t picked by lane index, no broadcast. Plain NEON multiplies 8 byte pairs into
 * int16 (`smull`), adds a second dword's products (`smlal`: two products of at most
 * 128 * 127 stay under 2^15) and widens by pairwise adds into int32 (`sadalp`); the
 * pairs of a column sit in adjacent lanes, folded by one last pairwise add (`addp`).
 */
#ifndef KVSERVE_BLOCK_INT8_NEON_H
#define KVSERVE_BLOCK_INT8_NEON_H

#include <arm_neon.h>
#include <string.h>

#define QUARTERS_PER_GROUP 4     /* 4 columns per 128-bit vector */

/* One block's weights of quarter h as signed bytes: w[t] pairs with x's dword t
 * (t < 4: elements 0-15, t >= 4: elements 16-31). */
static inline __attribute__((always_inline)) void load_quarter_neon(
        const uint8_t *qb, int h, int nibbles, int8x16_t *w) {
    if (nibbles) {
        for (int t = 0; t < 4; t++) {
            const uint8x16_t v = vld1q_u8(qb + 64 * t + 16 * h);
            w[t] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
            w[4 + t] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        }
        return;
    }
    for (int t = 0; t < 8; t++)
        w[t] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(qb + 64 * t + 16 * h), vdupq_n_u8(0x80)));
}

/* start + the sums of w[0..3]'s bytes times x's 16 bytes xq (dword t against w[t]),
 * one column per lane. */
static inline __attribute__((always_inline)) int32x4_t dot_quarter_neon(
        const int8x16_t *w, const int8_t *xq, int32x4_t start) {
#if defined(__ARM_FEATURE_DOTPROD)
    const int8x16_t x = vld1q_s8(xq);
    start = vdotq_laneq_s32(start, w[0], x, 0);   /* the lane index must be a constant */
    start = vdotq_laneq_s32(start, w[1], x, 1);
    start = vdotq_laneq_s32(start, w[2], x, 2);
    return vdotq_laneq_s32(start, w[3], x, 3);
#else
    int32x4_t pairs[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};  /* columns 0-1, 2-3 */
    for (int t = 0; t < 4; t += 2) {
        int32_t words[2];
        memcpy(words, xq + 4 * t, sizeof words);
        const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(words[0]));
        const int8x16_t x1 = vreinterpretq_s8_s32(vdupq_n_s32(words[1]));
        /* bytes 0-7 of a vector are columns 0 and 1, bytes 8-15 columns 2 and 3 */
        int16x8_t low = vmull_s8(vget_low_s8(w[t]), vget_low_s8(x0));
        int16x8_t high = vmull_high_s8(w[t], x0);
        low = vmlal_s8(low, vget_low_s8(w[t + 1]), vget_low_s8(x1));
        high = vmlal_high_s8(high, w[t + 1], x1);
        pairs[0] = vpadalq_s16(pairs[0], low);      /* lanes: 2 per column, in order */
        pairs[1] = vpadalq_s16(pairs[1], high);
    }
    return vaddq_s32(start, vpaddq_s32(pairs[0], pairs[1]));
#endif
}

/* One group of 16 columns against `tile` rows (from row r0), all blocks: each
 * quarter's weights are loaded once per block for the tile's rows. */
static void group_tile_neon(const Int8Job *job, int64_t group, int64_t r0, int tile) {
    const GroupView view = group_view(job, group);
    const int64_t blocks = view.blocks, k = job->k, block_bytes = view.block_bytes;
    const int64_t groups_per_block = view.scales_per_block;
    const int halves = view.halves, nibbles = view.nibbles;
    const uint8_t *q = view.q;
    const float *d = view.d, *m = view.m;
    const QuantizedRows *x = job->x;
    float32x4_t acc[INT8_ROW_TILE][QUARTERS_PER_GROUP];
    for (int r = 0; r < tile; r++)
        for (int h = 0; h < QUARTERS_PER_GROUP; h++) acc[r][h] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * block_bytes;
        __builtin_prefetch(qb + 8 * block_bytes, 0, 3);
        __builtin_prefetch(qb + 8 * block_bytes + 64, 0, 3);
        const float *db = d + b * groups_per_block * GROUP, *mb = m + b * groups_per_block * GROUP;
        for (int h = 0; h < QUARTERS_PER_GROUP; h++) {
            int8x16_t w[8];
            load_quarter_neon(qb, h, nibbles, w);
            const float32x4_t d0 = vld1q_f32(db + 4 * h), m0 = vld1q_f32(mb + 4 * h);
            for (int r = 0; r < tile; r++) {
                const int64_t row = r0 + r;
                const int8_t *xq = x->codes + row * k + b * BLOCK;
                const int32_t *code_sums = x->code_sums16 + row * 2 * blocks + 2 * b;
                /* the shifted byte forms' 128 * sum(x), per half block */
                const int32x4_t low = dot_quarter_neon(
                    w, xq, vdupq_n_s32(nibbles ? 0 : 128 * code_sums[0]));
                const int32x4_t high = dot_quarter_neon(
                    w + 4, xq + 16, vdupq_n_s32(nibbles ? 0 : 128 * code_sums[1]));
                const float scale = x->scales[row * blocks + b];
                if (halves) {
                    const float32x4_t d1 = vld1q_f32(db + GROUP + 4 * h);
                    const float32x4_t m1 = vld1q_f32(mb + GROUP + 4 * h);
                    const float *sums = x->sums16 + row * 2 * blocks + 2 * b;
                    float32x4_t a = vfmaq_f32(acc[r][h], vcvtq_f32_s32(low),
                                              vmulq_n_f32(d0, scale));
                    a = vfmaq_n_f32(a, m0, sums[0]);
                    a = vfmaq_f32(a, vcvtq_f32_s32(high), vmulq_n_f32(d1, scale));
                    acc[r][h] = vfmaq_n_f32(a, m1, sums[1]);
                } else {
                    const float32x4_t a = vfmaq_f32(acc[r][h],
                                                    vcvtq_f32_s32(vaddq_s32(low, high)),
                                                    vmulq_n_f32(d0, scale));
                    acc[r][h] = vfmaq_n_f32(a, m0, x->sums32[row * blocks + b]);
                }
            }
        }
    }
    for (int r = 0; r < tile; r++)
        for (int h = 0; h < QUARTERS_PER_GROUP; h++)
            vst1q_f32(job->y + (r0 + r) * job->ldy + group * GROUP + 4 * h, acc[r][h]);
}

#endif
