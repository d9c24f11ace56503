/* The two halves of a decoder layer for a decode step on GGUF blocks, each one native
 * call (models/fast_decode.py): the attention half (RMSNorm, qkv projection, RoPE and
 * the cache write, paged attention, o projection, residual) and the MLP half (RMSNorm,
 * gated MLP, residual), for projections in any of block_gemm's kinds, one kind or
 * several per weight (kernels.h's BlockWeight: Q4_1 files, Q8_0 files, Q5_K_M and
 * Q4_K_M mixtures). They chain the kernels of block_gemm.c, block_mlp.c, layer_ops.c
 * and paged_attention.c in the modules' order, on the same calls the modules make, so
 * a Llama layer's output is the modules' bit for bit.
 *
 * The variants of the families, each a field of BlockStackLayer (NULL: not there):
 *   Qwen2     qkv_bias, added to the qkv rows as BlockLinear adds it
 *   Qwen3     q_norm, k_norm: an RMSNorm of every q and k head after the qkv kernel
 *   Gemma 3   the head norms too, attn_out_norm and mlp_out_norm on o's and down's
 *             outputs before each residual add, GELU-tanh (BlockStackShape.activation),
 *             and sliding layers (`group`: which BlockStackGroup's contexts and rotary
 *             tables the layer reads). Its (1 + weight) norms arrive with 1 + weight
 *             precomputed, so every norm is rms_norm_rows' x / rms(x) * weight. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {                     /* the sizes every layer of the model shares */
    int64_t hidden, intermediate, heads, kv_heads, dim;
    float scale;                     /* the attention's softmax scale */
    int kv_bf16;                     /* the caches hold bf16 (else fp32) */
    int activation;                  /* ACTIVATION_SILU or ACTIVATION_GELU_TANH */
} BlockStackShape;

typedef struct {                     /* one attention group's view of a decode step */
    const float *cos, *sin;          /* [T, D]: the group's rotary tables */
    const int64_t *slot_mapping;     /* [T]: the cache slot of each row's new K/V */
    const int64_t *slots;            /* [T, width]: each row's context slots */
    const int64_t *lengths;          /* [T]: how many of them row t attends to */
    int64_t width;
} BlockStackGroup;

typedef struct {
    LayerTraits traits;                          /* norms, bias, group (kernels.h) */
    BlockWeight qkv, o, gate_up, down;
    void *keys, *values;                         /* the layer's flat cache [slots, KVH, D] */
    int64_t num_slots;                           /* the caches' slots */
} BlockStackLayer;

/* y = x + y, or x + rms_norm(y) with out_norm (y normalised in place first). */
static void add_residual(const float *x, float *y, int64_t tokens, int64_t hidden,
                         const float *out_norm, float eps) {
    if (out_norm) rms_norm_rows(y, tokens, hidden, out_norm, eps, y);
    for (int64_t i = 0; i < tokens * hidden; i++) y[i] += x[i];
}

/* y = x + [norm](o_proj(attention(rope(qk_norms(qkv_proj(rms_norm(x)) [+ qkv_bias])))))
 * for `tokens` decode requests, writing each token's new K/V to its cache slot first.
 * x, y [tokens, hidden]; the attention reads the contexts of `group` as
 * paged_decode_attention does. */
int block_attention_half(const BlockStackLayer *layer, const BlockStackShape *shape,
                         const BlockStackGroup *group, const float *x, int64_t tokens,
                         float *y, int num_threads) {
    if (tokens <= 0) return 0;
    const LayerTraits *traits = &layer->traits;
    const int64_t hidden = shape->hidden, heads = shape->heads, kv_heads = shape->kv_heads;
    const int64_t dim = shape->dim, width_qkv = (heads + 2 * kv_heads) * dim;
    float *h = malloc(sizeof(float) * tokens * hidden);
    float *qkv = malloc(sizeof(float) * tokens * width_qkv);
    float *context = malloc(sizeof(float) * tokens * heads * dim);
    int status = 2;
    if (h && qkv && context) {
        rms_norm_rows(x, tokens, hidden, traits->input_norm, traits->input_eps, h);
        status = block_weight_gemm(&layer->qkv, h, tokens, hidden, qkv, width_qkv, num_threads);
        for (int64_t t = 0; !status && traits->qkv_bias && t < tokens; t++)
            for (int64_t i = 0; i < width_qkv; i++) qkv[t * width_qkv + i] += traits->qkv_bias[i];
        for (int64_t t = 0; !status && traits->q_norm && traits->k_norm && t < tokens; t++) {
            float *row = qkv + t * width_qkv;
            rms_norm_rows(row, heads, dim, traits->q_norm, traits->qk_eps, row);
            rms_norm_rows(row + heads * dim, kv_heads, dim, traits->k_norm, traits->qk_eps,
                          row + heads * dim);
        }
        if (!status && any_slot_outside(group->slot_mapping, tokens, layer->num_slots))
            status = STATUS_SLOT_OUTSIDE_CACHE;             /* before any K/V is stored */
        if (!status)
            rope_store_rows(qkv, 0, tokens, heads, kv_heads, dim, group->cos, group->sin,
                            group->slot_mapping, layer->keys, layer->values, shape->kv_bf16);
        if (!status)
            status = paged_decode_attention(qkv, width_qkv, layer->keys, layer->values,
                                            shape->kv_bf16, group->slots, NULL, NULL,
                                            tokens, layer->num_slots, group->lengths, tokens,
                                            group->width, heads, kv_heads, dim, shape->scale,
                                            context, num_threads);
        if (!status)
            status = block_weight_gemm(&layer->o, context, tokens, heads * dim, y, hidden,
                                       num_threads);
        if (!status) add_residual(x, y, tokens, hidden, traits->attn_out_norm, traits->out_eps);
    }
    free(h);
    free(qkv);
    free(context);
    return status;
}

/* y = x + [norm](gated_mlp(rms_norm(x))): the MLP half of the layer. */
int block_mlp_half(const BlockStackLayer *layer, const BlockStackShape *shape, const float *x,
                   int64_t tokens, float *y, int num_threads) {
    if (tokens <= 0) return 0;
    const int64_t hidden = shape->hidden;
    float *h = malloc(sizeof(float) * tokens * hidden);
    if (!h) return 2;
    const LayerTraits *traits = &layer->traits;
    rms_norm_rows(x, tokens, hidden, traits->post_norm, traits->post_eps, h);
    int status = blocks_gated_mlp(h, tokens, hidden, &layer->gate_up, shape->intermediate,
                                  &layer->down, hidden, shape->activation, y, num_threads);
    if (!status) add_residual(x, y, tokens, hidden, traits->mlp_out_norm, traits->out_eps);
    free(h);
    return status;
}

/* Every layer of the step through the two halves above, in one call (models/
 * fast_decode.py's FastDecodeStack): the layers' Python loop, its checks and the
 * interpreter lock's round trips go, the arithmetic is the halves' own. x [tokens,
 * hidden] in, the last layer's output out (in place); groups: one per attention
 * group the layers name. 5 for a group index past num_groups. */
int block_decoder_stack(const BlockStackLayer *layers, int64_t num_layers,
                        const BlockStackShape *shape, const BlockStackGroup *groups,
                        int64_t num_groups, float *x, int64_t tokens, int num_threads) {
    if (tokens <= 0) return 0;
    for (int64_t l = 0; l < num_layers; l++)
        if (layers[l].traits.group < 0 || layers[l].traits.group >= num_groups) return 5;
    float *y = malloc(sizeof(float) * tokens * shape->hidden);
    int status = y ? 0 : 2;
    for (int64_t l = 0; !status && l < num_layers; l++) {
        const BlockStackLayer *layer = &layers[l];
        status = block_attention_half(layer, shape, &groups[layer->traits.group], x, tokens, y,
                                      num_threads);
        if (!status) status = block_mlp_half(layer, shape, y, tokens, x, num_threads);
    }
    free(y);
    return status;
}
