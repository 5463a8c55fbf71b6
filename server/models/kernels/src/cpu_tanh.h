/* tanh(x) on 16 floats (Cephes' tanhf, within a few ulp): an odd polynomial below
 * |x| = 0.625, (1 - e) / (1 + e) with e = exp(-2|x|) above (exp_ps's domain: no overflow,
 * +-1 exactly for large |x|). For the CPU attention kernel's logit soft-capping
 * (kernels/cpu_build.py puts this header in the kernels' build keys). */
#ifndef HICACHE_CPU_TANH_H
#define HICACHE_CPU_TANH_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_exp.h"

static inline __m512 tanh_ps(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f), z = _mm512_mul_ps(x, x);
    const __m512 a = _mm512_abs_ps(x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 e = exp_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    /* big carries |x|'s sign: x's sign bit put back */
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
    const __m512 signed_big = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(big), sign));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_GT_OQ),
                                small, signed_big);
}

#endif
