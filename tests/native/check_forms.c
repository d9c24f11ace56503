/* Test weights in the layouts block_gemm reads (engine/kernels/block_rows.h for the
 * fp32 kinds, block_int8.c's header for the int8-activation ones), and the float64
 * reference products they are checked against.
 *
 * Each weight is drawn as logical codes, one int per element, with a scale (and a
 * minimum) per 32 or, for the halves kinds, per 16 elements; the values w = d * c + m
 * come from those, and the codes are then laid out as the kind stores them:
 *   Q4            byte j of a block's 16: element j (low nibble), j + 16 (high)
 *   Q8, Q8_HALVES signed bytes (halves: Q6_K's q - 32, -32..31)
 *   Q5            codes 0..31 a byte each
 *   I8_*          groups of 16 columns: [group][block][vector t][lane j][4 bytes], the
 *                 4 bytes being dword t of column j's block bytes (I8_Q4: the Q4 bytes;
 *                 I8_U8: unsigned codes, from Q8_0 (q + 128, m = -128 d) or from Q5_1;
 *                 I8_U8_HALVES: Q8_HALVES' codes + 128, 96..159), and scales and
 *                 minima as [group][block][scale of the block][lane j].
 */
#include "check_forms.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define BLOCK 32
#define LANES 16

uint32_t next_random(uint32_t *state) {      /* xorshift32 */
    uint32_t s = *state;
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return *state = s;
}

float random_float(uint32_t *state, float low, float high) {
    return low + (high - low) * (float)(next_random(state) >> 8) / (float)(1 << 24);
}

static int is_int8_kind(int kind) {
    return kind >= BLOCKS_I8_Q4;
}

/* The block's bytes of column c as the fp32 kind stores them: Q4's nibble pairs, or
 * the codes as bytes. */
static void block_bytes(const int *codes, int nibbles, uint8_t *out) {
    if (nibbles)
        for (int j = 0; j < 16; j++) out[j] = (uint8_t)(codes[j] | codes[j + 16] << 4);
    else
        for (int j = 0; j < BLOCK; j++) out[j] = (uint8_t)codes[j];
}

int make_weight(int kind, int64_t n, int64_t k, uint32_t seed, TestWeight *out) {
    uint32_t state = seed * 2654435761u | 1u;
    const int nibbles = kind == BLOCKS_Q4 || kind == BLOCKS_I8_Q4;
    const int halves = kind == BLOCKS_Q8_HALVES || kind == BLOCKS_I8_U8_HALVES;
    const int from_q8 = kind == BLOCKS_I8_U8 && seed % 2 == 0;   /* else from Q5_1 */
    const int per_scale = halves ? 16 : BLOCK, bytes = nibbles ? 16 : BLOCK;
    const int64_t blocks = k / BLOCK, scales = k / per_scale;
    int low = 0, high = 15;
    if (kind == BLOCKS_Q8) low = -128, high = 127;
    if (kind == BLOCKS_Q8_HALVES) low = -32, high = 31;
    if (kind == BLOCKS_Q5 || (kind == BLOCKS_I8_U8 && !from_q8)) low = 0, high = 31;
    if (kind == BLOCKS_I8_U8 && from_q8) low = 0, high = 255;
    if (kind == BLOCKS_I8_U8_HALVES) low = 96, high = 159;
    /* minima: Q4, Q5 and the int8 forms (from Q8: -128 d, exactly the + 128 undone) */
    const int minima = kind == BLOCKS_Q4 || kind == BLOCKS_Q5 || is_int8_kind(kind);
    const int shifted = from_q8 || kind == BLOCKS_I8_U8_HALVES;

    memset(out, 0, sizeof *out);
    out->kind = kind, out->n = n, out->k = k;
    int *codes = malloc(sizeof(int) * (size_t)(n * k));
    out->q = malloc((size_t)(n * blocks * bytes));
    out->d = malloc(sizeof(float) * (size_t)(n * scales));
    out->m = minima ? malloc(sizeof(float) * (size_t)(n * scales)) : NULL;
    out->w = malloc(sizeof(double) * (size_t)(n * k));
    float *d = malloc(sizeof(float) * (size_t)(n * scales));
    float *m = malloc(sizeof(float) * (size_t)(n * scales));
    if (!codes || !out->q || !out->d || (minima && !out->m) || !out->w || !d || !m) {
        free(codes), free(d), free(m), free_weight(out);
        return 0;
    }
    for (int64_t i = 0; i < n * k; i++) {
        const int64_t block = i % k / BLOCK;
        codes[i] = block == 0 && blocks > 1 ? high
                 : block == 1 ? low
                 : low + (int)(next_random(&state) % (uint32_t)(high - low + 1));
    }
    for (int64_t i = 0; i < n * scales; i++) {
        d[i] = random_float(&state, 0.001f, 0.011f);
        m[i] = !minima ? 0.0f : shifted ? -128.0f * d[i] : -random_float(&state, 0.0f, 0.05f);
    }
    for (int64_t i = 0; i < n * k; i++)
        out->w[i] = (double)d[i / per_scale] * codes[i] + (double)m[i / per_scale];

    uint8_t *q = out->q;
    const int64_t per_block = BLOCK / per_scale, vectors = bytes / 4;
    for (int64_t c = 0; c < n; c++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t laid[BLOCK];
            block_bytes(codes + c * k + b * BLOCK, nibbles, laid);
            if (!is_int8_kind(kind)) {
                memcpy(q + (c * blocks + b) * bytes, laid, (size_t)bytes);
                continue;
            }
            const int64_t group = c / LANES, lane = c % LANES;
            for (int64_t t = 0; t < vectors; t++)
                memcpy(q + ((group * blocks + b) * vectors + t) * 4 * LANES + 4 * lane,
                       laid + 4 * t, 4);
        }
    for (int64_t c = 0; c < n; c++)
        for (int64_t s = 0; s < scales; s++) {
            int64_t at = c * scales + s;       /* the fp32 kinds: [n, scales] */
            if (is_int8_kind(kind))
                at = ((c / LANES * blocks + s / per_block) * per_block + s % per_block) * LANES
                     + c % LANES;
            out->d[at] = d[c * scales + s];
            if (minima) out->m[at] = m[c * scales + s];
        }
    free(codes), free(d), free(m);
    return 1;
}

void free_weight(TestWeight *weight) {
    free(weight->q), free(weight->d), free(weight->m), free(weight->w);
    memset(weight, 0, sizeof *weight);
}

void quantized_activations(const float *x, int64_t rows, int64_t k, double *out) {
    for (int64_t start = 0; start < rows * k; start += BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[start + i]));
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < BLOCK; i++)
            out[start + i] = (double)lrintf(x[start + i] * inverse) * (double)scale;
    }
}

void reference_product(const double *x, int64_t rows, const TestWeight *weight,
                       double *want, double *size) {
    const int64_t n = weight->n, k = weight->k;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            double total = 0.0, magnitude = 0.0;
            for (int64_t j = 0; j < k; j++) {
                const double term = x[r * k + j] * weight->w[c * k + j];
                total += term;
                magnitude += fabs(term);
            }
            want[r * n + c] = total;
            size[r * n + c] = magnitude;
        }
}
