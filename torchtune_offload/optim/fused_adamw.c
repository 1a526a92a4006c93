/* One pass of Adam/AdamW over an fp32 master, its two fp32 moments and a bf16 or fp32 gradient,
 * writing the master rounded to bf16 for the device. Built by fused_step.py at first use.
 *
 * Each line is one of torch's single-tensor AdamW operations, in its order, with the same
 * float32 rounding per operation (no contraction into fused multiply-adds).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* torch.lerp's two formulas, chosen by the weight as torch chooses them. */
static inline float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

/* decay: 1 - lr * weight_decay (AdamW) or unused; l2: weight_decay (Adam) or 0; lerp_weight:
 * 1 - beta1; sq_weight: 1 - beta2; neg_step_size: -lr / (1 - beta1^t). scaled: the gradient is
 * first multiplied by grad_scale (clipping) as grad.mul_(grad_scale) would round it in its dtype;
 * the gradient in memory is left as it is. */
#define ADAMW_PASS(NAME, GRAD_T, GRAD_TO_FLOAT, GRAD_SCALED)                                           \
    void NAME(float *param, float *exp_avg, float *exp_avg_sq, const GRAD_T *grad, uint16_t *out,      \
              int64_t n, int decoupled, float decay, float l2, float lerp_weight, float beta2,          \
              float sq_weight, float bias_correction2_sqrt, float eps, float neg_step_size,             \
              int scaled, float grad_scale, int threads) {                                              \
        _Pragma("omp parallel for simd num_threads(threads) schedule(static)")                        \
        for (int64_t i = 0; i < n; i++) {                                                               \
            float g = GRAD_TO_FLOAT(grad[i]);                                                           \
            if (scaled) g = GRAD_SCALED(g, grad_scale);                                                 \
            float p = param[i];                                                                         \
            if (decoupled) p = p * decay;                                                               \
            else if (l2 != 0.0f) g = g + l2 * p;                                                        \
            float m = lerp(exp_avg[i], g, lerp_weight);                                                 \
            float v = exp_avg_sq[i] * beta2;                                                            \
            v = v + sq_weight * g * g;                                                                  \
            float denom = sqrtf(v) / bias_correction2_sqrt + eps;                                       \
            p = p + neg_step_size * m / denom;                                                          \
            exp_avg[i] = m;                                                                             \
            exp_avg_sq[i] = v;                                                                          \
            param[i] = p;                                                                               \
            out[i] = float_to_bf16(p);                                                                  \
        }                                                                                               \
    }

#define FLOAT_AS_IS(x) (x)

ADAMW_PASS(adamw_bf16_grad, uint16_t, bf16_to_float, bf16_scaled)
ADAMW_PASS(adamw_fp32_grad, float, FLOAT_AS_IS, fp32_scaled)
