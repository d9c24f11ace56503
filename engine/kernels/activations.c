/* The gated MLP's activation for steps too large for the block kernels:
 * out[t, i] = silu(gate[t, i]) * up[t, i], silu(g) = g / (1 + e^-g), where gate_up
 * [T, 2I] holds the fused projection's output (gate columns first). In and out are
 * both fp32 or both bf16; the arithmetic is fp32 and a bf16 result is rounded once
 * (to nearest even, as torch rounds). One pass over the data instead of torch's
 * silu, multiply and two dtype casts, each a pass over [T, I] or [T, 2I]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

typedef struct {
    const void *gate_up;
    void *out;
    int64_t tokens, inter;
    int bf16;
} SiluMulJob;

static float silu_times(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }


static void silu_mul_row_f32(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, silu_times16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_times8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
#endif
    for (; i < n; i++) out[i] = silu_times(gate[i], up[i]);
}

static void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        store_bf16x16(out + i, silu_times16(load_bf16x16(gate + i), load_bf16x16(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        store_bf16x8(out + i, silu_times8(load_bf16x8(gate + i), load_bf16x8(up + i)));
#endif
    for (; i < n; i++)
        out[i] = float_to_bf16(silu_times(bf16_to_float(gate[i]), bf16_to_float(up[i])));
}

static void silu_mul_part(const void *arg, int part, int parts) {
    const SiluMulJob *job = arg;
    const int64_t inter = job->inter;
    for (int64_t t = job->tokens * part / parts; t < job->tokens * (part + 1) / parts; t++) {
        if (job->bf16) {
            const uint16_t *row = (const uint16_t *)job->gate_up + t * 2 * inter;
            silu_mul_row_bf16(row, row + inter, (uint16_t *)job->out + t * inter, inter);
        } else {
            const float *row = (const float *)job->gate_up + t * 2 * inter;
            silu_mul_row_f32(row, row + inter, (float *)job->out + t * inter, inter);
        }
    }
}

int silu_mul(const void *gate_up, int64_t tokens, int64_t inter, int bf16, void *out,
             int num_threads) {
    if (tokens <= 0 || inter <= 0) return 0;
    SiluMulJob job = {gate_up, out, tokens, inter, bf16};
    run_parallel(silu_mul_part, &job, num_threads);
    return 0;
}
