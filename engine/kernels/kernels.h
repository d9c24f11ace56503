/* Functions one kernel file uses from another (all built into one library). */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

/* block_gemm.c: y[rows, n] = x[rows, k] @ W^T for W in Q4_1 blocks. */
int q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *d,
            const float *m, int64_t n, float *y, int num_threads);

/* paged_attention.c: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row. */
void rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps,
                   float *out);

/* attention_vectors.c: the AVX-512 passes of decode attention over one context range
 * (slots row[0 .. count)) of an fp32 or (kv_bf16) bf16 cache; attention_vectors_apply
 * says whether they serve head size `dim` on this build. */
int attention_vectors_apply(int64_t dim);
void attention_scores_vector(const float *q, const void *keys, int kv_bf16, const int64_t *row,
                             int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                             float scale, float *scores);
void attention_values_vector(const float *probs, const void *values, int kv_bf16,
                             const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                             int64_t dim, float *out, int64_t out_stride);

#endif
