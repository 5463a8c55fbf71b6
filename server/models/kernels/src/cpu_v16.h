/* Vectors of 16 floats for the attention and layer kernels, one vocabulary for two builds
 * (kernels/cpu_build.py picks the build by the CPU, as torch dispatches):
 *
 * - AVX-512F: v16f is __m512 and each v16_ operation is the _mm512_ intrinsic of the same
 *   name, as a macro (bringing the vocabulary in changed no vector instruction of this
 *   build: the disassembly's count of each was the same before and after);
 * - AVX2 + FMA (AMD's Zen 2 and 3, Intel's client cores): v16f is two __m256 (lanes 0-7 in
 *   lo, 8-15 in hi) and each operation does, lane by lane, what its AVX-512 intrinsic does.
 *   The horizontal sum adds in the order GCC's _mm512_reduce_add_ps does (the halves, then
 *   the quarters, then pairs), and exp_ps's 2^n is exact where scalef's is, so a kernel's
 *   every lane runs the same chain in both builds: the same bits on either CPU.
 *
 * On AVX2 the operations that take an immediate (compares, rounding, shifts) are macros
 * that name their vector argument twice: pass them a variable, not a call.
 *
 * Masks (v16mask): a bit per lane on AVX-512 (__mmask16), all-ones lanes on AVX2. Masked
 * loads read no memory outside the mask on either (a row's tail may end a page).
 * bf16x16 (__m256i) holds 16 bfloat16s on both.
 */
#ifndef HICACHE_CPU_V16_H
#define HICACHE_CPU_V16_H
#include <immintrin.h>
#include <stdint.h>

typedef __m256i bf16x16;

#ifdef __AVX512F__

typedef __m512 v16f;
typedef __m512i v16i;
typedef __mmask16 v16mask;

#define v16_setzero_ps _mm512_setzero_ps
#define v16_set1_ps _mm512_set1_ps
#define v16_set1_epi32 _mm512_set1_epi32
#define v16_loadu_ps _mm512_loadu_ps
#define v16_storeu_ps _mm512_storeu_ps
#define v16_maskz_loadu_ps _mm512_maskz_loadu_ps
#define v16_mask_storeu_ps _mm512_mask_storeu_ps
#define v16_add_ps _mm512_add_ps
#define v16_sub_ps _mm512_sub_ps
#define v16_mul_ps _mm512_mul_ps
#define v16_div_ps _mm512_div_ps
#define v16_max_ps _mm512_max_ps
#define v16_abs_ps _mm512_abs_ps
#define v16_fmadd_ps _mm512_fmadd_ps
#define v16_fnmadd_ps _mm512_fnmadd_ps
#define v16_mask_max_ps _mm512_mask_max_ps
#define v16_maskz_mov_ps _mm512_maskz_mov_ps
#define v16_mask_mov_ps _mm512_mask_mov_ps
#define v16_mask_blend_ps _mm512_mask_blend_ps
#define v16_cmp_ps_mask _mm512_cmp_ps_mask
#define v16_reduce_add_ps _mm512_reduce_add_ps
#define v16_reduce_max_ps _mm512_reduce_max_ps
#define v16_cvtss_f32 _mm512_cvtss_f32
#define v16_roundscale_ps _mm512_roundscale_ps
#define v16_scalef_ps _mm512_scalef_ps
#define v16_castps_si512 _mm512_castps_si512
#define v16_castsi512_ps _mm512_castsi512_ps
#define v16_and_si512 _mm512_and_si512
#define v16_or_si512 _mm512_or_si512
#define v16_add_epi32 _mm512_add_epi32
#define v16_srli_epi32 _mm512_srli_epi32
#define v16_slli_epi32 _mm512_slli_epi32
#define v16_mask_or_epi32 _mm512_mask_or_epi32
#define v16_cvtepi32_epi16 _mm512_cvtepi32_epi16
#define v16_cvtepu16_epi32 _mm512_cvtepu16_epi32
#define v16_maskz_loadu_epi16 _mm256_maskz_loadu_epi16
#define v16_mask_storeu_epi16 _mm256_mask_storeu_epi16

/* Lanes [lo, hi) (lane indices; either may lie outside 0..16). */
static inline uint32_t v16_bits_below(int64_t n) {
    return n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1;
}
static inline v16mask v16_lanes(int64_t lo, int64_t hi) {
    return (__mmask16)(v16_bits_below(hi) & ~v16_bits_below(lo));
}

/* r[c] <- column c of the 16 x 16 block whose rows are r[0..16) (three rounds of shuffles). */
static inline void v16_transpose(v16f r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {  /* pairs of rows interleaved within each 128-bit lane */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  /* r[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3 */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; ++i)  /* lanes regrouped across row quads ... */
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; ++k) {  /* ... and again: whole columns */
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    }
}

#else /* AVX2 + FMA */

typedef struct { __m256 lo, hi; } v16f;
typedef struct { __m256i lo, hi; } v16i;
typedef struct { __m256 lo, hi; } v16mask;

#define V16_INLINE static inline __attribute__((always_inline))
#define V16_F(a, b) ((v16f){(a), (b)})
/* an operation of one or two v16f, applied to both halves */
#define V16_EACH1(op, a) V16_F(op((a).lo), op((a).hi))
#define V16_EACH2(op, a, b) V16_F(op((a).lo, (b).lo), op((a).hi, (b).hi))

V16_INLINE v16f v16_setzero_ps(void) { return V16_F(_mm256_setzero_ps(), _mm256_setzero_ps()); }
V16_INLINE v16f v16_set1_ps(float x) { return V16_F(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
V16_INLINE v16i v16_set1_epi32(int x) {
    return (v16i){_mm256_set1_epi32(x), _mm256_set1_epi32(x)};
}
V16_INLINE v16f v16_loadu_ps(const float *p) {
    return V16_F(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
V16_INLINE void v16_storeu_ps(float *p, v16f v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
V16_INLINE v16f v16_maskz_loadu_ps(v16mask k, const float *p) {
    return V16_F(_mm256_maskload_ps(p, _mm256_castps_si256(k.lo)),
                 _mm256_maskload_ps(p + 8, _mm256_castps_si256(k.hi)));
}
V16_INLINE void v16_mask_storeu_ps(float *p, v16mask k, v16f v) {
    _mm256_maskstore_ps(p, _mm256_castps_si256(k.lo), v.lo);
    _mm256_maskstore_ps(p + 8, _mm256_castps_si256(k.hi), v.hi);
}
V16_INLINE v16f v16_add_ps(v16f a, v16f b) { return V16_EACH2(_mm256_add_ps, a, b); }
V16_INLINE v16f v16_sub_ps(v16f a, v16f b) { return V16_EACH2(_mm256_sub_ps, a, b); }
V16_INLINE v16f v16_mul_ps(v16f a, v16f b) { return V16_EACH2(_mm256_mul_ps, a, b); }
V16_INLINE v16f v16_div_ps(v16f a, v16f b) { return V16_EACH2(_mm256_div_ps, a, b); }
/* vmaxps in both builds: the second operand where either is NaN */
V16_INLINE v16f v16_max_ps(v16f a, v16f b) { return V16_EACH2(_mm256_max_ps, a, b); }
V16_INLINE v16f v16_abs_ps(v16f a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return V16_F(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
V16_INLINE v16f v16_fmadd_ps(v16f a, v16f b, v16f c) {
    return V16_F(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
V16_INLINE v16f v16_fnmadd_ps(v16f a, v16f b, v16f c) {
    return V16_F(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
/* k ? b : a, per lane */
V16_INLINE v16f v16_mask_blend_ps(v16mask k, v16f a, v16f b) {
    return V16_F(_mm256_blendv_ps(a.lo, b.lo, k.lo), _mm256_blendv_ps(a.hi, b.hi, k.hi));
}
V16_INLINE v16f v16_mask_mov_ps(v16f src, v16mask k, v16f a) {
    return v16_mask_blend_ps(k, src, a);
}
V16_INLINE v16f v16_maskz_mov_ps(v16mask k, v16f a) {
    return V16_F(_mm256_and_ps(k.lo, a.lo), _mm256_and_ps(k.hi, a.hi));
}
V16_INLINE v16f v16_mask_max_ps(v16f src, v16mask k, v16f a, v16f b) {
    return v16_mask_blend_ps(k, src, v16_max_ps(a, b));
}
/* `pred` a _CMP_ constant (a macro: the instruction takes it as an immediate) */
#define v16_cmp_ps_mask(a, b, pred) \
    ((v16mask){_mm256_cmp_ps((a).lo, (b).lo, (pred)), _mm256_cmp_ps((a).hi, (b).hi, (pred))})

/* GCC's _mm512_reduce_add_ps (max): the halves, the quarters, lanes {2, 3} onto {0, 1},
 * lane 1 onto lane 0. */
#define V16_REDUCE(add4, add1, v)                                                          \
    __m256 h = _mm256_##add4((v).hi, (v).lo);                                              \
    __m128 q = _mm_##add1(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));         \
    q = _mm_##add1(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));                      \
    return _mm_cvtss_f32(_mm_##add1(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(0, 0, 0, 1))))
V16_INLINE float v16_reduce_add_ps(v16f v) { V16_REDUCE(add_ps, add_ps, v); }
V16_INLINE float v16_reduce_max_ps(v16f v) { V16_REDUCE(max_ps, max_ps, v); }
#undef V16_REDUCE
V16_INLINE float v16_cvtss_f32(v16f v) { return _mm256_cvtss_f32(v.lo); }

/* Rounding to an integral value (`mode` a _MM_FROUND_ constant, as roundscale's imm8 with
 * no fraction bits) */
#define v16_roundscale_ps(v, mode) \
    ((v16f){_mm256_round_ps((v).lo, (mode)), _mm256_round_ps((v).hi, (mode))})
/* y * 2^n for integral n in [-126, 127]: the power built exactly, one rounding of the
 * product, as scalef's. exp_ps's n lies in [-126, 0] for its domain x <= 0. */
V16_INLINE __m256 v16_pow2_half(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
V16_INLINE v16f v16_scalef_ps(v16f y, v16f n) {
    return V16_F(_mm256_mul_ps(y.lo, v16_pow2_half(n.lo)),
                 _mm256_mul_ps(y.hi, v16_pow2_half(n.hi)));
}

V16_INLINE v16i v16_castps_si512(v16f v) {
    return (v16i){_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)};
}
V16_INLINE v16f v16_castsi512_ps(v16i v) {
    return V16_F(_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi));
}
V16_INLINE v16i v16_and_si512(v16i a, v16i b) {
    return (v16i){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
V16_INLINE v16i v16_or_si512(v16i a, v16i b) {
    return (v16i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
}
V16_INLINE v16i v16_add_epi32(v16i a, v16i b) {
    return (v16i){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
#define v16_srli_epi32(v, n) \
    ((v16i){_mm256_srli_epi32((v).lo, (n)), _mm256_srli_epi32((v).hi, (n))})
#define v16_slli_epi32(v, n) \
    ((v16i){_mm256_slli_epi32((v).lo, (n)), _mm256_slli_epi32((v).hi, (n))})
/* k ? a | b : src, per lane */
V16_INLINE v16i v16_mask_or_epi32(v16i src, v16mask k, v16i a, v16i b) {
    const v16i o = v16_or_si512(a, b);
    return (v16i){_mm256_blendv_epi8(src.lo, o.lo, _mm256_castps_si256(k.lo)),
                  _mm256_blendv_epi8(src.hi, o.hi, _mm256_castps_si256(k.hi))};
}
/* 16 int32 in [0, 65535] -> their low halves (the kernels' only use: bfloat16 bits) */
V16_INLINE bf16x16 v16_cvtepi32_epi16(v16i v) {
    /* packus interleaves the halves' 128-bit lanes: lo0-3 hi0-3 lo4-7 hi4-7 */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(v.lo, v.hi), 0xD8);
}
V16_INLINE v16i v16_cvtepu16_epi32(bf16x16 h) {
    return (v16i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                  _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1))};
}
V16_INLINE uint32_t v16_mask_bits(v16mask k) {
    return (uint32_t)_mm256_movemask_ps(k.lo) | (uint32_t)_mm256_movemask_ps(k.hi) << 8;
}
/* 16 uint16 at p, lanes outside k zero and unread */
V16_INLINE bf16x16 v16_maskz_loadu_epi16(v16mask k, const uint16_t *p) {
    const uint32_t bits = v16_mask_bits(k);
    if (bits == 0xFFFFu)
        return _mm256_loadu_si256((const __m256i *)p);
    uint16_t lanes[16] = {0};
    for (int i = 0; i < 16; ++i)
        if (bits >> i & 1) lanes[i] = p[i];
    return _mm256_loadu_si256((const __m256i *)lanes);
}
V16_INLINE void v16_mask_storeu_epi16(uint16_t *p, v16mask k, bf16x16 v) {
    const uint32_t bits = v16_mask_bits(k);
    if (bits == 0xFFFFu) {
        _mm256_storeu_si256((__m256i *)p, v);
        return;
    }
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, v);
    for (int i = 0; i < 16; ++i)
        if (bits >> i & 1) p[i] = lanes[i];
}

/* Lanes [lo, hi) (lane indices; either may lie outside 0..16). */
V16_INLINE v16mask v16_lanes(int64_t lo, int64_t hi) {
    const int a = lo < 0 ? 0 : lo > 16 ? 16 : (int)lo, b = hi < 0 ? 0 : hi > 16 ? 16 : (int)hi;
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    const __m256i va = _mm256_set1_epi32(a), vb = _mm256_set1_epi32(b);
    /* lane i is in when a <= i < b: i > a - 1 and b > i */
    const __m256i am1 = _mm256_sub_epi32(va, _mm256_set1_epi32(1));
    const __m256i i_hi = _mm256_add_epi32(idx, eight);
    return (v16mask){
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, am1),
                                             _mm256_cmpgt_epi32(vb, idx))),
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i_hi, am1),
                                             _mm256_cmpgt_epi32(vb, i_hi)))};
}

/* The 8 x 8 block whose rows are r[0..8), transposed in place (r[c] <- column c). */
V16_INLINE void v16_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* r[c] <- column c of the 16 x 16 block whose rows are r[0..16): four 8 x 8 transposes. */
static inline void v16_transpose(v16f r[16]) {
    __m256 q[4][8];  /* quadrant (row half, column half) */
    for (int i = 0; i < 8; ++i) {
        q[0][i] = r[i].lo;
        q[1][i] = r[i].hi;
        q[2][i] = r[8 + i].lo;
        q[3][i] = r[8 + i].hi;
    }
    for (int k = 0; k < 4; ++k) v16_transpose8(q[k]);
    for (int c = 0; c < 8; ++c) {  /* column c: rows 0-7 from quadrant 0, 8-15 from 2 */
        r[c] = V16_F(q[0][c], q[2][c]);
        r[8 + c] = V16_F(q[1][c], q[3][c]);
    }
}

#endif

#endif
