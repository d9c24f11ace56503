/* GGUF rows parsed into the block kernels' forms in one pass (models/block_formats.py
 * documents the forms and gives the same values with torch ops, the reference the
 * tests hold this to; block_int8.c documents the int8-activation forms).
 *
 * Each 32-weight block of a row is decoded into its form's code bytes (16 nibble
 * bytes for Q4_1, 32 bytes for the others) with its scale and minimum (two of each
 * for Q8_16, whose scales cover 16 weights), then written where the destination form
 * keeps it: rows one after another for the fp32 forms, column groups of 16 for the
 * int8 forms. Every product is the one block_formats.py forms (fp32, same operands),
 * so the values are equal bit for bit. Rows are shared between threads.
 */
#include <stdint.h>
#include <string.h>

#include "fp16.h"
#include "kernels.h"
#include "worker_pool.h"

#define BLOCK 32
#define GROUP 16

typedef struct {
    uint8_t bytes[BLOCK];        /* Q4_1 form: 16 bytes, element j low, j + 16 high */
    float d[2], m[2];            /* [1]: Q8_16's second 16 weights */
    float super[2];              /* K types: the super-block's d (and Q4_K's dmin) */
    int sub[2];                  /* K types: Q4_K's 6-bit scale and minimum, Q6_K's two
                                  * int8 scales: d[h] = super[0] * sub[h] (Q4_K's m[0] =
                                  * -(super[1] * sub[1])) */
    uint16_t d_bits, m_bits;     /* GGUF's types of one fp16 scale: d[0] and m[0] (Q4_1,
                                  * Q5_1) as the file holds them */
} Decoded;

static const int form_scale_bits[] = FORM_SCALE_BITS;

static const int64_t block_bytes_of[] = GGUF_BLOCK_BYTES;
static const int64_t block_weights_of[] = GGUF_BLOCK_WEIGHTS;

/* Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (0..7) from 12 bytes. */
static void k_scale_min(const uint8_t *packed, int j, int *scale, int *minimum) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *minimum = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
        *minimum = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

/* Block b of a row (`row`: the row's GGUF bytes) decoded into its form. */
static void decode_block(int type, const uint8_t *row, int64_t b, Decoded *out) {
    if (type == GGUF_Q4_0 || type == GGUF_Q4_1 || type == GGUF_Q8_0 || type == GGUF_Q5_0
        || type == GGUF_Q5_1) {
        const uint8_t *block = row + b * block_bytes_of[type];
        out->d[0] = fp16_value(block);
        out->d_bits = (uint16_t)(block[0] | block[1] << 8);
        out->m_bits = (uint16_t)(block[2] | block[3] << 8);    /* Q4_1 and Q5_1 only */
        if (type == GGUF_Q4_0) {
            memcpy(out->bytes, block + 2, 16);
            out->m[0] = out->d[0] * -8.0f;
        } else if (type == GGUF_Q4_1) {
            out->m[0] = fp16_value(block + 2);
            memcpy(out->bytes, block + 4, 16);
        } else if (type == GGUF_Q8_0) {
            memcpy(out->bytes, block + 2, 32);
        } else {                                 /* Q5_0 (signed, q - 16), Q5_1 (0..31) */
            const int offset = type == GGUF_Q5_0 ? 2 : 4;
            uint32_t high;
            memcpy(&high, block + offset, 4);
            if (type == GGUF_Q5_1) out->m[0] = fp16_value(block + 2);
            for (int j = 0; j < BLOCK; j++) {
                const int nibble = (block[offset + 4 + j % 16] >> (j < 16 ? 0 : 4)) & 15;
                const int code = nibble | (int)((high >> j) & 1) << 4;
                out->bytes[j] = (uint8_t)(type == GGUF_Q5_0 ? code - 16 : code);
            }
        }
        return;
    }
    const int64_t super = b / 8, sub = b % 8;    /* K types: 256 weights, 8 blocks of 32 */
    if (type == GGUF_Q6_K) {
        /* element 128 h + r: low 4 bits in nibble r / 64 of byte 64 h + r % 64, high 2
         * bits at bit 2 (r / 32) of byte 128 + 32 h + r % 32; a block's r / 64 and
         * r / 32 are fixed, so its bytes are runs of both */
        const uint8_t *block = row + super * block_bytes_of[type];
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = fp16_value(block + 208);
        const int half = (int)sub / 4, r0 = BLOCK * ((int)sub % 4);
        const uint8_t *low = block + 64 * half + r0 % 64, *high = block + 128 + 32 * half;
        const int low_shift = 4 * (r0 / 64), high_shift = 2 * (r0 / 32);
        for (int j = 0; j < BLOCK; j++)
            out->bytes[j] = (uint8_t)((((low[j] >> low_shift) & 15)
                                       | ((high[j] >> high_shift) & 3) << 4) - 32);
        out->super[0] = d;
        out->sub[0] = scales[2 * sub];
        out->sub[1] = scales[2 * sub + 1];
        out->d[0] = d * (float)out->sub[0];
        out->d[1] = d * (float)out->sub[1];
        return;
    }
    const int q5 = type == GGUF_Q5_K;
    const uint8_t *block = row + super * block_bytes_of[type];
    const uint8_t *codes = block + (q5 ? 48 : 16) + 32 * (sub / 2);
    k_scale_min(block + 4, (int)sub, &out->sub[0], &out->sub[1]);
    out->super[0] = fp16_value(block);
    out->super[1] = fp16_value(block + 2);
    out->d[0] = out->super[0] * (float)out->sub[0];
    out->m[0] = -(out->super[1] * (float)out->sub[1]);
    const int shift = 4 * (int)(sub % 2);
    if (!q5) {                                   /* Q4_1 form: element j | element j + 16 */
        for (int j = 0; j < 16; j++)
            out->bytes[j] = (uint8_t)(((codes[j] >> shift) & 15)
                                      | ((codes[j + 16] >> shift) & 15) << 4);
        return;
    }
    for (int j = 0; j < BLOCK; j++)              /* fifth bit of sub-block s: bit s */
        out->bytes[j] = (uint8_t)(((codes[j] >> shift) & 15)
                                  | ((block[16 + j] >> sub) & 1) << 4);
}

typedef struct {
    int type, form;
    const uint8_t *raw;
    int64_t n, k, row_bytes, start;
    const int64_t *order;
    uint8_t *codes;
    float *d, *m;
    WorkRanges *items;           /* rows */
} ParseJob;

/* Decoded block b of row `row` in the super-block forms (block_int8.c's header):
 * codes in I8_Q4's nibble order (I8_Q6K: the low 4 bits so, then a plane of the high 2
 * bits), the fp32 super-block scales per lane, the integer sub-scales as bytes. */
static void store_super_block(const ParseJob *job, int64_t row, int64_t b,
                              const Decoded *block) {
    const int64_t blocks = job->k / BLOCK, supers = job->k / 256;
    const int64_t group = row / GROUP, lane = row % GROUP, s = b / 8;
    const int q6 = job->form == BLOCKS_I8_Q6K;
    uint8_t *out = job->codes + (group * blocks + b) * GROUP * (q6 ? 24 : 16);
    uint8_t *sub = (uint8_t *)job->m + (group * blocks + b) * 2 * GROUP;
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 4; i++) {
            uint8_t *at = out + (t * GROUP + lane) * 4 + i;
            if (!q6) {
                *at = block->bytes[4 * t + i];
                continue;
            }
            const int low = block->bytes[4 * t + i] + 32, high = block->bytes[16 + 4 * t + i] + 32;
            *at = (uint8_t)((low & 15) | (high & 15) << 4);
        }
    if (q6)
        for (int u = 0; u < 2; u++)
            for (int i = 0; i < 4; i++) {
                int bits = 0;
                for (int t = 0; t < 4; t++)
                    bits |= (((int8_t)block->bytes[16 * u + 4 * t + i] + 32) >> 4 & 3) << 2 * t;
                out[256 + (u * GROUP + lane) * 4 + i] = (uint8_t)bits;
            }
    for (int h = 0; h < 2; h++) {
        sub[h * GROUP + lane] = (uint8_t)block->sub[h];
        if (q6 && h == 1) break;
        job->d[((group * supers + s) * (q6 ? 1 : 2) + h) * GROUP + lane] = block->super[h];
    }
}

/* Decoded block b of destination row `row` written where `form` keeps it. */
static void store_block(const ParseJob *job, int64_t row, int64_t b, Decoded *block) {
    if (job->form == BLOCKS_I8_Q4K || job->form == BLOCKS_I8_Q6K) {
        store_super_block(job, row, b, block);
        return;
    }
    const int64_t blocks = job->k / BLOCK;
    const int nibbles = job->form == BLOCKS_Q4 || job->form == BLOCKS_I8_Q4
                        || job->form == BLOCKS_I8_Q4_0 || job->form == BLOCKS_I8_Q4_1;
    const int halves = job->form == BLOCKS_Q8_HALVES || job->form == BLOCKS_I8_U8_HALVES;
    const int width = nibbles ? 16 : 32, per_block = halves ? 2 : 1;
    if (job->form < BLOCKS_I8_Q4) {
        memcpy(job->codes + (row * blocks + b) * width, block->bytes, (size_t)width);
        for (int h = 0; h < per_block; h++) {
            job->d[(row * blocks + b) * per_block + h] = block->d[h];
            if (job->m) job->m[(row * blocks + b) * per_block + h] = block->m[h];
        }
        return;
    }
    const int signed_codes = job->type == GGUF_Q8_0 || job->type == GGUF_Q5_0
                             || job->type == GGUF_Q6_K;
    const int64_t group = row / GROUP, lane = row % GROUP;
    uint8_t *out = job->codes + (group * blocks + b) * GROUP * width;
    for (int t = 0; t < width / 4; t++)
        for (int i = 0; i < 4; i++)
            out[(t * GROUP + lane) * 4 + i] =
                (uint8_t)(signed_codes ? block->bytes[4 * t + i] ^ 0x80 : block->bytes[4 * t + i]);
    if (form_scale_bits[job->form] == 16) {  /* the file's fp16 scale (and Q4_1's minimum) */
        const int64_t at = (group * blocks + b) * GROUP + lane;
        ((uint16_t *)job->d)[at] = block->d_bits;
        if (job->m) ((uint16_t *)job->m)[at] = block->m_bits;
        return;
    }
    for (int h = 0; h < per_block; h++) {
        const int64_t at = ((group * blocks + b) * per_block + h) * GROUP + lane;
        job->d[at] = block->d[h];
        job->m[at] = signed_codes ? -128.0f * block->d[h] : block->m[h];
    }
}

static void parse_part(const void *arg, int part, int parts) {
    const ParseJob *job = arg;
    (void)parts;
    int64_t limit, i;
    Decoded block = {{0}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0, 0}, 0, 0};
    while ((i = work_ranges_take(job->items, part, &limit)) >= 0) {
        const uint8_t *row = job->raw + (job->order ? job->order[i] : i) * job->row_bytes;
        for (int64_t b = 0; b < job->k / BLOCK; b++) {
            decode_block(job->type, row, b, &block);
            store_block(job, job->start + i, b, &block);
        }
    }
}

/* Bytes of one GGUF row of `type` with k weights (k a multiple of its block). */
static int64_t gguf_row_bytes(int type, int64_t k) {
    return k / block_weights_of[type] * block_bytes_of[type];
}

/* Whether every row the job reads lies in raw [raw_rows, row_bytes] and every row it
 * writes in the output's out_rows: the caller proved the ranges against the file
 * (gguf_check.py) and the shapes; they are proven again here, before any byte is
 * read, so a wrong shape upstream is an error, not a read past the mapping. */
static int rows_in_range(int type, int64_t n, int64_t k, int64_t row_bytes,
                         int64_t raw_rows, const int64_t *order, int64_t start,
                         int64_t out_rows) {
    if (n < 0 || k <= 0 || start < 0 || raw_rows < 0 || n > out_rows - start
        || row_bytes != gguf_row_bytes(type, k))
        return 0;
    if (!order)
        return n <= raw_rows;
    for (int64_t i = 0; i < n; i++)
        if (order[i] < 0 || order[i] >= raw_rows)
            return 0;
    return 1;
}

/* GGUF rows of `type` from raw [raw_rows, row_bytes] (row i of the output: raw's row
 * order[i], or i, for i < n) into rows [start, start + n) of a weight of kind `form`
 * with out_rows rows (kernels.h's BLOCKS_*; the int8 forms need start and n in whole
 * groups of 16). 1 for a bad argument, a row out of range included. */
int parse_gguf_rows(int type, const uint8_t *raw, int64_t n, int64_t k, int64_t row_bytes,
                    int64_t raw_rows, const int64_t *order, int form, int64_t start,
                    int64_t out_rows, void *codes, float *d, float *m, int num_threads) {
    if (type < GGUF_FIRST || type > GGUF_LAST || form < BLOCKS_FIRST || form > BLOCKS_LAST
        || k % block_weights_of[type] || k % BLOCK
        || (form == BLOCKS_I8_Q4K && type != GGUF_Q4_K)
        || (form == BLOCKS_I8_Q6K && type != GGUF_Q6_K)
        || (form == BLOCKS_I8_Q4_0 && type != GGUF_Q4_0)
        || (form == BLOCKS_I8_Q4_1 && type != GGUF_Q4_1)
        || (form == BLOCKS_I8_Q8_0 && type != GGUF_Q8_0 && type != GGUF_Q5_0)
        || (form >= BLOCKS_I8_Q4 && (start % GROUP || n % GROUP))
        || !rows_in_range(type, n, k, row_bytes, raw_rows, order, start, out_rows))
        return 1;
    WorkRanges items;
    work_ranges_init(&items, n, num_threads);
    ParseJob job = {type, form, raw, n, k, row_bytes, start, order, codes, d, m, &items};
    run_parallel(parse_part, &job, num_threads);
    return 0;
}
