/* What the checks of check_kernels.c share: a loaded build of the kernel library, the
 * tally of checks and mismatches, and the tolerance of fp32 results. */
#ifndef KVSERVE_CHECK_LIBRARY_H
#define KVSERVE_CHECK_LIBRARY_H

#include "kernels.h"

/* fp32 results may differ from a float64 reference by this much of the sum of their
 * terms' sizes: the paths sum in different orders, while a wrong code, scale or lane
 * is off by far more. */
#define TOLERANCE 1e-5

/* One build of the library (NAME:PATH on the command line): its routines, and the
 * int8_path() it must report (-1: not checked). */
typedef struct {
    const char *name;
    int expected_int8;
    __typeof__(block_gemm) *block_gemm;
    __typeof__(blocks_gated_mlp) *blocks_gated_mlp;
    __typeof__(rms_norm) *rms_norm;
    __typeof__(argmax_rows) *argmax_rows;
    __typeof__(int8_path) *int8_path;
    __typeof__(block_gemm_lanes) *block_gemm_lanes;
    __typeof__(bf16_gemm_available) *bf16_gemm_available;
    __typeof__(bf16_gemm) *bf16_gemm;
    __typeof__(bf16_gated_gemm) *bf16_gated_gemm;
} Library;

extern int failures, checks;

/* Whether |got - want| <= TOLERANCE * size (+ 1e-7); prints the miss, naming the check
 * `what` and the library, unless one of this case was already `reported`. */
int close_to(double got, double want, double size, const char *what, const Library *library,
             int reported);

/* check_layer_ops.c: the checks of rms_norm, argmax_rows and blocks_gated_mlp over the
 * libraries, the first being the one the others are compared with. */
void check_rms_norm(const Library *libraries, int count);
void check_argmax(const Library *libraries, int count);
void check_gated_mlp(const Library *libraries, int count);

/* check_bf16_gemm.c: bf16_gemm and bf16_gated_gemm on the builds that have them. */
void check_bf16_gemm(const Library *libraries, int count);

#endif
