/* The micro tile of prefill_attention.c: TILE_ROWS query rows against one block of
 * KEY_BLOCK packed keys at a time, with an online softmax (see prefill_attention.c for
 * the packed layouts and the precision). Included by prefill_attention.c alone, after
 * its TILE_ROWS, KEY_BLOCK and MAX_DIM, on AVX512-BF16 builds. */
#ifndef KVSERVE_PREFILL_TILES_H
#define KVSERVE_PREFILL_TILES_H
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
#error "prefill_tiles.h is for AVX512-BF16 builds only"
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

static inline __m512bh broadcast_word(uint32_t word) {
    return (__m512bh)_mm512_set1_epi32((int)word);
}

/* One micro tile's running state: rows' queries, softmax state and output. */
typedef struct Tile {
    _Alignas(64) uint32_t q[TILE_ROWS][MAX_DIM / 2];     /* bf16 pairs, as words */
    _Alignas(64) float o[TILE_ROWS][MAX_DIM];
    _Alignas(64) uint32_t p[TILE_ROWS][KEY_BLOCK / 2];   /* the block's probabilities */
    __m512 l[TILE_ROWS];                        /* per-lane partial sums of e^(s - m) */
    _Alignas(64) float m[TILE_ROWS], alpha[16];
    int64_t first[TILE_ROWS], last[TILE_ROWS];  /* visible key indices, inclusive */
} Tile;

/* scores [TILE_ROWS][2] (32 keys from key index kb) = q . k for every row. */
static inline __attribute__((always_inline)) void tile_scores(
        const Tile *tile, int64_t dim, const uint32_t *keys, __m512 s[TILE_ROWS][2]) {
    const int64_t pairs = dim / 2;
    for (int r = 0; r < TILE_ROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)(keys + p * 16));
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(keys + (pairs + p) * 16));
        for (int r = 0; r < TILE_ROWS; r++) {
            const __m512bh q = broadcast_word(tile->q[r][p]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], q, k0);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], q, k1);
        }
    }
}

/* Online softmax over one block: masks what a row may not see, updates m and l,
 * leaves the rescale of O in alpha and the probabilities, in bf16, in p.
 * The rows' rescales come from one vector exp; l is kept per lane (16 partial sums a
 * row, added up at the end). */
static inline void tile_softmax(Tile *tile, __m512 s[TILE_ROWS][2], int64_t kb, int masked) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _Alignas(64) float top[16], before[16];
    for (int r = 0; r < TILE_ROWS; r++) {
        if (masked) {
            for (int h = 0; h < 2; h++) {
                const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(kb + 16 * h)));
                const __mmask16 seen =
                    _mm512_cmpge_epi32_mask(index, _mm512_set1_epi32((int)tile->first[r])) &
                    _mm512_cmple_epi32_mask(index, _mm512_set1_epi32((int)tile->last[r]));
                s[r][h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, s[r][h]);
            }
        }
        const float peak = _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1]));
        before[r] = tile->m[r];
        top[r] = peak > tile->m[r] ? peak : tile->m[r];
        tile->m[r] = top[r];
    }
    const __mmask16 rows = (__mmask16)((1u << TILE_ROWS) - 1u);
    _mm512_mask_storeu_ps(tile->alpha, rows, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rows, before),
                                                                  _mm512_maskz_loadu_ps(rows, top))));
    for (int r = 0; r < TILE_ROWS; r++) {
        const __m512 p0 = exp16(_mm512_sub_ps(s[r][0], _mm512_set1_ps(top[r])));
        const __m512 p1 = exp16(_mm512_sub_ps(s[r][1], _mm512_set1_ps(top[r])));
        tile->l[r] = _mm512_fmadd_ps(tile->l[r], _mm512_set1_ps(tile->alpha[r]), _mm512_add_ps(p0, p1));
        _mm256_storeu_si256((__m256i *)tile->p[r], (__m256i)_mm512_cvtneps_pbh(p0));
        _mm256_storeu_si256((__m256i *)(tile->p[r] + 8), (__m256i)_mm512_cvtneps_pbh(p1));
    }
}

/* O[rows r0 .. r0 + 4)[dims 16 c0 .. + 16 vecs] = alpha O + P V over the block's 16 key
 * pairs; values: the block's first packed pair. */
static inline __attribute__((always_inline)) void tile_weigh(
        Tile *tile, const uint32_t *values, int64_t dim, int r0, int64_t c0, const int vecs) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < vecs; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(tile->o[r0 + r] + 16 * (c0 + v)),
                                      _mm512_set1_ps(tile->alpha[r0 + r]));
    for (int q = 0; q < KEY_BLOCK / 2; q++) {
        __m512bh v[4];
        for (int i = 0; i < vecs; i++)
            v[i] = (__m512bh)_mm512_loadu_si512((const void *)(values + q * dim + 16 * (c0 + i)));
        for (int r = 0; r < 4; r++) {
            const __m512bh p = broadcast_word(tile->p[r0 + r][q]);
            for (int i = 0; i < vecs; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], p, v[i]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < vecs; v++)
            _mm512_storeu_ps(tile->o[r0 + r] + 16 * (c0 + v), acc[r][v]);
}

#endif
