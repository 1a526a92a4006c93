/* bfloat16 <-> float32 on the host, as torch converts them; included by the host passes
 * (fused_adamw.c, fused_adamw8bit.c, host_add.c; fused_step.py compiles them with this folder on
 * the include path). */
#ifndef TORCHTUNE_OFFLOAD_BF16_H
#define TORCHTUNE_OFFLOAD_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* A bf16 gradient widened to float and multiplied by a clipping factor, as torch's CPU
 * grad.mul_(factor) leaves it (one float32 product rounded to bf16), widened again: the passes
 * apply clipping in registers instead of in a pass of its own over the gradient. */
static inline float bf16_scaled(float g, float scale) { return bf16_to_float(float_to_bf16(g * scale)); }
/* The same for a float32 gradient: one float32 product. */
static inline float fp32_scaled(float g, float scale) { return g * scale; }

#endif
