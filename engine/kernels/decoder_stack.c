/* Every decoder layer of a model with bf16 weights packed in pairs, for one step
 * (decode rows, short prefill chunks, any row count), in one native call
 * (models/packed_stack.py). Llama-style layers, and the variants of Qwen2 (a qkv
 * bias), Qwen3 (RMSNorm of each q and k head), Gemma 3 (that too, plus norms on the
 * attention's and the MLP's outputs, (1 + weight) norms, GELU) and hybrid
 * sliding-window models (each layer reads the contexts and rotary tables of its
 * attention group).
 *
 * The Python layer loop costs two things on steps of this size: its own time (~12
 * calls per layer, each with its checks and tensor allocations, while the kernels'
 * helper threads spin) and, in a server, a wait for the interpreter lock at every
 * return from a kernel while the event loop runs: a 30-layer step goes through that
 * lock ~360 times. Here the layers chain the same kernels the loop calls, in the
 * same order and on the same buffers' values, so for Llama-style layers the output
 * is bit-identical to the packed layers' loop (tests/engine/test_packed_stack.py):
 *
 *   h   = rms_norm(x)                        bf16
 *   qkv = h @ Wqkv [+ bias]                  fp32; [q_norm, k_norm per head]; rope on
 *                                            q, k; k, v to the cache
 *   a   = attention(q, cache)                fp32, rounded to bf16
 *   o   = a @ Wo                             fp32
 *   x   = x + o                              [Gemma: x + rms_norm(o)]
 *   h   = rms_norm(x)                        bf16
 *   g   = act(h @ Wgate) * (h @ Wup)         bf16 (one gated GEMM; SiLU or GELU-tanh)
 *   d   = g @ Wdown                          fp32
 *   x   = x + d                              [Gemma: x + rms_norm(d)]
 *
 * Gemma's (1 + weight) norms arrive with 1 + weight precomputed, so every norm is
 * rms_norm's x / rms(x) * weight.
 *
 * Attention: row t of a layer of group g attends to lengths[t] slots of slots row
 * slot_rows[t] (row t without slot_rows) of groups[g], from entry starts[t] (0
 * without starts), as paged_decode_attention reads them. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

typedef struct {
    LayerTraits traits;              /* norms, bias, group (kernels.h) */
    const uint32_t *qkv;             /* pairs of [(H + 2 KVH) D, hidden] */
    const uint32_t *o;               /* pairs of [hidden, H D] */
    const uint32_t *gate_up;         /* gated pairs of [2 I, hidden] */
    const uint32_t *down;            /* pairs of [hidden, I] */
    void *keys, *values;             /* this layer's flat cache [num_slots, KVH, D] */
    int64_t num_slots;
} StackLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, intermediate;
    float scale;
    int kv_bf16;
    int activation;                  /* ACTIVATION_SILU or ACTIVATION_GELU_TANH */
} StackShape;

typedef struct {                     /* one attention group's view of the step */
    const float *cos, *sin;          /* [T, D] */
    const int64_t *slot_mapping;     /* [T] */
    const int64_t *slots;            /* [num_rows, width] */
    const int64_t *slot_rows;        /* [T] or NULL */
    const int64_t *starts;           /* [T] or NULL */
    int64_t num_rows;
    const int64_t *lengths;          /* [T] */
    int64_t width;
} StackGroup;

typedef struct {
    uint16_t *normed;                /* [T, hidden] bf16 */
    float *qkv;                      /* [T, (H + 2 KVH) D] */
    float *context;                  /* [T, H D] */
    uint16_t *context_bf16;          /* [T, H D] */
    float *projected;                /* [T, hidden] */
    uint16_t *activated;             /* [T, I] bf16 */
} StackBuffers;

/* x += y, or x += rms_norm(y) when `norm` is set (y is then normalised in place). */
static int add_rows(float *x, float *y, int64_t tokens, int64_t hidden, const float *norm,
                    float eps, int num_threads) {
    if (norm) {
        const int status = rms_norm(y, tokens, hidden, norm, eps, y, 0, num_threads);
        if (status) return status;
    }
    for (int64_t i = 0; i < tokens * hidden; i++) x[i] = x[i] + y[i];
    return 0;
}

/* Qwen3's and Gemma 3's RMSNorm of every q and k head of the qkv rows, in place. */
static void norm_heads(const LayerTraits *traits, const StackShape *shape, float *qkv,
                       int64_t tokens) {
    const int64_t heads = shape->heads, kv_heads = shape->kv_heads, dim = shape->dim;
    const int64_t width = (heads + 2 * kv_heads) * dim;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        rms_norm_rows(row, heads, dim, traits->q_norm, traits->qk_eps, row);
        rms_norm_rows(row + heads * dim, kv_heads, dim, traits->k_norm, traits->qk_eps,
                      row + heads * dim);
    }
}

static int attention_half(const StackLayer *layer, const StackShape *shape, float *x,
                          int64_t tokens, const StackGroup *g, const StackBuffers *b,
                          int num_threads) {
    const LayerTraits *traits = &layer->traits;
    const int64_t hidden = shape->hidden, heads = shape->heads, dim = shape->dim;
    const int64_t width_qkv = (heads + 2 * shape->kv_heads) * dim;
    int status = rms_norm(x, tokens, hidden, traits->input_norm, traits->input_eps, b->normed, 1,
                          num_threads);
    if (!status)
        status = bf16_gemm(b->normed, hidden, layer->qkv, tokens, hidden, width_qkv, b->qkv,
                           width_qkv, 0, 0, num_threads);
    if (!status && traits->qkv_bias)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t i = 0; i < width_qkv; i++)
                b->qkv[t * width_qkv + i] = b->qkv[t * width_qkv + i] + traits->qkv_bias[i];
    if (!status && traits->q_norm) norm_heads(traits, shape, b->qkv, tokens);
    if (!status)
        status = rope_store(b->qkv, tokens, heads, shape->kv_heads, dim, g->cos, g->sin,
                            g->slot_mapping, layer->keys, layer->values, layer->num_slots,
                            shape->kv_bf16, num_threads);
    if (!status)
        status = paged_decode_attention(b->qkv, width_qkv, layer->keys, layer->values,
                                        shape->kv_bf16, g->slots, g->slot_rows,
                                        g->starts, g->num_rows, layer->num_slots, g->lengths,
                                        tokens, g->width, heads, shape->kv_heads, dim,
                                        shape->scale, b->context, num_threads);
    if (status) return status;
    store_cached(b->context_bf16, 1, 0, b->context, tokens * heads * dim);
    status = bf16_gemm(b->context_bf16, heads * dim, layer->o, tokens, heads * dim, hidden,
                       b->projected, hidden, 0, 0, num_threads);
    if (!status)
        status = add_rows(x, b->projected, tokens, hidden, traits->attn_out_norm,
                          traits->out_eps, num_threads);
    return status;
}

static int mlp_half(const StackLayer *layer, const StackShape *shape, float *x, int64_t tokens,
                    const StackBuffers *b, int num_threads) {
    const LayerTraits *traits = &layer->traits;
    const int64_t hidden = shape->hidden, inter = shape->intermediate;
    int status = rms_norm(x, tokens, hidden, traits->post_norm, traits->post_eps, b->normed, 1,
                          num_threads);
    if (!status)
        status = bf16_gated_gemm(b->normed, hidden, layer->gate_up, tokens, hidden, inter,
                                 b->activated, inter, shape->activation, num_threads);
    if (!status)
        status = bf16_gemm(b->activated, inter, layer->down, tokens, inter, hidden, b->projected,
                           hidden, 0, 0, num_threads);
    if (!status)
        status = add_rows(x, b->projected, tokens, hidden, traits->mlp_out_norm,
                          traits->out_eps, num_threads);
    return status;
}

/* x [tokens, hidden] fp32 in, every layer's output out (in place). groups: one per
 * attention group the layers name (see above). Returns 0, or the first failing
 * kernel's status (x then holds a partial result); 5 for a group index past
 * num_groups or a q norm without its k norm (or the reverse). */
int bf16_decoder_stack(const StackLayer *layers, int64_t num_layers, const StackShape *shape,
                       float *x, int64_t tokens, const StackGroup *groups, int64_t num_groups,
                       int num_threads) {
    if (tokens <= 0) return 0;
    if (!bf16_gemm_available()) return 1;
    for (int64_t l = 0; l < num_layers; l++) {
        const LayerTraits *traits = &layers[l].traits;
        if (traits->group < 0 || traits->group >= num_groups
            || (traits->q_norm == NULL) != (traits->k_norm == NULL)) return 5;
    }
    const int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * shape->dim;
    const int64_t attended = shape->heads * shape->dim;
    StackBuffers b = {
        malloc(sizeof(uint16_t) * tokens * shape->hidden),
        malloc(sizeof(float) * tokens * qkv_width),
        malloc(sizeof(float) * tokens * attended),
        malloc(sizeof(uint16_t) * tokens * attended),
        malloc(sizeof(float) * tokens * shape->hidden),
        malloc(sizeof(uint16_t) * tokens * shape->intermediate),
    };
    int status = (b.normed && b.qkv && b.context && b.context_bf16 && b.projected
                  && b.activated) ? 0 : 2;
    for (int64_t l = 0; !status && l < num_layers; l++) {
        status = attention_half(&layers[l], shape, x, tokens,
                                &groups[layers[l].traits.group], &b, num_threads);
        if (!status) status = mlp_half(&layers[l], shape, x, tokens, &b, num_threads);
    }
    free(b.normed);
    free(b.qkv);
    free(b.context);
    free(b.context_bf16);
    free(b.projected);
    free(b.activated);
    return status;
}
