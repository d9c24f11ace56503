/* Checks builds of the kernel library against float64 references and against each
 * other: usage `check_kernels NAME:LIBRARY[:INT8_PATH] ...`, the first library being
 * the one the others are compared with (on AArch64: the generic level's plain C, then
 * the neon and dotprod levels; tests/native/run_arm_checks.py builds and runs them).
 *
 * Here: block_gemm for every kind of kernels.h (check_forms.c's weights) over row
 * counts that leave partial row tiles, columns of whole and partial groups and short
 * and long rows, with a row stride past n whose gap must stay untouched; and
 * int8_path() where a code is given. check_layer_ops.c: rms_norm, argmax_rows and
 * blocks_gated_mlp. fp32 results may differ by TOLERANCE of the sum of their terms'
 * sizes (check_library.h), argmax not at all.
 * Exits 1 on any mismatch, naming the routine, library and case; 2 on bad usage.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_forms.h"
#include "check_library.h"

#define MAX_LIBRARIES 8

int failures, checks;

static const char *const KIND_NAMES[] = {"", "Q4", "Q8", "Q8_HALVES", "Q5", "I8_Q4", "I8_U8",
                                         "I8_U8_HALVES"};

static void *symbol(void *handle, const char *path, const char *name) {
    void *found = dlsym(handle, name);
    if (!found) {
        fprintf(stderr, "%s: no symbol %s\n", path, name);
        exit(2);
    }
    return found;
}

/* NAME:PATH[:INT8_PATH] -> the library's routines. */
static void open_library(char *spec, Library *library) {
    char *path = strchr(spec, ':');
    if (!path) {
        fprintf(stderr, "expected NAME:LIBRARY[:INT8_PATH], got %s\n", spec);
        exit(2);
    }
    *path++ = '\0';
    char *code = strchr(path, ':');
    if (code) *code++ = '\0';
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    library->name = spec;
    library->expected_int8 = code ? atoi(code) : -1;
    *(void **)&library->block_gemm = symbol(handle, path, "block_gemm");
    *(void **)&library->blocks_gated_mlp = symbol(handle, path, "blocks_gated_mlp");
    *(void **)&library->rms_norm = symbol(handle, path, "rms_norm");
    *(void **)&library->argmax_rows = symbol(handle, path, "argmax_rows");
    *(void **)&library->int8_path = symbol(handle, path, "int8_path");
    *(void **)&library->block_gemm_lanes = symbol(handle, path, "block_gemm_lanes");
    *(void **)&library->bf16_gemm_available = symbol(handle, path, "bf16_gemm_available");
    *(void **)&library->bf16_gemm = symbol(handle, path, "bf16_gemm");
    *(void **)&library->bf16_gated_gemm = symbol(handle, path, "bf16_gated_gemm");
}

int close_to(double got, double want, double size, const char *what, const Library *library,
             int reported) {
    checks++;
    if (fabs(got - want) <= TOLERANCE * size + 1e-7) return 1;
    if (!reported)
        printf("MISMATCH %s [%s]: got %.9g, want %.9g (size %.3g)\n", what, library->name, got,
               want, size);
    return 0;
}

/* x [rows, k] in -1..1, with a block of zeros (a quantization scale of 0), a block of
 * one sign and a block 100 times larger than the rest. */
static void random_activations(uint32_t seed, int64_t rows, int64_t k, float *x) {
    uint32_t state = seed * 40503u | 1u;
    for (int64_t i = 0; i < rows * k; i++) x[i] = random_float(&state, -1.0f, 1.0f);
    for (int i = 0; i < 32; i++) x[i] = 0.0f;
    for (int64_t i = (rows - 1) * k; i < (rows - 1) * k + 32; i++) x[i] = -fabsf(x[i]) - 0.5f;
    if (k >= 64)
        for (int64_t i = k - 32; i < k; i++) x[i] *= 100.0f;
}

/* One block_gemm case on every library: y[rows, n] (row stride n + 3) against the
 * reference and against the first library's y. */
static void gemm_case(const Library *libraries, int count, int kind, int64_t rows, int64_t n,
                      int64_t k, uint32_t seed) {
    const int64_t ldy = n + 3;
    TestWeight weight;
    float *x = malloc(sizeof(float) * (size_t)(rows * k));
    double *x64 = malloc(sizeof(double) * (size_t)(rows * k));
    double *want = malloc(sizeof(double) * (size_t)(rows * n));
    double *size = malloc(sizeof(double) * (size_t)(rows * n));
    float *first = malloc(sizeof(float) * (size_t)(rows * ldy));
    float *y = malloc(sizeof(float) * (size_t)(rows * ldy));
    if (!x || !x64 || !want || !size || !first || !y || !make_weight(kind, n, k, seed, &weight)) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    random_activations(seed, rows, k, x);
    if (kind >= BLOCKS_I8_Q4) {
        quantized_activations(x, rows, k, x64);
    } else {
        for (int64_t i = 0; i < rows * k; i++) x64[i] = x[i];
    }
    reference_product(x64, rows, &weight, want, size);
    char what[160];
    snprintf(what, sizeof what, "block_gemm kind %s rows %ld n %ld k %ld", KIND_NAMES[kind],
             (long)rows, (long)n, (long)k);
    for (int l = 0; l < count; l++) {
        float *out = l == 0 ? first : y;
        for (int64_t i = 0; i < rows * ldy; i++) out[i] = NAN;
        const int status = libraries[l].block_gemm(kind, x, rows, k, weight.q, weight.d,
                                                   weight.m, n, out, ldy, 1 + (int)(seed % 2));
        int ok = status == 0;
        if (!ok) printf("MISMATCH %s [%s]: status %d\n", what, libraries[l].name, status);
        for (int64_t r = 0; ok && r < rows; r++) {
            for (int64_t c = 0; c < n; c++) {
                const double got = out[r * ldy + c], s = size[r * n + c];
                ok &= close_to(got, want[r * n + c], s, what, &libraries[l], !ok);
                if (l > 0) ok &= close_to(got, first[r * ldy + c], s, what, &libraries[l], !ok);
            }
            for (int64_t c = n; c < ldy && ok; c++)
                if (!isnan(out[r * ldy + c])) {
                    printf("MISMATCH %s [%s]: wrote y[%ld, %ld] past n\n", what,
                           libraries[l].name, (long)r, (long)c);
                    ok = 0;
                }
        }
        failures += !ok;
    }
    free_weight(&weight);
    free(x), free(x64), free(want), free(size), free(first), free(y);
}

static void check_block_gemm(const Library *libraries, int count) {
    static const int64_t row_counts[] = {1, 3, 8, 9, 17};
    static const int64_t column_counts[] = {16, 48, 5, 33};   /* the last two: fp32 kinds */
    static const int64_t lengths[] = {32, 96, 256};
    uint32_t seed = 1;
    for (int kind = BLOCKS_Q4; kind <= BLOCKS_I8_U8_HALVES; kind++)
        for (int ri = 0; ri < 5; ri++)
            for (int ni = 0; ni < (kind >= BLOCKS_I8_Q4 ? 2 : 4); ni++)
                for (int ki = 0; ki < 3; ki++)
                    gemm_case(libraries, count, kind, row_counts[ri], column_counts[ni],
                              lengths[ki], seed++);
}

int main(int argc, char **argv) {
    Library libraries[MAX_LIBRARIES];
    const int count = argc - 1;
    if (count < 1 || count > MAX_LIBRARIES) {
        fprintf(stderr, "usage: %s NAME:LIBRARY[:INT8_PATH] ... (1 to %d; the first is the "
                "reference build)\n", argv[0], MAX_LIBRARIES);
        return 2;
    }
    for (int l = 0; l < count; l++) {
        open_library(argv[l + 1], &libraries[l]);
        const int path = libraries[l].int8_path();
        printf("%s: int8_path %d, block_gemm_lanes %d, bf16_gemm %d\n", libraries[l].name,
               path, libraries[l].block_gemm_lanes(), libraries[l].bf16_gemm_available());
        if (libraries[l].expected_int8 >= 0 && path != libraries[l].expected_int8) {
            printf("MISMATCH int8_path [%s]: %d, want %d\n", libraries[l].name, path,
                   libraries[l].expected_int8);
            failures++;
        }
    }
    check_block_gemm(libraries, count);
    check_rms_norm(libraries, count);
    check_argmax(libraries, count);
    check_gated_mlp(libraries, count);
    check_bf16_gemm(libraries, count);
    printf("%d values checked on %d libraries: %s\n", checks, count,
           failures ? "MISMATCHES" : "all match");
    return failures ? 1 : 0;
}
