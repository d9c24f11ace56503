/* The two halves of a Llama decoder layer for a decode step on GGUF blocks, each one
 * native call (models/fast_decode.py): the attention half (RMSNorm, qkv projection,
 * RoPE and the cache write, paged attention, o projection, residual) and the MLP half
 * (RMSNorm, gated MLP, residual), for projections in any of block_gemm's kinds, one
 * kind or several per weight (kernels.h's BlockWeight: Q4_1 files, Q8_0 files, Q5_K_M
 * and Q4_K_M mixtures). They chain the kernels of block_gemm.c, block_mlp.c,
 * layer_ops.c and paged_attention.c in the modules' order, on the same calls the
 * modules make, so a layer's output is the modules' bit for bit. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* y = x + o_proj(attention(rope(qk_norms(qkv_proj(rms_norm(x)) [+ qkv_bias])))) for
 * `tokens` decode requests, writing each token's new K/V to its cache slot first. x, y
 * [tokens, hidden]; qkv_bias [(heads + 2 kv_heads) dim] (Qwen2) or NULL, added to
 * every row as BlockLinear adds it; q_norm, k_norm [dim] (Qwen3: an RMSNorm of every
 * q head and k head, eps qk_eps) or NULL; cos, sin [tokens, dim]; the decode context
 * as in paged_decode_attention. */
int block_attention_half(const float *x, int64_t tokens, int64_t hidden,
                         const float *norm_weight, float eps, const BlockWeight *qkv_proj,
                         const float *qkv_bias, const float *q_norm, const float *k_norm,
                         float qk_eps, const float *cos, const float *sin,
                         const int64_t *slot_mapping, void *keys, void *values, int kv_bf16,
                         const int64_t *slots, const int64_t *lengths, int64_t width,
                         int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                         const BlockWeight *o_proj, float *y, int num_threads) {
    if (tokens <= 0) return 0;
    const int64_t width_qkv = (heads + 2 * kv_heads) * dim;
    float *h = malloc(sizeof(float) * tokens * hidden);
    float *qkv = malloc(sizeof(float) * tokens * width_qkv);
    float *context = malloc(sizeof(float) * tokens * heads * dim);
    int status = 2;
    if (h && qkv && context) {
        rms_norm_rows(x, tokens, hidden, norm_weight, eps, h);
        status = block_weight_gemm(qkv_proj, h, tokens, hidden, qkv, width_qkv, num_threads);
        for (int64_t t = 0; !status && qkv_bias && t < tokens; t++)
            for (int64_t i = 0; i < width_qkv; i++) qkv[t * width_qkv + i] += qkv_bias[i];
        for (int64_t t = 0; !status && q_norm && k_norm && t < tokens; t++) {
            float *row = qkv + t * width_qkv;
            rms_norm_rows(row, heads, dim, q_norm, qk_eps, row);
            rms_norm_rows(row + heads * dim, kv_heads, dim, k_norm, qk_eps, row + heads * dim);
        }
        if (!status)
            rope_store_rows(qkv, 0, tokens, heads, kv_heads, dim, cos, sin, slot_mapping, keys,
                            values, kv_bf16);
        if (!status)
            status = paged_decode_attention(qkv, width_qkv, keys, values, kv_bf16, slots, NULL,
                                            NULL, tokens, lengths, tokens, width, heads,
                                            kv_heads, dim, scale, context, num_threads);
        if (!status)
            status = block_weight_gemm(o_proj, context, tokens, heads * dim, y, hidden,
                                       num_threads);
        for (int64_t i = 0; !status && i < tokens * hidden; i++) y[i] += x[i];
    }
    free(h);
    free(qkv);
    free(context);
    return status;
}

/* y = x + gated_mlp(rms_norm(x)): the MLP half of a Llama decoder layer. */
int block_mlp_half(const float *x, int64_t rows, int64_t k, const float *norm_weight, float eps,
                   const BlockWeight *gate_up, int64_t intermediate, const BlockWeight *down,
                   float *y, int num_threads) {
    if (rows <= 0) return 0;
    float *h = malloc(sizeof(float) * rows * k);
    if (!h) return 2;
    rms_norm_rows(x, rows, k, norm_weight, eps, h);
    int status = blocks_gated_mlp(h, rows, k, gate_up, intermediate, down, k, y, num_threads);
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
    BlockWeight qkv, o, gate_up, down;
    void *keys, *values;             /* this layer's flat cache [slots, KVH, D] */
    const float *qkv_bias;           /* [(H + 2 KVH) D] (Qwen2), or NULL */
    const float *q_norm, *k_norm;    /* [D] each (Qwen3), or NULL */
    float qk_eps;
} BlockStackLayer;

/* x [tokens, hidden] in, the last layer's output out (in place); the rest as in
 * block_attention_half. */
int block_decoder_stack(const BlockStackLayer *layers, int64_t num_layers, int64_t hidden,
                        int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t dim,
                        float scale, int kv_bf16, float *x, int64_t tokens, const float *cos,
                        const float *sin, const int64_t *slot_mapping, const int64_t *slots,
                        const int64_t *lengths, int64_t width, int num_threads) {
    if (tokens <= 0) return 0;
    float *y = malloc(sizeof(float) * tokens * hidden);
    int status = y ? 0 : 2;
    for (int64_t l = 0; !status && l < num_layers; l++) {
        const BlockStackLayer *layer = &layers[l];
        status = block_attention_half(x, tokens, hidden, layer->input_norm, layer->input_eps,
                                      &layer->qkv, layer->qkv_bias, layer->q_norm,
                                      layer->k_norm, layer->qk_eps, cos, sin, slot_mapping,
                                      layer->keys, layer->values, kv_bf16, slots, lengths,
                                      width, heads, kv_heads, dim, scale, &layer->o, y,
                                      num_threads);
        if (!status)
            status = block_mlp_half(y, tokens, hidden, layer->post_norm, layer->post_eps,
                                    &layer->gate_up, intermediate, &layer->down, x,
                                    num_threads);
    }
    free(y);
    return status;
}
