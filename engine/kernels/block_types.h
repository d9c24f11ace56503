/* Written from engine/kernels/block_types.py (python -m engine.kernels.block_types):
 * the codes of the kernel forms (block_gemm's kind) and of the GGUF types
 * (parse_gguf_rows' type). Edit the table there, not this file. */
#ifndef KVSERVE_BLOCK_TYPES_H
#define KVSERVE_BLOCK_TYPES_H

#define BLOCKS_Q4 1   /* Q4_1 */
#define BLOCKS_Q8 2   /* Q8_0 */
#define BLOCKS_Q8_HALVES 3   /* Q8_16 */
#define BLOCKS_Q5 4   /* Q5_1 */
#define BLOCKS_I8_Q4 5   /* I8_Q4 */
#define BLOCKS_I8_U8 6   /* I8_U8 */
#define BLOCKS_I8_U8_HALVES 7   /* I8_U8_16 */
#define BLOCKS_I8_Q4K 8   /* I8_Q4K */
#define BLOCKS_I8_Q6K 9   /* I8_Q6K */
#define BLOCKS_I8_Q4_0 10   /* I8_Q4_0 */
#define BLOCKS_I8_Q4_1 11   /* I8_Q4_1 */
#define BLOCKS_I8_Q8_0 12   /* I8_Q8_0 */

#define GGUF_Q4_0 1
#define GGUF_Q4_1 2
#define GGUF_Q5_0 3
#define GGUF_Q5_1 4
#define GGUF_Q8_0 5
#define GGUF_Q4_K 6
#define GGUF_Q5_K 7
#define GGUF_Q6_K 8

#define BLOCKS_FIRST 1
#define BLOCKS_LAST 12
#define GGUF_FIRST 1
#define GGUF_LAST 8
/* per GGUF code: weights and bytes of one of its blocks */
#define GGUF_BLOCK_WEIGHTS {0, 32, 32, 32, 32, 32, 256, 256, 256}
#define GGUF_BLOCK_BYTES {0, 18, 20, 22, 24, 34, 144, 176, 210}
/* per form code: the bits of a scale (16: fp16 scales and minima), and the
 * multiple of the scale that is a block's minimum where none is stored */
#define FORM_SCALE_BITS {0, 32, 32, 32, 32, 32, 32, 32, 32, 32, 16, 16, 16}
#define FORM_IMPLIED_MINIMUM {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -8, 0, -128}

#endif
