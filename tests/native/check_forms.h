/* Test weights in every block_gemm kind's layout, and the float64 reference of their
 * products (check_forms.c), for check_kernels.c. */
#ifndef KVSERVE_CHECK_FORMS_H
#define KVSERVE_CHECK_FORMS_H

#include <stdint.h>

/* A weight [n, k] of one kind (kernels.h's BLOCKS_*), as block_gemm takes it: codes q,
 * scales d and minima m (NULL for the kinds without minima) in the kind's layout, and
 * the same weights as float64 values w [n, k], the kind's formula (d * c + m) applied. */
typedef struct {
    int kind;
    int64_t n, k;
    void *q;
    float *d, *m;
    double *w;
} TestWeight;

/* A deterministic generator: the same cases on every build and machine. */
uint32_t next_random(uint32_t *state);
float random_float(uint32_t *state, float low, float high);

/* Random weights of `kind` (n a multiple of 16 for the int8 kinds, k of 32): random
 * codes over the kind's whole range except a first block of the largest codes and a
 * second of the smallest, where k has them. Returns 0 when out of memory. */
int make_weight(int kind, int64_t n, int64_t k, uint32_t seed, TestWeight *out);
void free_weight(TestWeight *weight);

/* x [rows, k] as block_int8.c's kernels see it: quantized per block of 32 to int8
 * (absmax / 127, rounded to nearest even) and scaled back, in float64. */
void quantized_activations(const float *x, int64_t rows, int64_t k, double *out);

/* want[r, c] = sum_j x[r, j] w[c, j] and size[r, c] = sum_j |x[r, j] w[c, j]| (the
 * scale of fp32's rounding), x [rows, k] in float64. */
void reference_product(const double *x, int64_t rows, const TestWeight *weight,
                       double *want, double *size);

#endif
