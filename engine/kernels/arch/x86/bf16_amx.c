/* AMX tiles for the bf16 GEMM (bf16_gemm.c) on CPUs with AMX-BF16 (Sapphire Rapids
 * and later): one TDPBF16PS multiplies a 16 x 32 bf16 tile of x by a 32 x 16 bf16
 * tile of W^T into a 16 x 16 fp32 tile, 8,192 multiply-adds, where one AVX512-BF16
 * vdpbf16ps does 32. Tiles in registers multiply several times as fast as the
 * vdpbf16ps loop at its peak, so a decode step's products read their weights at
 * memory speed instead of waiting on the dot-product unit (docs/cpu-kernels.md,
 * NATIVE_BF16_MAX_ROWS, compares the two on whole products).
 *
 * The weights' pair layout (bf16_gemm.c) is already AMX's: a B tile is 16 pairs of K
 * (32 values) x 16 columns, rows of 16 words = 64 bytes, and in the pair layout the
 * 16 pairs of one vector of columns lie contiguous: pairs p .. p + 15 of vector v
 * start at word (v * K / 2 + p) * 16. An A tile is 16 rows of x x 32 values of K
 * (64 bytes per row, rows x_stride apart).
 *
 * Tile registers (all 16 rows x 64 bytes):
 *   C: 0 = rows 0-15 x vector 0, 1 = rows 0-15 x vector 1,
 *      2 = rows 16-31 x vector 0, 3 = rows 16-31 x vector 1;
 *   A: 4 = rows 0-15, 5 = rows 16-31;   B: 6 = vector 0, 7 = vector 1.
 * Per 32 values of K: two A loads from L1, two B loads (2 KB of weights), four
 * products. K must be a multiple of 32, and each A tile reads 16 whole rows
 * (BlockRows: from x in place, or from bf16_gemm's copies).
 *
 * Linux hands out the tile registers only to a process that asked for them
 * (arch_prctl ARCH_REQ_XCOMP_PERM): bf16_amx_enable asks, once, for the process. Each
 * thread loads the tile configuration before its tiles and releases them after, as
 * other AMX users on the same threads (oneDNN) configure their own. */
#include <stdint.h>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_on;       /* set by bf16_amx_enable: 1 when the tiles serve */

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* wanted 1: use the tiles when this CPU and the kernel allow (returns 1 if they will),
 * 0: leave them off (the AVX512-BF16 loop serves). Call before any GEMM runs, from
 * one thread. */
int bf16_amx_enable(int wanted) {
    static int permitted = -1;
    /* built with -march=native (build.py), so this CPU has the tiles; the kernel (or a
     * seccomp profile) may still refuse them, and then the loop serves */
    if (wanted && permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    amx_on = wanted && permitted > 0;
    return amx_on;
}

int bf16_amx_on(void) { return amx_on; }

/* Eight tiles of 16 rows x 64 bytes. Static data: gcc 12 does not see ldtilecfg read
 * its operand, and drops the stores that fill a configuration on the stack. */
static const TileConfig tiles_16x64 = {
    .palette = 1,
    .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void bf16_amx_begin(void) { _tile_loadconfig(&tiles_16x64); }

void bf16_amx_end(void) { _tile_release(); }

static inline __attribute__((always_inline)) void panel_tiles(
        const BlockRows *rows, const uint32_t *w, int64_t vector_words, int64_t k, float *c,
        const uint32_t *ahead, const int blocks, const int width) {
    _tile_zero(0);
    if (width == 2) _tile_zero(1);
    if (blocks == 2) _tile_zero(2);
    if (blocks == 2 && width == 2) _tile_zero(3);
    for (int64_t chunk = 0; chunk < k / 32; chunk++) {
        const uint32_t *b = w + chunk * 256;       /* 16 pairs x 16 words */
        _tile_loadd(4, rows[0].x + chunk * rows[0].chunk_step, rows[0].stride * 2);
        _tile_loadd(6, b, 64);
        if (blocks == 2)
            _tile_loadd(5, rows[1].x + chunk * rows[1].chunk_step, rows[1].stride * 2);
        if (width == 2) _tile_loadd(7, b + vector_words, 64);
        if (ahead) {         /* the same 2 KB of the next panel, into L2 */
            for (int line = 0; line < 256; line += 16) {
                _mm_prefetch((const char *)(ahead + chunk * 256 + line), _MM_HINT_T1);
                _mm_prefetch((const char *)(ahead + vector_words + chunk * 256 + line),
                             _MM_HINT_T1);
            }
        }
        _tile_dpbf16ps(0, 4, 6);
        if (width == 2) _tile_dpbf16ps(1, 4, 7);
        if (blocks == 2) _tile_dpbf16ps(2, 5, 6);
        if (blocks == 2 && width == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
    if (width == 2) _tile_stored(1, c + 16, 128);
    if (blocks == 2) _tile_stored(2, c + 16 * 32, 128);
    if (blocks == 2 && width == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* c [32][32] fp32 (row r, column 16 v + j) = `blocks` (1 or 2) blocks of 16 rows of x
 * (rows[b]: 16 readable rows of k bf16) times `width` (1 or 2) vectors of 16 columns
 * of W from w (the first vector's pairs; the next vector_words words on). `ahead`
 * (or NULL): the next panel's two vectors, prefetched into L2 along the way (tile
 * loads straight from memory leave the tiles waiting on it). Between bf16_amx_begin
 * and bf16_amx_end on the calling thread. */
void bf16_amx_panel(const BlockRows *rows, int blocks, const uint32_t *w,
                    int64_t vector_words, int width, int64_t k, float *c,
                    const uint32_t *ahead) {
    if (blocks == 2 && width == 2) panel_tiles(rows, w, vector_words, k, c, ahead, 2, 2);
    else if (blocks == 2) panel_tiles(rows, w, vector_words, k, c, ahead, 2, 1);
    else if (width == 2) panel_tiles(rows, w, vector_words, k, c, ahead, 1, 2);
    else panel_tiles(rows, w, vector_words, k, c, ahead, 1, 1);
}

#else

int bf16_amx_enable(int wanted) { (void)wanted; return 0; }
int bf16_amx_on(void) { return 0; }
void bf16_amx_begin(void) {}
void bf16_amx_end(void) {}
void bf16_amx_panel(const BlockRows *rows, int blocks, const uint32_t *w,
                    int64_t vector_words, int width, int64_t k, float *c,
                    const uint32_t *ahead) {
    (void)ahead; (void)rows; (void)blocks; (void)w; (void)vector_words; (void)width; (void)k;
    (void)c;
}

#endif
