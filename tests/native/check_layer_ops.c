/* The checks of check_kernels.c for a decoder layer's other routines: rms_norm (fp32
 * and bf16 out), argmax_rows (ties, NaNs, infinities; exact) and blocks_gated_mlp (a
 * Q4 MLP's fused sweep and a mixed one's three passes), each against float64
 * references and against the first library. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_forms.h"
#include "check_library.h"

/* rms_norm of rows of n values (fp32 and bf16 out) against the float64 formula. */
void check_rms_norm(const Library *libraries, int count) {
    static const int64_t widths[] = {1, 7, 64, 100, 1000};
    uint32_t state = 99;
    for (int wi = 0; wi < 5; wi++) {
        const int64_t rows = 3, n = widths[wi];
        float *x = malloc(sizeof(float) * (size_t)(rows * n)), *w = malloc(sizeof(float) * n);
        float *out = malloc(sizeof(float) * (size_t)(rows * n));
        uint16_t *half = malloc(sizeof(uint16_t) * (size_t)(rows * n));
        if (!x || !w || !out || !half) exit(2);
        for (int64_t i = 0; i < rows * n; i++) x[i] = random_float(&state, -3.0f, 3.0f);
        for (int64_t i = 0; i < n; i++) w[i] = random_float(&state, 0.5f, 1.5f);
        char what[96];
        snprintf(what, sizeof what, "rms_norm n %ld", (long)n);
        for (int l = 0; l < count; l++) {
            libraries[l].rms_norm(x, rows, n, w, 1e-6f, out, 0, 2);
            libraries[l].rms_norm(x, rows, n, w, 1e-6f, half, 1, 2);
            int ok = 1;
            for (int64_t r = 0; r < rows; r++) {
                double squares = 0.0;
                for (int64_t i = 0; i < n; i++) squares += (double)x[r * n + i] * x[r * n + i];
                const double inverse = 1.0 / sqrt(squares / (double)n + 1e-6);
                for (int64_t i = 0; i < n; i++) {
                    const double want = x[r * n + i] * inverse * w[i];
                    ok &= close_to(out[r * n + i], want, fabs(want), what, &libraries[l], !ok);
                    /* bf16: 8 bits of mantissa, rounded to nearest */
                    const uint32_t bits = (uint32_t)half[r * n + i] << 16;
                    float rounded;
                    memcpy(&rounded, &bits, sizeof rounded);
                    ok &= close_to(rounded, want, fabs(want) / 256.0 / TOLERANCE, what,
                                   &libraries[l], !ok);
                }
            }
            failures += !ok;
        }
        free(x), free(w), free(out), free(half);
    }
}

/* The first index of the row's largest value, a NaN counting as the largest. */
static int64_t reference_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

/* argmax_rows over rows of random values with planted ties, NaNs and infinities. */
void check_argmax(const Library *libraries, int count) {
    static const int64_t widths[] = {1, 5, 16, 17, 1000, 4099};
    uint32_t state = 7;
    for (int wi = 0; wi < 6; wi++) {
        const int64_t rows = 9, n = widths[wi];
        float *x = malloc(sizeof(float) * (size_t)(rows * n));
        int64_t *got = malloc(sizeof(int64_t) * rows);
        if (!x || !got) exit(2);
        for (int64_t i = 0; i < rows * n; i++) x[i] = random_float(&state, -5.0f, 5.0f);
        float *row = x + n;                             /* row 1: a tie of the largest */
        row[n / 2] = row[n - 1] = 9.0f;
        row = x + 2 * n;                                /* row 2: a NaN after the peak */
        row[0] = 9.0f, row[n - 1] = NAN;
        row = x + 3 * n;                                /* row 3: all equal */
        for (int64_t i = 0; i < n; i++) row[i] = 1.0f;
        row = x + 4 * n;                                /* row 4: -inf but one +inf */
        for (int64_t i = 0; i < n; i++) row[i] = -INFINITY;
        row[n / 3] = INFINITY;
        row = x + 5 * n;                                /* row 5: all -inf */
        for (int64_t i = 0; i < n; i++) row[i] = -INFINITY;
        for (int l = 0; l < count; l++) {
            const int status = libraries[l].argmax_rows(x, rows, n, got, 2);
            for (int64_t r = 0; r < rows; r++) {
                checks++;
                const int64_t want = reference_argmax(x + r * n, n);
                if (status || got[r] != want) {
                    printf("MISMATCH argmax_rows n %ld row %ld [%s]: status %d, got %ld, "
                           "want %ld\n", (long)n, (long)r, libraries[l].name, status,
                           (long)got[r], (long)want);
                    failures++;
                    break;
                }
            }
        }
        free(x), free(got);
    }
}

static double activation_of(int activation, double gate) {
    if (activation == ACTIVATION_SILU) return gate / (1.0 + exp(-gate));
    return 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)));
}

/* One MLP case: y = down(act(gate) * up) for gate_up [2I, k] and down [n, I] of the
 * given kinds. The hidden values' own fp32 error (at most TOLERANCE of their sums'
 * sizes, through an activation of slope below 1.2) widens y's tolerance by its sum
 * through the down weights. */
static void mlp_case(const Library *libraries, int count, int gate_up_kind, int down_kind,
                     int activation, int64_t rows, int64_t k, int64_t inter, int64_t n,
                     uint32_t seed) {
    TestWeight gate_up, down;
    float *x = malloc(sizeof(float) * (size_t)(rows * k));
    double *x64 = malloc(sizeof(double) * (size_t)(rows * k));
    double *both = malloc(sizeof(double) * (size_t)(rows * 2 * inter));
    double *both_size = malloc(sizeof(double) * (size_t)(rows * 2 * inter));
    double *h = malloc(sizeof(double) * (size_t)(rows * inter));
    double *h_error = malloc(sizeof(double) * (size_t)(rows * inter));
    double *want = malloc(sizeof(double) * (size_t)(rows * n));
    double *size = malloc(sizeof(double) * (size_t)(rows * n));
    double *spread = malloc(sizeof(double) * (size_t)(rows * n));
    float *first = malloc(sizeof(float) * (size_t)(rows * n));
    float *y = malloc(sizeof(float) * (size_t)(rows * n));
    if (!x || !x64 || !both || !both_size || !h || !h_error || !want || !size || !spread
        || !first || !y || !make_weight(gate_up_kind, 2 * inter, k, seed, &gate_up)
        || !make_weight(down_kind, n, inter, seed + 1, &down))
        exit(2);
    uint32_t state = seed | 1u;
    for (int64_t i = 0; i < rows * k; i++) x64[i] = x[i] = random_float(&state, -1.0f, 1.0f);
    reference_product(x64, rows, &gate_up, both, both_size);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < inter; j++) {
            const double *row = both + r * 2 * inter, *row_size = both_size + r * 2 * inter;
            const double g = row[j], u = row[inter + j];
            h[r * inter + j] = activation_of(activation, g) * u;
            h_error[r * inter + j] = TOLERANCE * (1.2 * row_size[j] * fabs(u)
                                                  + fabs(activation_of(activation, g))
                                                    * row_size[inter + j]
                                                  + fabs(h[r * inter + j]));
        }
    reference_product(h, rows, &down, want, size);
    for (int64_t r = 0; r < rows; r++)             /* the hidden errors through |down| */
        for (int64_t c = 0; c < n; c++) {
            double total = 0.0;
            for (int64_t j = 0; j < inter; j++)
                total += h_error[r * inter + j] * fabs(down.w[c * inter + j]);
            spread[r * n + c] = total;
        }
    const BlockWeight gate_up_weight = {1, {{gate_up_kind, 2 * inter, gate_up.q, gate_up.d,
                                             gate_up.m}}};
    const BlockWeight down_weight = {1, {{down_kind, n, down.q, down.d, down.m}}};
    char what[128];
    snprintf(what, sizeof what, "blocks_gated_mlp kinds %d/%d activation %d rows %ld k %ld "
             "inter %ld n %ld", gate_up_kind, down_kind, activation, (long)rows, (long)k,
             (long)inter, (long)n);
    for (int l = 0; l < count; l++) {
        float *out = l == 0 ? first : y;
        const int status = libraries[l].blocks_gated_mlp(x, rows, k, &gate_up_weight, inter,
                                                         &down_weight, n, activation, out, 2);
        int ok = status == 0;
        if (!ok) printf("MISMATCH %s [%s]: status %d\n", what, libraries[l].name, status);
        for (int64_t i = 0; ok && i < rows * n; i++) {
            const double allowed = size[i] + spread[i] / TOLERANCE;
            ok &= close_to(out[i], want[i], allowed, what, &libraries[l], !ok);
            if (l > 0) ok &= close_to(out[i], first[i], 2 * allowed, what, &libraries[l], !ok);
        }
        failures += !ok;
    }
    free_weight(&gate_up), free_weight(&down);
    free(x), free(x64), free(both), free(both_size), free(h), free(h_error), free(want);
    free(size), free(spread), free(first), free(y);
}

void check_gated_mlp(const Library *libraries, int count) {
    static const int64_t row_counts[] = {1, 3, 9};
    uint32_t seed = 500;
    for (int ri = 0; ri < 3; ri++)
        for (int64_t inter = 32; inter <= 64; inter += 32) {
            mlp_case(libraries, count, BLOCKS_Q4, BLOCKS_Q4, ACTIVATION_SILU, row_counts[ri],
                     96, inter, 40, seed++);
            mlp_case(libraries, count, BLOCKS_Q8_HALVES, BLOCKS_Q5, ACTIVATION_GELU_TANH,
                     row_counts[ri], 64, inter, 16, seed++);
        }
}
