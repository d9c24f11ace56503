/* bf16_gemm's tile on AArch64's NEON (no bf16 dot products assumed): included by
 * bf16_gemm.c, which owns the job, the packed layout and the threads. The same
 * widening as bf16_tile_256.h's on 4-lane registers:
 *
 * a pair's word shifted left by 16 is W[c][2p] as an fp32, masked to its high half
 * W[c][2p + 1] (both exact); x is widened once per call (GemmJob.wide), and each
 * row's pair (x[2p], x[2p + 1]) is one 64-bit load whose two lanes the FMAs take by
 * index (vfmaq_lane_f32), so no broadcast is spent. A tile is ROWS rows x 16 columns:
 * 16 accumulators, 8 widened weight vectors and ROWS pair registers, 28 of the 32
 * vector registers.
 *
 * The fused activation and the bf16 rounding are the scalar C of vector_math.h: per
 * output value, not per product, so they cost little beside the products. */
#ifndef KVSERVE_BF16_TILE_NEON_H
#define KVSERVE_BF16_TILE_NEON_H

#include <arm_neon.h>
#include <math.h>

#define ROWS 4

/* sums[r][0 .. 16) = rows row + r of x times the 16 columns of vector `vector`;
 * `next` (or NULL): the same vector of the next panel, prefetched. */
static inline void tile_vector(const GemmJob *job, int64_t row, int64_t rows, int64_t vector,
                               const uint32_t *next, float sums[ROWS][16]) {
    const int64_t pairs = job->k / 2;
    const uint32_t *w = job->w + vector * pairs * 16;
    const float *x[ROWS];
    wide_rows(job, row, rows, ROWS, x);
    const uint32x4_t high_half = vdupq_n_u32(0xffff0000u);
    float32x4_t acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = vdupq_n_f32(0.0f);
    for (int64_t p = 0; p < pairs; p++) {
        float32x4_t even[4], odd[4];
        for (int c = 0; c < 4; c++) {
            const uint32x4_t words = vld1q_u32(w + p * 16 + 4 * c);
            even[c] = vreinterpretq_f32_u32(vshlq_n_u32(words, 16));
            odd[c] = vreinterpretq_f32_u32(vandq_u32(words, high_half));
        }
        if (next) __builtin_prefetch(next + p * 16, 0, 2);
        for (int r = 0; r < ROWS; r++) {
            const float32x2_t pair = vld1_f32(x[r] + 2 * p);
            for (int c = 0; c < 4; c++)
                acc[r][c] = vfmaq_lane_f32(vfmaq_lane_f32(acc[r][c], even[c], pair, 0),
                                           odd[c], pair, 1);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) vst1q_f32(sums[r] + 4 * c, acc[r][c]);
}

/* One row's 16 sums into y at `column` (fp32, or bf16 rounded to nearest even). */
static inline void store_sums(const GemmJob *job, int64_t row, int64_t column,
                              const float *sums) {
    const int64_t left = job->gated_inter ? 16 : job->n - column;
    const int64_t count = left >= 16 ? 16 : left;
    if (job->y_bf16) {
        uint16_t *out = (uint16_t *)job->y + row * job->y_stride + column;
        for (int64_t c = 0; c < count; c++) out[c] = float_to_bf16(sums[c]);
    } else {
        memcpy((float *)job->y + row * job->y_stride + column, sums,
               (size_t)count * sizeof(float));
    }
}

/* act(gate) * up of one row into y (bf16), as bf16_tile_256.h's (SiLU, or GELU's tanh
 * form: gate / (1 + e^(-2u)) with u = sqrt(2 / pi) (gate + 0.044715 gate^3)). */
static inline void store_fused_sums(const GemmJob *job, int64_t row, int64_t vector,
                                    const float *gate, const float *up) {
    uint16_t *out = (uint16_t *)job->y + row * job->y_stride + (vector / 2) * 16;
    for (int c = 0; c < 16; c++) {
        const float g = gate[c];
        const float twice_u = job->fused == ACTIVATION_GELU_TANH
            ? 2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g) : g;
        out[c] = float_to_bf16(g / (1.0f + expf(-twice_u)) * up[c]);
    }
}

/* x [m, k] bf16 (rows x_stride apart) -> fp32 [m, k] contiguous, or NULL when out of
 * memory. */
static float *widen_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    float *wide = malloc((size_t)(m * k) * sizeof(float));
    if (!wide) return NULL;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) wide[r * k + i] = bf16_to_float(x[r * x_stride + i]);
    return wide;
}

#endif
