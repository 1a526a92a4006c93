/* One pass of AdamW over blockwise 8-bit moments in bitsandbytes' format, built by adamw8bit.py
 * at first use (through fused_step.build_library).
 *
 * Per block of 256 elements: dequantize both moments with the block's old absmax, update them and
 * the parameter in float32 (each operation rounded once, as the pure-torch reference does), keep
 * the updated moments in a stack buffer that stays in L1, then take each moment's new absmax and
 * requantize every element to its nearest code, the reference's code bit for bit (ties included).
 * Blocks are independent, so OpenMP splits them over the threads; each thread reads and writes
 * every byte once. With AVX-512 (VBMI for byte permutes) whole blocks take a vector path: 64
 * elements at a time, even and odd elements in separate vectors (so bf16 converts with a shift),
 * codes looked up by byte permutes, each new code estimated in fixed point from per-binade tables
 * and only the rare lanes near a midpoint checked against it. The portable loop does the rest
 * (and all of it without AVX-512), with the same results; with AVX2 its requantization takes eight
 * lanes at a time (quantize_block_avx2), which makes it about five times faster.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define BLOCK 256
#define CODES 256

#define FLOAT_AS_IS(x) (x)

/* Built with -DTABLE_CHECKS (the float-range tests' debug build), every table index computed from
 * data is checked before use and the process aborts on one out of range, which a test then reports
 * as a crash: an out-of-range read that lands in mapped memory would otherwise go unseen. Without
 * it the checks compile to nothing. */
#ifdef TABLE_CHECKS
/* Each of the COUNT lanes of a vector, stored into lanes[] by STORE, checked as an index. */
#define CHECK_LANES(TYPE, COUNT, STORE, size)                                                            \
    do {                                                                                                   \
        TYPE lanes[COUNT];                                                                                 \
        STORE;                                                                                             \
        for (int lane = 0; lane < (COUNT); lane++) CHECK_INDEX(lanes[lane], size);                        \
    } while (0)
#include <stdio.h>
#include <stdlib.h>
#define CHECK_INDEX(i, size)                                                                              \
    do {                                                                                                   \
        if ((int64_t)(i) < 0 || (int64_t)(i) >= (int64_t)(size)) {                                         \
            fprintf(stderr, "fused_adamw8bit.c:%d: table index %lld outside [0, %lld)\n", __LINE__,         \
                    (long long)(i), (long long)(size));                                                    \
            abort();                                                                                       \
        }                                                                                                  \
    } while (0)
#else
#define CHECK_INDEX(i, size) ((void)0)
#endif

/* The factor a block's moments are scaled by before coding: 1 / absmax, with absmax raised to
 * 1e-38 first, as bitsandbytes' blockwise quantization computes it (so that a block whose absmax
 * is subnormal has a finite scale: below about 2^-128, 1 / absmax overflows float32). Its values
 * are then at most 1e38 * absmax, under 1, and code towards zero. A NaN absmax gives a NaN scale
 * (every element codes as NaN does, see quantize_one), an infinite one 0. */
#define SMALLEST_ABSMAX 1e-38f
static inline float block_scale(float absmax) { return 1.0f / (absmax < SMALLEST_ABSMAX ? SMALLEST_ABSMAX : absmax); }

typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, decay, neg_step_size;
    float grad_scale; /* the clipping factor, where scaled */
    int scaled;
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
    float bound[GROUPS - 1];      /* between group g and g + 1: the group of y is the count of bounds below it */
    int32_t positions;
    int is_signed;
} QuantTable;

static float position_value(const float *code, int zero, int j) { return j == 0 ? 0.0f : code[zero + j]; }

static void build_table(const float *code, int is_signed, QuantTable *t) {
    const int zero = is_signed ? 127 : 0;
    int first = 0;
    memset(t, 0, sizeof *t);
    t->is_signed = is_signed;
    for (int g = 0; g < GROUPS; g++) {
        const int count = (g == 0 || g == GROUPS - 1) ? 1 : (is_signed ? 1 << (g - 1) : 1 << g);
        t->first[g] = first;
        t->last[g] = count - 1;
        const float lo = position_value(code, zero, first);
        if (g < GROUPS - 1)
            t->bound[g] = (position_value(code, zero, first + count - 1) + position_value(code, zero, first + count)) * 0.5f;
        if (count > 1) {
            const float step = (position_value(code, zero, first + count - 1) - lo) / (float)(count - 1);
            t->scale[g] = 1.0f / step;
        } else {
            /* A lone code steps as if to a next code twice as far as its upper boundary, so that a
             * value at that boundary is near a whole position and gets checked (a negative value
             * there goes up: the reference sends that tie to the larger magnitude); 1 has none. */
            t->scale[g] = g < GROUPS - 1 ? 0.5f / (t->bound[g] - lo) : 0.0f;
        }
        t->offset[g] = 0.5f - lo * t->scale[g];
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
            if (t->bound[g] < lower) t->group_below[b]++;
            else if (t->bound[g] < upper) t->boundary[b] = t->bound[g];
        }
    }
}

/* The exact position near estimate j: past every midpoint below y (for a negative x, also one at
 * y: the reference counts midpoints strictly below x, so a tie goes to the larger magnitude). */
static int32_t exact_position(const QuantTable *t, float y, int32_t j, int negative) {
#define PAST(mid) (negative ? (mid) <= y : (mid) < y)
    CHECK_INDEX(j, t->positions);
    while (j > 0 && !PAST(t->midpoint[j - 1])) j--;
    while (j < t->positions - 1 && PAST(t->midpoint[j])) j++;
#undef PAST
    return j;
}

static inline uint8_t code_index(const QuantTable *t, int32_t j, int negative) {
    if (!t->is_signed) return (uint8_t)j;
    return (uint8_t)(negative ? 127 - (j > 127 ? 127 : j) : 127 + j);
}

/* The code of x (a moment times its block's scale): the nearest code, as the reference finds it.
 * A NaN gets the last code, 255, where torch.bucketize puts it (past every midpoint), and an
 * infinity the code at its end of the map; neither reaches the float-to-int conversion below,
 * whose result would be undefined. */
static inline uint8_t quantize_one(const QuantTable *t, float x) {
    const int negative = t->is_signed && x < 0.0f;
    if (x != x) return (uint8_t)(CODES - 1);
    float y = fabsf(x);
    if (y > FLT_MAX) return code_index(t, t->positions - 1, negative);
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    int32_t b = (int32_t)(bits >> 23) - FIRST_EXPONENT;
    b = b < 0 ? 0 : (b > BINADES - 1 ? BINADES - 1 : b);
    const int32_t g = t->group_below[b] + (t->boundary[b] < y);
    CHECK_INDEX(g, GROUPS);
    const float kf = y * t->scale[g] + t->offset[g];
    int32_t k = (int32_t)kf;
    k = k < 0 ? 0 : (k > t->last[g] ? t->last[g] : k);
    int32_t j = t->first[g] + k;
    const float frac = kf - floorf(kf);
    if (frac < NEAR || frac > 1.0f - NEAR) j = exact_position(t, y, j, negative);
    return code_index(t, j, negative);
}

#if !defined(__AVX2__) /* else quantize_block_avx2 below */
static void quantize_block(const float *values, int64_t len, float absmax, const QuantTable *t, uint8_t *out) {
    if (absmax == 0.0f) { /* no scale: bitsandbytes writes code 0 */
        memset(out, 0, (size_t)len);
        return;
    }
    const float inv = block_scale(absmax);
    for (int64_t i = 0; i < len; i++) out[i] = quantize_one(t, values[i] * inv);
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

/* quantize_block with AVX2, for CPUs without the AVX-512 path (most desktops' Intel cores, AMD's
 * before Zen 4), where quantize_one one element at a time costs ten times the rest of the step.
 * Eight lanes at a time do quantize_one's arithmetic, operation for operation (a multiply and an
 * add, no fused multiply-add: the file is built with -ffp-contract=off, which keeps the compiler
 * from fusing either path's, so each lane's kf is quantize_one's), with the group found as the
 * count of group boundaries below y. That is quantize_one's binade lookup plus its comparison
 * because bitsandbytes' maps have increasing bounds, at most one per binade (build_table's own
 * premise), all above 2^-31 (the smallest is about 1.6e-7), so the clamped binades lose none.
 * Where any of the eight lanes lies near a rounding boundary (where quantize_one would search the
 * midpoints) or is not finite, quantize_one codes all eight: the result is quantize_one's. */
_Static_assert(GROUPS - 1 == 8, "the AVX2 quantizer looks groups 0 to GROUPS - 2 up in eight-lane permutes");

typedef struct {
    __m256 bound[GROUPS - 1];
    __m256 scale, offset;  /* groups 0 to 7 (the last group, the lone top code, is set apart) */
    __m256i first, last;
    __m256i top_position;  /* the last group's one position */
} Avx2Table;

static void build_avx2_table(const QuantTable *t, Avx2Table *v) {
    for (int g = 0; g < GROUPS - 1; g++) v->bound[g] = _mm256_set1_ps(t->bound[g]);
    v->scale = _mm256_loadu_ps(t->scale);
    v->offset = _mm256_loadu_ps(t->offset);
    v->first = _mm256_loadu_si256((const __m256i *)t->first);
    v->last = _mm256_loadu_si256((const __m256i *)t->last);
    v->top_position = _mm256_set1_epi32(t->first[GROUPS - 1]);
}

/* The codes of the 8 values x (already scaled by 1 / absmax) as 32-bit lanes; 0 in *settled where
 * a lane needs quantize_one's search (or is NaN or infinite). A lane past the last boundary is in
 * the last group, whose one position quantize_one gives it (its scale is 0: kf is 0.5, never near);
 * the others index eight-entry tables with one permute each. */
static inline __m256i quantize8_avx2(__m256 x, const QuantTable *t, const Avx2Table *v, int *settled) {
    const __m256 y = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256i g = _mm256_setzero_si256();
    for (int k = 0; k < GROUPS - 2; k++) /* a true comparison is -1: subtracting it counts the bound */
        g = _mm256_sub_epi32(g, _mm256_castps_si256(_mm256_cmp_ps(v->bound[k], y, _CMP_LT_OQ)));
#ifdef TABLE_CHECKS
    CHECK_LANES(int32_t, 8, _mm256_storeu_si256((__m256i *)lanes, g), GROUPS - 1);
#endif
    const __m256 top = _mm256_cmp_ps(v->bound[GROUPS - 2], y, _CMP_LT_OQ);
    const __m256 kf = _mm256_add_ps(_mm256_mul_ps(y, _mm256_permutevar8x32_ps(v->scale, g)),
                                    _mm256_permutevar8x32_ps(v->offset, g));
    __m256i k = _mm256_max_epi32(_mm256_cvttps_epi32(kf), _mm256_setzero_si256());
    k = _mm256_min_epi32(k, _mm256_permutevar8x32_epi32(v->last, g));
    __m256i j = _mm256_add_epi32(_mm256_permutevar8x32_epi32(v->first, g), k);
    j = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(j), _mm256_castsi256_ps(v->top_position), top));
    const __m256 frac = _mm256_sub_ps(kf, _mm256_floor_ps(kf));
    const __m256 near = _mm256_or_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(NEAR), _CMP_LT_OQ),
                                     _mm256_cmp_ps(frac, _mm256_set1_ps(1.0f - NEAR), _CMP_GT_OQ));
    const __m256 unsettled = _mm256_or_ps(_mm256_andnot_ps(top, near), /* NaN or infinite: */
                                          _mm256_cmp_ps(y, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
    *settled = _mm256_movemask_ps(unsettled) == 0;
    if (!t->is_signed) return j;
    const __m256i positive = _mm256_add_epi32(_mm256_set1_epi32(127), j);
    const __m256i negative = _mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_min_epi32(j, _mm256_set1_epi32(127)));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(positive), _mm256_castsi256_ps(negative),
                                                _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)));
}

static void quantize_block_avx2(const float *values, int64_t len, float absmax, const QuantTable *t, uint8_t *out) {
    if (absmax == 0.0f) { /* no scale: bitsandbytes writes code 0 */
        memset(out, 0, (size_t)len);
        return;
    }
    Avx2Table v;
    build_avx2_table(t, &v);
    const float inv = block_scale(absmax);
    const __m256 inv8 = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        int settled;
        const __m256i c = quantize8_avx2(_mm256_mul_ps(_mm256_loadu_ps(values + i), inv8), t, &v, &settled);
        if (settled) { /* the low byte of each lane, in order */
            const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c, c), _mm256_setzero_si256());
            _mm_storel_epi64((__m128i *)(out + i), _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes),
                                                                      _mm256_extracti128_si256(bytes, 1)));
        } else {
            for (int k = 0; k < 8; k++) out[i + k] = quantize_one(t, values[i + k] * inv);
        }
    }
    for (; i < len; i++) out[i] = quantize_one(t, values[i] * inv);
}
#define HAVE_AVX2_QUANTIZE 1
#endif

#define ADAMW8BIT_BLOCK(NAME, PARAM_T, TO_FLOAT, FROM_FLOAT, GRAD_T, GRAD_TO_FLOAT, GRAD_SCALED)        \
    static void NAME(PARAM_T *param, const GRAD_T *grad, uint8_t *q1, uint8_t *q2, float *absmax1,      \
                     float *absmax2, const float *code1, const float *code2, const QuantTable *t1,      \
                     const QuantTable *t2, int64_t len, const Scalars *s) {                             \
        float m[BLOCK], v[BLOCK];                                                                      \
        const float a1 = *absmax1, a2 = *absmax2;                                                      \
        float max1 = 0.0f, max2 = 0.0f;                                                                \
        int nan1 = 0, nan2 = 0; /* a NaN moment makes its absmax NaN, as torch's amax does */          \
        _Pragma("omp simd reduction(max:max1,max2) reduction(|:nan1,nan2)")                            \
        for (int64_t i = 0; i < len; i++) {                                                            \
            float g = GRAD_TO_FLOAT(grad[i]);                                                          \
            if (s->scaled) g = GRAD_SCALED(g, s->grad_scale);                                          \
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
            nan1 |= mi != mi;                                                                          \
            nan2 |= vi != vi;                                                                          \
        }                                                                                              \
        if (nan1) max1 = NAN;                                                                          \
        if (nan2) max2 = NAN;                                                                          \
        *absmax1 = max1;                                                                               \
        *absmax2 = max2;                                                                               \
        QUANTIZE_BLOCK(m, len, max1, t1, q1);                                                          \
        QUANTIZE_BLOCK(v, len, max2, t2, q2);                                                          \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VBMI__)
#include <immintrin.h>

/* The vector path works on 64 elements at a time in "pair order": four vectors holding the even
 * elements of the first 32, their odd elements, then the same of the next 32. Then a bf16 vector
 * of 32 elements gives its floats with a shift and a mask (a bf16's bits are the top half of its
 * float's), one interleaving permute (or a shift and an or) puts rounded ones back, and all
 * between is elementwise but for the byte permutes that look codes up and write them, which read
 * and write in any order. */
#define PAIR_ELEMENT(k, i) (((k) >> 1) * 32 + 2 * (i) + ((k) & 1)) /* element at lane i of vector k */

/* The vector quantizer's tables, 32 entries each, indexed by binade: entry b holds the group at the
 * binade's lower edge. A binade holds at most one group boundary, and the group above it is the
 * one at the lower edge of binade b + 1, so a lane above bound[b] just reads entry b + 1. The
 * estimate is in fixed point, the code index in bits 16 to 23 and the fraction of a position
 * below: trunc(y * scale + offset), with the group's first position and the signed map's 127
 * folded into offset, capped at top. */
#define FRACTION_BITS 16
#define NEAR_UNITS 4 /* see quantize16 */

typedef struct {
    float bound[BINADES], scale[BINADES], offset[BINADES];
    int32_t top[BINADES];
    float below[CODES + 2]; /* below[c]: the midpoint under code index c's position, as the reference computes it */
} VecTable;

static void build_vec_table(const QuantTable *t, VecTable *v) {
    const int base = t->is_signed ? 127 : 0;
    const float unit = (float)(1 << FRACTION_BITS);
    for (int b = 0; b < BINADES; b++) {
        const int g = t->group_below[b];
        v->bound[b] = t->boundary[b];
        /* build_table's scale and offset (0.5 - lo * scale) times a power of two, so rounded alike;
         * the offset NEAR_UNITS more (see quantize16). */
        v->scale[b] = t->scale[g] * unit;
        v->offset[b] = (t->offset[g] + (float)(t->first[g] + base)) * unit + (float)NEAR_UNITS;
        /* half a position past the top code: a capped lane is not near */
        v->top[b] = ((t->first[g] + t->last[g] + base) << FRACTION_BITS) | (1 << (FRACTION_BITS - 1));
    }
    for (int c = 0; c < CODES + 2; c++) {
        const int j = c - base; /* position */
        v->below[c] = j >= 1 && j < t->positions ? t->midpoint[j - 1] : (j < 1 ? -INFINITY : INFINITY);
    }
}

/* The fixed-point codes of the near lanes (see quantize16) settled against the exact midpoints:
 * the estimate rounded to the nearest position j, then j - 1 or j as y lies below or past the
 * midpoint between them (a tie, for a negative value, goes past it: the reference sends it to the
 * larger magnitude), capped at the group's top as before. A negative value exactly at the
 * boundary of its binade's two groups is the one tie that the comparison with bound sent down: it
 * goes up here. */
static __attribute__((noinline)) __m512i settle(__mmask16 near, __m512i fixed, __m512 x, __m512 y, __m512i b,
                                                const VecTable *t) {
    const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(x));
    __m512i j = _mm512_srli_epi32(
        _mm512_add_epi32(fixed, _mm512_set1_epi32((1 << (FRACTION_BITS - 1)) - NEAR_UNITS)), FRACTION_BITS);
#ifdef TABLE_CHECKS
    CHECK_LANES(int32_t, 16, _mm512_storeu_si512(lanes, _mm512_maskz_mov_epi32(near, j)), CODES + 2);
#endif
    /* Finite lanes of a finite block give j in range (its callers send any other block to
     * quantize_one); the cap keeps the gather inside the table whatever reaches it. */
    j = _mm512_min_epu32(j, _mm512_set1_epi32(CODES + 1));
    const __m512 mid = _mm512_mask_i32gather_ps(y, near, j, t->below, 4);
    const __mmask16 past = _mm512_mask_cmp_ps_mask(near & ~negative, y, mid, _CMP_GT_OQ) |
                           _mm512_mask_cmp_ps_mask(near & negative, y, mid, _CMP_GE_OQ);
    __m512i settled = _mm512_slli_epi32(_mm512_mask_sub_epi32(j, ~past, j, _mm512_set1_epi32(1)), FRACTION_BITS);
    const __m512i top = _mm512_permutex2var_epi32(_mm512_loadu_si512(t->top), b, _mm512_loadu_si512(t->top + 16));
    settled = _mm512_min_epi32(settled, top);
    const __m512 bound = _mm512_permutex2var_ps(_mm512_loadu_ps(t->bound), b, _mm512_loadu_ps(t->bound + 16));
    const __mmask16 tie = _mm512_mask_cmp_ps_mask(near & negative, y, bound, _CMP_EQ_OQ);
    settled = _mm512_mask_add_epi32(settled, tie, top, _mm512_set1_epi32(1 << FRACTION_BITS));
    return _mm512_mask_mov_epi32(fixed, near, settled);
}

/* quantize_one for 16 values already scaled by 1 / absmax, as fixed-point codes (the code index in
 * bits 16 to 23). Lanes below 2^-31 are raised to it (still the zero group) so that every exponent
 * indexes the 32-entry tables, which read its low five bits (FIRST_EXPONENT is 96 = 3 * 32). The
 * estimate's float rounding (one fused multiply-add, fine here: it only finds a candidate) stays
 * within about one unit of 2^-16 of a position, so where it lies more than NEAR_UNITS from a whole
 * position it rounds as the exact midpoints do; only lanes nearer (about 1e-4 of values, and
 * values at or next to a midpoint, which the ratios of bf16 gradients often are) are settled
 * exactly, with exact set, else only flagged in *any_near. The offsets hold NEAR_UNITS more than
 * the estimate, so a near lane is one whose low 16 bits are under 2 * NEAR_UNITS. A negative
 * lane of the signed map gets 254 minus its positive code index, 127 - position, in 16-bit
 * saturating arithmetic: the position of 1 (code 255) gives code 0 there, the negative code
 * nearest -1. */
static inline __m512i quantize16(__m512 x, int is_signed, int exact, __mmask16 *any_near, const VecTable *t,
                                 const __m512 bound[2], const __m512 scale[2], const __m512 offset[2],
                                 const __m512i top[2]) {
    const __m512 tiny = _mm512_castsi512_ps(_mm512_set1_epi32(FIRST_EXPONENT << 23));
    /* |x| raised to tiny in one instruction (imm 0x0b: larger magnitude, sign cleared). */
    const __m512 y = is_signed ? _mm512_range_ps(x, tiny, 0x0b) : _mm512_max_ps(x, tiny);
    __m512i b = _mm512_srli_epi32(_mm512_castps_si512(y), 23);
#ifdef TABLE_CHECKS /* the tables are read by the exponent's low five bits: it must lie in their 32 binades */
    CHECK_LANES(int32_t, 16, _mm512_storeu_si512(lanes, _mm512_sub_epi32(b, _mm512_set1_epi32(FIRST_EXPONENT))),
                BINADES);
#endif
    const __mmask16 above = _mm512_cmp_ps_mask(y, _mm512_permutex2var_ps(bound[0], b, bound[1]), _CMP_GT_OQ);
    b = _mm512_mask_add_epi32(b, above, b, _mm512_set1_epi32(1));
    __m512i fixed = _mm512_cvttps_epi32(_mm512_fmadd_ps(y, _mm512_permutex2var_ps(scale[0], b, scale[1]),
                                                        _mm512_permutex2var_ps(offset[0], b, offset[1])));
    const __mmask16 near = _mm512_testn_epi32_mask(fixed, _mm512_set1_epi32((1 << FRACTION_BITS) - 2 * NEAR_UNITS));
    *any_near |= near;
    fixed = _mm512_min_epi32(fixed, _mm512_permutex2var_epi32(top[0], b, top[1]));
    if (exact && near) fixed = settle(near, fixed, x, y, b, t);
    if (is_signed) /* the sign bit of each high 16 bits is the lane's; the low 16 bits do not matter */
        fixed = _mm512_mask_subs_epu16(fixed, _mm512_movepi16_mask(_mm512_castps_si512(x)),
                                       _mm512_set1_epi32((254 << FRACTION_BITS) | 0xffff), fixed);
    return fixed;
}

/* Byte 2 of each 32-bit lane of two pair-order vectors, gathered into element order. */
static const uint8_t code_bytes[64] = {
#define B(j) (((j) & 1) << 6) + 4 * (((j) & 31) >> 1) + 2
#define B8(j) B(j), B(j + 1), B(j + 2), B(j + 3), B(j + 4), B(j + 5), B(j + 6), B(j + 7)
    B8(0), B8(8), B8(16), B8(24), B8(32), B8(40), B8(48), B8(56)
#undef B8
#undef B
};

/* Codes of the 64 pair-order values at values into out[0..63], in order; with exact 0 it gives up
 * (returns 0) where a lane needs settling, which the caller then asks for with exact 1 (kept out of
 * line, as the loop runs faster without its code). */
static inline int quantize64(const float *values, __m512 inv, int is_signed, int exact, const VecTable *t, uint8_t *out) {
    const __m512 bound[2] = {_mm512_loadu_ps(t->bound), _mm512_loadu_ps(t->bound + 16)};
    const __m512 scale[2] = {_mm512_loadu_ps(t->scale), _mm512_loadu_ps(t->scale + 16)};
    const __m512 offset[2] = {_mm512_loadu_ps(t->offset), _mm512_loadu_ps(t->offset + 16)};
    const __m512i top[2] = {_mm512_loadu_si512(t->top), _mm512_loadu_si512(t->top + 16)};
    __m512i c[4];
    __mmask16 near = 0;
    for (int k = 0; k < 4; k++)
        c[k] = quantize16(_mm512_mul_ps(_mm512_loadu_ps(values + 16 * k), inv), is_signed, exact, &near, t, bound, scale,
                          offset, top);
    if (near && !exact) return 0;
    const __m512i order = _mm512_loadu_si512(code_bytes);
    _mm512_storeu_si512(out, _mm512_mask_blend_epi8(0xffffffff00000000ull, _mm512_permutex2var_epi8(c[0], order, c[1]),
                                                    _mm512_permutex2var_epi8(c[2], order, c[3])));
    return 1;
}

static __attribute__((noinline)) void quantize64_exact(const float *values, __m512 inv, int is_signed,
                                                      const VecTable *t, uint8_t *out) {
    quantize64(values, inv, is_signed, 1, t, out);
}

/* quantize_block for the pair-order block at values. A block whose absmax is infinite or NaN (a
 * moment overflowed, or a gradient held a NaN) has infinite or NaN values, which the vector
 * quantizer's tables cannot index: quantize_one codes it, element by element. */
static inline void quantize_block_avx512(const float *values, float absmax, int is_signed, const VecTable *t,
                                         const QuantTable *scalar, uint8_t *out) {
    if (absmax == 0.0f) { /* no scale: bitsandbytes writes code 0 */
        memset(out, 0, BLOCK);
        return;
    }
    if (!(absmax <= FLT_MAX)) {
        const float scale = block_scale(absmax);
        for (int i = 0; i < BLOCK; i++)
            out[(i / 64) * 64 + PAIR_ELEMENT((i % 64) / 16, i % 16)] = quantize_one(scalar, values[i] * scale);
        return;
    }
    const __m512 inv = _mm512_set1_ps(block_scale(absmax));
    unsigned redo = 0; /* the chunks to settle, after the loop: a call inside it costs registers */
    for (int i = 0; i < BLOCK / 64; i++) redo |= (unsigned)!quantize64(values + 64 * i, inv, is_signed, 0, t, out + 64 * i) << i;
    for (int i = 0; redo; i++, redo >>= 1)
        if (redo & 1) quantize64_exact(values + 64 * i, inv, is_signed, t, out + 64 * i);
}

/* A 256-entry float table as four 256-entry byte tables (byte k of every code), so that 64 codes
 * are looked up with byte permutes instead of gathers, which are slow on many x86 cores. */
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

/* Unpacking four byte planes within 128-bit lanes leaves lane i of float vector k holding byte
 * 16 (i / 4) + 4k + i % 4; so the codes are first put in that order from pair order. */
static const uint8_t unpack_order[64] = {
#define U(n) PAIR_ELEMENT(((n) % 16) / 4, 4 * ((n) / 16) + (n) % 4)
#define U8(n) U(n), U(n + 1), U(n + 2), U(n + 3), U(n + 4), U(n + 5), U(n + 6), U(n + 7)
    U8(0), U8(8), U8(16), U8(24), U8(32), U8(40), U8(48), U8(56)
#undef U8
#undef U
};

/* code[q[e]] * absmax for the 64 codes at q, in pair order. */
static inline void dequantize64(const uint8_t *q, const ByteTable *t, __m512 absmax, __m512 out[4]) {
    const __m512i codes = _mm512_permutexvar_epi8(_mm512_loadu_si512(unpack_order), _mm512_loadu_si512(q));
    const __mmask64 upper = _mm512_movepi8_mask(codes);
    __m512i bytes[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *plane = t->plane[k];
        /* Codes of 128 and up look up the upper half; the others keep their code as the index of
         * the second permute, which looks up the lower half in just those lanes (no blend). */
        __m512i r = _mm512_mask2_permutex2var_epi8(_mm512_loadu_si512(plane + 128), codes, upper,
                                                   _mm512_loadu_si512(plane + 192));
        bytes[k] = _mm512_mask2_permutex2var_epi8(_mm512_loadu_si512(plane), r, ~upper, _mm512_loadu_si512(plane + 64));
    }
    const __m512i w01lo = _mm512_unpacklo_epi8(bytes[0], bytes[1]), w01hi = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
    const __m512i w23lo = _mm512_unpacklo_epi8(bytes[2], bytes[3]), w23hi = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo)), absmax);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo)), absmax);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi)), absmax);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi)), absmax);
}

/* Lane i of the even (odd) vector: element 2i (2i + 1) of two 16-float vectors side by side. */
static const uint32_t even_lanes[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const uint32_t odd_lanes[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
/* The inverse: lane e of two pair-order vectors side by side, as a permute index (the even vector's
 * lanes are 0 to 15, the odd one's 16 to 31): element e for e under 16, element 16 + e after. */
static const uint32_t first_half[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const uint32_t second_half[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* 64 elements from base + i (bf16 or float32) as floats in pair order. */
static inline void load64(const void *base, int is_bf16, int64_t i, __m512 out[4]) {
    for (int h = 0; h < 2; h++) {
        if (is_bf16) {
            const __m512i pairs = _mm512_loadu_si512((const uint16_t *)base + i + 32 * h);
            out[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            out[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
        } else {
            const float *p = (const float *)base + i + 32 * h;
            const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
            out[2 * h] = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(even_lanes), hi);
            out[2 * h + 1] = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(odd_lanes), hi);
        }
    }
}

/* float_to_bf16 on 16 lanes, as 32-bit lanes holding the bf16 in their low half. */
static inline __m512i round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
}

/* The clipping factor on 64 loaded gradients, as bf16_scaled / fp32_scaled compute it. */
static inline void scale64(__m512 g[4], int is_bf16, float scale) {
    const __m512 factor = _mm512_set1_ps(scale);
    for (int k = 0; k < 4; k++) {
        g[k] = _mm512_mul_ps(g[k], factor);
        if (is_bf16) g[k] = _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(g[k]), 16));
    }
}

/* float_to_bf16 of the 64 pair-order floats in x, into out[0..63] in order. */
static inline void store64_bf16(uint16_t *out, const __m512 x[4]) {
#if defined(__AVX512BF16__)
    /* One instruction rounds two vectors to nearest even (a NaN to a quiet NaN, as float_to_bf16
     * does), but it reads denormal inputs as zero where torch keeps them. So a result with a zero
     * exponent (a zero, or a flushed denormal; rare) sends the 64 elements the exact way below. */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i out0 = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
    const __m512i out1 = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
    const __m512i exponent = _mm512_set1_epi16(0x7f80);
    if (!(_mm512_testn_epi16_mask(out0, exponent) | _mm512_testn_epi16_mask(out1, exponent))) {
        _mm512_storeu_si512(out, out0);
        _mm512_storeu_si512(out + 32, out1);
        return;
    }
#endif
    /* The even element in the low half of each 32 bits, the odd one in the high half. */
    _mm512_storeu_si512(out, _mm512_or_si512(round_bf16(x[0]), _mm512_slli_epi32(round_bf16(x[1]), 16)));
    _mm512_storeu_si512(out + 32, _mm512_or_si512(round_bf16(x[2]), _mm512_slli_epi32(round_bf16(x[3]), 16)));
}

/* The 64 pair-order floats in x into base + i, as bf16 or float32. */
static inline void store64(void *base, int is_bf16, int64_t i, const __m512 x[4]) {
    if (is_bf16) {
        store64_bf16((uint16_t *)base + i, x);
        return;
    }
    float *p = (float *)base + i;
    for (int h = 0; h < 2; h++) {
        _mm512_storeu_ps(p + 32 * h, _mm512_permutex2var_ps(x[2 * h], _mm512_loadu_si512(first_half), x[2 * h + 1]));
        _mm512_storeu_ps(p + 32 * h + 16, _mm512_permutex2var_ps(x[2 * h], _mm512_loadu_si512(second_half), x[2 * h + 1]));
    }
}

/* The ADAMW8BIT_BLOCK loop for a whole block, 64 elements at a time in pair order, same
 * operations in the same order; the moments wait in m and v (pair order, in L1) for the absmax. */
static void block_avx512(void *param, int param_bf16, const void *grad, int grad_bf16, uint8_t *q1, uint8_t *q2,
                         float *absmax1, float *absmax2, const ByteTable *code1, const ByteTable *code2,
                         const VecTable *t1, const VecTable *t2, const QuantTable *s1, const QuantTable *s2,
                         const Scalars *s) {
    float m[BLOCK], v[BLOCK];
    const __m512 old1 = _mm512_set1_ps(*absmax1), old2 = _mm512_set1_ps(*absmax2);
    const __m512 beta1 = _mm512_set1_ps(s->beta1), omb1 = _mm512_set1_ps(s->one_minus_beta1);
    const __m512 beta2 = _mm512_set1_ps(s->beta2), omb2 = _mm512_set1_ps(s->one_minus_beta2);
    const __m512 c2 = _mm512_set1_ps(s->inv_bias_correction2_sqrt), eps = _mm512_set1_ps(s->eps);
    const __m512 decay = _mm512_set1_ps(s->decay), step = _mm512_set1_ps(s->neg_step_size);
    __m512 max1 = _mm512_setzero_ps(), max2 = _mm512_setzero_ps();
    __mmask16 nan1 = 0, nan2 = 0; /* the max instructions drop NaNs; torch's amax keeps them */
    for (int64_t i = 0; i < BLOCK; i += 64) {
        __m512 mi[4], vi[4], g[4], p[4];
        dequantize64(q1 + i, code1, old1, mi);
        dequantize64(q2 + i, code2, old2, vi);
        load64(grad, grad_bf16, i, g);
        if (s->scaled) scale64(g, grad_bf16, s->grad_scale);
        load64(param, param_bf16, i, p);
        for (int k = 0; k < 4; k++) {
            mi[k] = _mm512_add_ps(_mm512_mul_ps(mi[k], beta1), _mm512_mul_ps(g[k], omb1));
            vi[k] = _mm512_add_ps(_mm512_mul_ps(vi[k], beta2), _mm512_mul_ps(_mm512_mul_ps(g[k], g[k]), omb2));
            const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi[k]), c2), eps);
            p[k] = _mm512_mul_ps(p[k], decay);
            p[k] = _mm512_add_ps(p[k], _mm512_mul_ps(_mm512_div_ps(mi[k], denom), step));
            _mm512_storeu_ps(m + i + 16 * k, mi[k]);
            _mm512_storeu_ps(v + i + 16 * k, vi[k]);
            max1 = _mm512_range_ps(max1, mi[k], 0x0b); /* max(max1, |m|) in one instruction (max1 >= 0) */
            max2 = _mm512_max_ps(max2, vi[k]); /* v >= +0: v and g * g are */
            nan1 |= _mm512_cmp_ps_mask(mi[k], mi[k], _CMP_UNORD_Q);
            nan2 |= _mm512_cmp_ps_mask(vi[k], vi[k], _CMP_UNORD_Q);
        }
        store64(param, param_bf16, i, p);
    }
    const float new1 = nan1 ? NAN : _mm512_reduce_max_ps(max1), new2 = nan2 ? NAN : _mm512_reduce_max_ps(max2);
    *absmax1 = new1;
    *absmax2 = new2;
    quantize_block_avx512(m, new1, 1, t1, s1, q1);
    quantize_block_avx512(v, new2, 0, t2, s2, q2);
}
#define HAVE_AVX512_BLOCK 1
#endif
#ifdef HAVE_AVX2_QUANTIZE
#define QUANTIZE_BLOCK quantize_block_avx2
#else
#define QUANTIZE_BLOCK quantize_block
#endif
ADAMW8BIT_BLOCK(block_fp32_fp32, float, FLOAT_AS_IS, FLOAT_AS_IS, float, FLOAT_AS_IS, fp32_scaled)
ADAMW8BIT_BLOCK(block_fp32_bf16, float, FLOAT_AS_IS, FLOAT_AS_IS, uint16_t, bf16_to_float, bf16_scaled)
ADAMW8BIT_BLOCK(block_bf16_fp32, uint16_t, bf16_to_float, float_to_bf16, float, FLOAT_AS_IS, fp32_scaled)
ADAMW8BIT_BLOCK(block_bf16_bf16, uint16_t, bf16_to_float, float_to_bf16, uint16_t, bf16_to_float, bf16_scaled)

/* param_dtype / grad_dtype: 0 float32, 1 bfloat16. The float arguments are the step's constants
 * (see adamw8bit.step_constants); decay is 1 without weight decay (p * 1 is p exactly). scaled: the
 * gradient is first multiplied by grad_scale (clipping) as grad.mul_(grad_scale) would round it in
 * its dtype; the gradient in memory is left as it is. */
void adamw8bit_step(void *param, const void *grad, uint8_t *state1, uint8_t *state2, float *absmax1,
                    float *absmax2, const float *code1, const float *code2, int64_t n, int param_dtype,
                    int grad_dtype, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                    float inv_bias_correction2_sqrt, float eps, float decay, float neg_step_size, int scaled,
                    float grad_scale, int threads) {
    const Scalars s = {beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, decay,
                       neg_step_size, grad_scale, scaled};
    QuantTable t1, t2;
    build_table(code1, 1, &t1);
    build_table(code2, 0, &t2);
#ifdef HAVE_AVX512_BLOCK
    ByteTable b1, b2;
    VecTable v1, v2;
    build_byte_table(code1, &b1);
    build_byte_table(code2, &b2);
    build_vec_table(&t1, &v1);
    build_vec_table(&t2, &v2);
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
                         grad_dtype, q1, q2, a1, a2, &b1, &b2, &v1, &v2, &t1, &t2, &s);
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

/* The loops this build compiled in, for the tests that run every build (adamw8bit.build_paths):
 * 1 the AVX-512 block loop, 2 the AVX2 quantizer, 4 AVX512_BF16's conversion, 8 the table checks. */
int adamw8bit_paths(void) {
    int paths = 0;
#ifdef HAVE_AVX512_BLOCK
    paths |= 1;
#if defined(__AVX512BF16__)
    paths |= 4;
#endif
#endif
#ifdef HAVE_AVX2_QUANTIZE
    paths |= 2;
#endif
#ifdef TABLE_CHECKS
    paths |= 8;
#endif
    return paths;
}
