/* Block products on int8 activations (dtype int8-activations): y[rows, n] = x @ W^T
 * for W in GGUF-style blocks of 32, with x quantized per block of 32 to int8 (a scale
 * per block, absmax / 127, as llama.cpp's Q8 activations) and the products summed in
 * int32 by VNNI's `vpdpbusd` (64 byte products per instruction against fp32's 16
 * FMAs; AArch64: `sdot`, or NEON's widening multiplies, block_int8_neon.h), one fp32
 * conversion and scaling per block.
 *
 * The weights are repacked at load (int8_repack) from the forms block_rows.h reads
 * into groups of 16 columns, lane j of a vector holding column j of the group:
 *   I8_Q4 (from Q4_1): per block, 4 vectors of 16 dwords; dword t of lane j is the
 *       column's code bytes 4t..4t+3, so its low nibbles are elements 4t..4t+3 and its
 *       high ones elements 16+4t..16+4t+3.
 *   I8_U8 (from Q8_0 with its codes + 128, or Q5_1's codes 0..31): per block, 8
 *       vectors; dword t of lane j is elements 4t..4t+3 as unsigned bytes.
 *   I8_U8_HALVES (from Q6_K's Q8 form, a scale per 16 weights): the same bytes.
 * Scales and minima per block (per half block for halves), 16 lanes: [group][block]
 * [halves][16] floats. Every form is then w = d * c + m with c unsigned (Q8: m = -128 d),
 * so a block's product is d * dx * sum(c * xq) + m * dx * sum(xq): the second term
 * from the quantized x's sums, which cancels the + 128 exactly.
 *
 * Two forms keep a K-quant file's width (the super-block forms): their blocks carry
 * integer sub-scales, and fp32 scales come once per 256 weights, as in the file.
 *   I8_Q4K (from Q4_K): codes as I8_Q4; d holds [group][super][d, dmin][16] floats, m
 *       (bytes) [group][block][scale, minimum][16]: a block's d = d * scale and m =
 *       -(dmin * minimum), the values I8_Q4 would hold. 19 bytes per 32 weights per
 *       column against I8_Q4's 24 (the file: 18).
 *   I8_Q6K (from Q6_K): per block 4 vectors of the codes' low 4 bits laid out as
 *       I8_Q4's nibbles, then 2 vectors of their high 2 bits: byte i of lane j's dword
 *       in vector u holds at bits 2t..2t+1 those of element 16 u + 4 t + i. d holds
 *       [group][super][16] floats, m (int8) [group][block][two halves][16]: a half's d
 *       = d * scale, its m = -128 d, with codes q + 96 (the values I8_U8_HALVES holds).
 *       26.5 bytes per 32 weights against I8_U8_HALVES' 48 (the file: 26.25).
 * Their products are the wide forms' to the bit: the same integers, and the same fp32
 * scales, formed once per block for all the tile's rows.
 *
 * Lane j of a vector accumulates column j, so x's 4 bytes of a dword are broadcast to
 * all lanes and no horizontal sums are needed. N is a multiple of 16 (the repacked
 * tensors keep the shapes of the forms they came from: [N, K/2] or [N, K] codes,
 * [N, K/32] or [N, K/16] scales and minima).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#include "kernels.h"
#include "worker_pool.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define INT8_PATH INT8_AVX512_VNNI
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#include <immintrin.h>
#define INT8_PATH INT8_AVX_VNNI
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT8_PATH INT8_AVX2
/* AArch64 (its NEON has the widening and pairwise adds the tile uses; KVSERVE_PLAIN_C:
 * the ARM generic level keeps to the portable loop): block_int8_neon.h */
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(KVSERVE_PLAIN_C) \
    && defined(__ARM_FEATURE_DOTPROD)
#define INT8_PATH INT8_DOTPROD
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(KVSERVE_PLAIN_C)
#define INT8_PATH INT8_NEON
#else
#define INT8_PATH INT8_PORTABLE
#endif

#define BLOCK 32
#define GROUP 16                 /* columns per group: the lanes of a 512-bit vector */
#define INT8_ROW_TILE 8          /* activation rows sharing one pass over the weights */

/* x[rows, k] quantized per block: codes [rows, k], scales [rows, k/32], the sums
 * scale * sum(codes) per 16 and per 32 values ([rows, k/16], [rows, k/32]) and the
 * integer sums of codes per 16 ([rows, k/16]; AVX2's unsigned forms add 128 times
 * them back, see group_tile_256). */
typedef struct {
    int8_t *codes;
    float *scales, *sums16, *sums32;
    int32_t *code_sums16;
} QuantizedRows;

/* Block i (row i / blocks, block i % blocks) of x quantized into `out`. No libm call
 * per value (fmaxf and lrintf are calls unless errno is given up): |x|'s bits compared
 * as integers (non-negative floats order as their bits) and rintf, which compile to
 * vector max and round instructions, so each loop runs on whole vectors; rintf rounds
 * as lrintf does (the current mode, to even). */
static inline void quantize_block(const float *x, int64_t k, int64_t i, QuantizedRows *out) {
    const int64_t blocks = k / BLOCK, r = i / blocks, b = i % blocks;
    const float *xb = x + r * k + b * BLOCK;
    uint32_t bits[BLOCK], largest = 0;
    memcpy(bits, xb, sizeof(bits));
    for (int j = 0; j < BLOCK; j++) {
        const uint32_t magnitude = bits[j] & 0x7FFFFFFFu;
        largest = magnitude > largest ? magnitude : largest;
    }
    float amax;
    memcpy(&amax, &largest, sizeof(amax));
    const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *codes = out->codes + r * k + b * BLOCK;
    for (int j = 0; j < BLOCK; j++) codes[j] = (int8_t)(int32_t)rintf(xb[j] * inverse);
    int sums[2] = {0, 0};
    for (int half = 0; half < 2; half++)
        for (int j = 0; j < 16; j++) sums[half] += codes[16 * half + j];
    out->scales[i] = scale;
    out->sums16[2 * i] = scale * (float)sums[0];
    out->sums16[2 * i + 1] = scale * (float)sums[1];
    out->sums32[i] = scale * (float)(sums[0] + sums[1]);
    out->code_sums16[2 * i] = sums[0];
    out->code_sums16[2 * i + 1] = sums[1];
}

typedef struct {
    const float *x;
    int64_t rows, k;
    QuantizedRows *out;
} QuantizeJob;

static void quantize_part(const void *arg, int part, int parts) {
    const QuantizeJob *job = arg;
    const int64_t total = job->rows * (job->k / BLOCK);
    for (int64_t i = total * part / parts; i < total * (part + 1) / parts; i++)
        quantize_block(job->x, job->k, i, job->out);
}

/* Blocks of x from which the quantization is split over the threads: a prefill
 * chunk's x, not a decode step's (docs/cpu-kernels.md, "Activation quantization"). */
#define PARALLEL_QUANTIZE_BLOCKS 1024

static void quantize_rows(const float *x, int64_t rows, int64_t k, QuantizedRows *out,
                          int num_threads) {
    const QuantizeJob job = {x, rows, k, out};
    if (rows * (k / BLOCK) >= PARALLEL_QUANTIZE_BLOCKS && num_threads > 1)
        run_parallel(quantize_part, &job, num_threads);
    else
        quantize_part(&job, 0, 1);
}

typedef struct {
    int kind;
    const QuantizedRows *x;
    const uint8_t *q;
    const float *d, *m;
    int64_t rows, k, n;
    float *y;
    int64_t ldy;
    WorkRanges *items;           /* groups of 16 columns */
} Int8Job;

/* One group's weights as every loop reads them: its blocks, scales and minima, and
 * its form's sizes (a Q4 block is 256 bytes, the byte forms' 512, I8_Q6K's 384; the
 * halves forms have two scales and minima per block). In the super-block forms d
 * points at the group's super-block scales and sub at its sub-scale bytes. */
typedef struct {
    const uint8_t *q, *sub;
    const float *d, *m;
    const uint16_t *d16, *m16;   /* the fp16 forms' scales and (I8_Q4_1) minima */
    int64_t blocks, block_bytes, scales_per_block;
    int nibbles, halves, super_q4, super_q6;
    float implied_minimum;       /* the fp16 forms without minima: m = this * d */
} GroupView;

static const int form_scale_bits[] = FORM_SCALE_BITS;
static const int form_implied_minimum[] = FORM_IMPLIED_MINIMUM;

static inline GroupView group_view(const Int8Job *job, int64_t group) {
    GroupView view;
    view.blocks = job->k / BLOCK;
    view.super_q4 = job->kind == BLOCKS_I8_Q4K;
    view.super_q6 = job->kind == BLOCKS_I8_Q6K;
    view.nibbles = job->kind == BLOCKS_I8_Q4 || view.super_q4 || job->kind == BLOCKS_I8_Q4_0
                   || job->kind == BLOCKS_I8_Q4_1;
    view.halves = job->kind == BLOCKS_I8_U8_HALVES || view.super_q6;
    view.block_bytes = view.nibbles ? 256 : view.super_q6 ? 384 : 512;
    view.scales_per_block = view.halves ? 2 : 1;
    view.q = job->q + group * view.blocks * view.block_bytes;
    view.sub = NULL;
    view.d16 = view.m16 = NULL;
    view.implied_minimum = (float)form_implied_minimum[job->kind];
    if (form_scale_bits[job->kind] == 16) {
        view.d = view.m = NULL;
        view.d16 = (const uint16_t *)job->d + group * view.blocks * GROUP;
        if (job->m) view.m16 = (const uint16_t *)job->m + group * view.blocks * GROUP;
    } else if (view.super_q4 || view.super_q6) {
        const int64_t supers = view.blocks / 8, per_super = view.super_q4 ? 2 : 1;
        view.d = job->d + group * supers * per_super * GROUP;
        view.sub = (const uint8_t *)job->m + group * view.blocks * 2 * GROUP;
        view.m = NULL;
    } else {
        view.d = job->d + group * view.blocks * view.scales_per_block * GROUP;
        view.m = job->m + group * view.blocks * view.scales_per_block * GROUP;
    }
    return view;
}

/* Lane `lane`'s scale and minimum of block b, half h (scales_per_block 2: h 0, 1),
 * in any form: a super-block form's formed from its integers as the parser forms the
 * wide forms' values (block_parse.c), so they are equal to the bit. */
static inline void lane_scale(const GroupView *view, int64_t b, int h, int lane,
                              float *d, float *m) {
    if (view->super_q4) {
        const float *sup = view->d + (b / 8) * 2 * GROUP;
        *d = sup[lane] * (float)view->sub[b * 2 * GROUP + lane];
        *m = -(sup[GROUP + lane] * (float)view->sub[b * 2 * GROUP + GROUP + lane]);
    } else if (view->super_q6) {
        *d = view->d[(b / 8) * GROUP + lane] * (float)(int8_t)view->sub[(b * 2 + h) * GROUP + lane];
        *m = -128.0f * *d;
    } else if (view->d16) {
        *d = fp16_bits_value(view->d16[b * GROUP + lane]);
        *m = view->m16 ? fp16_bits_value(view->m16[b * GROUP + lane])
                       : view->implied_minimum * *d;
    } else {
        const int64_t at = (b * view->scales_per_block + h) * GROUP + lane;
        *d = view->d[at];
        *m = view->m[at];
    }
}

/* Lane `lane`'s code of element e (0..31) of a block's bytes qb, as the form keeps it
 * unsigned (I8_Q6K: q + 96, as I8_U8_HALVES). */
static inline int lane_code(const GroupView *view, const uint8_t *qb, int lane, int e) {
    const int t = (e % 16) / 4, i = e % 4;
    if (!view->nibbles && !view->super_q6)
        return qb[64 * (e / 4) + 4 * lane + i];
    const int low = (qb[64 * t + 4 * lane + i] >> (e < 16 ? 0 : 4)) & 0x0F;
    if (!view->super_q6)
        return low;
    const int high = (qb[256 + 64 * (e / 16) + 4 * lane + i] >> (2 * t)) & 3;
    return (low | high << 4) + 96;
}

#if INT8_PATH == INT8_AVX512_VNNI
/* Per row of a tile, the int32 sums of codes times x's codes over one block, for the
 * two halves of the block (w[0..3]: elements 0-15, w[4..7]: 16-31). */
static inline __attribute__((always_inline)) void block_sums_vnni(
        const __m512i *w, const int32_t *xq, __m512i *low, __m512i *high) {
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) {
        a = _mm512_dpbusd_epi32(a, w[t], _mm512_set1_epi32(xq[t]));
        c = _mm512_dpbusd_epi32(c, w[4 + t], _mm512_set1_epi32(xq[4 + t]));
    }
    *low = a;
    *high = c;
}

/* One group of 16 columns against `tile` rows (from row r0), all blocks. */
static void group_tile_vnni(const Int8Job *job, int64_t group, int64_t r0, int tile) {
    const GroupView view = group_view(job, group);
    const int64_t blocks = view.blocks, k = job->k, block_bytes = view.block_bytes;
    const int64_t groups_per_block = view.scales_per_block;
    const int halves = view.halves, nibbles = view.nibbles;
    const uint8_t *q = view.q;
    const float *d = view.d, *m = view.m;
    const QuantizedRows *x = job->x;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    __m512 acc[INT8_ROW_TILE];
    for (int r = 0; r < tile; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w[8];
        const uint8_t *qb = q + b * block_bytes;
        _mm_prefetch((const char *)(qb + 8 * block_bytes), _MM_HINT_T0);
        _mm_prefetch((const char *)(qb + 8 * block_bytes + 64), _MM_HINT_T0);
        if (nibbles) {
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(qb + 64 * t);
                w[t] = _mm512_and_si512(v, low_nibbles);
                w[4 + t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
            }
        } else {
            _mm_prefetch((const char *)(qb + 8 * block_bytes + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(qb + 8 * block_bytes + 192), _MM_HINT_T0);
            for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(qb + 64 * t);
        }
        const float *db = d + b * groups_per_block * GROUP, *mb = m + b * groups_per_block * GROUP;
        const __m512 d0 = _mm512_loadu_ps(db), m0 = _mm512_loadu_ps(mb);
        for (int r = 0; r < tile; r++) {
            const int64_t row = r0 + r;
            __m512i low, high;
            block_sums_vnni(w, (const int32_t *)(x->codes + row * k + b * BLOCK), &low, &high);
            const float scale = x->scales[row * blocks + b];
            if (halves) {
                const __m512 d1 = _mm512_loadu_ps(db + GROUP), m1 = _mm512_loadu_ps(mb + GROUP);
                const float *sums = x->sums16 + row * 2 * blocks + 2 * b;
                __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low),
                                           _mm512_mul_ps(d0, _mm512_set1_ps(scale)), acc[r]);
                a = _mm512_fmadd_ps(m0, _mm512_set1_ps(sums[0]), a);
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high),
                                    _mm512_mul_ps(d1, _mm512_set1_ps(scale)), a);
                acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(sums[1]), a);
            } else {
                const __m512 a = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_add_epi32(low, high)),
                    _mm512_mul_ps(d0, _mm512_set1_ps(scale)), acc[r]);
                acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(x->sums32[row * blocks + b]), a);
            }
        }
    }
    for (int r = 0; r < tile; r++)
        _mm512_storeu_ps(job->y + (r0 + r) * job->ldy + group * GROUP, acc[r]);
}
#endif

#if INT8_PATH == INT8_AVX_VNNI || INT8_PATH == INT8_AVX2
#include "block_int8_256.h"          /* group_tile_256 */
#endif

#if INT8_PATH == INT8_NEON || INT8_PATH == INT8_DOTPROD
#include "block_int8_neon.h"         /* group_tile_neon */
#endif

/* The portable loop: the same sums, one column at a time (the vector builds run it
 * for the forms they have no tile for). */
static __attribute__((unused)) void group_tile_portable(const Int8Job *job, int64_t group,
                                                        int64_t r0, int tile) {
    const GroupView view = group_view(job, group);
    const int64_t blocks = view.blocks, k = job->k, block_bytes = view.block_bytes;
    const int halves = view.halves;
    for (int lane = 0; lane < GROUP; lane++)
        for (int r = 0; r < tile; r++) {
            const int64_t row = r0 + r;
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *qb = view.q + b * block_bytes;
                const int8_t *xq = job->x->codes + row * k + b * BLOCK;
                int32_t sums[2] = {0, 0};
                for (int e = 0; e < BLOCK; e++)
                    sums[e / 16] += lane_code(&view, qb, lane, e) * xq[e];
                const float scale = job->x->scales[row * blocks + b];
                float d0, m0, d1, m1;
                lane_scale(&view, b, 0, lane, &d0, &m0);
                if (halves) {
                    lane_scale(&view, b, 1, lane, &d1, &m1);
                    const float *s16 = job->x->sums16 + row * 2 * blocks + 2 * b;
                    total += d0 * scale * (float)sums[0] + m0 * s16[0];
                    total += d1 * scale * (float)sums[1] + m1 * s16[1];
                } else {
                    total += d0 * scale * (float)(sums[0] + sums[1])
                             + m0 * job->x->sums32[row * blocks + b];
                }
            }
            job->y[row * job->ldy + group * GROUP + lane] = total;
        }
}

/* One tile on this build's loop. The forms at a file's width (the super-block and
 * fp16 forms) have a vector tile on the avx2 loop only (block_int8_256.h); the other
 * loops take them one column at a time, and the loader keeps their wide forms there
 * (int8_blocks.py). */
static void group_tile(const Int8Job *job, int64_t group, int64_t r0, int tile) {
#if INT8_PATH == INT8_AVX2
    group_tile_256(job, group, r0, tile);
#else
    if (job->kind == BLOCKS_I8_Q4K || job->kind == BLOCKS_I8_Q6K
        || form_scale_bits[job->kind] == 16) {
        group_tile_portable(job, group, r0, tile);
        return;
    }
#if INT8_PATH == INT8_AVX512_VNNI
    group_tile_vnni(job, group, r0, tile);
#elif INT8_PATH == INT8_AVX_VNNI
    group_tile_256(job, group, r0, tile);
#elif INT8_PATH == INT8_NEON || INT8_PATH == INT8_DOTPROD
    group_tile_neon(job, group, r0, tile);
#else
    group_tile_portable(job, group, r0, tile);
#endif
#endif
}

static void int8_part(const void *arg, int part, int parts) {
    const Int8Job *job = arg;
    (void)parts;
    int64_t limit, group;
    while ((group = work_ranges_take(job->items, part, &limit)) >= 0)
        for (int64_t r0 = 0; r0 < job->rows; r0 += INT8_ROW_TILE)
            group_tile(job, group, r0, (int)(job->rows - r0 < INT8_ROW_TILE ? job->rows - r0
                                                                            : INT8_ROW_TILE));
}

/* block_gemm for the int8 kinds (kernels.h): 1 for N not a multiple of 16 (the
 * super-block forms: K not one of 256) or a missing d or m (only the forms with an
 * implied minimum have no m), 2 when out of memory. */
int int8_block_gemm(int kind, const float *x, int64_t rows, int64_t k, const void *q,
                    const float *d, const float *m, int64_t n, float *y, int64_t ldy,
                    int num_threads) {
    if (n % GROUP || ((kind == BLOCKS_I8_Q4K || kind == BLOCKS_I8_Q6K) && k % 256)
        || !d || (!m && !form_implied_minimum[kind]))    /* every other form reads m */
        return 1;
    const int64_t blocks = k / BLOCK;
    QuantizedRows quantized = {malloc((size_t)(rows * k)),
                               malloc(sizeof(float) * (size_t)(rows * blocks)),
                               malloc(sizeof(float) * (size_t)(rows * blocks * 2)),
                               malloc(sizeof(float) * (size_t)(rows * blocks)),
                               malloc(sizeof(int32_t) * (size_t)(rows * blocks * 2))};
    int status = 0;
    if (!quantized.codes || !quantized.scales || !quantized.sums16 || !quantized.sums32
        || !quantized.code_sums16) {
        status = 2;
    } else {
        quantize_rows(x, rows, k, &quantized, num_threads);
        WorkRanges items;
        work_ranges_init(&items, n / GROUP, num_threads);
        Int8Job job = {kind, &quantized, q, d, m, rows, k, n, y, ldy, &items};
        run_parallel(int8_part, &job, num_threads);
    }
    free(quantized.codes);
    free(quantized.scales);
    free(quantized.sums16);
    free(quantized.sums32);
    free(quantized.code_sums16);
    return status;
}

/* Which loop this build multiplies int8 activations with: kernels.h's INT8_* (native.py's
 * INT8_PATHS). */
int int8_path(void) {
    return INT8_PATH;
}
