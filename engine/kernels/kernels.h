/* Functions one kernel file uses from another (all built into one library). */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

#include "block_types.h"   /* BLOCKS_* and GGUF_* codes, from block_types.py */

/* block_gemm.c: y[rows, n] (row stride ldy) = x[rows, k] @ W^T for W in blocks of
 * one kind (BLOCKS_*, block_types.py's KERNEL_FORMS); q4_gemm for Q4_1 blocks with
 * ldy = n. */
/* int8_path(): which loop multiplies int8 activations in this build (native.py's
 * INT8_PATHS). */
#define INT8_PORTABLE 0
#define INT8_AVX2 1
#define INT8_AVX_VNNI 2
#define INT8_AVX512_VNNI 3
#define INT8_NEON 4         /* AArch64: NEON's widening multiplies */
#define INT8_DOTPROD 5      /* AArch64 with the dotprod extension: sdot */
int int8_path(void);
int int8_block_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
                    const float *d, const float *m, int64_t n, float *y, int64_t ldy,
                    int num_threads);
int block_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
               const float *d, const float *m, int64_t n, float *y, int64_t ldy,
               int num_threads);
int block_gemm_lanes(void);
int q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *d,
            const float *m, int64_t n, float *y, int num_threads);

/* A weight [N, k] in blocks, as its parts in row order: a fused projection whose
 * pieces come in different kinds (a Q4_K_M file's Q4_K q and k beside a Q6_K v) has
 * one part per run of one kind; every other weight has one part. Part p holds rows
 * (output columns) [offset_p, offset_p + columns) with offset_p the columns of the
 * parts before it. m is NULL for the kinds without minima (Q8). */
#define MAX_WEIGHT_PARTS 4

/* The status of a call whose step names a cache slot outside the cache (the attention,
 * rope_store, the block stack's K/V stores): native.py's SLOT_OUTSIDE_CACHE. */
#define STATUS_SLOT_OUTSIDE_CACHE 9

/* Whether any of slots[0 .. count) lies outside [0, num_slots) (a negative one too). */
static inline int any_slot_outside(const int64_t *slots, int64_t count, int64_t num_slots) {
    int outside = 0;
    for (int64_t i = 0; i < count; i++) outside |= (uint64_t)slots[i] >= (uint64_t)num_slots;
    return outside;
}
typedef struct {
    int64_t kind;                    /* BLOCKS_* */
    int64_t columns;
    const void *q;
    const float *d, *m;
} BlockPart;

typedef struct {
    int64_t num_parts;
    BlockPart parts[MAX_WEIGHT_PARTS];
} BlockWeight;

/* A decoder layer's family traits, as the native layer paths read them: both
 * decode_layer.c's BlockStackLayer and decoder_stack.c's StackLayer begin with one.
 * Filled by models/layer_spec.py's native_traits from the family's LayerSpec. */
typedef struct {
    const float *input_norm, *post_norm;         /* [hidden]: before the attention, the MLP */
    float input_eps, post_eps;
    const float *qkv_bias;                       /* [(H + 2 KVH) D] added to qkv, or NULL */
    const float *q_norm, *k_norm;                /* [D] each: a norm per head, or NULL */
    float qk_eps;
    const float *attn_out_norm, *mlp_out_norm;   /* [hidden] on o's, down's output, or NULL */
    float out_eps;
    int group;                                   /* the attention group the layer reads */
} LayerTraits;

/* y[rows, N] (row stride ldy) = x[rows, k] @ W^T, each part's kernel writing its own
 * columns (block_gemm.c). */
int block_weight_gemm(const BlockWeight *w, const float *x, int64_t rows, int64_t k, float *y,
                      int64_t ldy, int num_threads);

/* block_mlp.c: y[rows, n] = down(silu(gate(x)) * up(x)) with gate_up [2I, k] (gate rows
 * first) and down [n, I] in Q4_1 blocks; blocks_gated_mlp for weights of any kinds and
 * either activation (ACTIVATION_SILU, ACTIVATION_GELU_TANH). */
int q4_gated_mlp(const float *x, int64_t rows, int64_t k, const uint8_t *gate_up_q,
                 const float *gate_up_d, const float *gate_up_m, int64_t intermediate,
                 const uint8_t *down_q, const float *down_d, const float *down_m, int64_t n,
                 float *y, int num_threads);
int blocks_gated_mlp(const float *x, int64_t rows, int64_t k, const BlockWeight *gate_up,
                     int64_t intermediate, const BlockWeight *down, int64_t n, int activation,
                     float *y, int num_threads);

/* layer_ops.c: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row (this thread);
 * RoPE on the q and k heads of qkv rows [first, last) and their k, v written to the
 * cache slots (see layer_ops.c). */
void rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps,
                   float *out);
void rope_store_rows(float *qkv, int64_t first, int64_t last, int64_t heads, int64_t kv_heads,
                     int64_t dim, const float *cos, const float *sin,
                     const int64_t *slot_mapping, void *keys, void *values, int kv_bf16);

/* Entry points called from Python (native.py), declared here so every definition is
 * checked against one prototype. */
int rms_norm(const float *x, int64_t rows, int64_t n, const float *weight, float eps,
             void *out, int bf16, int num_threads);
int rope_store(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
               const float *cos, const float *sin, const int64_t *slot_mapping,
               void *keys, void *values, int64_t num_slots, int kv_bf16, int num_threads);
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);
int rescore_head(const uint16_t *approx, const float *hidden, const float *weight,
                 int64_t rows, int64_t vocab, int64_t hidden_size, int64_t candidates,
                 float *logits, int num_threads);
int gated_activation(const void *gate_up, int64_t tokens, int64_t inter, int bf16,
                     int activation, void *out, int num_threads);

/* paged_attention.c: attention over the paged cache (see there). */
int paged_decode_attention(const float *q, int64_t q_stride, const void *keys,
                           const void *values, int kv_bf16, const int64_t *slots,
                           const int64_t *slot_rows, const int64_t *starts, int64_t num_rows,
                           int64_t num_slots, const int64_t *lengths, int64_t batch,
                           int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                           float scale, float *out, int num_threads);

/* prefill_attention.c: causal attention of one prefill chunk over a bf16 cache (see
 * there); prefill_attention_apply says whether this build serves head size `dim`. */
int prefill_attention_apply(int64_t dim);
int prefill_attention_bf16(const float *q, int64_t q_stride, const uint16_t *keys,
                           const uint16_t *values, const int64_t *slots, int64_t num_keys,
                           int64_t num_slots, int64_t first_key, int64_t start, int64_t n,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t window,
                           float scale, float *out, int64_t out_stride, int num_threads);
/* One chunk of prefill_attention_runs: n queries from q (q_stride floats apart), at
 * positions start .., over the num_keys slots of `slots` (positions first_key ..),
 * causal and, with window > 0, in a sliding window; outputs from out. */
typedef struct {
    const float *q;
    float *out;
    const int64_t *slots;
    int64_t num_keys, first_key, start, n, window;
} PrefillRun;
int prefill_attention_runs(const PrefillRun *runs, int64_t num_runs, int64_t q_stride,
                           int64_t out_stride, const uint16_t *keys, const uint16_t *values,
                           int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           int num_threads);

/* step_runs.c: a step's query rows (paged_decode_attention's arguments) cut into runs
 * of one prefill chunk's rows, PREFILL_RUN_MIN_ROWS or more, written to runs (at most
 * batch / PREFILL_RUN_MIN_ROWS); returns how many. The other rows' indices go to order,
 * in order, *rest of them. */
#define PREFILL_RUN_MIN_ROWS 8
int64_t find_prefill_runs(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                          const int64_t *slots, const int64_t *slot_rows,
                          const int64_t *starts, const int64_t *lengths, int64_t batch,
                          int64_t width, PrefillRun *runs, int64_t *order, int64_t *rest);

/* attention_vectors.c (AVX-512, or AVX2 and FMA): the vector
 * passes of decode attention over one context range (slots row[0 .. count)) of an
 * fp32 or (kv_bf16) bf16 cache; attention_vectors_apply says whether they serve head
 * size `dim` on this build. */
int attention_vectors_apply(int64_t dim);
void attention_scores_vector(const float *q, const void *keys, int kv_bf16, const int64_t *row,
                             int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                             float scale, float *scores);
void attention_values_vector(const float *probs, const void *values, int kv_bf16,
                             const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                             int64_t dim, float *out, int64_t out_stride);

/* bf16_gemm.c: y[m, n] = x[m, k] @ W^T, bf16 x and W (packed in pairs, see there),
 * fp32 or (y_bf16) bf16 y; bf16_gemm_available says how this build multiplies them:
 * BF16_GEMM_NONE (not at all: bf16_gemm returns 2), BF16_GEMM_DOT (AVX512-BF16 dot
 * products, AMX tiles where on) or BF16_GEMM_WIDEN (AVX2, NEON: fp32 FMAs on the pairs
 * widened in registers, bf16_tile_256.h and bf16_tile_neon.h). */
#define BF16_GEMM_NONE 0
#define BF16_GEMM_DOT 1
#define BF16_GEMM_WIDEN 2
int bf16_gemm_available(void);
int bf16_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m, int64_t k,
              int64_t n, void *y, int64_t y_stride, int y_bf16, int64_t gated_inter,
              int num_threads);
#define ACTIVATION_SILU 1
#define ACTIVATION_GELU_TANH 2
int bf16_gated_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m,
                    int64_t k, int64_t inter, uint16_t *y, int64_t y_stride, int activation,
                    int num_threads);

/* bf16_amx.c: bf16_gemm's products on AMX tiles where the CPU has them;
 * bf16_amx_enable(1) asks Linux for the tiles (once per process) and returns whether
 * they serve, bf16_amx_enable(0) turns them off. */
int bf16_amx_enable(int wanted);
int bf16_amx_on(void);
void bf16_amx_begin(void);
void bf16_amx_end(void);
typedef struct {
    const uint16_t *x;       /* 16 rows of bf16 */
    int64_t stride;          /* elements from one row to the next */
    int64_t chunk_step;      /* elements from one 32 values of K to the next */
} BlockRows;
void bf16_amx_panel(const BlockRows *rows, int blocks, const uint32_t *w,
                    int64_t vector_words, int width, int64_t k, float *c,
                    const uint32_t *ahead);

/* attention_bf16.c: the same passes over a bf16 cache with AVX512-BF16 dot products,
 * for head sizes attention_bf16_apply accepts on this build; words: scratch of
 * heads * (count + 1) 32-bit words. */
int attention_bf16_apply(int64_t dim);
void attention_scores_bf16(const float *q, const uint16_t *keys, const uint16_t *values,
                           const int64_t *row, int64_t count, int64_t heads, int64_t kv_heads,
                           int64_t dim, float scale, float *scores);
void attention_values_bf16(const float *probs, const uint16_t *values, const int64_t *row,
                           int64_t count, int64_t heads, int64_t kv_heads, int64_t dim,
                           uint32_t *words, float *out, int64_t out_stride);

#endif
