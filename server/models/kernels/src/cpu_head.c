/* The greedy screen of an LM head (AVX2 + FMA, OpenMP; built for AVX-512 CPUs too, which
 * run it as it is): from an int8 copy of the head, which outputs can still be a row's
 * largest logit. kernels/cpu_head.py and models/head_screen.py use it; the screen's
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
 * For row b, output j: screened s = scale[j] * sum_k x[b][k] q[j][k] (float32), lo = s -
 * norm[b] reach[j] and hi = s + norm[b] reach[j] (float64). The exact logit lies in [lo, hi],
 * so the largest lies at or above lo_max = max_j lo; an output is a candidate when its hi
 * reaches lo_max - slack * max(|lo_max|, |hi_max|) - TINY_FLOOR (slack: what rounding the
 * logits to the model's dtype may merge; 0 in float32), or when it is not a number.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define GROUP 16     /* outputs per group of the int8 copy: two 8-float vectors */
#define PANEL 64     /* outputs per panel of the linear kernel (cpu_linear.c's NR) */
#define ROWS 6       /* rows of x per register tile: 12 accumulators */
#define MAX_ROWS 64  /* rows per call */
/* Absolute terms for values near float32's denormals, which the relative bound misses: a
 * denormal input a bfloat16 path flushes to zero moves a product by < 2^-126 |x_k|, at most
 * 2^-116 ||x|| in all for K < 2^20 (TINY_REACH, per unit of ||x||, in reach); an add that
 * lands below 2^-126 is off by < 2^-126 absolute, (K + 2) 2^-126 < 2^-105 a chain for
 * either chain (TINY_FLOOR, below the floor). */
#define TINY_REACH 0x1p-110
#define TINY_FLOOR 0x1p-99

/* Bytes of the packed int8 copy of a [V, K] head. */
int64_t hicache_head_packed_size(int64_t V, int64_t K) {
    return (V + GROUP - 1) / GROUP * K * GROUP;
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

/* The int8 copy of rows [0, V) of a float32 head w [V, K] (row-major): per row j, scale[j] =
 * max |w[j]| / 127 (1 for a row of zeros), q[j][k] = round(w[j][k] / scale[j]) (nearest,
 * ties away from zero) in [-127, 127], and reach[j] = (||w[j] - scale[j] q[j]|| + g
 * (||w[j]|| + scale[j] ||q[j]||)) (1 + 2^-20), the norms summed in float64 and reach rounded
 * up to float32 (head_screen.py says what it bounds). */
void hicache_head_quantize(const float *w, int64_t V, int64_t K, double g, int8_t *q,
                           float *scale, float *reach) {
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
        float r32 = (float)bound;
        if ((double)r32 < bound)
            r32 = nextafterf(r32, INFINITY);
        scale[j] = s;
        reach[j] = r32;
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

/* The candidates' panels (`flags`, the layout above) of B rows. Returns the number of
 * panels flagged, or -1 for arguments it does not take. `screened` [B, V] float32 receives
 * each row's screened logits (scratch the caller keeps). */
int64_t hicache_head_screen(const float *x, int64_t B, int64_t K, const int8_t *packed,
                            const float *scale, const float *reach, int64_t V,
                            const double *norm, double slack, float *screened,
                            uint8_t *flags, int threads) {
    if (B < 1 || B > MAX_ROWS || K < 1 || V < 1 || threads < 1 || !(slack >= 0))
        return -1;
    const int64_t groups = (V + GROUP - 1) / GROUP, panels = (V + PANEL - 1) / PANEL;
    double lo_max[MAX_ROWS], hi_max[MAX_ROWS];
    for (int64_t b = 0; b < B; b++)
        lo_max[b] = hi_max[b] = -INFINITY;
    #pragma omp parallel num_threads(threads)
    {
        double lo[MAX_ROWS], hi[MAX_ROWS];
        for (int64_t b = 0; b < B; b++)
            lo[b] = hi[b] = -INFINITY;
        float out[ROWS][GROUP];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *w = packed + g * K * GROUP;
            const int64_t v0 = g * GROUP, n = V - v0 < GROUP ? V - v0 : GROUP;
            for (int64_t b0 = 0; b0 < B; b0 += ROWS) {
                const int mr = B - b0 < ROWS ? (int)(B - b0) : ROWS;
                group_rows(mr, x + b0 * K, K, w, out);
                for (int i = 0; i < mr; i++) {
                    const int64_t b = b0 + i;
                    float *row = screened + b * V + v0;
                    for (int64_t j = 0; j < n; j++) {
                        row[j] = out[i][j] * scale[v0 + j];
                        const double r = norm[b] * (double)reach[v0 + j];
                        if ((double)row[j] - r > lo[b])
                            lo[b] = (double)row[j] - r;
                        if ((double)row[j] + r > hi[b])
                            hi[b] = (double)row[j] + r;
                    }
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
    double floor_[MAX_ROWS];
    for (int64_t b = 0; b < B; b++) {
        const double big = fabs(lo_max[b]) > fabs(hi_max[b]) ? fabs(lo_max[b]) : fabs(hi_max[b]);
        floor_[b] = (slack > 0 ? lo_max[b] - slack * big : lo_max[b]) - TINY_FLOOR;
        if (!(floor_[b] > -INFINITY))  /* a non-finite row: every output is a candidate */
            floor_[b] = -INFINITY;
    }
    int64_t flagged = 0;
    #pragma omp parallel for schedule(static) reduction(+ : flagged) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t v0 = p * PANEL, n = V - v0 < PANEL ? V - v0 : PANEL;
        uint8_t hit = 0;
        for (int64_t b = 0; b < B && !hit; b++) {
            const float *row = screened + b * V + v0;
            for (int64_t j = 0; j < n; j++) {
                if (!((double)row[j] + norm[b] * (double)reach[v0 + j] < floor_[b])) {
                    hit = 1;  /* also for a NaN: never screened out */
                    break;
                }
            }
        }
        flags[p] = hit;
        flagged += hit;
    }
    return flagged;
}
