/* bf16_gemm's tile on AVX2 + FMA (no bf16 dot products): included by bf16_gemm.c,
 * which owns the job, the packed layout and the threads.
 *
 * The weights stay in bf16_gemm.c's pairs, read at half fp32's bytes, and are widened
 * in registers: a word holds W[c][2p] in its low half and W[c][2p + 1] in its high
 * half, so `word << 16` is W[c][2p] as an fp32 and `word & 0xffff0000` is W[c][2p + 1]
 * (bf16 is fp32's top half: exact). x is widened once per call into fp32 rows
 * (GemmJob.wide), so a row's pair p is two broadcasts from memory. Per pair a tile of
 * ROWS rows x 16 columns does 2 loads and 4 shifts or ands of weights, 2 ROWS
 * broadcasts and 4 ROWS FMAs. ROWS 5 fills the 16 ymm registers (10 accumulators, 4
 * widened weight vectors, 2 broadcasts) and gives each accumulator's chain of 2 FMAs
 * a pair 20 FMAs of cover, so the FMA units set the pace, as in an fp32 GEMM;
 * 4 rows leave the chains' latency exposed and 6 spill (docs/cpu-kernels.md, the
 * widening tile, has the rates).
 *
 * The sums are the same products as fp32's (bf16 x bf16 is exact in fp32), added in
 * pair order: even element, then odd, per accumulator. */
#ifndef KVSERVE_BF16_TILE_256_H
#define KVSERVE_BF16_TILE_256_H

#define ROWS 5

static inline __m256 even_halves(__m256i words) {     /* W[c][2p] of each word */
    return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

static inline __m256 odd_halves(__m256i words) {      /* W[c][2p + 1] of each word */
    return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xffff0000u)));
}

/* sums[r][0 .. 16) = rows row + r of x times the 16 columns of vector `vector`;
 * `next` (or NULL): the same vector of the next panel, prefetched into L2. */
static inline void tile_vector(const GemmJob *job, int64_t row, int64_t rows, int64_t vector,
                               const uint32_t *next, float sums[ROWS][16]) {
    const int64_t pairs = job->k / 2;
    const uint32_t *w = job->w + vector * pairs * 16;
    const float *x[ROWS];
    wide_rows(job, row, rows, ROWS, x);
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m256i low = _mm256_loadu_si256((const __m256i *)(w + p * 16));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(w + p * 16 + 8));
        if (next) _mm_prefetch((const char *)(next + p * 16), _MM_HINT_T1);
        const __m256 even0 = even_halves(low), odd0 = odd_halves(low);
        const __m256 even1 = even_halves(high), odd1 = odd_halves(high);
        for (int r = 0; r < ROWS; r++) {
            const __m256 first = _mm256_broadcast_ss(x[r] + 2 * p);
            const __m256 second = _mm256_broadcast_ss(x[r] + 2 * p + 1);
            acc[r][0] = _mm256_fmadd_ps(second, odd0, _mm256_fmadd_ps(first, even0, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(second, odd1, _mm256_fmadd_ps(first, even1, acc[r][1]));
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(sums[r], acc[r][0]);
        _mm256_storeu_ps(sums[r] + 8, acc[r][1]);
    }
}

/* One row's 16 sums into y at `column` (fp32, or bf16 rounded to nearest even). */
static inline void store_sums(const GemmJob *job, int64_t row, int64_t column,
                              const float *sums) {
    const int64_t left = job->gated_inter ? 16 : job->n - column;
    if (job->y_bf16) {
        uint16_t *out = (uint16_t *)job->y + row * job->y_stride + column;
        if (left >= 16) {
            store_bf16x8(out, _mm256_loadu_ps(sums));
            store_bf16x8(out + 8, _mm256_loadu_ps(sums + 8));
        } else {
            for (int64_t c = 0; c < left; c++) out[c] = float_to_bf16(sums[c]);
        }
    } else {
        memcpy((float *)job->y + row * job->y_stride + column, sums,
               (size_t)(left >= 16 ? 16 : left) * sizeof(float));
    }
}

/* act(gate) * up of one row into y (bf16), gate and up the sums of the pair of
 * vectors (gate j, up j) starting at vector = 2 j: columns 16 j .. 16 j + 15. */
static inline void store_fused_sums(const GemmJob *job, int64_t row, int64_t vector,
                                    const float *gate, const float *up) {
    uint16_t *out = (uint16_t *)job->y + row * job->y_stride + (vector / 2) * 16;
    for (int half = 0; half < 16; half += 8) {
        const __m256 g = _mm256_loadu_ps(gate + half), u = _mm256_loadu_ps(up + half);
        store_bf16x8(out + half, job->fused == ACTIVATION_GELU_TANH ? gelu_tanh_times8(g, u)
                                                                     : silu_times8(g, u));
    }
}

/* x [m, k] bf16 (rows x_stride apart) -> fp32 [m, k] contiguous, or NULL when out of
 * memory. */
static float *widen_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    float *wide = malloc((size_t)(m * k) * sizeof(float));
    if (!wide) return NULL;
    for (int64_t r = 0; r < m; r++) {
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) _mm256_storeu_ps(wide + r * k + i, load_bf16x8(x + r * x_stride + i));
        for (; i < k; i++) wide[r * k + i] = bf16_to_float(x[r * x_stride + i]);
    }
    return wide;
}

#endif
