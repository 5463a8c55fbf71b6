/* bfloat16 <-> float32 on 16 lanes (cpu_v16.h's, AVX-512 or AVX2): what the bfloat16
 * kernels share (kernels/cpu_build.py puts this header in their build keys). bfloat16
 * travels as uint16: the high half of a float32. */
#ifndef HICACHE_CPU_BF16_H
#define HICACHE_CPU_BF16_H
#include "cpu_v16.h"
#include <stdint.h>

/* float32 -> bfloat16, round to nearest even, NaN kept quiet. */
static inline bf16x16 round_bf16(v16f v) {
    const v16i u = v16_castps_si512(v);
    const v16i lsb = v16_and_si512(v16_srli_epi32(u, 16), v16_set1_epi32(1));
    v16i r = v16_srli_epi32(v16_add_epi32(v16_add_epi32(u, v16_set1_epi32(0x7FFF)), lsb), 16);
    const v16mask nan = v16_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = v16_mask_or_epi32(r, nan, v16_srli_epi32(u, 16), v16_set1_epi32(0x40));
    return v16_cvtepi32_epi16(r);
}

/* 16 bfloat16s -> float32, exactly. */
static inline v16f bf16_to_f32(bf16x16 h) {
    return v16_castsi512_ps(v16_slli_epi32(v16_cvtepu16_epi32(h), 16));
}

/* 16 bfloat16s at p (lanes past `mask` read as 0). */
static inline v16f load_bf16(v16mask mask, const uint16_t *p) {
    return bf16_to_f32(v16_maskz_loadu_epi16(mask, p));
}

/* v rounded to bfloat16 and stored (lanes in `mask`). */
static inline void store_bf16_ps(v16mask mask, uint16_t *p, v16f v) {
    v16_mask_storeu_epi16(p, mask, round_bf16(v));
}

/* v rounded to bfloat16 and back: the float32 value torch's bfloat16 op would store. */
static inline v16f rne_bf16(v16f v) { return bf16_to_f32(round_bf16(v)); }

/* Whether this CPU has AVX512-BF16 (vdpbf16ps, vcvtneps2bf16). */
static inline int avx512bf16_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

#endif
