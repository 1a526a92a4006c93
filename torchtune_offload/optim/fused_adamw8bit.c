/* One pass of AdamW over blockwise 8-bit moments in bitsandbytes' format, built by adamw8bit.py
 * at first use (through fused_step.build_library).
 *
 * Per block of 256 elements: dequantize both moments with the block's old absmax, update them and
 * the parameter in float32 (each operation rounded once, as the pure-torch reference does), keep
 * the updated moments in a stack buffer that stays in L1, then take each moment's new absmax and
 * requantize every element to its nearest code. Blocks are independent, so OpenMP splits them
 * over the threads; each thread reads and writes every byte once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define CODES 256

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

#define FLOAT_AS_IS(x) (x)

typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, decay, neg_step_size;
} Scalars;

/* Quantization without a search. A map's positive codes fall in groups: zero, seven decades of
 * evenly spaced codes, and 1. Position j (0 = zero) in the positive codes is found from y = |x|:
 * the group from the float exponent of y (each binade holds at most one group boundary, so one
 * comparison with that boundary settles it), then the nearest even step within the group by
 * arithmetic. Float rounding of the codes and of that arithmetic puts the estimate off by a
 * fraction of 1e-4 of a step at most, so only where the estimate lies within NEAR of a rounding
 * boundary (about 0.2% of elements) is it checked against the exact midpoints, which makes the
 * result the nearest code as the reference finds it (ties to the lower code). The signed map
 * mirrors its positive codes (without -1). */
#define NEAR 1e-3f
#define BINADES 32
#define FIRST_EXPONENT 96 /* binade 0 is [2^-31, 2^-30); smaller magnitudes all go to zero */
#define GROUPS 9

typedef struct {
    int32_t group_below[BINADES]; /* groups whose boundary lies below the binade's lower edge */
    float boundary[BINADES];      /* the group boundary inside the binade, or +inf */
    float scale[16], offset[16];  /* step = trunc(y * scale + offset), clamped to [0, last] */
    int32_t first[16], last[16];  /* position of the group's first code; steps in it minus one */
    float midpoint[CODES];        /* between positions j and j + 1, as the reference computes it; +inf past the end */
    int32_t positions;
    int is_signed;
} QuantTable;

static float position_value(const float *code, int zero, int j) { return j == 0 ? 0.0f : code[zero + j]; }

static void build_table(const float *code, int is_signed, QuantTable *t) {
    const int zero = is_signed ? 127 : 0;
    int first = 0;
    float bounds[GROUPS - 1];
    memset(t, 0, sizeof *t);
    t->is_signed = is_signed;
    for (int g = 0; g < GROUPS; g++) {
        const int count = (g == 0 || g == GROUPS - 1) ? 1 : (is_signed ? 1 << (g - 1) : 1 << g);
        t->first[g] = first;
        t->last[g] = count - 1;
        if (count > 1) {
            const float lo = position_value(code, zero, first), hi = position_value(code, zero, first + count - 1);
            const float step = (hi - lo) / (float)(count - 1);
            t->scale[g] = 1.0f / step;
            t->offset[g] = 0.5f - lo * t->scale[g];
        } else {
            t->scale[g] = 0.0f;
            t->offset[g] = 0.5f;
        }
        if (g < GROUPS - 1)
            bounds[g] = (position_value(code, zero, first + count - 1) + position_value(code, zero, first + count)) * 0.5f;
        first += count;
    }
    t->positions = first;
    for (int j = 0; j < CODES; j++)
        t->midpoint[j] = j + 1 < first ? (position_value(code, zero, j) + position_value(code, zero, j + 1)) * 0.5f : INFINITY;
    for (int b = 0; b < BINADES; b++) {
        uint32_t bits = (uint32_t)(FIRST_EXPONENT + b) << 23;
        float lower, upper;
        memcpy(&lower, &bits, sizeof lower);
        upper = lower * 2.0f;
        t->boundary[b] = INFINITY;
        for (int g = 0; g < GROUPS - 1; g++) {
            if (bounds[g] < lower) t->group_below[b]++;
            else if (bounds[g] < upper) t->boundary[b] = bounds[g];
        }
    }
}

/* The exact position near estimate j: past every midpoint below y (for a negative x, also one at
 * y: the reference counts midpoints strictly below x, so a tie goes to the larger magnitude). */
static int32_t exact_position(const QuantTable *t, float y, int32_t j, int negative) {
#define PAST(mid) (negative ? (mid) <= y : (mid) < y)
    while (j > 0 && !PAST(t->midpoint[j - 1])) j--;
    while (j < t->positions - 1 && PAST(t->midpoint[j])) j++;
#undef PAST
    return j;
}

static inline uint8_t code_index(const QuantTable *t, int32_t j, int negative) {
    if (!t->is_signed) return (uint8_t)j;
    return (uint8_t)(negative ? 127 - (j > 127 ? 127 : j) : 127 + j);
}

static inline uint8_t quantize_one(const QuantTable *t, float x) {
    float y = fabsf(x);
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    int32_t b = (int32_t)(bits >> 23) - FIRST_EXPONENT;
    b = b < 0 ? 0 : (b > BINADES - 1 ? BINADES - 1 : b);
    const int32_t g = t->group_below[b] + (t->boundary[b] < y);
    const float kf = y * t->scale[g] + t->offset[g];
    int32_t k = (int32_t)kf;
    k = k < 0 ? 0 : (k > t->last[g] ? t->last[g] : k);
    int32_t j = t->first[g] + k;
    const float frac = kf - floorf(kf);
    const int negative = t->is_signed && x < 0.0f;
    if (frac < NEAR || frac > 1.0f - NEAR) j = exact_position(t, y, j, negative);
    return code_index(t, j, negative);
}

static void quantize_block(const float *values, int64_t len, float absmax, const QuantTable *t, uint8_t *out) {
    if (absmax == 0.0f) { /* no scale: bitsandbytes writes code 0 */
        memset(out, 0, (size_t)len);
        return;
    }
    const float inv = 1.0f / absmax;
    for (int64_t i = 0; i < len; i++) out[i] = quantize_one(t, values[i] * inv);
}

#define ADAMW8BIT_BLOCK(NAME, PARAM_T, TO_FLOAT, FROM_FLOAT, GRAD_T, GRAD_TO_FLOAT)                     \
    static void NAME(PARAM_T *param, const GRAD_T *grad, uint8_t *q1, uint8_t *q2, float *absmax1,      \
                     float *absmax2, const float *code1, const float *code2, const QuantTable *t1,      \
                     const QuantTable *t2, int64_t len, const Scalars *s) {                             \
        float m[BLOCK], v[BLOCK];                                                                      \
        const float a1 = *absmax1, a2 = *absmax2;                                                      \
        float max1 = 0.0f, max2 = 0.0f;                                                                \
        _Pragma("omp simd reduction(max:max1,max2)")                                                   \
        for (int64_t i = 0; i < len; i++) {                                                            \
            float g = GRAD_TO_FLOAT(grad[i]);                                                          \
            float mi = code1[q1[i]] * a1;                                                              \
            float vi = code2[q2[i]] * a2;                                                              \
            mi = mi * s->beta1 + g * s->one_minus_beta1;                                               \
            vi = vi * s->beta2 + (g * g) * s->one_minus_beta2;                                         \
            float denom = sqrtf(vi) * s->inv_bias_correction2_sqrt + s->eps;                                 \
            float p = TO_FLOAT(param[i]) * s->decay;                                                   \
            p = p + (mi / denom) * s->neg_step_size;                                                   \
            param[i] = FROM_FLOAT(p);                                                                  \
            m[i] = mi;                                                                                 \
            v[i] = vi;                                                                                 \
            max1 = fabsf(mi) > max1 ? fabsf(mi) : max1;                                                \
            max2 = fabsf(vi) > max2 ? fabsf(vi) : max2;                                                \
        }                                                                                              \
        *absmax1 = max1;                                                                               \
        *absmax2 = max2;                                                                               \
        QUANTIZE_BLOCK(m, len, max1, t1, q1);                                                          \
        QUANTIZE_BLOCK(v, len, max2, t2, q2);                                                          \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>

/* quantize_one over a whole block, 16 elements at a time, with the tables in registers. */
static void quantize_block_avx512(const float *values, int64_t len, float absmax, const QuantTable *t,
                                  uint8_t *out) {
    if (len != BLOCK || absmax == 0.0f) {
        quantize_block(values, len, absmax, t, out);
        return;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / absmax);
    const __m512i below0 = _mm512_loadu_si512(t->group_below), below1 = _mm512_loadu_si512(t->group_below + 16);
    const __m512 bound0 = _mm512_loadu_ps(t->boundary), bound1 = _mm512_loadu_ps(t->boundary + 16);
    const __m512 scale = _mm512_loadu_ps(t->scale), offset = _mm512_loadu_ps(t->offset);
    const __m512i first = _mm512_loadu_si512(t->first), last = _mm512_loadu_si512(t->last);
    const __m512i exponent0 = _mm512_set1_epi32(FIRST_EXPONENT), zero = _mm512_setzero_si512();
    const __m512 near_lo = _mm512_set1_ps(NEAR), near_hi = _mm512_set1_ps(1.0f - NEAR);
    const __m512i top = _mm512_set1_epi32(BINADES - 1), one = _mm512_set1_epi32(1), mid = _mm512_set1_epi32(127);
    for (int64_t i = 0; i < BLOCK; i += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values + i), inv);
        const __m512 y = _mm512_abs_ps(x);
        __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(y), 23), exponent0);
        b = _mm512_min_epi32(_mm512_max_epi32(b, zero), top);
        __m512i g = _mm512_permutex2var_epi32(below0, b, below1);
        const __mmask16 above = _mm512_cmp_ps_mask(_mm512_permutex2var_ps(bound0, b, bound1), y, _CMP_LT_OQ);
        g = _mm512_mask_add_epi32(g, above, g, one);
        const __m512 kf = _mm512_add_ps(_mm512_mul_ps(y, _mm512_permutexvar_ps(g, scale)), _mm512_permutexvar_ps(g, offset));
        __m512i k = _mm512_max_epi32(_mm512_cvttps_epi32(kf), zero);
        k = _mm512_min_epi32(k, _mm512_permutexvar_epi32(g, last));
        __m512i j = _mm512_add_epi32(_mm512_permutexvar_epi32(g, first), k);
        const __m512 frac = _mm512_sub_ps(kf, _mm512_roundscale_ps(kf, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
        const __mmask16 near = _mm512_cmp_ps_mask(frac, near_lo, _CMP_LT_OQ) | _mm512_cmp_ps_mask(frac, near_hi, _CMP_GT_OQ);
        if (near) { /* rare: settle these lanes against the exact midpoints, as quantize_one does */
            int32_t lanes[16];
            float ys[16], xs[16];
            _mm512_storeu_si512(lanes, j);
            _mm512_storeu_ps(ys, y);
            _mm512_storeu_ps(xs, x);
            for (int l = 0; l < 16; l++)
                if (near >> l & 1) lanes[l] = exact_position(t, ys[l], lanes[l], t->is_signed && xs[l] < 0.0f);
            j = _mm512_loadu_si512(lanes);
        }
        if (t->is_signed) {
            const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512i down = _mm512_sub_epi32(mid, _mm512_min_epi32(j, mid));
            j = _mm512_mask_blend_epi32(negative, _mm512_add_epi32(mid, j), down);
        }
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(j));
    }
}

static inline __m512 load16(const void *base, int is_bf16, int64_t i) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16));
    return _mm512_loadu_ps((const float *)base + i);
}

/* float_to_bf16 on 16 lanes: round to nearest even, NaN stays NaN. */
static inline void store16(void *base, int is_bf16, int64_t i, __m512 x) {
    if (!is_bf16) {
        _mm512_storeu_ps((float *)base + i, x);
        return;
    }
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm512_cvtepi32_epi16(rounded));
}

/* A 256-entry float table as four 256-entry byte tables (byte k of every code), so that 64 codes
 * are looked up with byte permutes (two 128-byte halves each, chosen by the code's top bit)
 * instead of gathers, which are slow on many x86 cores. */
typedef struct {
    uint8_t plane[4][CODES];
} ByteTable;

static void build_byte_table(const float *code, ByteTable *t) {
    for (int i = 0; i < CODES; i++) {
        uint32_t bits;
        memcpy(&bits, code + i, sizeof bits);
        for (int k = 0; k < 4; k++) t->plane[k][i] = (uint8_t)(bits >> (8 * k));
    }
}

/* code[q[i]] * absmax for the 64 codes at q, into out[0..63]. */
static inline void dequantize64(const uint8_t *q, const ByteTable *t, __m512 absmax, float *out) {
    /* Unpacking interleaves within 128-bit lanes; this order makes the result come out in order. */
    static const uint8_t order[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
        52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
        44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i codes = _mm512_permutexvar_epi8(_mm512_loadu_si512(order), _mm512_loadu_si512(q));
    const __mmask64 upper = _mm512_movepi8_mask(codes);
    __m512i bytes[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *plane = t->plane[k];
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(plane), codes, _mm512_loadu_si512(plane + 64));
        const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(plane + 128), codes, _mm512_loadu_si512(plane + 192));
        bytes[k] = _mm512_mask_blend_epi8(upper, lo, hi);
    }
    const __m512i w01lo = _mm512_unpacklo_epi8(bytes[0], bytes[1]), w01hi = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
    const __m512i w23lo = _mm512_unpacklo_epi8(bytes[2], bytes[3]), w23hi = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo)), absmax));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo)), absmax));
    _mm512_storeu_ps(out + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi)), absmax));
    _mm512_storeu_ps(out + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi)), absmax));
}

/* The ADAMW8BIT_BLOCK loop for a whole block, 16 elements at a time, same operations in the same order. */
static void block_avx512(void *param, int param_bf16, const void *grad, int grad_bf16, uint8_t *q1, uint8_t *q2,
                         float *absmax1, float *absmax2, const ByteTable *code1, const ByteTable *code2,
                         const QuantTable *t1, const QuantTable *t2, const Scalars *s) {
    float m[BLOCK], v[BLOCK];
    for (int64_t i = 0; i < BLOCK; i += 64) {
        dequantize64(q1 + i, code1, _mm512_set1_ps(*absmax1), m + i);
        dequantize64(q2 + i, code2, _mm512_set1_ps(*absmax2), v + i);
    }
    const __m512 beta1 = _mm512_set1_ps(s->beta1), omb1 = _mm512_set1_ps(s->one_minus_beta1);
    const __m512 beta2 = _mm512_set1_ps(s->beta2), omb2 = _mm512_set1_ps(s->one_minus_beta2);
    const __m512 c2 = _mm512_set1_ps(s->inv_bias_correction2_sqrt), eps = _mm512_set1_ps(s->eps);
    const __m512 decay = _mm512_set1_ps(s->decay), step = _mm512_set1_ps(s->neg_step_size);
    __m512 max1 = _mm512_setzero_ps(), max2 = _mm512_setzero_ps();
    for (int64_t i = 0; i < BLOCK; i += 16) {
        const __m512 g = load16(grad, grad_bf16, i);
        __m512 mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
        mi = _mm512_add_ps(_mm512_mul_ps(mi, beta1), _mm512_mul_ps(g, omb1));
        vi = _mm512_add_ps(_mm512_mul_ps(vi, beta2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
        const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), c2), eps);
        __m512 p = _mm512_mul_ps(load16(param, param_bf16, i), decay);
        p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_div_ps(mi, denom), step));
        store16(param, param_bf16, i, p);
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
        max1 = _mm512_max_ps(max1, _mm512_abs_ps(mi));
        max2 = _mm512_max_ps(max2, _mm512_abs_ps(vi));
    }
    *absmax1 = _mm512_reduce_max_ps(max1);
    *absmax2 = _mm512_reduce_max_ps(max2);
    quantize_block_avx512(m, BLOCK, *absmax1, t1, q1);
    quantize_block_avx512(v, BLOCK, *absmax2, t2, q2);
}
#define HAVE_AVX512_BLOCK 1
#define QUANTIZE_BLOCK quantize_block_avx512
#else
#define QUANTIZE_BLOCK quantize_block
#endif

ADAMW8BIT_BLOCK(block_fp32_fp32, float, FLOAT_AS_IS, FLOAT_AS_IS, float, FLOAT_AS_IS)
ADAMW8BIT_BLOCK(block_fp32_bf16, float, FLOAT_AS_IS, FLOAT_AS_IS, uint16_t, bf16_to_float)
ADAMW8BIT_BLOCK(block_bf16_fp32, uint16_t, bf16_to_float, float_to_bf16, float, FLOAT_AS_IS)
ADAMW8BIT_BLOCK(block_bf16_bf16, uint16_t, bf16_to_float, float_to_bf16, uint16_t, bf16_to_float)

/* param_dtype / grad_dtype: 0 float32, 1 bfloat16. The float arguments are the step's constants
 * (see adamw8bit._scalars); decay is 1 without weight decay (p * 1 is p exactly). */
void adamw8bit_step(void *param, const void *grad, uint8_t *state1, uint8_t *state2, float *absmax1,
                    float *absmax2, const float *code1, const float *code2, int64_t n, int param_dtype,
                    int grad_dtype, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                    float inv_bias_correction2_sqrt, float eps, float decay, float neg_step_size, int threads) {
    const Scalars s = {beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, decay,
                       neg_step_size};
    QuantTable t1, t2;
    build_table(code1, 1, &t1);
    build_table(code2, 0, &t2);
#ifdef HAVE_AVX512_BLOCK
    ByteTable b1, b2;
    build_byte_table(code1, &b1);
    build_byte_table(code2, &b2);
#endif
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * BLOCK, len = n - start < BLOCK ? n - start : BLOCK;
        uint8_t *q1 = state1 + start, *q2 = state2 + start;
        float *a1 = absmax1 + b, *a2 = absmax2 + b;
#ifdef HAVE_AVX512_BLOCK
        if (len == BLOCK) {
            block_avx512((char *)param + start * (param_dtype ? 2 : 4), param_dtype, (const char *)grad + start * (grad_dtype ? 2 : 4),
                         grad_dtype, q1, q2, a1, a2, &b1, &b2, &t1, &t2, &s);
            continue;
        }
#endif
        if (param_dtype == 0 && grad_dtype == 0)
            block_fp32_fp32((float *)param + start, (const float *)grad + start, q1, q2, a1, a2, code1, code2,
                            &t1, &t2, len, &s);
        else if (param_dtype == 0)
            block_fp32_bf16((float *)param + start, (const uint16_t *)grad + start, q1, q2, a1, a2, code1,
                            code2, &t1, &t2, len, &s);
        else if (grad_dtype == 0)
            block_bf16_fp32((uint16_t *)param + start, (const float *)grad + start, q1, q2, a1, a2, code1,
                            code2, &t1, &t2, len, &s);
        else
            block_bf16_bf16((uint16_t *)param + start, (const uint16_t *)grad + start, q1, q2, a1, a2, code1,
                            code2, &t1, &t2, len, &s);
    }
}
