/* Every decoder layer of a Llama-style model with bf16 weights packed in pairs, for
 * one step (decode rows, short prefill chunks, any row count), in one native call
 * (models/packed_stack.py).
 *
 * The Python layer loop costs two things on steps of this size: its own time (~12
 * calls per layer, each with its checks and tensor allocations, while the kernels'
 * helper threads spin) and, in a server, a wait for the interpreter lock at every
 * return from a kernel while the event loop runs: a 30-layer step went through that
 * lock ~360 times. Here the layers chain the same kernels the loop calls, in the
 * same order and on the same buffers' values, so the output is bit-identical
 * (tests/engine/test_packed_stack.py):
 *
 *   h   = rms_norm(x)                        bf16
 *   qkv = h @ Wqkv                           fp32; rope on q, k; k, v to the cache
 *   a   = attention(q, cache)                fp32, rounded to bf16
 *   x   = x + a @ Wo                         fp32
 *   h   = rms_norm(x)                        bf16
 *   g   = silu(h @ Wgate) * (h @ Wup)        bf16 (one gated GEMM)
 *   x   = x + g @ Wdown                      fp32
 *
 * Attention: row t attends to the first lengths[t] slots of slots row slot_rows[t]
 * (row t without slot_rows), as paged_decode_attention reads them. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

typedef struct {
    const float *input_norm;         /* [hidden] */
    const float *post_norm;          /* [hidden] */
    float input_eps, post_eps;
    const uint32_t *qkv;             /* pairs of [(H + 2 KVH) D, hidden] */
    const uint32_t *o;               /* pairs of [hidden, H D] */
    const uint32_t *gate_up;         /* gated pairs of [2 I, hidden] */
    const uint32_t *down;            /* pairs of [hidden, I] */
    void *keys, *values;             /* this layer's flat cache [num_slots, KVH, D] */
} StackLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, intermediate, num_slots;
    float scale;
    int kv_bf16;
} StackShape;

typedef struct {
    uint16_t *normed;                /* [T, hidden] bf16 */
    float *qkv;                      /* [T, (H + 2 KVH) D] */
    float *context;                  /* [T, H D] */
    uint16_t *context_bf16;          /* [T, H D] */
    float *projected;                /* [T, hidden] */
    uint16_t *activated;             /* [T, I] bf16 */
} StackBuffers;

static void add_rows(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

static int attention_half(const StackLayer *layer, const StackShape *shape, float *x,
                          int64_t tokens, const float *cos, const float *sin,
                          const int64_t *slot_mapping, const int64_t *slots,
                          const int64_t *slot_rows, int64_t num_rows, const int64_t *lengths,
                          int64_t width, const StackBuffers *b, int num_threads) {
    const int64_t hidden = shape->hidden, heads = shape->heads, dim = shape->dim;
    const int64_t width_qkv = (heads + 2 * shape->kv_heads) * dim;
    int status = rms_norm(x, tokens, hidden, layer->input_norm, layer->input_eps, b->normed, 1,
                          num_threads);
    if (!status)
        status = bf16_gemm(b->normed, hidden, layer->qkv, tokens, hidden, width_qkv, b->qkv,
                           width_qkv, 0, 0, num_threads);
    if (!status)
        status = rope_store(b->qkv, tokens, heads, shape->kv_heads, dim, cos, sin, slot_mapping,
                            layer->keys, layer->values, shape->num_slots, shape->kv_bf16,
                            num_threads);
    if (!status)
        status = paged_decode_attention(b->qkv, width_qkv, layer->keys, layer->values,
                                        shape->kv_bf16, slots, slot_rows, num_rows, lengths,
                                        tokens, width, heads, shape->kv_heads, dim,
                                        shape->scale, b->context, num_threads);
    if (status) return status;
    store_cached(b->context_bf16, 1, 0, b->context, tokens * heads * dim);
    status = bf16_gemm(b->context_bf16, heads * dim, layer->o, tokens, heads * dim, hidden,
                       b->projected, hidden, 0, 0, num_threads);
    if (!status) add_rows(x, b->projected, tokens * hidden);
    return status;
}

static int mlp_half(const StackLayer *layer, const StackShape *shape, float *x, int64_t tokens,
                    const StackBuffers *b, int num_threads) {
    const int64_t hidden = shape->hidden, inter = shape->intermediate;
    int status = rms_norm(x, tokens, hidden, layer->post_norm, layer->post_eps, b->normed, 1,
                          num_threads);
    if (!status)
        status = bf16_gated_gemm(b->normed, hidden, layer->gate_up, tokens, hidden, inter,
                                 b->activated, inter, num_threads);
    if (!status)
        status = bf16_gemm(b->activated, inter, layer->down, tokens, inter, hidden, b->projected,
                           hidden, 0, 0, num_threads);
    if (!status) add_rows(x, b->projected, tokens * hidden);
    return status;
}

/* x [tokens, hidden] fp32 in, every layer's output out (in place). cos, sin [tokens,
 * D]; slot_mapping [tokens]; slots [num_rows, width], lengths [tokens] and slot_rows
 * [tokens] or NULL: the attention's contexts (see above). Returns 0, or the first
 * failing kernel's status (x then holds a partial result). */
int bf16_decoder_stack(const StackLayer *layers, int64_t num_layers, const StackShape *shape,
                       float *x, int64_t tokens, const float *cos, const float *sin,
                       const int64_t *slot_mapping, const int64_t *slots,
                       const int64_t *slot_rows, int64_t num_rows, const int64_t *lengths,
                       int64_t width, int num_threads) {
    if (tokens <= 0) return 0;
    if (!bf16_gemm_available()) return 1;
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
        status = attention_half(&layers[l], shape, x, tokens, cos, sin, slot_mapping, slots,
                                slot_rows, num_rows, lengths, width, &b, num_threads);
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
