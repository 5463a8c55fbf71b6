/* The greedy screen of an LM head (OpenMP; AVX2 + FMA, and an AVX-512 build whose VNNI path
 * runs where the CPU has AVX512-VNNI): from an int8 copy of the head, which outputs can
 * still be a row's largest logit. kernels/cpu_head.py and models/head_screen.py use it; the screen's
 * argument is in head_screen.py's docstring.
 *
 * Layouts (kernels/cpu_head.py checks them):
 *
 *   W        [V, K] the head, float32 (bfloat16 heads converted, exactly)
 *   packed   [ceil(V / 16)][K][16] int8: group g holds q[16g .. 16g + 15][k] for each k,
 *            q[j] = round(W[j] / scale[j]) in [-127, 127]; missing outputs are zeros
 *   scale    [V] float32; reach [V] float32: how far output j's screened logit may be from
 *            its exact one, per unit of the row's norm (head_screen.py works it out)
 *   x        [B, K] float32, rows contiguous; norm [B] float64: each row's 2-norm, rounded up
 *   flags    [ceil(V / 64)] uint8: set to 1 for each panel of 64 outputs (the linear
 *            kernel's panels) holding a candidate of some row, else 0
 *
 *   qnorm    [V] float32: ||scale[j] q[j]||, rounded up (the VNNI path's bound)
 *   quads    (the VNNI path) [ceil(V / 16)][ceil(K / 4)][16][4] int8: group g holds, for each
 *            four inputs 4c .. 4c + 3, q[16g + j][4c .. 4c + 3] for j = 0 .. 15 (the four
 *            bytes vpdpbusd reads per lane); missing outputs and inputs are zeros
 *
 * Two paths give the screened logits s:
 *   fma   s = scale[j] * sum_k x[b][k] q[j][k], one float32 FMA chain per output (AVX2)
 *   vnni  (AVX512-VNNI) x[b] quantized too, in two levels: x' = xs0 q0 + xs1 q1, q0 =
 *         round(x / xs0) and q1 = round((x - xs0 q0) / xs1) in [-127, 127], each xs the
 *         level's max |.| / 127; s = ((float)S0 * xs0 + (float)S1 * xs1) * scale[j], with
 *         S_l = sum_k q_l[k] q[j][k] exact in int32 (vpdpbusd reads q_l + 128 as unsigned,
 *         and 128 sum_k q[j][k] is taken off). What x loses there is err[b] = (||x - x'|| +
 *         2^-21 (||xs0 q0|| + ||xs1 q1||)) (1 + 2^-20): |x.w - x'.w| <= ||x - x'|| ||w|| for
 *         w = scale[j] q[j], and the four float32 roundings after the sums are within
 *         2^-22 of each level's |xs_l q_l.w| <= ||xs_l q_l|| ||w||. The fma path's err is 0.
 * For row b, output j: r = norm[b] reach[j] + err[b] qnorm[j], lo = s - r and hi = s + r
 * (float64). The exact logit lies in [lo, hi],
 * so the largest lies at or above lo_max = max_j lo; an output is a candidate when its hi
 * reaches lo_max - slack * max(|lo_max|, |hi_max|) - TINY_FLOOR (slack: what rounding the
 * logits to the model's dtype may merge; 0 in float32), or when it is not a number.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pack.h"

#define GROUP 16     /* outputs per group of the int8 copy: two 8-float vectors */
#define PANEL 64     /* outputs per panel of the linear kernel (cpu_linear.c's NR) */
_Static_assert(PANEL % GROUP == 0, "a panel is whole groups");
#define ROWS 6       /* rows of x per register tile: 12 accumulators */
#define MAX_ROWS 64  /* rows per call */
/* Absolute terms for values near float32's denormals, which the relative bound misses: a
 * denormal input a bfloat16 path flushes to zero moves a product by < 2^-126 |x_k|, at most
 * 2^-116 ||x|| in all for K < 2^20 (TINY_REACH, per unit of ||x||, in reach); an add that
 * lands below 2^-126 is off by < 2^-126 absolute, (K + 2) 2^-126 < 2^-105 a chain for
 * either chain (TINY_FLOOR, below the floor). */
#define TINY_REACH 0x1p-110
#define TINY_FLOOR 0x1p-99

/* Bytes of the packed int8 copy of a [V, K] head, either layout. */
int64_t hicache_head_packed_size(int64_t V, int64_t K) {
    return (V + GROUP - 1) / GROUP * ((K + 3) / 4 * 4) * GROUP;
}

/* Whether this CPU has AVX512-VNNI (vpdpbusd); the AVX2 build never takes that path. */
int hicache_head_has_vnni(void) {
#ifdef __AVX512F__
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* q [V, K] int8 row-major -> the VNNI path's layout (`quads`, above). */
void hicache_head_pack_quads(const int8_t *q, int64_t V, int64_t K, int8_t *packed) {
    PACK_TUPLES(packed, q, V, K, GROUP, (K + 3) / 4, 4);
}

/* q [V, K] int8 row-major -> packed (the layout above). */
void hicache_head_pack(const int8_t *q, int64_t V, int64_t K, int8_t *packed) {
    const int64_t groups = (V + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < GROUP; j++) {
                const int64_t v = g * GROUP + j;
                packed[(g * K + k) * GROUP + j] = v < V ? q[v * K + k] : 0;
            }
}

/* The float32 at or above v. */
static float round_up(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* The int8 copy of rows [0, V) of a float32 head w [V, K] (row-major): per row j, scale[j] =
 * max |w[j]| / 127 (1 for a row of zeros), q[j][k] = round(w[j][k] / scale[j]) (nearest,
 * ties away from zero) in [-127, 127], reach[j] = (||w[j] - scale[j] q[j]|| + g
 * (||w[j]|| + scale[j] ||q[j]||)) (1 + 2^-20) and qnorm[j] = ||scale[j] q[j]|| (1 + 2^-20),
 * the norms summed in float64 and rounded up to float32 (head_screen.py says what reach
 * bounds). */
void hicache_head_quantize(const float *w, int64_t V, int64_t K, double g, int8_t *q,
                           float *scale, float *reach, float *qnorm) {
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < V; j++) {
        const float *row = w + j * K;
        float most = 0.0f;
        for (int64_t k = 0; k < K; k++)
            most = fabsf(row[k]) > most ? fabsf(row[k]) : most;
        float s = most > 0.0f ? most / 127.0f : 1.0f;
        if (!(s >= FLT_MIN))  /* a tiny row: a normal scale (its error is in reach) */
            s = FLT_MIN;
        double err = 0.0, wn = 0.0, qn = 0.0;
        for (int64_t k = 0; k < K; k++) {
            float r = roundf(row[k] / s);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            if (r != r)  /* a NaN weight: q 0, and reach NaN keeps the output a candidate */
                r = 0.0f;
            q[j * K + k] = (int8_t)r;
            const double approx = (double)s * (double)r, wk = (double)row[k];
            err += (wk - approx) * (wk - approx);
            wn += wk * wk;
            qn += approx * approx;
        }
        const double bound = (sqrt(err) + g * (sqrt(wn) + sqrt(qn)) + TINY_REACH)
                             * (1.0 + 0x1p-20);
        scale[j] = s;
        reach[j] = round_up(bound);
        qnorm[j] = round_up(sqrt(qn) * (1.0 + 0x1p-20));
    }
}

/* Rows [0, mr) of x against group `g`'s int8 outputs: out[i][0 .. 16) screened logits
 * (before the scale). */
static inline __attribute__((always_inline)) void group_tile(
        const int mr, const float *x, int64_t K, const int8_t *w, float out[ROWS][GROUP]) {
    __m256 acc[ROWS][2];
    for (int i = 0; i < mr; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(w + k * GROUP));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(a, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(out[i], acc[i][0]);
        _mm256_storeu_ps(out[i] + 8, acc[i][1]);
    }
}

static void group_rows(int mr, const float *x, int64_t K, const int8_t *w,
                       float out[ROWS][GROUP]) {
    switch (mr) {
    case 1: group_tile(1, x, K, w, out); break;
    case 2: group_tile(2, x, K, w, out); break;
    case 3: group_tile(3, x, K, w, out); break;
    case 4: group_tile(4, x, K, w, out); break;
    case 5: group_tile(5, x, K, w, out); break;
    default: group_tile(6, x, K, w, out); break;
    }
}

#define VNNI_TILE 8  /* rows of x per tile on the VNNI path: 8 accumulators and the sum */

#ifdef __AVX512F__
#define VNNI "avx512f,avx512bw,avx512vnni"

/* Rows [0, mr) of the quantized x (two levels a row, each xq + 128 unsigned in K4 fours)
 * against group `g`'s quads: out[i][l][0 .. 16) = sum_k xq_l[i][k] q[16g + j][k], exact. */
static inline __attribute__((always_inline, target(VNNI))) void quad_tile(
        const int mr, const uint8_t *xq, int64_t K4, const int8_t *w,
        int32_t out[VNNI_TILE][2][GROUP]) {
    __m512i acc[VNNI_TILE][2], sum = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int i = 0; i < mr; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t c = 0; c < K4; c++) {
        const __m512i q = _mm512_loadu_si512((const void *)(w + c * 4 * GROUP));
        sum = _mm512_dpbusd_epi32(sum, ones, q);  /* sum_k q[j][k], for the 128 taken off */
        for (int i = 0; i < mr; i++)
            for (int l = 0; l < 2; l++) {
                int32_t four;
                memcpy(&four, xq + ((2 * i + l) * K4 + c) * 4, 4);
                acc[i][l] = _mm512_dpbusd_epi32(acc[i][l], _mm512_set1_epi32(four), q);
            }
    }
    const __m512i off = _mm512_slli_epi32(sum, 7);
    for (int i = 0; i < mr; i++)
        for (int l = 0; l < 2; l++)
            _mm512_storeu_si512((void *)out[i][l], _mm512_sub_epi32(acc[i][l], off));
}

static __attribute__((target(VNNI))) void quad_rows(int mr, const uint8_t *xq, int64_t K4,
                                                    const int8_t *w,
                                                    int32_t out[VNNI_TILE][2][GROUP]) {
    switch (mr) {
    case 1: quad_tile(1, xq, K4, w, out); break;
    case 2: quad_tile(2, xq, K4, w, out); break;
    case 3: quad_tile(3, xq, K4, w, out); break;
    case 4: quad_tile(4, xq, K4, w, out); break;
    case 5: quad_tile(5, xq, K4, w, out); break;
    case 6: quad_tile(6, xq, K4, w, out); break;
    case 7: quad_tile(7, xq, K4, w, out); break;
    default: quad_tile(8, xq, K4, w, out); break;
    }
}
#endif

/* quad_rows's sums in plain integer C, for CPUs without AVX512-VNNI: the same exact int32
 * sums, so the same screened logits (the VNNI path runs and is tested on every CPU; only
 * CPUs with vpdpbusd take it by default). */
static void quad_rows_plain(int mr, const uint8_t *xq, int64_t K4, const int8_t *w,
                            int32_t out[VNNI_TILE][2][GROUP]) {
    for (int i = 0; i < mr; i++)
        for (int l = 0; l < 2; l++)
            for (int j = 0; j < GROUP; j++) {
                int32_t sum = 0;
                for (int64_t k = 0; k < 4 * K4; k++)
                    sum += (xq[(2 * i + l) * 4 * K4 + k] - 128)
                           * w[(k / 4 * GROUP + j) * 4 + k % 4];
                out[i][l][j] = sum;
            }
}

/* Rows [0, mr) of x against one group, screened logits before the output's scale: the fma
 * path from `groups_` (x float32), the VNNI path from `quads` (xq, then times xs[i]). */
static inline void screen_tile(int vnni, int mr, const float *x, const uint8_t *xq, int64_t K,
                               int64_t K4, const int8_t *quads, const int8_t *groups_,
                               const float *xs, float out[][GROUP]) {
    if (vnni) {
        int32_t sums[VNNI_TILE][2][GROUP];
#ifdef __AVX512F__
        if (vnni == 2)
            quad_rows(mr, xq, K4, quads, sums);
        else
#endif
            quad_rows_plain(mr, xq, K4, quads, sums);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < GROUP; j++)
                out[i][j] = (float)sums[i][0][j] * xs[2 * i] + (float)sums[i][1][j] * xs[2 * i + 1];
        return;
    }
    group_rows(mr, x, K, groups_, out);
}

/* How far row b's screened logit of an output may be from its exact one (the header's r). */
static inline double reach_of(double norm, float reach, double err, float qnorm) {
    const double r = norm * (double)reach;
    return err > 0.0 ? r + err * (double)qnorm : r;
}

/* Level l (0, 1) of row x quantized for the VNNI path into xq (4 K4 bytes): q = round(d /
 * xs) in [-127, 127], 128 + q stored, 128 (a zero) past K; d = x less level 0's part for
 * level 1. Returns xs (max |d| / 127, a normal float32; 1 where d is 0). */
static float quantize_level(const float *x, int64_t K, int64_t K4, const uint8_t *first,
                            float s0, uint8_t *xq) {
    double most = 0.0;
    for (int64_t k = 0; k < K; k++) {
        const double d = first ? (double)x[k] - (double)s0 * (first[k] - 128) : (double)x[k];
        most = fabs(d) > most ? fabs(d) : most;
    }
    float s = most > 0.0 ? (float)(most / 127.0) : 1.0f;
    if (!(s >= FLT_MIN))
        s = FLT_MIN;
    for (int64_t k = 0; k < 4 * K4; k++) {
        double r = 0.0;
        if (k < K) {
            const double d = first ? (double)x[k] - (double)s0 * (first[k] - 128) : (double)x[k];
            r = nearbyint(d / (double)s);
            r = r > 127.0 ? 127.0 : r < -127.0 ? -127.0 : r;
        }
        xq[k] = (uint8_t)(int)(r + 128.0);
    }
    return s;
}

/* Row x quantized in two levels for the VNNI path: x' = xs[0] q0 + xs[1] q1, q1 quantizing
 * what q0 leaves. xq holds q0 then q1 (4 K4 bytes each); err the header's: (||x - x'|| +
 * 2^-21 (||xs[0] q0|| + ||xs[1] q1||)) (1 + 2^-20). */
static void quantize_row(const float *x, int64_t K, int64_t K4, uint8_t *xq, float xs[2],
                         double *err) {
    xs[0] = quantize_level(x, K, K4, NULL, 0.0f, xq);
    xs[1] = quantize_level(x, K, K4, xq, xs[0], xq + 4 * K4);
    double lost = 0.0, kept0 = 0.0, kept1 = 0.0;
    for (int64_t k = 0; k < K; k++) {
        const double a0 = (double)xs[0] * (xq[k] - 128), a1 = (double)xs[1] * (xq[4 * K4 + k] - 128);
        const double d = ((double)x[k] - a0) - a1;
        lost += d * d;
        kept0 += a0 * a0;
        kept1 += a1 * a1;
    }
    *err = (sqrt(lost) + 0x1p-21 * (sqrt(kept0) + sqrt(kept1))) * (1.0 + 0x1p-20);
}

/* The candidates' panels (`flags`, the layout above) of B rows, on the fma path (`packed` in
 * groups) or the VNNI path (`vnni` 1, `packed` in quads). Returns the number of panels
 * flagged, or -1 for arguments it does not take (`vnni` 3: the VNNI path with the plain
 * tile's sums even where vpdpbusd is there, to compare the two). `screened` [B, V] float32 receives each
 * row's screened logits (scratch the caller keeps), `err` [B] float64 each row's err. */
int64_t hicache_head_screen(const float *x, int64_t B, int64_t K, const int8_t *packed,
                            const float *scale, const float *reach, const float *qnorm,
                            int64_t V, const double *norm, double slack, float *screened,
                            uint8_t *flags, double *err, int vnni, int threads) {
    if (B < 1 || B > MAX_ROWS || K < 1 || V < 1 || threads < 1 || !(slack >= 0)
            || (vnni && K > 65536))
        return -1;  /* K > 65536: an int32 sum of 255 x 127 products could overflow */
    if (vnni)  /* 2: vpdpbusd's tile; 1: the plain one (the same sums; asked for with 3) */
        vnni = vnni != 3 && hicache_head_has_vnni() ? 2 : 1;
    const int64_t groups = (V + GROUP - 1) / GROUP, panels = (V + PANEL - 1) / PANEL;
    const int64_t K4 = (K + 3) / 4;
    double lo_max[MAX_ROWS], hi_max[MAX_ROWS];
    float xs[2 * MAX_ROWS];
    uint8_t *xq = NULL;
    /* per row and group, the largest screened logit + r (a NaN kept): the flags' pass reads
     * these, not the B x V screened logits */
    double *group_hi = malloc((size_t)(B * groups) * sizeof(double));
    if (!group_hi)
        return -1;
    for (int64_t b = 0; b < B; b++) {
        lo_max[b] = hi_max[b] = -INFINITY;
        err[b] = 0.0;
    }
    if (vnni) {
        if (!(xq = malloc((size_t)(B * 2 * K4 * 4)))) {
            free(group_hi);
            return -1;
        }
        for (int64_t b = 0; b < B; b++)
            quantize_row(x + b * K, K, K4, xq + b * 2 * K4 * 4, xs + 2 * b, &err[b]);
    }
    const int tile = vnni ? VNNI_TILE : ROWS;
    #pragma omp parallel num_threads(threads)
    {
        double lo[MAX_ROWS], hi[MAX_ROWS];
        for (int64_t b = 0; b < B; b++)
            lo[b] = hi[b] = -INFINITY;
        float out[VNNI_TILE > ROWS ? VNNI_TILE : ROWS][GROUP];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t v0 = g * GROUP, n = V - v0 < GROUP ? V - v0 : GROUP;
            for (int64_t b0 = 0; b0 < B; b0 += tile) {
                const int mr = B - b0 < tile ? (int)(B - b0) : tile;
                screen_tile(vnni, mr, x + b0 * K, vnni ? xq + b0 * 2 * K4 * 4 : NULL, K, K4,
                            packed + g * K4 * 4 * GROUP, packed + g * K * GROUP, xs + 2 * b0,
                            out);
                for (int i = 0; i < mr; i++) {
                    const int64_t b = b0 + i;
                    float *row = screened + b * V + v0;
                    double most = -INFINITY;
                    for (int64_t j = 0; j < n; j++) {
                        row[j] = out[i][j] * scale[v0 + j];
                        const double r = reach_of(norm[b], reach[v0 + j], err[b], qnorm[v0 + j]);
                        const double down = (double)row[j] - r, up = (double)row[j] + r;
                        if (down > lo[b])
                            lo[b] = down;
                        if (up > hi[b])
                            hi[b] = up;
                        if (!(up <= most) && most == most)  /* a NaN stays */
                            most = up;
                    }
                    group_hi[b * groups + g] = most;
                }
            }
        }
        #pragma omp critical
        for (int64_t b = 0; b < B; b++) {
            if (lo[b] > lo_max[b])
                lo_max[b] = lo[b];
            if (hi[b] > hi_max[b])
                hi_max[b] = hi[b];
        }
    }
    free(xq);
    double floor_[MAX_ROWS];
    for (int64_t b = 0; b < B; b++) {
        const double big = fabs(lo_max[b]) > fabs(hi_max[b]) ? fabs(lo_max[b]) : fabs(hi_max[b]);
        floor_[b] = (slack > 0 ? lo_max[b] - slack * big : lo_max[b]) - TINY_FLOOR;
        if (!(floor_[b] > -INFINITY))  /* a non-finite row: every output is a candidate */
            floor_[b] = -INFINITY;
    }
    int64_t flagged = 0;
    const int64_t per_panel = PANEL / GROUP;
    #pragma omp parallel for schedule(static) reduction(+ : flagged) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t g0 = p * per_panel, g1 = g0 + per_panel < groups ? g0 + per_panel : groups;
        uint8_t hit = 0;
        for (int64_t b = 0; b < B && !hit; b++)
            for (int64_t g = g0; g < g1; g++)
                if (!(group_hi[b * groups + g] < floor_[b])) {
                    hit = 1;  /* also for a NaN: never screened out */
                    break;
                }
        flags[p] = hit;
        flagged += hit;
    }
    free(group_hi);
    return flagged;
}
