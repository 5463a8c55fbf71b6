/* The rest of a decoder layer on the CPU (cpu_v16.h's vectors: AVX-512F or AVX2; OpenMP),
 * float32 and bfloat16: RMSNorm (with the residual add before it), RoPE in place, and
 * SiLU(gate) * up. Each is one pass over its rows where torch runs four to eight ops, each a
 * read and a write of the whole tensor plus a dispatch (a 512-wide decode row's RMSNorm: ~15 us
 * in torch).
 *
 * Layouts (kernels/cpu_layer.py checks them):
 *
 *   rms_norm   x [M, H] rows `ldx` apart; residual and sum [M, H] contiguous, or NULL;
 *              weight [H]; out [M, H] contiguous
 *   rope       x [T, heads, head_dim] rows `ldx` apart, each row's heads contiguous;
 *              positions [T] int64; cos, sin [max_positions, rotary_dim / 2]: the first
 *              rotary_dim (even, <= head_dim) values of each head are rotated, the rest
 *              kept (partial rotary, Phi-4-mini's; rotary_dim = head_dim for the others)
 *   silu_mul   gate_up [M, 2 I] contiguous (gate | up); out [M, I] contiguous
 *   gelu_tanh_mul   as silu_mul (Gemma's GeGLU)
 *   gemma_norm x [M / heads, heads, H]: rows `ldx` apart, each row's heads contiguous
 *              (heads = 1: x [M, H]); weight, next_weight [H] float32 (Gemma's 1 + w);
 *              residual and sum [M, H] contiguous (sum may be the residual), or NULL;
 *              out [M, H] contiguous
 *
 * What must stay true: every row is computed alone, the same way whatever rows share the
 * call (a token's bits do not depend on its batch). RoPE is exactly torch's arithmetic
 * (x1 cos - x2 sin, x2 cos + x1 sin, each product rounded: no FMA contraction, as -std=c11
 * gives), so it changes no bit of the model; RMSNorm and SiLU round differently from torch,
 * within float32 rounding.
 *
 * bfloat16 (the _bf16 functions, same layouts in uint16): float32 math inside, rounded to
 * bfloat16 where transformers' bfloat16 modules round (each of their ops computes in
 * float32 and stores bfloat16): the residual sum; RMSNorm's normalised row, then its product
 * with the weight; RoPE's four products and two sums (cos and sin rounded to bfloat16
 * first), so it is torch's bfloat16 arithmetic exactly; SiLU(gate), then its product with
 * up.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_bf16.h"
#include "cpu_exp.h"
#include "cpu_tanh.h"

#define VEC 16
#define PARALLEL_MIN_FLOATS 65536  /* below this a call stays on the calling thread */

static inline v16mask tail_mask(int64_t left) {
    return v16_lanes(0, left);
}

/* Either dtype through one body (`bf16` a constant at every call, so the compiler keeps
 * two copies without the branch): 16 elements at element i of p as float32, stored back
 * rounded, the bfloat16 rounding of an op's result (none in float32), a row's start. */
static inline v16f load_any(const void *p, int64_t i, v16mask k, int bf16) {
    return bf16 ? load_bf16(k, (const uint16_t *)p + i)
                : v16_maskz_loadu_ps(k, (const float *)p + i);
}

static inline void store_any(void *p, int64_t i, v16mask k, v16f v, int bf16) {
    if (bf16)
        store_bf16_ps(k, (uint16_t *)p + i, v);
    else
        v16_mask_storeu_ps((float *)p + i, k, v);
}

static inline v16f round_any(v16f v, int bf16) { return bf16 ? rne_bf16(v) : v; }

static inline const void *row_at(const void *p, int64_t offset, int bf16) {
    return (const char *)p + offset * (bf16 ? 2 : 4);
}

/* out = weight * (h / sqrt(mean(h^2) + eps)), h = x, or with a residual h = residual + x,
 * written to sum (which may be the residual itself). The squares are summed in 16 lanes in
 * order, then across the lanes. */
void hicache_rms_norm_f32(const float *x, int64_t ldx, const float *residual, float *sum,
                          const float *weight, float eps, int64_t M, int64_t H, float *out,
                          int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (M * H >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * ldx;
        float *hs = residual ? sum + m * H : NULL, *o = out + m * H;
        v16f sq = v16_setzero_ps();
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            v16f h = v16_maskz_loadu_ps(k, xr + i);
            if (hs) {
                h = v16_add_ps(v16_maskz_loadu_ps(k, residual + m * H + i), h);
                v16_mask_storeu_ps(hs + i, k, h);
            }
            sq = v16_fmadd_ps(h, h, sq);
        }
        const float scale = 1.0f / sqrtf(v16_reduce_add_ps(sq) / (float)H + eps);
        const v16f s = v16_set1_ps(scale);
        const float *h_src = hs ? hs : xr;
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            const v16f h = v16_maskz_loadu_ps(k, h_src + i);
            v16_mask_storeu_ps(o + i, k, v16_mul_ps(v16_maskz_loadu_ps(k, weight + i),
                                                    v16_mul_ps(h, s)));
        }
    }
}

/* Rotate-half RoPE of the first rotary_dim values of every head of every row, in place. */
void hicache_rope_f32(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t head_dim,
                      int64_t rotary_dim, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int threads) {
    const int64_t half = rotary_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (T * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + t * ldx + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i += VEC) {
                const v16mask k = tail_mask(half - i);
                const v16f a = v16_maskz_loadu_ps(k, x1 + i), b = v16_maskz_loadu_ps(k, x2 + i);
                const v16f cv = v16_maskz_loadu_ps(k, c + i), sv = v16_maskz_loadu_ps(k, s + i);
                v16_mask_storeu_ps(x1 + i, k, v16_sub_ps(v16_mul_ps(a, cv),
                                                         v16_mul_ps(b, sv)));
                v16_mask_storeu_ps(x2 + i, k, v16_add_ps(v16_mul_ps(b, cv),
                                                         v16_mul_ps(a, sv)));
            }
        }
    }
}

/* ---------------------------------------------------------------------------- bfloat16 */

void hicache_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *residual,
                           uint16_t *sum, const uint16_t *weight, float eps, int64_t M,
                           int64_t H, uint16_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (M * H >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t *xr = x + m * ldx;
        uint16_t *hs = residual ? sum + m * H : NULL, *o = out + m * H;
        v16f sq = v16_setzero_ps();
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            v16f h = load_bf16(k, xr + i);
            if (hs) {
                h = rne_bf16(v16_add_ps(load_bf16(k, residual + m * H + i), h));
                store_bf16_ps(k, hs + i, h);
            }
            sq = v16_fmadd_ps(h, h, sq);
        }
        const float scale = 1.0f / sqrtf(v16_reduce_add_ps(sq) / (float)H + eps);
        const v16f s = v16_set1_ps(scale);
        const uint16_t *h_src = hs ? hs : xr;
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            const v16f h = rne_bf16(v16_mul_ps(load_bf16(k, h_src + i), s));
            store_bf16_ps(k, o + i, v16_mul_ps(load_bf16(k, weight + i), h));
        }
    }
}

/* cos and sin: bfloat16 [max_positions, rotary_dim / 2] (torch's cos.to(bfloat16)). */
void hicache_rope_bf16(uint16_t *x, int64_t ldx, int64_t T, int64_t heads, int64_t head_dim,
                       int64_t rotary_dim, const int64_t *positions, const uint16_t *cos_table,
                       const uint16_t *sin_table, int threads) {
    const int64_t half = rotary_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (T * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t *x1 = x + t * ldx + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i += VEC) {
                const v16mask k = tail_mask(half - i);
                const v16f a = load_bf16(k, x1 + i), b = load_bf16(k, x2 + i);
                const v16f cv = load_bf16(k, c + i), sv = load_bf16(k, s + i);
                store_bf16_ps(k, x1 + i, v16_sub_ps(rne_bf16(v16_mul_ps(a, cv)),
                                                    rne_bf16(v16_mul_ps(b, sv))));
                store_bf16_ps(k, x2 + i, v16_add_ps(rne_bf16(v16_mul_ps(b, cv)),
                                                    rne_bf16(v16_mul_ps(a, sv))));
            }
        }
    }
}

/* ------------------------------------------------------------------------ SiLU * up */

/* out = silu(gate) * up = gate * sigmoid(gate) * up, sigmoid from e = exp(-|gate|) <= 1:
 * 1 / (1 + e) for gate >= 0, e / (1 + e) below (no overflow either side); in bfloat16
 * silu(gate) rounded, then its product with up. */
static inline void silu_mul(const void *gate_up, int64_t M, int64_t I, void *out, int threads,
                            int bf16) {
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (M * I >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; ++m) {
        const void *g = row_at(gate_up, m * 2 * I, bf16), *u = row_at(g, I, bf16);
        void *o = (void *)row_at(out, m * I, bf16);
        for (int64_t i = 0; i < I; i += VEC) {
            const v16mask k = tail_mask(I - i);
            const v16f gv = load_any(g, i, k, bf16);
            const v16f e = exp_ps(v16_sub_ps(v16_setzero_ps(), v16_abs_ps(gv)));
            const v16f one = v16_set1_ps(1.0f);
            const v16mask neg = v16_cmp_ps_mask(gv, v16_setzero_ps(), _CMP_LT_OQ);
            const v16f sig = v16_div_ps(v16_mask_mov_ps(one, neg, e), v16_add_ps(one, e));
            const v16f act = round_any(v16_mul_ps(gv, sig), bf16);
            store_any(o, i, k, v16_mul_ps(act, load_any(u, i, k, bf16)), bf16);
        }
    }
}

void hicache_silu_mul_f32(const float *gate_up, int64_t M, int64_t I, float *out, int threads) {
    silu_mul(gate_up, M, I, out, threads, 0);
}

void hicache_silu_mul_bf16(const uint16_t *gate_up, int64_t M, int64_t I, uint16_t *out,
                           int threads) {
    silu_mul(gate_up, M, I, out, threads, 1);
}

/* ------------------------------------------------------------------------ Gemma's ops
 * Both dtypes from one body each (load_any and its kin, above). Gemma rounds differently
 * from Llama: its RMSNorm keeps the normalised row in float32, multiplies by the float32
 * 1 + w and rounds once (transformers' Gemma3RMSNorm); the residual sum and GeGLU's
 * gelu_tanh(gate), then its product with up, round as in SiLU * up. */

/* 1 / sqrt(mean(x^2) + eps) of one row, the squares summed in 16 lanes in order. */
static inline float inv_rms(const void *x, int64_t H, float eps, int bf16) {
    v16f sq = v16_setzero_ps();
    for (int64_t i = 0; i < H; i += VEC) {
        const v16f h = load_any(x, i, tail_mask(H - i), bf16);
        sq = v16_fmadd_ps(h, h, sq);
    }
    return 1.0f / sqrtf(v16_reduce_add_ps(sq) / (float)H + eps);
}

/* Without a residual: out = (x * s) * weight. With one: sum = residual + that (Gemma's
 * norm after the attention or the MLP, then the add) and out = (sum * s') * next_weight
 * (the next norm, before the MLP or the next layer): three of transformers' modules in one
 * pass, the sum kept for the residual stream. */
static inline void gemma_norm(const void *x, int64_t ldx, int64_t heads, const float *weight,
                              const void *residual, void *sum, const float *next_weight,
                              float eps, int64_t M, int64_t H, void *out, int threads,
                              int bf16) {
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (M * H >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; ++m) {
        const void *xr = row_at(x, (m / heads) * ldx + (m % heads) * H, bf16);
        const v16f s = v16_set1_ps(inv_rms(xr, H, eps, bf16));
        void *target = (void *)(residual ? row_at(sum, m * H, bf16) : row_at(out, m * H, bf16));
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            v16f n = v16_mul_ps(v16_mul_ps(load_any(xr, i, k, bf16), s),
                                     v16_maskz_loadu_ps(k, weight + i));
            if (residual)  /* the branch rounded, then the sum */
                n = v16_add_ps(load_any(row_at(residual, m * H, bf16), i, k, bf16),
                               round_any(n, bf16));
            store_any(target, i, k, n, bf16);
        }
        if (!residual)
            continue;
        const v16f s2 = v16_set1_ps(inv_rms(target, H, eps, bf16));
        void *o = (void *)row_at(out, m * H, bf16);
        for (int64_t i = 0; i < H; i += VEC) {
            const v16mask k = tail_mask(H - i);
            store_any(o, i, k, v16_mul_ps(v16_mul_ps(load_any(target, i, k, bf16), s2),
                                          v16_maskz_loadu_ps(k, next_weight + i)), bf16);
        }
    }
}

void hicache_gemma_norm_f32(const float *x, int64_t ldx, int64_t heads, const float *weight,
                            const float *residual, float *sum, const float *next_weight,
                            float eps, int64_t M, int64_t H, float *out, int threads) {
    gemma_norm(x, ldx, heads, weight, residual, sum, next_weight, eps, M, H, out, threads, 0);
}

void hicache_gemma_norm_bf16(const uint16_t *x, int64_t ldx, int64_t heads,
                             const float *weight, const uint16_t *residual, uint16_t *sum,
                             const float *next_weight, float eps, int64_t M, int64_t H,
                             uint16_t *out, int threads) {
    gemma_norm(x, ldx, heads, weight, residual, sum, next_weight, eps, M, H, out, threads, 1);
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in the order of
 * torch's vectorised CPU kernel (GeluKernelImpl, approximate="tanh"), no FMA. */
static inline v16f gelu_tanh_ps(v16f x) {
    const v16f beta = v16_set1_ps(0.7978845608028654f), kappa = v16_set1_ps(0.044715f);
    const v16f cube = v16_mul_ps(v16_mul_ps(x, x), x);
    const v16f inner = v16_mul_ps(beta, v16_add_ps(x, v16_mul_ps(kappa, cube)));
    return v16_mul_ps(v16_mul_ps(v16_set1_ps(0.5f), x),
                      v16_add_ps(v16_set1_ps(1.0f), tanh_ps(inner)));
}

static inline void gelu_tanh_mul(const void *gate_up, int64_t M, int64_t I, void *out,
                                 int threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if (M * I >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; ++m) {
        const void *g = row_at(gate_up, m * 2 * I, bf16), *u = row_at(g, I, bf16);
        void *o = (void *)row_at(out, m * I, bf16);
        for (int64_t i = 0; i < I; i += VEC) {
            const v16mask k = tail_mask(I - i);
            const v16f act = round_any(gelu_tanh_ps(load_any(g, i, k, bf16)), bf16);
            store_any(o, i, k, v16_mul_ps(act, load_any(u, i, k, bf16)), bf16);
        }
    }
}

void hicache_gelu_tanh_mul_f32(const float *gate_up, int64_t M, int64_t I, float *out,
                               int threads) {
    gelu_tanh_mul(gate_up, M, I, out, threads, 0);
}

void hicache_gelu_tanh_mul_bf16(const uint16_t *gate_up, int64_t M, int64_t I, uint16_t *out,
                                int threads) {
    gelu_tanh_mul(gate_up, M, I, out, threads, 1);
}
