/* The checks of check_kernels.c for bf16_gemm (bf16_gemm.c's layout) on every build
 * that has it: products of bf16 rows and weights against a float64 product of the same
 * bf16 values, fp32 and bf16 out, at row and column remainders of the tiles; and the
 * gated form (SiLU, GELU's tanh form) against the activation of those float64 sums. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_forms.h"
#include "check_library.h"

static uint16_t to_bf16(float value) {          /* round to nearest even, as the kernels */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static double from_bf16(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* w [n, k] bf16 -> pairs [ceil(n / 16)][k / 2][16] words (zero past n), the layout of
 * packed_linear.bf16_pairs; `gated`: rows reordered into alternating 16-row blocks of
 * gate (rows 0 .. n/2) and up (n/2 .. n), as gate_pairs does. */
static uint32_t *pack_pairs(const uint16_t *w, int64_t n, int64_t k, int gated) {
    const int64_t vectors = (n + 15) / 16;
    uint32_t *pairs = calloc((size_t)(vectors * k / 2 * 16), sizeof(uint32_t));
    if (!pairs) exit(2);
    for (int64_t v = 0; v < vectors; v++)
        for (int64_t c = 0; c < 16 && v * 16 + c < n; c++) {
            const int64_t source = gated ? (v % 2) * (n / 2) + (v / 2) * 16 + c : v * 16 + c;
            for (int64_t p = 0; p < k / 2; p++)
                pairs[(v * (k / 2) + p) * 16 + c] = w[source * k + 2 * p]
                                                    | (uint32_t)w[source * k + 2 * p + 1] << 16;
        }
    return pairs;
}

static void gemm_case(const Library *libraries, int count, int64_t rows, int64_t n, int64_t k,
                      int activation, uint32_t seed) {
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(rows * k));
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(n * k));
    double *want = malloc(sizeof(double) * (size_t)(rows * n));
    double *size = malloc(sizeof(double) * (size_t)(rows * n));
    float *y = malloc(sizeof(float) * (size_t)(rows * n));
    uint16_t *half = malloc(sizeof(uint16_t) * (size_t)(rows * n));
    if (!x || !w || !want || !size || !y || !half) exit(2);
    uint32_t state = seed | 1u;
    for (int64_t i = 0; i < rows * k; i++) x[i] = to_bf16(random_float(&state, -2.0f, 2.0f));
    for (int64_t i = 0; i < n * k; i++) w[i] = to_bf16(random_float(&state, -1.0f, 1.0f));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            double total = 0.0, magnitude = 0.0;
            for (int64_t i = 0; i < k; i++) {
                const double term = from_bf16(x[r * k + i]) * from_bf16(w[c * k + i]);
                total += term, magnitude += fabs(term);
            }
            want[r * n + c] = total, size[r * n + c] = magnitude;
        }
    uint32_t *pairs = pack_pairs(w, n, k, activation != 0);
    const int64_t inter = n / 2;
    char what[112];
    snprintf(what, sizeof what, "bf16_gemm rows %ld n %ld k %ld activation %d", (long)rows,
             (long)n, (long)k, activation);
    for (int l = 0; l < count; l++) {
        if (libraries[l].bf16_gemm_available() == BF16_GEMM_NONE) continue;
        int ok = 1;
        if (activation == 0) {
            ok &= libraries[l].bf16_gemm(x, k, pairs, rows, k, n, y, n, 0, 0, 2) == 0;
            ok &= libraries[l].bf16_gemm(x, k, pairs, rows, k, n, half, n, 1, 0, 2) == 0;
            for (int64_t i = 0; ok && i < rows * n; i++) {
                ok &= close_to(y[i], want[i], size[i], what, &libraries[l], !ok);
                ok &= close_to(from_bf16(half[i]), want[i],       /* + bf16's rounding */
                               size[i] + fabs(want[i]) / (128 * TOLERANCE), what,
                               &libraries[l], !ok);
            }
        } else {
            ok &= libraries[l].bf16_gated_gemm(x, k, pairs, rows, k, inter, half, inter,
                                               activation, 2) == 0;
            for (int64_t r = 0; ok && r < rows; r++)
                for (int64_t j = 0; ok && j < inter; j++) {
                    const double g = want[r * n + j], u = want[r * n + inter + j];
                    const double act = activation == ACTIVATION_SILU ? g / (1.0 + exp(-g))
                        : 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
                    const double bound = 1.2 * size[r * n + j] * fabs(u)
                                         + fabs(act) * size[r * n + inter + j];
                    ok &= close_to(from_bf16(half[r * inter + j]), act * u,
                                   bound + fabs(act * u) / (128 * TOLERANCE), what,
                                   &libraries[l], !ok);
                }
        }
        if (!ok) printf("MISMATCH %s [%s]\n", what, libraries[l].name);
        failures += !ok;
    }
    free(x), free(w), free(want), free(size), free(y), free(half), free(pairs);
}

void check_bf16_gemm(const Library *libraries, int count) {
    static const int64_t row_counts[] = {1, 3, 4, 5, 9, 17};
    uint32_t seed = 900;
    for (int ri = 0; ri < 6; ri++) {
        gemm_case(libraries, count, row_counts[ri], 17, 2, 0, seed++);
        gemm_case(libraries, count, row_counts[ri], 48, 64, 0, seed++);
        gemm_case(libraries, count, row_counts[ri], 100, 130, 0, seed++);
        gemm_case(libraries, count, row_counts[ri], 64, 96, ACTIVATION_SILU, seed++);
        gemm_case(libraries, count, row_counts[ri], 32, 64, ACTIVATION_GELU_TANH, seed++);
    }
}
