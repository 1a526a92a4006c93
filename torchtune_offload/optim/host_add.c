/* dst += src over host memory, on all of torch's threads: the staging ring's addition of a later
 * micro-batch's gradient into its host sum. Built by host_add.py at first use.
 *
 * Each element is rounded as torch's CPU add_ rounds it: both operands widened to float, one
 * float32 addition, and (for a bf16 sum) that result rounded to nearest even, so the sums are
 * the same bits as dst.add_(src).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define ADD_PASS(NAME, DST_T, SRC_T, LOAD_DST, LOAD_SRC, STORE)                              \
    void NAME(DST_T *dst, const SRC_T *src, int64_t n, int threads) {                         \
        _Pragma("omp parallel for simd num_threads(threads) schedule(static)")              \
        for (int64_t i = 0; i < n; i++) dst[i] = STORE(LOAD_DST(dst[i]) + LOAD_SRC(src[i])); \
    }

#define AS_IS(x) (x)

ADD_PASS(add_fp32_bf16, float, uint16_t, AS_IS, bf16_to_float, AS_IS)
ADD_PASS(add_fp32_fp32, float, float, AS_IS, AS_IS, AS_IS)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The bf16 sum's rounding is most of the portable loop's instructions, and on a CPU with few cores
 * the loop runs at the cores' pace, not the memory's (docs/accumulation.md). AVX512_BF16 rounds two
 * vectors in one instruction, to nearest even and a NaN to a quiet NaN as float_to_bf16 does, but
 * it reads a denormal float as zero where torch rounds it: a block with a denormal sum (rare: both
 * operands near the smallest normal) is rounded the portable way instead. */
void add_bf16_bf16(uint16_t *dst, const uint16_t *src, int64_t n, int threads) {
    const int64_t blocks = n / 32;
    const __m512i exponent = _mm512_set1_epi32(0x7f800000), mantissa = _mm512_set1_epi32(0x007fffff);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t *d = dst + 32 * b;
        const uint16_t *s = src + 32 * b;
        const __m512 lo = _mm512_add_ps(widen16(d), widen16(s)), hi = _mm512_add_ps(widen16(d + 16), widen16(s + 16));
        const __m512i lo_bits = _mm512_castps_si512(lo), hi_bits = _mm512_castps_si512(hi);
        const __mmask16 denormal_lo = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(lo_bits, exponent), lo_bits, mantissa);
        const __mmask16 denormal_hi = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(hi_bits, exponent), hi_bits, mantissa);
        if (__builtin_expect((denormal_lo | denormal_hi) == 0, 1)) {
            _mm512_storeu_si512((void *)d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
            float sums[32];
            _mm512_storeu_ps(sums, lo);
            _mm512_storeu_ps(sums + 16, hi);
            for (int k = 0; k < 32; k++) d[k] = float_to_bf16(sums[k]);
        }
    }
    for (int64_t i = 32 * blocks; i < n; i++) dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(src[i]));
}
#else
ADD_PASS(add_bf16_bf16, uint16_t, uint16_t, bf16_to_float, bf16_to_float, float_to_bf16)
#endif
