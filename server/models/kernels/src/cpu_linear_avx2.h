/* The linear kernel's register tiles on AVX2 + FMA (8 floats a vector), for CPUs without
 * AVX-512 (AMD's Zen 2 and 3, Intel's client cores): cpu_linear.c includes this in its
 * AVX2 build instead of its AVX-512 tiles (kernels/cpu_build.py picks the build).
 *
 * The same packed layouts and the same arithmetic per output as the AVX-512 tiles: float32,
 * one FMA chain over k in order; bfloat16, one float32 chain over the input pairs in order
 * (the odd element's product added first, each product exact), then the bias, then one
 * rounding to nearest even. So both builds give every output the same bits (vector width,
 * tiling and threads change which outputs share a register, never an output's chain).
 *
 * Tiles: of the 16 registers, 12 hold 6 rows x 16 outputs (a quarter panel) of float32
 * accumulators, the 6 x 16 tile of AVX2 GEMMs (4 rows in bfloat16, whose pairs take more
 * registers); a call runs each quarter panel for its rows in turn.
 */
#ifndef HICACHE_CPU_LINEAR_AVX2_H
#define HICACHE_CPU_LINEAR_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define VEC 8          /* floats per AVX2 vector */
#define QUARTER 16     /* outputs per quarter panel: 2 vectors */
#define ROWS_AVX2 6    /* rows per float32 register tile: 12 accumulators */
#define ROWS_BF16 4    /* rows per bfloat16 register tile (each pair's weights take 4) */

/* A mask of the first `left` (0..8) lanes, for maskload / maskstore. */
static inline __m256i lanes_below(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Rows [0, mr) (mr <= 6) of x times the quarter panel at w (rows NR floats apart): y[i][0 ..
 * cols) for cols <= 16. */
static inline __attribute__((always_inline)) void quarter_tile(
        const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
        const float *bias, float *y, int64_t ldy, int cols, int fetch) {
    /* the accumulators as named registers (gcc kept an array of them on the stack) */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define ROW_FMA(i)                                                                          \
    if (mr > i) {                                                                           \
        const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                              \
        c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);                                          \
        c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);                                          \
    }
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * NR;
        if (fetch)
            _mm_prefetch((const char *)(wk + PREFETCH_ROWS * NR), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + VEC);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
#undef ROW_FMA
    const __m256 acc[ROWS_AVX2][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                      {c30, c31}, {c40, c41}, {c50, c51}};
    for (int j = 0; j < 2; j++) {
        const int left = cols - j * VEC;
        if (left <= 0)
            break;
        const __m256i mask = lanes_below(left >= VEC ? VEC : left);
        const __m256 b = bias ? _mm256_maskload_ps(bias + j * VEC, mask) : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m256 out = bias ? _mm256_add_ps(acc[i][j], b) : acc[i][j];
            _mm256_maskstore_ps(y + i * ldy + j * VEC, mask, out);
        }
    }
}

static void quarter_tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                              const float *bias, float *y, int64_t ldy, int cols, int fetch) {
    switch (mr) {
    case 1: quarter_tile(1, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 2: quarter_tile(2, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 3: quarter_tile(3, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 4: quarter_tile(4, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 5: quarter_tile(5, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    default: quarter_tile(6, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    }
}

/* Rows [0, mr) (mr <= MR) of x times one panel: y[i][0 .. cols) for i < mr. */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                      const float *bias, float *y, int64_t ldy, int cols, int fetch) {
    for (int h = 0; h * QUARTER < cols; h++) {
        const int hc = cols - h * QUARTER < QUARTER ? cols - h * QUARTER : QUARTER;
        for (int i = 0; i < mr; i += ROWS_AVX2)
            quarter_tile_rows(mr - i < ROWS_AVX2 ? mr - i : ROWS_AVX2, x + i * ldx, ldx,
                              w + h * QUARTER, K, bias ? bias + h * QUARTER : NULL,
                              y + i * ldy + h * QUARTER, ldy, hc, fetch && i == 0);
    }
}

/* ------------------------------------------------------------------------ bfloat16 */

/* 8 float32 -> 8 bfloat16 (round to nearest even, NaN kept quiet): cpu_bf16.h's round_bf16
 * on 8 lanes. */
static inline __m128i round_bf16_avx2(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* lanes hold values <= 0xFFFF: pack to 16 bits, the two 128-bit halves in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

/* Rows [0, mr) (mr <= 4) of x times the bfloat16 quarter panel at w (pairs 2 * NR uint16s
 * apart): the chain of the module docstring, rounded to bfloat16 with the bias. */
static inline __attribute__((always_inline)) void quarter_tile_bf16(
        const int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,
        const uint16_t *bias, uint16_t *y, int64_t ldy, int cols, int fetch) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;  /* named: in */
    __m256 c20 = c00, c21 = c00, c30 = c00, c31 = c00;                    /* registers */
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t pairs = (K + 1) / 2;
    /* row i's pair (x[2q], x[2q+1]) against each output's: the odd element's product first */
#define ROW_PAIR(i)                                                                         \
    if (mr > i) {                                                                           \
        uint32_t pair;                                                                      \
        if (whole)                                                                          \
            memcpy(&pair, x + i * ldx + 2 * q, sizeof pair);                                \
        else                                                                                \
            pair = x[i * ldx + 2 * q];                                                      \
        const __m256i a = _mm256_set1_epi32((int)pair);                                     \
        const __m256 ah = _mm256_castsi256_ps(_mm256_and_si256(a, hi_mask));                \
        const __m256 al = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));                    \
        c##i##0 = _mm256_fmadd_ps(al, wl0, _mm256_fmadd_ps(ah, wh0, c##i##0));              \
        c##i##1 = _mm256_fmadd_ps(al, wl1, _mm256_fmadd_ps(ah, wh1, c##i##1));              \
    }
    for (int64_t q = 0; q < pairs; q++) {
        const uint16_t *wq = w + q * 2 * NR;
        if (fetch)
            _mm_prefetch((const char *)(wq + PREFETCH_ROWS * 2 * NR), _MM_HINT_T0);
        const int whole = 2 * q + 1 < K;  /* else an odd K's last input, partner 0 */
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)wq);
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wq + 2 * VEC));
        const __m256 wh0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask));
        const __m256 wl0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 wh1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask));
        const __m256 wl1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        ROW_PAIR(0) ROW_PAIR(1) ROW_PAIR(2) ROW_PAIR(3)
    }
#undef ROW_PAIR
    const __m256 acc[ROWS_BF16][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int j = 0; j < 2; j++) {
        const int left = cols - j * VEC;
        if (left <= 0)
            break;
        const int n = left >= VEC ? VEC : left;
        uint16_t b16[VEC] = {0};
        if (bias)
            memcpy(b16, bias + j * VEC, (size_t)n * sizeof(uint16_t));
        const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)b16)), 16));
        for (int i = 0; i < mr; i++) {
            const __m128i out = round_bf16_avx2(bias ? _mm256_add_ps(acc[i][j], b) : acc[i][j]);
            if (n == VEC) {
                _mm_storeu_si128((__m128i *)(y + i * ldy + j * VEC), out);
            } else {
                uint16_t tmp[VEC];
                _mm_storeu_si128((__m128i *)tmp, out);
                memcpy(y + i * ldy + j * VEC, tmp, (size_t)n * sizeof(uint16_t));
            }
        }
    }
}

static void quarter_tile_rows_bf16(int mr, const uint16_t *x, int64_t ldx, const uint16_t *w,
                                int64_t K, const uint16_t *bias, uint16_t *y, int64_t ldy,
                                int cols, int fetch) {
    switch (mr) {
    case 1: quarter_tile_bf16(1, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 2: quarter_tile_bf16(2, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 3: quarter_tile_bf16(3, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    default: quarter_tile_bf16(4, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    }
}

/* Rows [0, mr) (mr <= MR) of x times the bfloat16 panel at w: outputs [0, cols). */
static void tile_rows_bf16_f(int mr, const uint16_t *x, int64_t ldx, const uint16_t *w,
                             int64_t K, const uint16_t *bias, uint16_t *y, int64_t ldy,
                             int cols, int fetch) {
    for (int h = 0; h * QUARTER < cols; h++) {
        const int hc = cols - h * QUARTER < QUARTER ? cols - h * QUARTER : QUARTER;
        for (int i = 0; i < mr; i += ROWS_BF16)
            quarter_tile_rows_bf16(mr - i < ROWS_BF16 ? mr - i : ROWS_BF16, x + i * ldx, ldx,
                                w + h * QUARTER * 2, K, bias ? bias + h * QUARTER : NULL,
                                y + i * ldy + h * QUARTER, ldy, hc, fetch && i == 0);
    }
}

#endif
