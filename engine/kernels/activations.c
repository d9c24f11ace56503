/* The gated MLP's activation as a pass of its own (steps too large for the block
 * kernels' fused sweep, weights of mixed kinds): out[t, i] = act(gate[t, i]) * up[t, i]
 * with act SiLU, g / (1 + e^-g), or GELU's tanh form (Gemma's), where gate_up [T, 2I]
 * holds the fused projection's output (gate columns first). In and out are
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
    int bf16, gelu;
} GatedActivationJob;

static float silu_times(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

/* gelu_tanh_times16's formula: g / (1 + e^-2u), u = sqrt(2 / pi) (g + 0.044715 g^3). */
static float gelu_tanh_times(float gate, float up) {
    const float twice_u = gate * (gate * gate * (2.0f * 0.7978845608028654f * 0.044715f)
                                  + 2.0f * 0.7978845608028654f);
    return gate / (1.0f + expf(-twice_u)) * up;
}

static float activated(int gelu, float gate, float up) {
    return gelu ? gelu_tanh_times(gate, up) : silu_times(gate, up);
}

#ifdef __AVX512F__
static __m512 activated16(int gelu, __m512 gate, __m512 up) {
    return gelu ? gelu_tanh_times16(gate, up) : silu_times16(gate, up);
}
#elif defined(__AVX2__) && defined(__FMA__)
static __m256 activated8(int gelu, __m256 gate, __m256 up) {
    return gelu ? gelu_tanh_times8(gate, up) : silu_times8(gate, up);
}
#endif

static void activation_row_f32(int gelu, const float *gate, const float *up, float *out,
                               int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, activated16(gelu, _mm512_loadu_ps(gate + i),
                                              _mm512_loadu_ps(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, activated8(gelu, _mm256_loadu_ps(gate + i),
                                             _mm256_loadu_ps(up + i)));
#endif
    for (; i < n; i++) out[i] = activated(gelu, gate[i], up[i]);
}

static void activation_row_bf16(int gelu, const uint16_t *gate, const uint16_t *up,
                                uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        store_bf16x16(out + i, activated16(gelu, load_bf16x16(gate + i), load_bf16x16(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        store_bf16x8(out + i, activated8(gelu, load_bf16x8(gate + i), load_bf16x8(up + i)));
#endif
    for (; i < n; i++)
        out[i] = float_to_bf16(activated(gelu, bf16_to_float(gate[i]), bf16_to_float(up[i])));
}

static void gated_activation_part(const void *arg, int part, int parts) {
    const GatedActivationJob *job = arg;
    const int64_t inter = job->inter;
    for (int64_t t = job->tokens * part / parts; t < job->tokens * (part + 1) / parts; t++) {
        if (job->bf16) {
            const uint16_t *row = (const uint16_t *)job->gate_up + t * 2 * inter;
            activation_row_bf16(job->gelu, row, row + inter, (uint16_t *)job->out + t * inter,
                                inter);
        } else {
            const float *row = (const float *)job->gate_up + t * 2 * inter;
            activation_row_f32(job->gelu, row, row + inter, (float *)job->out + t * inter, inter);
        }
    }
}

/* activation: ACTIVATION_SILU or ACTIVATION_GELU_TANH (1 for another). */
int gated_activation(const void *gate_up, int64_t tokens, int64_t inter, int bf16,
                     int activation, void *out, int num_threads) {
    if (activation != ACTIVATION_SILU && activation != ACTIVATION_GELU_TANH) return 1;
    if (tokens <= 0 || inter <= 0) return 0;
    GatedActivationJob job = {gate_up, out, tokens, inter, bf16,
                              activation == ACTIVATION_GELU_TANH};
    run_parallel(gated_activation_part, &job, num_threads);
    return 0;
}
