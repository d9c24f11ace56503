/* fp16 values as fp32, exactly (GGUF's block scales; the int8 forms that keep the
 * file's fp16 scales widen them so). F16C's conversion where the build has it, else
 * the bits rebuilt, subnormals included. */
#ifndef KVSERVE_FP16_H
#define KVSERVE_FP16_H

#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float fp16_bits_value(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);                         /* exact, subnormals included */
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F,
                   mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | mantissa << 13;
    } else if (exponent != 0) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else if (mantissa == 0) {
        bits = sign;
    } else {                                     /* subnormal: normalize */
        int shift = 0;
        uint32_t value = mantissa;
        while (!(value & 0x400)) {
            value <<= 1;
            shift++;
        }
        bits = sign | (uint32_t)(113 - shift) << 23 | (value & 0x3FF) << 13;
    }
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
#endif
}

/* The fp16 stored little-endian at `at`. */
static inline float fp16_value(const uint8_t *at) {
    return fp16_bits_value((uint16_t)(at[0] | at[1] << 8));
}

#endif
