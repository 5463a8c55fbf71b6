/* bfloat16 <-> float32 on 16 lanes in AVX-512F (+BW/VL): what the bfloat16 kernels share
 * (kernels/cpu_build.py puts this header in their build keys). bfloat16 travels as uint16:
 * the high half of a float32. */
#ifndef HICACHE_CPU_BF16_H
#define HICACHE_CPU_BF16_H
#include <immintrin.h>
#include <stdint.h>

/* float32 -> bfloat16, round to nearest even, NaN kept quiet (AVX-512F only). */
static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 bfloat16s -> float32, exactly. */
static inline __m512 bf16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 bfloat16s at p (lanes past `mask` read as 0). */
static inline __m512 load_bf16(__mmask16 mask, const uint16_t *p) {
    return bf16_to_f32(_mm256_maskz_loadu_epi16(mask, p));
}

/* v rounded to bfloat16 and stored (lanes in `mask`). */
static inline void store_bf16_ps(__mmask16 mask, uint16_t *p, __m512 v) {
    _mm256_mask_storeu_epi16(p, mask, round_bf16(v));
}

/* v rounded to bfloat16 and back: the float32 value torch's bfloat16 op would store. */
static inline __m512 rne_bf16(__m512 v) { return bf16_to_f32(round_bf16(v)); }

/* Whether this CPU has AVX512-BF16 (vdpbf16ps, vcvtneps2bf16). */
static inline int avx512bf16_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

#endif
