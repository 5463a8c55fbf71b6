/* tanh(x) on 16 floats (Cephes' tanhf, within a few ulp): an odd polynomial below
 * |x| = 0.625, (1 - e) / (1 + e) with e = exp(-2|x|) above (exp_ps's domain: no overflow,
 * +-1 exactly for large |x|). For the CPU attention kernel's logit soft-capping
 * (kernels/cpu_build.py puts this header in the kernels' build keys). */
#ifndef HICACHE_CPU_TANH_H
#define HICACHE_CPU_TANH_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_exp.h"

static inline v16f tanh_ps(v16f x) {
    const v16f one = v16_set1_ps(1.0f), z = v16_mul_ps(x, x);
    const v16f a = v16_abs_ps(x);
    v16f p = v16_set1_ps(-5.70498872745e-3f);
    p = v16_fmadd_ps(p, z, v16_set1_ps(2.06390887954e-2f));
    p = v16_fmadd_ps(p, z, v16_set1_ps(-5.37397155531e-2f));
    p = v16_fmadd_ps(p, z, v16_set1_ps(1.33314422036e-1f));
    p = v16_fmadd_ps(p, z, v16_set1_ps(-3.33332819422e-1f));
    const v16f small = v16_fmadd_ps(v16_mul_ps(p, z), x, x);
    const v16f e = exp_ps(v16_mul_ps(a, v16_set1_ps(-2.0f)));
    const v16f big = v16_div_ps(v16_sub_ps(one, e), v16_add_ps(one, e));
    /* big carries |x|'s sign: x's sign bit put back */
    const v16i sign = v16_and_si512(v16_castps_si512(x), v16_set1_epi32(INT32_MIN));
    const v16f signed_big = v16_castsi512_ps(
        v16_or_si512(v16_castps_si512(big), sign));
    return v16_mask_blend_ps(v16_cmp_ps_mask(a, v16_set1_ps(0.625f), _CMP_GT_OQ),
                             small, signed_big);
}

#endif
