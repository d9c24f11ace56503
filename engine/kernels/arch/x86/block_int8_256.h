/* The int8-activation group tile on 256-bit x86 vectors (block_int8.c's INT8_AVX2 and
 * INT8_AVX_VNNI paths; included there after Int8Job, whose layout it reads).
 *
 * A group's 16 columns are two halves of 8 lanes: bytes 0-31 and 32-63 of each 64-byte
 * vector of the repacked layout (block_int8.c's header). With AVX-VNNI `vpdpbusd` sums
 * the unsigned codes times x's bytes as on AVX-512. AVX2 has `vpmaddubsw` (pairs of
 * unsigned x signed bytes into int16, saturating) and `vpmaddwd` (pairs of int16 into
 * int32):
 *   - Q4 codes (0..15) times x (|x| <= 127): a pair sums to at most 3,810, so all 8
 *     dwords of a block (both its halves: the Q4 form has one scale per block) are
 *     summed in int16 and widened once;
 *   - the halves form holds only Q6_K's codes (q - 32 + 128: 96..159), so c - 96
 *     (0..63) is a `vpmaddubsw` operand itself, two dwords' pairs still fit int16, and
 *     96 * sum(x) is added back;
 *   - other unsigned codes (Q8_0's c + 128, Q5's 0..31) would overflow a pair: they are
 *     shifted to signed (c - 128, at most 128 in size) and multiplied by sign trick,
 *     |c - 128| times x with c - 128's sign, and 128 * sum(x) is added back.
 * The integers are the portable loop's, so only the fp32 scaling's order differs.
 *
 * The fp16 forms (avx2 only: I8_Q4_0 and I8_Q4_1 hold I8_Q4's codes, I8_Q8_0 I8_U8's)
 * take the same sums; their scales are widened with `vcvtph2ps` once per half block.
 * The super-block forms (avx2 only) take the same sums: I8_Q4K's codes are I8_Q4's,
 * and I8_Q6K's low nibbles and high bits unpack straight to q (0..63), the halves
 * form's c - 96. Their per-block scales are formed once per block and half from the
 * integer sub-scales (block_int8.c's header), so every row's fp32 operations are the
 * wide forms' own.
 *
 * The form and the tile's rows are compile-time constants in each instance
 * (group_tile_256 dispatches), so the row loop unrolls and no branch is left inside.
 */
#ifndef KVSERVE_BLOCK_INT8_256_H
#define KVSERVE_BLOCK_INT8_256_H

#include <immintrin.h>

enum { FORM_Q4, FORM_U8, FORM_U8_HALVES, FORM_Q4K, FORM_Q6K, FORM_Q4_0, FORM_Q4_1, FORM_Q8_0 };

/* Forms whose blocks are 4-bit codes summed whole, forms with two scales a block, and
 * forms that keep the file's fp16 scales. */
#define NIBBLE_FORM(form) \
    ((form) == FORM_Q4 || (form) == FORM_Q4K || (form) == FORM_Q4_0 || (form) == FORM_Q4_1)
#define HALVES_FORM(form) ((form) == FORM_U8_HALVES || (form) == FORM_Q6K)
#define FP16_FORM(form) ((form) == FORM_Q4_0 || (form) == FORM_Q4_1 || (form) == FORM_Q8_0)

/* acc + the dword sums of w's unsigned bytes times x's signed ones (AVX-VNNI). */
#if INT8_PATH == INT8_AVX_VNNI
#define DOT_U8(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
#endif

/* Blocks read ahead of the one multiplied. Every line of the block is asked for: the
 * hardware's stream prefetchers stop at each 4 KB page, and asking for half the lines
 * (as this did before) was slower than asking for none (docs/cpu-kernels.md, "Memory
 * layout"). A line past the tensor's end is only a hint, never a fault. */
#define PREFETCH_BLOCKS 8

static inline void prefetch_block(const uint8_t *block, int64_t block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)
        _mm_prefetch((const char *)(block + line), _MM_HINT_T0);
}

static inline __m256i widen_pairs(__m256i pairs16) {
    return _mm256_madd_epi16(pairs16, _mm256_set1_epi16(1));
}

/* One block's weights of half h: w[t] pairs with x's dword t (Q4: t < 4 the low
 * nibbles, t >= 4 the high ones). On AVX2 the halves form is c - 96 and the U8 form
 * |c - 128| in w with c - 128 in `sign`. */
static inline __attribute__((always_inline)) void unpack_half(
        const uint8_t *qb, int h, const int form, __m256i *w, __m256i *sign) {
    if (NIBBLE_FORM(form) || form == FORM_Q6K) {
        const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qb + 64 * t + 32 * h));
            w[t] = _mm256_and_si256(v, low_nibbles);
            w[4 + t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        }
        if (form == FORM_Q6K) {
            /* bits 2t..2t+1 of each byte to bits 4..5: shifts within 16-bit lanes,
             * the bits crossing into the neighbour byte masked off */
            const __m256i high_bits = _mm256_set1_epi8(0x30);
            for (int u = 0; u < 2; u++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qb + 256 + 64 * u + 32 * h));
                __m256i *wu = w + 4 * u;
                wu[0] = _mm256_or_si256(wu[0], _mm256_and_si256(_mm256_slli_epi16(v, 4), high_bits));
                wu[1] = _mm256_or_si256(wu[1], _mm256_and_si256(_mm256_slli_epi16(v, 2), high_bits));
                wu[2] = _mm256_or_si256(wu[2], _mm256_and_si256(v, high_bits));
                wu[3] = _mm256_or_si256(wu[3], _mm256_and_si256(_mm256_srli_epi16(v, 2), high_bits));
            }
        }
        return;
    }
    for (int t = 0; t < 8; t++) {
        w[t] = _mm256_loadu_si256((const __m256i *)(qb + 64 * t + 32 * h));
#if INT8_PATH == INT8_AVX2
        if (form == FORM_U8_HALVES) {
            w[t] = _mm256_sub_epi8(w[t], _mm256_set1_epi8(96));
        } else {
            sign[t] = _mm256_xor_si256(w[t], _mm256_set1_epi8((char)0x80));
            w[t] = _mm256_abs_epi8(sign[t]);
        }
#else
        (void)sign;
#endif
    }
}

/* The int32 sums of one row's block against one half: elements 0-15 into *low, 16-31
 * into *high (Q4: all 32 into *low, *high zero). xq: the row's block as 8 dwords;
 * code_sums: its two integer sums per 16. */
static inline __attribute__((always_inline)) void row_sums(
        const __m256i *w, const __m256i *sign, const int32_t *xq, const int32_t *code_sums,
        const int form, __m256i *low, __m256i *high) {
    __m256i x[8];
    for (int t = 0; t < 8; t++) x[t] = _mm256_set1_epi32(xq[t]);
#if INT8_PATH == INT8_AVX_VNNI
    (void)sign, (void)code_sums;
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        a = DOT_U8(a, w[t], x[t]);
        c = DOT_U8(c, w[4 + t], x[4 + t]);
    }
    if (NIBBLE_FORM(form)) a = _mm256_add_epi32(a, c), c = _mm256_setzero_si256();
    *low = a;
    *high = c;
#else
    if (NIBBLE_FORM(form)) {
        __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], x[0]),
                                     _mm256_maddubs_epi16(w[1], x[1]));
        for (int t = 2; t < 8; t++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[t], x[t]));
        *low = widen_pairs(s);
        *high = _mm256_setzero_si256();
        return;
    }
    const int offset = HALVES_FORM(form) ? 96 : 128;
    __m256i half[2];
    for (int part = 0; part < 2; part++) {
        const __m256i *wp = w + 4 * part, *xp = x + 4 * part;
        __m256i a = _mm256_set1_epi32(offset * code_sums[part]);
        if (HALVES_FORM(form)) {
            a = _mm256_add_epi32(a, widen_pairs(_mm256_add_epi16(
                    _mm256_maddubs_epi16(wp[0], xp[0]), _mm256_maddubs_epi16(wp[1], xp[1]))));
            a = _mm256_add_epi32(a, widen_pairs(_mm256_add_epi16(
                    _mm256_maddubs_epi16(wp[2], xp[2]), _mm256_maddubs_epi16(wp[3], xp[3]))));
        } else {
            const __m256i *sp = sign + 4 * part;
            for (int t = 0; t < 4; t++)
                a = _mm256_add_epi32(a, widen_pairs(_mm256_maddubs_epi16(
                        wp[t], _mm256_sign_epi8(xp[t], sp[t]))));
        }
        half[part] = a;
    }
    *low = half[0];
    *high = half[1];
#endif
}

/* Half h's scales and minima of block b (the halves forms: of both 16-weight halves,
 * in *d1 and *m1 too): loaded, widened from the file's fp16 (a minimum not stored is
 * the table's multiple of the scale, as the parser forms the wide forms' one), or for
 * the super-block forms formed from their integer sub-scales as the parser forms the
 * wide forms' values (block_parse.c). */
static inline __attribute__((always_inline)) void half_scales(
        const GroupView *view, int64_t b, int h, const int form,
        __m256 *d0, __m256 *m0, __m256 *d1, __m256 *m1) {
    if (FP16_FORM(form)) {
        const int64_t at = b * GROUP + 8 * h;
        *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(view->d16 + at)));
        *m0 = form == FORM_Q4_1
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(view->m16 + at)))
            : _mm256_mul_ps(*d0, _mm256_set1_ps(view->implied_minimum));
        return;
    }
    if (form == FORM_Q4K) {
        const float *sup = view->d + (b / 8) * 2 * GROUP + 8 * h;
        const uint8_t *sub = view->sub + b * 2 * GROUP + 8 * h;
        *d0 = _mm256_mul_ps(_mm256_loadu_ps(sup), _mm256_cvtepi32_ps(
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sub))));
        const __m256 minimum = _mm256_mul_ps(_mm256_loadu_ps(sup + GROUP), _mm256_cvtepi32_ps(
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sub + GROUP)))));
        *m0 = _mm256_xor_ps(minimum, _mm256_set1_ps(-0.0f));
        return;
    }
    if (form == FORM_Q6K) {
        const __m256 sup = _mm256_loadu_ps(view->d + (b / 8) * GROUP + 8 * h);
        const uint8_t *sub = view->sub + b * 2 * GROUP + 8 * h;
        *d0 = _mm256_mul_ps(sup, _mm256_cvtepi32_ps(
                  _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sub))));
        *d1 = _mm256_mul_ps(sup, _mm256_cvtepi32_ps(
                  _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sub + GROUP)))));
        *m0 = _mm256_mul_ps(*d0, _mm256_set1_ps(-128.0f));
        *m1 = _mm256_mul_ps(*d1, _mm256_set1_ps(-128.0f));
        return;
    }
    const int64_t at = b * (HALVES_FORM(form) ? 2 : 1) * GROUP + 8 * h;
    *d0 = _mm256_loadu_ps(view->d + at);
    *m0 = _mm256_loadu_ps(view->m + at);
    if (HALVES_FORM(form)) {
        *d1 = _mm256_loadu_ps(view->d + at + GROUP);
        *m1 = _mm256_loadu_ps(view->m + at + GROUP);
    }
}

/* One group of 16 columns against `tile` rows (from row r0), all blocks; each half's
 * weights and scales are unpacked once per block for the tile's rows. */
static inline __attribute__((always_inline)) void group_tile_256_form(
        const Int8Job *job, int64_t group, int64_t r0, const int tile, const int form) {
    const GroupView view = group_view(job, group);
    const int64_t blocks = view.blocks, k = job->k;
    const int64_t block_bytes = NIBBLE_FORM(form) ? 256 : form == FORM_Q6K ? 384 : 512;
    const uint8_t *q = view.q;
    const int8_t *codes = job->x->codes + r0 * k;
    const float *scales = job->x->scales + r0 * blocks, *sums16 = job->x->sums16 + r0 * 2 * blocks;
    const float *sums32 = job->x->sums32 + r0 * blocks;
    const int32_t *code_sums = job->x->code_sums16 + r0 * 2 * blocks;
    __m256 acc[INT8_ROW_TILE][2];
    for (int r = 0; r < tile; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * block_bytes;
        prefetch_block(qb + PREFETCH_BLOCKS * block_bytes, block_bytes);
        for (int h = 0; h < 2; h++) {
            __m256i w[8], sign[8];
            __m256 d0, m0, d1 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
            unpack_half(qb, h, form, w, sign);
            half_scales(&view, b, h, form, &d0, &m0, &d1, &m1);
            for (int r = 0; r < tile; r++) {
                __m256i low, high;
                row_sums(w, sign, (const int32_t *)(codes + r * k + b * BLOCK),
                         code_sums + r * 2 * blocks + 2 * b, form, &low, &high);
                const __m256 scale = _mm256_broadcast_ss(scales + r * blocks + b);
                if (HALVES_FORM(form)) {
                    const float *s16 = sums16 + r * 2 * blocks + 2 * b;
                    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low),
                                               _mm256_mul_ps(d0, scale), acc[r][h]);
                    a = _mm256_fmadd_ps(m0, _mm256_broadcast_ss(s16), a);
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), _mm256_mul_ps(d1, scale), a);
                    acc[r][h] = _mm256_fmadd_ps(m1, _mm256_broadcast_ss(s16 + 1), a);
                } else {
                    const __m256i total = NIBBLE_FORM(form) ? low : _mm256_add_epi32(low, high);
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                                     _mm256_mul_ps(d0, scale), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(m0, _mm256_broadcast_ss(sums32 + r * blocks + b),
                                                a);
                }
            }
        }
    }
    for (int r = 0; r < tile; r++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(job->y + (r0 + r) * job->ldy + group * GROUP + 8 * h, acc[r][h]);
}

#if INT8_PATH == INT8_AVX2
/* I8_Q6K's tile: its integer sub-scales applied in the integers. Per half block,
 * vpmaddwd multiplies each 16-weight half's int16 pair sums by its scale (a lane's
 * int8 scale in both int16 halves of its dword), and one more vpmaddwd adds -32 x
 * (scale0 x code_sum0 + scale1 x code_sum1), so a lane's int32 is exactly
 *   sum over the block of scale(e) * (q(e) - 32) * xq(e),
 * at most 2 x 128 x 16 x 32 x 127 in size: exact in fp32 (< 2^24). One conversion
 * and one FMA by d * dx per row then finish the block, where the wide form takes two
 * of each and two FMAs for its minima. The products equal the wide form's within
 * fp32 rounding (the scale meets d before dx there). */
static inline __attribute__((always_inline)) void group_tile_256_q6k_form(
        const Int8Job *job, int64_t group, int64_t r0, const int tile) {
    const GroupView view = group_view(job, group);
    const int64_t blocks = view.blocks, k = job->k, block_bytes = 384;
    const int8_t *codes = job->x->codes + r0 * k;
    const float *scales = job->x->scales + r0 * blocks;
    const int32_t *code_sums = job->x->code_sums16 + r0 * 2 * blocks;
    const __m256i low_words = _mm256_set1_epi32(0xFFFF);
    __m256 acc[INT8_ROW_TILE][2];
    for (int r = 0; r < tile; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = view.q + b * block_bytes;
        prefetch_block(qb + PREFETCH_BLOCKS * block_bytes, block_bytes);
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            unpack_half(qb, h, FORM_Q6K, w, NULL);
            const uint8_t *sub = view.sub + b * 2 * GROUP + 8 * h;
            const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sub));
            const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sub + GROUP)));
            const __m256i pair0 = _mm256_or_si256(_mm256_and_si256(s0, low_words),
                                                  _mm256_slli_epi32(s0, 16));
            const __m256i pair1 = _mm256_or_si256(_mm256_and_si256(s1, low_words),
                                                  _mm256_slli_epi32(s1, 16));
            const __m256i offsets = _mm256_or_si256(   /* -32 scale0 | -32 scale1 << 16 */
                _mm256_and_si256(_mm256_mullo_epi16(s0, _mm256_set1_epi16(-32)), low_words),
                _mm256_slli_epi32(_mm256_mullo_epi16(s1, _mm256_set1_epi16(-32)), 16));
            const __m256 d = _mm256_loadu_ps(view.d + (b / 8) * GROUP + 8 * h);
            for (int r = 0; r < tile; r++) {
                const int32_t *xq = (const int32_t *)(codes + r * k + b * BLOCK);
                const int32_t *cs = code_sums + r * 2 * blocks + 2 * b;
                __m256i x[8];
                for (int t = 0; t < 8; t++) x[t] = _mm256_set1_epi32(xq[t]);
                __m256i total = _mm256_madd_epi16(
                    offsets, _mm256_set1_epi32((int32_t)(((uint32_t)cs[0] & 0xFFFFu)
                                                         | ((uint32_t)cs[1] << 16))));
                for (int part = 0; part < 4; part++) {
                    const __m256i sums = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[2 * part], x[2 * part]),
                        _mm256_maddubs_epi16(w[2 * part + 1], x[2 * part + 1]));
                    total = _mm256_add_epi32(total, _mm256_madd_epi16(sums, part < 2 ? pair0 : pair1));
                }
                const __m256 scale = _mm256_broadcast_ss(scales + r * blocks + b);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, scale),
                                            acc[r][h]);
            }
        }
    }
    for (int r = 0; r < tile; r++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(job->y + (r0 + r) * job->ldy + group * GROUP + 8 * h, acc[r][h]);
}
#endif

/* Instances per form with the tile's rows constant: full tiles of INT8_ROW_TILE, and
 * a step's remainder (or a decode step of a few rows) by its own count. */
#define TILE_CASES(form)                                                              \
    switch (tile) {                                                                   \
    case 1: group_tile_256_form(job, group, r0, 1, form); break;                      \
    case 2: group_tile_256_form(job, group, r0, 2, form); break;                      \
    case 3: group_tile_256_form(job, group, r0, 3, form); break;                      \
    case 4: group_tile_256_form(job, group, r0, 4, form); break;                      \
    case 5: group_tile_256_form(job, group, r0, 5, form); break;                      \
    case 6: group_tile_256_form(job, group, r0, 6, form); break;                      \
    case 7: group_tile_256_form(job, group, r0, 7, form); break;                      \
    default: group_tile_256_form(job, group, r0, INT8_ROW_TILE, form);                \
    }

static __attribute__((noinline)) void group_tile_256_q4(const Int8Job *job, int64_t group,
                                                        int64_t r0, int tile) {
    TILE_CASES(FORM_Q4)
}

static __attribute__((noinline)) void group_tile_256_u8(const Int8Job *job, int64_t group,
                                                        int64_t r0, int tile) {
    TILE_CASES(FORM_U8)
}

static __attribute__((noinline)) void group_tile_256_halves(const Int8Job *job, int64_t group,
                                                            int64_t r0, int tile) {
    TILE_CASES(FORM_U8_HALVES)
}

#if INT8_PATH == INT8_AVX2
static __attribute__((noinline)) void group_tile_256_q4_0(const Int8Job *job, int64_t group,
                                                          int64_t r0, int tile) {
    TILE_CASES(FORM_Q4_0)
}

static __attribute__((noinline)) void group_tile_256_q4_1(const Int8Job *job, int64_t group,
                                                          int64_t r0, int tile) {
    TILE_CASES(FORM_Q4_1)
}

static __attribute__((noinline)) void group_tile_256_q8_0(const Int8Job *job, int64_t group,
                                                          int64_t r0, int tile) {
    TILE_CASES(FORM_Q8_0)
}

static __attribute__((noinline)) void group_tile_256_q4k(const Int8Job *job, int64_t group,
                                                         int64_t r0, int tile) {
    TILE_CASES(FORM_Q4K)
}

static __attribute__((noinline)) void group_tile_256_q6k(const Int8Job *job, int64_t group,
                                                         int64_t r0, int tile) {
    switch (tile) {
    case 1: group_tile_256_q6k_form(job, group, r0, 1); break;
    case 2: group_tile_256_q6k_form(job, group, r0, 2); break;
    case 3: group_tile_256_q6k_form(job, group, r0, 3); break;
    case 4: group_tile_256_q6k_form(job, group, r0, 4); break;
    case 5: group_tile_256_q6k_form(job, group, r0, 5); break;
    case 6: group_tile_256_q6k_form(job, group, r0, 6); break;
    case 7: group_tile_256_q6k_form(job, group, r0, 7); break;
    default: group_tile_256_q6k_form(job, group, r0, INT8_ROW_TILE);
    }
}
#endif

static void group_tile_256(const Int8Job *job, int64_t group, int64_t r0, int tile) {
#if INT8_PATH == INT8_AVX2
    if (job->kind == BLOCKS_I8_Q4K) {
        group_tile_256_q4k(job, group, r0, tile);
        return;
    }
    if (job->kind == BLOCKS_I8_Q6K) {
        group_tile_256_q6k(job, group, r0, tile);
        return;
    }
    if (job->kind == BLOCKS_I8_Q4_0 || job->kind == BLOCKS_I8_Q4_1 || job->kind == BLOCKS_I8_Q8_0) {
        (job->kind == BLOCKS_I8_Q4_0 ? group_tile_256_q4_0
         : job->kind == BLOCKS_I8_Q4_1 ? group_tile_256_q4_1 : group_tile_256_q8_0)(
            job, group, r0, tile);
        return;
    }
#endif
    if (job->kind == BLOCKS_I8_Q4) group_tile_256_q4(job, group, r0, tile);
    else if (job->kind == BLOCKS_I8_U8_HALVES) group_tile_256_halves(job, group, r0, tile);
    else group_tile_256_u8(job, group, r0, tile);
}

#endif
