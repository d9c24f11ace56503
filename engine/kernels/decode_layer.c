/* The two halves of a Llama decoder layer for a decode step on Q4_1 blocks, each one
 * native call (models/fast_decode.py): the attention half (RMSNorm, qkv projection,
 * RoPE and the cache write, paged attention, o projection, residual) and the MLP half
 * (RMSNorm, gated MLP, residual). They chain the kernels of block_gemm.c,
 * layer_ops.c and paged_attention.c in the modules' order. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* y = x + o_proj(attention(rope(qkv_proj(rms_norm(x))))) for `tokens` decode requests,
 * writing each token's new K/V to its cache slot first. x, y [tokens, hidden];
 * cos, sin [tokens, dim]; the decode context as in paged_decode_attention. */
int q4_attention_block(const float *x, int64_t tokens, int64_t hidden, const float *norm_weight,
                       float eps, const uint8_t *qkv_q, const float *qkv_d, const float *qkv_m,
                       const float *cos, const float *sin, const int64_t *slot_mapping,
                       void *keys, void *values, int kv_bf16, const int64_t *slots,
                       const int64_t *lengths, int64_t width, int64_t heads, int64_t kv_heads,
                       int64_t dim, float scale, const uint8_t *o_q, const float *o_d,
                       const float *o_m, float *y, int num_threads) {
    if (tokens <= 0) return 0;
    const int64_t width_qkv = (heads + 2 * kv_heads) * dim;
    float *h = malloc(sizeof(float) * tokens * hidden);
    float *qkv = malloc(sizeof(float) * tokens * width_qkv);
    float *context = malloc(sizeof(float) * tokens * heads * dim);
    int status = 2;
    if (h && qkv && context) {
        rms_norm_rows(x, tokens, hidden, norm_weight, eps, h);
        status = q4_gemm(h, tokens, hidden, qkv_q, qkv_d, qkv_m, width_qkv, qkv, num_threads);
        if (!status)
            rope_store_rows(qkv, 0, tokens, heads, kv_heads, dim, cos, sin, slot_mapping, keys,
                            values, kv_bf16);
        if (!status)
            status = paged_decode_attention(qkv, width_qkv, keys, values, kv_bf16, slots, NULL,
                                            NULL, tokens, lengths, tokens, width, heads,
                                            kv_heads, dim, scale, context, num_threads);
        if (!status)
            status = q4_gemm(context, tokens, heads * dim, o_q, o_d, o_m, hidden, y, num_threads);
        for (int64_t i = 0; !status && i < tokens * hidden; i++) y[i] += x[i];
    }
    free(h);
    free(qkv);
    free(context);
    return status;
}

/* y = x + gated_mlp(rms_norm(x)): the MLP half of a Llama decoder layer. */
int q4_mlp_block(const float *x, int64_t rows, int64_t k, const float *norm_weight, float eps,
                 const uint8_t *gate_up_q, const float *gate_up_d, const float *gate_up_m,
                 int64_t intermediate, const uint8_t *down_q, const float *down_d,
                 const float *down_m, float *y, int num_threads) {
    if (rows <= 0) return 0;
    float *h = malloc(sizeof(float) * rows * k);
    if (!h) return 2;
    rms_norm_rows(x, rows, k, norm_weight, eps, h);
    int status = q4_gated_mlp(h, rows, k, gate_up_q, gate_up_d, gate_up_m, intermediate,
                              down_q, down_d, down_m, k, y, num_threads);
    for (int64_t i = 0; !status && i < rows * k; i++) y[i] += x[i];
    free(h);
    return status;
}

/* Every layer of the step through the two halves above, in one call (models/
 * fast_decode.py's FastDecodeStack): the layers' Python loop, its checks and the
 * interpreter lock's round trips go, the arithmetic is the halves' own. */
typedef struct {
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    const uint8_t *qkv_q;
    const float *qkv_d, *qkv_m;
    const uint8_t *o_q;
    const float *o_d, *o_m;
    const uint8_t *gate_up_q;
    const float *gate_up_d, *gate_up_m;
    const uint8_t *down_q;
    const float *down_d, *down_m;
    void *keys, *values;             /* this layer's flat cache [slots, KVH, D] */
} Q4StackLayer;

/* x [tokens, hidden] in, the last layer's output out (in place); the rest as in
 * q4_attention_block. */
int q4_decoder_stack(const Q4StackLayer *layers, int64_t num_layers, int64_t hidden,
                     int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t dim,
                     float scale, int kv_bf16, float *x, int64_t tokens, const float *cos,
                     const float *sin, const int64_t *slot_mapping, const int64_t *slots,
                     const int64_t *lengths, int64_t width, int num_threads) {
    if (tokens <= 0) return 0;
    float *y = malloc(sizeof(float) * tokens * hidden);
    int status = y ? 0 : 2;
    for (int64_t l = 0; !status && l < num_layers; l++) {
        const Q4StackLayer *layer = &layers[l];
        status = q4_attention_block(x, tokens, hidden, layer->input_norm, layer->input_eps,
                                    layer->qkv_q, layer->qkv_d, layer->qkv_m, cos, sin,
                                    slot_mapping, layer->keys, layer->values, kv_bf16, slots,
                                    lengths, width, heads, kv_heads, dim, scale, layer->o_q,
                                    layer->o_d, layer->o_m, y, num_threads);
        if (!status)
            status = q4_mlp_block(y, tokens, hidden, layer->post_norm, layer->post_eps,
                                  layer->gate_up_q, layer->gate_up_d, layer->gate_up_m,
                                  intermediate, layer->down_q, layer->down_d, layer->down_m, x,
                                  num_threads);
    }
    free(y);
    return status;
}
