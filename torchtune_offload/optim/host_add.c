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

#define ADD_PASS(NAME, DST_T, SRC_T, LOAD_DST, LOAD_SRC, STORE)                              \
    void NAME(DST_T *dst, const SRC_T *src, int64_t n, int threads) {                         \
        _Pragma("omp parallel for simd num_threads(threads) schedule(static)")              \
        for (int64_t i = 0; i < n; i++) dst[i] = STORE(LOAD_DST(dst[i]) + LOAD_SRC(src[i])); \
    }

#define AS_IS(x) (x)

ADD_PASS(add_bf16_bf16, uint16_t, uint16_t, bf16_to_float, bf16_to_float, float_to_bf16)
ADD_PASS(add_fp32_bf16, float, uint16_t, AS_IS, bf16_to_float, AS_IS)
ADD_PASS(add_fp32_fp32, float, float, AS_IS, AS_IS, AS_IS)
