/* Linear layers on the CPU (AVX-512F, OpenMP): y = x W^T (+ b) in float32, on a weight packed
 * once into panels, for every batch size from one decode row to a 2,048-row prefill.
 *
 * Layouts (float32, kernels/cpu_linear.py checks them):
 *
 *   W        [N, K] row-major: the checkpoint's weight, as packed by hicache_linear_pack_f32
 *   packed   [ceil(N / 64)][K][64]: panel p holds outputs 64p .. 64p + 63, one row of 64 per
 *            k; the last panel's missing outputs are zeros
 *   x        [M, K] rows `ldx` floats apart, each row contiguous
 *   bias     [N] or NULL
 *   y        [M, N] contiguous
 *
 * What must stay true: every output is the chain acc = fma(x[m][k], W[n][k], acc) over
 * k = 0, 1, ..., K - 1 in order from acc = 0, then acc + bias[n]. Blocking, threads and the
 * number of rows change which rows share a register tile, never that chain, so a row gets
 * the same bits in a batch of one (a decode step) or of 2,048 (a prefill), and a token's
 * K/V are the same whether prefilled, extended on a cached prefix or decoded.
 *
 * Speed: a decode batch streams each weight once from memory, at most 6 rows per pass over
 * a panel; a prefill keeps a block of x rows in L2 while every panel goes by, 6 rows x 64
 * outputs per register tile (24 accumulators).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define VEC 16                  /* floats per AVX-512 vector */
#define NR 64                   /* outputs per panel: 4 vectors */
#define MR 6                    /* rows per register tile */
#define X_BLOCK_BYTES 262144    /* a block of x rows kept in L2 while the panels go by */
#define MAX_BLOCK_ROWS 192
#define PREFETCH_ROWS 8         /* panel rows (k) ahead that a memory-bound tile prefetches */

/* Rows [0, mr) of x times one panel: y[i][0 .. cols) for i < mr. Inlined with a constant
 * mr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
        const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
        const float *bias, float *y, int64_t ldy, int cols) {
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * NR;
        if (mr <= 2) {  /* memory-bound: fetch ahead (a prefetch past the panel is harmless) */
            const char *ahead = (const char *)(wk + PREFETCH_ROWS * NR);
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            _mm_prefetch(ahead + 192, _MM_HINT_T0);
        }
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + VEC);
        const __m512 w2 = _mm512_loadu_ps(wk + 2 * VEC), w3 = _mm512_loadu_ps(wk + 3 * VEC);
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(a, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(a, w3, acc[i][3]);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int left = cols - j * VEC;
        if (left <= 0)
            break;
        const __mmask16 mask = left >= VEC ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * VEC) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 out = bias ? _mm512_add_ps(acc[i][j], b) : acc[i][j];
            _mm512_mask_storeu_ps(y + i * ldy + j * VEC, mask, out);
        }
    }
}

static void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                      const float *bias, float *y, int64_t ldy, int cols) {
    switch (mr) {
    case 1: tile(1, x, ldx, w, K, bias, y, ldy, cols); break;
    case 2: tile(2, x, ldx, w, K, bias, y, ldy, cols); break;
    case 3: tile(3, x, ldx, w, K, bias, y, ldy, cols); break;
    case 4: tile(4, x, ldx, w, K, bias, y, ldy, cols); break;
    case 5: tile(5, x, ldx, w, K, bias, y, ldy, cols); break;
    default: tile(6, x, ldx, w, K, bias, y, ldy, cols); break;
    }
}

/* Floats of the packed weight: whole panels. */
int64_t hicache_linear_packed_size(int64_t N, int64_t K) {
    return (N + NR - 1) / NR * K * NR;
}

/* W [N, K] -> packed (see the layout above). */
void hicache_linear_pack_f32(const float *w, int64_t N, int64_t K, float *packed) {
    const int64_t panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                packed[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* y = x W^T (+ bias). Returns 0, or -1 for a shape it does not take. */
int hicache_linear_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *packed,
                       int64_t N, const float *bias, float *y, int threads) {
    if (M < 0 || K < 1 || N < 1 || ldx < K || threads < 1)
        return -1;
    if (M == 0)
        return 0;
    /* blocks of x rows of at most X_BLOCK_BYTES, as even as whole tiles allow (the threads
     * share out blocks x panels evenly only when the blocks are of one size) */
    int64_t most = X_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    most = most < MR ? MR : most > MAX_BLOCK_ROWS ? MAX_BLOCK_ROWS : most;
    const int64_t blocks = (M + most - 1) / most;
    const int64_t block = ((M + blocks - 1) / blocks + MR - 1) / MR * MR;
    const int64_t panels = (N + NR - 1) / NR;
    /* block-major: a thread keeps its block of x rows while it walks the panels; a decode
     * batch (one block) splits the panels, so every thread streams its share of W */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t p = 0; p < panels; p++) {
            const int64_t end = (b + 1) * block < M ? (b + 1) * block : M;
            const int cols = N - p * NR < NR ? (int)(N - p * NR) : NR;
            const float *w = packed + p * K * NR;
            for (int64_t m = b * block; m < end; m += MR) {
                const int mr = end - m < MR ? (int)(end - m) : MR;
                tile_rows(mr, x + m * ldx, ldx, w, K, bias ? bias + p * NR : NULL,
                          y + m * N + p * NR, N, cols);
            }
        }
    }
    return 0;
}
