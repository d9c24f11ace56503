/* y[M, N] = x[M, K] @ W^T with bf16 x and W, fp32 accumulation (AVX512-BF16, or the
 * widening tiles over the same layout: bf16_tile_256.h on AVX2, bf16_tile_neon.h on
 * AArch64), for the row counts of batched decode steps.
 *
 * W is packed once at load in pairs: [ceil(N / 16)][K / 2][16] 32-bit words, word
 * (j, p, c) holding W[16 j + c][2p] and W[16 j + c][2p + 1] (zero past N). A row of
 * x in bf16 is already pairs: word p = (x[2p], x[2p + 1]). One vdpbf16ps with the
 * broadcast word p of a row and the 16 words (j, p, .) adds the 16 columns' products
 * of that pair: after the K / 2 pairs, lane c holds y[row][16 j + c].
 *
 * The microkernel keeps ROWS x 3 such accumulators (8 rows, 48 columns: 24 of the 32
 * registers), reading per pair 3 weight vectors and 8 broadcast words for 24 dot
 * products, so it runs at the dot-product unit's rate; K is not blocked (the
 * projections' K of 576-1536 keep a row tile's x in L1 and a 48-column weight panel
 * in L2). Threads take whole panels (worker_pool.h's shared ranges); each panel is
 * read from memory by the first row tile, which prefetches the next panel into L2,
 * and from L2 by the others. docs/cpu-kernels.md, NATIVE_BF16_MAX_ROWS, compares it
 * with oneDNN on its own packed weights.
 *
 * On CPUs with AMX (bf16_amx.c) the same layout feeds tile products instead, for K a
 * multiple of 32: panels of 2 vectors, 32 rows at a time, the epilogue below.
 *
 * Output: fp32, or bf16 rounded to nearest even (vcvtneps2bf16, as oneDNN's).
 * bf16_gated_gemm runs a gated MLP's gate/up product on a paired layout (gate and up
 * in alternating 16-row blocks, one pair per panel) and writes act(gate) * up in
 * bf16 from the fp32 sums (act: SiLU, or GELU's tanh form); bf16_gemm's plain products of that layout put each block
 * back at its column (gate columns first).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"
#include "worker_pool.h"

#define PANEL 3          /* 16-column vectors per panel */
#define AMX_ROW_BLOCK 256  /* rows of x per AMX work item: 256 x 1,536 bf16 is 768 KB */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_GEMM BF16_GEMM_DOT
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BF16_GEMM BF16_GEMM_WIDEN      /* the tile of bf16_tile_256.h */
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(KVSERVE_PLAIN_C)
#define BF16_GEMM BF16_GEMM_WIDEN      /* the tile of bf16_tile_neon.h */
#else
#define BF16_GEMM BF16_GEMM_NONE
#endif

int bf16_gemm_available(void) { return BF16_GEMM; }

#if BF16_GEMM != BF16_GEMM_NONE
typedef struct {
    const uint16_t *x;
    int64_t x_stride;        /* bf16 elements from one row of x to the next */
    const uint32_t *w;
    int64_t m, k, n, vectors;        /* vectors = ceil(n / 16) */
    void *y;
    int64_t y_stride;        /* elements from one row of y to the next */
    int y_bf16;
    int64_t gated_inter;     /* > 0: W is a gated MLP's gate/up in alternating 16-row blocks
                                (see bf16_gated_gemm), `gated_inter` rows of each */
    int fused;               /* y [m, gated_inter] bf16 = act(gate) * up: 0 no, else the
                                activation (ACTIVATION_SILU, ACTIVATION_GELU_TANH) */
    int64_t panel;           /* vectors per panel: 3, or 2 (one gate/up pair) when fused */
    WorkRanges *panels;      /* panels (AMX: row blocks x panels), shared by the parts */
    int amx;                 /* 1: AMX tiles (bf16_amx.c), panels of 2 vectors */
    const uint16_t *tail;    /* AMX, m > AMX_ROW_BLOCK not a multiple of 16: x's last
                                m % 16 rows, then zero rows, 16 rows of k */
    const uint16_t *tiles;   /* AMX: x as whole A tiles (tile_x), or NULL: x itself */
    const float *wide;       /* the widening tile: x in fp32, [m, k] contiguous */
} GemmJob;

/* The first column of y that vector v fills: 16 v, or for a gated layout the gate's
 * (v even) or the up's (v odd) block v / 2. */
static inline int64_t column_of(const GemmJob *job, int64_t v) {
    return job->gated_inter ? (v & 1) * job->gated_inter + (v >> 1) * 16 : 16 * v;
}

static inline int64_t panel_count(const GemmJob *job) {
    return (job->vectors + job->panel - 1) / job->panel;
}

#if BF16_GEMM == BF16_GEMM_DOT
#define ROWS 8

static inline void store_row(const GemmJob *job, int64_t row, int64_t column, __m512 value) {
    const int64_t left = job->gated_inter ? 16 : job->n - column;
    const __mmask16 valid = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    if (job->y_bf16) {
        uint16_t *out = (uint16_t *)job->y + row * job->y_stride + column;
        _mm256_mask_storeu_epi16(out, valid, (__m256i)_mm512_cvtneps_pbh(value));
    } else {
        _mm512_mask_storeu_ps((float *)job->y + row * job->y_stride + column, valid, value);
    }
}

/* act(gate) * up of one row into y (bf16), for the pair of vectors (gate j, up j)
 * starting at vector = 2 j: columns 16 j .. 16 j + 15. */
static inline void store_fused(const GemmJob *job, int64_t row, int64_t vector, __m512 gate,
                               __m512 up) {
    const __m512 activated = job->fused == ACTIVATION_GELU_TANH ? gelu_tanh_times16(gate, up)
                                                                : silu_times16(gate, up);
    uint16_t *out = (uint16_t *)job->y + row * job->y_stride + (vector / 2) * 16;
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(activated));
}

/* Rows [row, row + rows) x vectors [vector, vector + width) of y; `next` (or NULL) is
 * the next panel, prefetched into L2 along the way. */
static inline __attribute__((always_inline)) void tile(
        const GemmJob *job, int64_t row, int64_t rows, int64_t vector, const int width,
        const uint32_t *next) {
    const int64_t pairs = job->k / 2, panel_stride = pairs * 16;
    const uint32_t *w = job->w + vector * panel_stride;
    const uint32_t *x[ROWS];        /* rows past m repeat the last one, not stored */
    for (int r = 0; r < ROWS; r++)
        x[r] = (const uint32_t *)(job->x + (row + (r < rows ? r : rows - 1)) * job->x_stride);
    __m512 acc[ROWS][PANEL];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < width; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh weights[PANEL];
        for (int v = 0; v < width; v++) {
            weights[v] = (__m512bh)_mm512_loadu_si512((const void *)(w + v * panel_stride + p * 16));
            if (next) _mm_prefetch((const char *)(next + v * panel_stride + p * 16), _MM_HINT_T1);
        }
        for (int r = 0; r < ROWS; r++) {
            const __m512bh word = (__m512bh)_mm512_set1_epi32((int)x[r][p]);
            for (int v = 0; v < width; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], word, weights[v]);
        }
    }
    if (job->fused) {       /* width 2: vector (gate j, up j), j = vector / 2 */
        for (int r = 0; r < rows; r++) store_fused(job, row + r, vector, acc[r][0], acc[r][1]);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < width; v++)
            store_row(job, row + r, column_of(job, vector + v), acc[r][v]);
}

/* gemm_part on AMX tiles. Work items are (block of AMX_ROW_BLOCK rows, panel of 2
 * vectors) pairs, row blocks outer: a block's rows of x stay in L2 while every panel
 * meets them, 32 rows at a time through c (row r, column 16 v + j) into y. Panels
 * outer (as the loop runs) read all of x once per panel: a 3,136-row prefill's x of
 * 3.6 MB, past L2, 96 times for a 3,072-column product. */
static void amx_part(const GemmJob *job, int part) {
    float c[32 * 32] __attribute__((aligned(64)));
    const int64_t vector_words = job->k / 2 * 16, panels = panel_count(job);
    int64_t item, limit;
    bf16_amx_begin();
    while ((item = work_ranges_take(job->panels, part, &limit)) >= 0) {
        const int64_t panel = item % panels, vector = panel * 2;
        const int64_t first_row = item / panels * AMX_ROW_BLOCK;
        const int64_t end_row = job->m - first_row < AMX_ROW_BLOCK ? job->m
                                                                   : first_row + AMX_ROW_BLOCK;
        const int width = job->vectors - vector < 2 ? 1 : 2;
        /* the next item's panel, when whole (2 vectors), prefetched by the first rows */
        const int64_t next_vector = (item + 1) % panels * 2;
        const uint32_t *next = item + 1 < limit && next_vector + 2 <= job->vectors
                                   ? job->w + next_vector * vector_words : NULL;
        for (int64_t row = first_row; row < end_row; row += 32) {
            const int64_t rows = end_row - row < 32 ? end_row - row : 32;
            BlockRows blocks[2];
            for (int b = 0; b < 2; b++) {
                const int64_t first = row + 16 * b;
                const int whole = first + 16 <= job->m;
                blocks[b].x = job->tiles ? job->tiles + first * job->k
                              : whole ? job->x + first * job->x_stride : job->tail;
                blocks[b].stride = job->tiles ? 32 : whole ? job->x_stride : job->k;
                blocks[b].chunk_step = job->tiles ? 512 : 32;
            }
            bf16_amx_panel(blocks, rows > 16 ? 2 : 1, job->w + vector * vector_words,
                           vector_words, width, job->k, c, row == first_row ? next : NULL);
            for (int64_t r = 0; r < rows; r++) {
                const __m512 first = _mm512_load_ps(c + r * 32);
                const __m512 second = _mm512_load_ps(c + r * 32 + 16);
                if (job->fused) {
                    store_fused(job, row + r, vector, first, second);
                    continue;
                }
                store_row(job, row + r, column_of(job, vector), first);
                if (width == 2) store_row(job, row + r, column_of(job, vector + 1), second);
            }
        }
    }
    bf16_amx_end();
}

/* x [m, k] (rows x_stride apart) as whole A tiles: tile (g, c), rows 16 g .. 16 g + 15
 * and values 32 c .. 32 c + 31 of K, is 1 KB contiguous at (g * k / 32 + c) * 512,
 * rows past m zero. NULL when out of memory. */
static uint16_t *tile_x(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = (m + 15) / 16, chunks = k / 32;
    uint16_t *tiles = malloc((size_t)(groups * 16 * k) * sizeof(uint16_t));
    if (!tiles) return NULL;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < chunks; c++) {
            uint16_t *tile = tiles + (g * chunks + c) * 512;
            for (int64_t r = 0; r < 16; r++) {
                if (16 * g + r < m)
                    memcpy(tile + r * 32, x + (16 * g + r) * x_stride + 32 * c, 64);
                else
                    memset(tile + r * 32, 0, 64);
            }
        }
    return tiles;
}
#else   /* BF16_GEMM_WIDEN: the header's tile_vector, store_sums, store_fused_sums */
/* x[0 .. count): rows row, row + 1, ... of x widened (GemmJob.wide); rows past m
 * repeat the last one (their sums are not stored). */
static inline void wide_rows(const GemmJob *job, int64_t row, int64_t rows, int count,
                             const float **x) {
    for (int r = 0; r < count; r++)
        x[r] = job->wide + (row + (r < rows ? r : rows - 1)) * job->k;
}

#if defined(__aarch64__)
#include "bf16_tile_neon.h"
#else
#include "bf16_tile_256.h"
#endif

/* The widening tiles': rows [row, row + rows) x vectors [vector, vector + width) of y,
 * each vector's sums from the header's tile_vector, then the epilogue. */
static inline void tile(const GemmJob *job, int64_t row, int64_t rows, int64_t vector,
                        const int width, const uint32_t *next) {
    const int64_t panel_stride = job->k / 2 * 16;
    float sums[PANEL][ROWS][16];
    for (int v = 0; v < width; v++)
        tile_vector(job, row, rows, vector + v, next ? next + v * panel_stride : NULL, sums[v]);
    for (int r = 0; r < rows; r++) {
        if (job->fused) {       /* width 2: (gate j, up j) */
            store_fused_sums(job, row + r, vector, sums[0][r], sums[1][r]);
            continue;
        }
        for (int v = 0; v < width; v++)
            store_sums(job, row + r, column_of(job, vector + v), sums[v][r]);
    }
}
#endif

/* Part `part` takes panels from job->panels (its own range first); each panel: all
 * rows, prefetching the panel after it while that one is in the same range. */
static void gemm_part(const void *arg, int part, int parts) {
    (void)parts;
    const GemmJob *job = arg;
#if BF16_GEMM == BF16_GEMM_DOT
    if (job->amx) {
        amx_part(job, part);
        return;
    }
#endif
    const int64_t panel_stride = job->k / 2 * 16;
    int64_t panel, limit;
    while ((panel = work_ranges_take(job->panels, part, &limit)) >= 0) {
        const int64_t vector = panel * job->panel;
        const int64_t width = job->vectors - vector < job->panel ? job->vectors - vector
                                                                 : job->panel;
        const uint32_t *next = panel + 1 < limit ? job->w + (vector + job->panel) * panel_stride
                                                 : NULL;
        for (int64_t row = 0; row < job->m; row += ROWS) {
            const int64_t rows = job->m - row < ROWS ? job->m - row : ROWS;
            const uint32_t *ahead = row == 0 ? next : NULL;
            if (width == 3) tile(job, row, rows, vector, 3, ahead);
            else if (width == 2) tile(job, row, rows, vector, 2, ahead);
            else tile(job, row, rows, vector, 1, ahead);
        }
    }
}


#if BF16_GEMM == BF16_GEMM_DOT
/* Sets the job on AMX tiles where they serve (K a multiple of 32): steps of up to
 * AMX_ROW_BLOCK rows read x copied into whole A tiles, zero rows past m (contiguous
 * tile loads instead of 16 rows k apart, so the weights stream faster); larger steps,
 * whose copy would be megabytes on one thread, read x in place, their last block of
 * fewer than 16 rows copied into a tile with zero rows. Returns the copy to free (or
 * NULL) in *copy; 0, or 3 when it cannot be allocated. */
static int prepare_amx(GemmJob *job, void **copy) {
    job->amx = bf16_amx_on() && job->k % 32 == 0;
    if (!job->amx) return 0;
    job->panel = 2;
    const int64_t whole = job->m / 16 * 16, left = job->m - whole;
    uint16_t *padded = NULL;
    if (job->m <= AMX_ROW_BLOCK) {
        padded = tile_x(job->x, job->x_stride, job->m, job->k);
        if (!padded) return 3;
        job->tiles = padded;
    } else if (left) {
        padded = calloc((size_t)(16 * job->k), sizeof(uint16_t));
        if (!padded) return 3;
        for (int64_t r = 0; r < left; r++)
            memcpy(padded + r * job->k, job->x + (whole + r) * job->x_stride,
                   (size_t)job->k * sizeof(uint16_t));
        job->tail = padded;
    }
    *copy = padded;
    return 0;
}
#endif

/* Runs the job: on AMX tiles or AVX512-BF16 dot products, or the widening tile over x
 * widened to fp32 once. Returns 0, or 3 when a copy of x cannot be allocated. */
static int run_gemm(GemmJob *job, int num_threads) {
    void *copy = NULL;
#if BF16_GEMM == BF16_GEMM_DOT
    const int status = prepare_amx(job, &copy);
    if (status) return status;
#else
    copy = widen_rows(job->x, job->x_stride, job->m, job->k);
    if (!copy) return 3;
    job->wide = copy;
#endif
    const int64_t panels = panel_count(job);
    const int64_t items = job->amx ? panels * ((job->m + AMX_ROW_BLOCK - 1) / AMX_ROW_BLOCK)
                                   : panels;
    const int parts = num_threads < 1 ? 1 : num_threads > items ? (int)items : num_threads;
    WorkRanges shared;
    work_ranges_init(&shared, items, parts);
    job->panels = &shared;
    run_parallel(gemm_part, job, parts);
    free(copy);
    return 0;
}

/* x [m, k] bf16 (rows x_stride apart, k even), w packed as above, y [m, n] (rows
 * y_stride apart) fp32 or (y_bf16) bf16; gated_inter > 0 for a gated layout (n = 2
 * gated_inter: gate columns first in y). Returns 0, or 1 for an odd k or a gated
 * layout that does not fit. */
int bf16_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m, int64_t k,
              int64_t n, void *y, int64_t y_stride, int y_bf16, int64_t gated_inter,
              int num_threads) {
    if (k % 2 || (gated_inter && (gated_inter % 16 || n != 2 * gated_inter))) return 1;
    if (m <= 0 || n <= 0) return 0;
    GemmJob job = {x, x_stride, w, m, k, n, (n + 15) / 16, y, y_stride, y_bf16, gated_inter,
                   0, PANEL, NULL, 0, NULL, NULL, NULL};
    return run_gemm(&job, num_threads);
}

/* A gated MLP's activation straight from its gate/up product: y [m, inter] bf16 (rows
 * y_stride apart) = act(x @ Wg^T) * (x @ Wu^T), the fp32 sums never rounded before
 * the activation (ACTIVATION_SILU or ACTIVATION_GELU_TANH). w holds Wg and Wu as
 * alternating 16-row blocks (gate 0, up 0, gate 1, ...), packed as above: one panel is
 * one (gate, up) pair. Returns 0, or 1. */
int bf16_gated_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m,
                    int64_t k, int64_t inter, uint16_t *y, int64_t y_stride, int activation,
                    int num_threads) {
    if (k % 2 || inter % 16 || inter <= 0) return 1;
    if (activation != ACTIVATION_SILU && activation != ACTIVATION_GELU_TANH) return 1;
    if (m <= 0) return 0;
    GemmJob job = {x, x_stride, w, m, k, 2 * inter, inter / 8, y, y_stride, 1, inter,
                   activation, 2, NULL, 0, NULL, NULL, NULL};
    return run_gemm(&job, num_threads);
}

#else

int bf16_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m, int64_t k,
              int64_t n, void *y, int64_t y_stride, int y_bf16, int64_t gated_inter,
              int num_threads) {
    (void)x; (void)x_stride; (void)w; (void)m; (void)k; (void)n; (void)y; (void)y_stride;
    (void)y_bf16; (void)gated_inter; (void)num_threads;
    return 2;
}

int bf16_gated_gemm(const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t m,
                    int64_t k, int64_t inter, uint16_t *y, int64_t y_stride, int activation,
                    int num_threads) {
    (void)x; (void)x_stride; (void)w; (void)m; (void)k; (void)inter; (void)y; (void)y_stride;
    (void)activation; (void)num_threads;
    return 2;
}

#endif
