/* exp(x) for x <= 0 on 16 floats (Cephes' expf: range reduction by ln 2, degree-5
 * polynomial); lanes below -87.3 give ~1e-38, never +inf or NaN. Shared by the CPU kernels
 * (kernels/cpu_build.py puts this header in their build keys). */
#ifndef HICACHE_CPU_EXP_H
#define HICACHE_CPU_EXP_H
#include "cpu_v16.h"

static inline v16f exp_ps(v16f x) {
    const v16f log2e = v16_set1_ps(1.44269504088896341f);
    const v16f ln2_hi = v16_set1_ps(0.693359375f), ln2_lo = v16_set1_ps(-2.12194440e-4f);
    x = v16_max_ps(x, v16_set1_ps(-87.3f));
    v16f n = v16_roundscale_ps(v16_mul_ps(x, log2e),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v16f r = v16_fnmadd_ps(n, ln2_hi, x);
    r = v16_fnmadd_ps(n, ln2_lo, r);
    v16f p = v16_set1_ps(1.9875691500e-4f);
    p = v16_fmadd_ps(p, r, v16_set1_ps(1.3981999507e-3f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(8.3334519073e-3f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(4.1665795894e-2f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(1.6666665459e-1f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(5.0000001201e-1f));
    v16f y = v16_fmadd_ps(v16_mul_ps(p, r), r, v16_add_ps(r, v16_set1_ps(1.0f)));
    return v16_scalef_ps(y, n);
}

#endif
