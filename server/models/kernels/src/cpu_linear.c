/* Linear layers on the CPU (AVX-512F, OpenMP): y = x W^T (+ b) in float32 or bfloat16, on a
 * weight packed once into panels, for every batch size from one decode row to a 2,048-row
 * prefill. The bfloat16 half is at the end of this file.
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
#include <string.h>

#include "cpu_pack.h"

#ifdef __AVX512F__
#include "cpu_amx.h"
#include "cpu_bf16.h"
#endif

#define NR 64                   /* outputs per panel */
#define MR 6                    /* rows per register tile */
#define X_BLOCK_BYTES 262144    /* a block of x rows kept in L2 while the panels go by */
#define MAX_BLOCK_ROWS 192
#define PREFETCH_ROWS 8         /* panel rows (k) ahead that a memory-bound tile prefetches */

#ifdef __AVX512F__
#define VEC 16                  /* floats per AVX-512 vector: a panel is 4 */

/* Rows [0, mr) of x times one panel: y[i][0 .. cols) for i < mr. Inlined with a constant
 * mr, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
        const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
        const float *bias, float *y, int64_t ldy, int cols, int fetch) {
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * NR;
        if (fetch) {  /* the panel comes from memory: fetch ahead (past its end is harmless) */
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
                      const float *bias, float *y, int64_t ldy, int cols, int fetch) {
    switch (mr) {
    case 1: tile(1, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 2: tile(2, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 3: tile(3, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 4: tile(4, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    case 5: tile(5, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    default: tile(6, x, ldx, w, K, bias, y, ldy, cols, fetch); break;
    }
}
#else
#include "cpu_linear_avx2.h"  /* tile_rows and tile_rows_bf16_f on 8-float vectors */
#endif

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
                          y + m * N + p * NR, N, cols, m == b * block);
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------- bfloat16
 *
 * Layouts (bfloat16 as uint16, kernels/cpu_linear.py checks them):
 *
 *   W        [N, K] row-major, as packed by hicache_linear_pack_bf16
 *   packed   [ceil(N / 64)][Q][64][2], Q = ceil(K / 2) rounded up to 16: panel p, pair q
 *            holds (W[n][2q], W[n][2q+1]) for n = 64p .. 64p + 63: the pair vdpbf16ps
 *            reads per lane, and 16 pairs x 16 outputs the VNNI-laid-out B tile AMX's
 *            tdpbf16ps reads (rows 256 bytes apart); missing outputs, pairs and the
 *            missing odd input of an odd K are zeros
 *   x        [M, K] bfloat16 rows `ldx` elements apart, each row contiguous
 *   bias     [N] bfloat16 or NULL
 *   y        [M, N] bfloat16, contiguous
 *
 * What must stay true: every output is the chain, from acc = 0 in float32, over the pairs
 * q = 0, 1, ... in order,
 *     acc = (acc + x[2q+1] W[n][2q+1]) + x[2q] W[n][2q]
 * (vdpbf16ps's order: odd element first; each product of two bfloat16s is exact in float32,
 * each add rounded to nearest even), then acc + bias[n], then one rounding to bfloat16
 * (nearest even). The AVX512-BF16 path and the plain AVX-512F one (bfloat16 -> float32 by a
 * shift, two FMAs per pair) compute exactly that, so they give the same bits wherever no
 * input or sum is a float32 denormal (vdpbf16ps flushes those to zero).
 *
 * Where the CPU has AMX (Sapphire Rapids and later) a third path runs every call on its
 * tiles: tdpbf16ps over blocks of 16 pairs in order, into float32 tiles, then the same bias
 * and rounding. The tile unit's own order of adds inside a block is not the chain above,
 * so the AMX path's bits are its own (within float32 rounding of the others); what stays
 * true on each path is that a row's bits depend on nothing else in the call: each row of a
 * C tile is its A row times B, and the blocks go in one order whatever the batch.
 */

#define PAIR_TILE 16  /* pairs per AMX tile row: 64 bytes */
#define AMX_ROWS 32  /* rows of x per tile call: two A tiles */
#define AMX_HALF 32  /* outputs per tile call: two B tiles */

#ifdef __AVX512F__

/* The tile's store: acc (+ bias) rounded to bfloat16, columns [0, cols) of rows [0, mr). */
static inline __attribute__((always_inline)) void store_bf16(
        const int mr, __m512 acc[MR][4], const uint16_t *bias, uint16_t *y, int64_t ldy,
        int cols) {
    for (int j = 0; j < 4; j++) {
        const int left = cols - j * VEC;
        if (left <= 0)
            break;
        const __mmask16 mask = left >= VEC ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + j * VEC))
                              : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 out = bias ? _mm512_add_ps(acc[i][j], b) : acc[i][j];
            _mm256_mask_storeu_epi16(y + i * ldy + j * VEC, mask, round_bf16(out));
        }
    }
}

/* Rows [0, mr) of x times one bfloat16 panel (AVX512-BF16: one vdpbf16ps per pair). */
#define TILE_BF16(NAME, TARGET, STEP)                                                       \
    static inline __attribute__((always_inline, target(TARGET))) void NAME(                 \
            const int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,     \
            const uint16_t *bias, uint16_t *y, int64_t ldy, int cols, int fetch) {          \
        __m512 acc[MR][4];                                                                  \
        for (int i = 0; i < mr; i++)                                                        \
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();                    \
        const int64_t pairs = (K + 1) / 2;                                                  \
        for (int64_t q = 0; q < pairs; q++) {                                               \
            const uint16_t *wq = w + q * 2 * NR;                                            \
            if (fetch) {                                                                    \
                const char *ahead = (const char *)(wq + PREFETCH_ROWS * 2 * NR);            \
                _mm_prefetch(ahead, _MM_HINT_T0);                                           \
                _mm_prefetch(ahead + 64, _MM_HINT_T0);                                      \
                _mm_prefetch(ahead + 128, _MM_HINT_T0);                                     \
                _mm_prefetch(ahead + 192, _MM_HINT_T0);                                     \
            }                                                                               \
            const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 32);    \
            const __m512i w2 = _mm512_loadu_si512(wq + 64), w3 = _mm512_loadu_si512(wq + 96); \
            const int whole = 2 * q + 1 < K;  /* else an odd K's last input, partner 0 */   \
            for (int i = 0; i < mr; i++) {                                                  \
                uint32_t pair;                                                              \
                if (whole)                                                                  \
                    memcpy(&pair, x + i * ldx + 2 * q, sizeof pair);                        \
                else                                                                        \
                    pair = x[i * ldx + 2 * q];                                              \
                const __m512i a = _mm512_set1_epi32((int)pair);                             \
                STEP(acc[i][0], a, w0);                                                     \
                STEP(acc[i][1], a, w1);                                                     \
                STEP(acc[i][2], a, w2);                                                     \
                STEP(acc[i][3], a, w3);                                                     \
            }                                                                               \
        }                                                                                   \
        store_bf16(mr, acc, bias, y, ldy, cols);                                            \
    }

#define STEP_DP(acc, a, w) \
    acc = _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(w))
/* the same arithmetic in AVX-512F: the odd element's product added first, then the even's
 * (each product exact, so an FMA rounds exactly as vdpbf16ps's add) */
#define STEP_F(acc, a, w)                                                                   \
    do {                                                                                    \
        const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);                        \
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi_mask)),            \
                              _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask)), acc);      \
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),                \
                              _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);          \
    } while (0)

TILE_BF16(tile_bf16_dp, "avx512bf16", STEP_DP)
TILE_BF16(tile_bf16_f, "avx512f", STEP_F)

#define TILE_ROWS_BF16(NAME, TILE, TARGET)                                                  \
    static __attribute__((target(TARGET))) void NAME(                                       \
            int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,           \
            const uint16_t *bias, uint16_t *y, int64_t ldy, int cols, int fetch) {         \
        switch (mr) {                                                                       \
        case 1: TILE(1, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                    \
        case 2: TILE(2, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                    \
        case 3: TILE(3, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                    \
        case 4: TILE(4, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                    \
        case 5: TILE(5, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                    \
        default: TILE(6, x, ldx, w, K, bias, y, ldy, cols, fetch); break;                   \
        }                                                                                   \
    }
TILE_ROWS_BF16(tile_rows_bf16_dp, tile_bf16_dp, "avx512bf16")
TILE_ROWS_BF16(tile_rows_bf16_f, tile_bf16_f, "avx512f")

/* ------------------------------------------------------------------------ bfloat16, AMX */

/* A tile call covers up to 32 rows of x and 32 outputs (half a panel) at a time, as a 2 x 2
 * block of C tiles: tmm0, tmm1 the first 16 rows' outputs 0-15 and 16-31, tmm2, tmm3 the
 * next rows'; tmm4, tmm5 their A tiles (16 pairs of each row); tmm6, tmm7 the two B tiles
 * (16 pairs x 16 outputs). Each block of 16 pairs loads four tiles into four registers and
 * runs four tdpbf16ps: every tile loaded is used twice, and no load waits for a product to
 * free its register within the block. With 16 rows or fewer, the first row of tiles alone.
 *
 * Every output's arithmetic is the same whatever the blocking: tdpbf16ps over the blocks
 * of 16 pairs in order, into a float32 tile row that is that row of x times B. */

/* Tiles for `r0` (1..16) rows in tmm0, tmm1, tmm4 and `r1` (0..16) in tmm2, tmm3, tmm5
 * (unused when 0); tmm6, tmm7: 16 rows of 64 bytes. */
static inline void configure_tiles_2x2(int r0, int r1) {
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    configure_tile_rows(rows);
}

/* C tiles += the A tiles (rows of `a`, `lda` bytes apart; the second 16 rows below the
 * first when `two`) times B_0, B_1 at `b` and `b` + 16 outputs (rows `ldb` bytes apart). */
#define AMX_2X2(a, lda, b, ldb, two)                                                  \
    do {                                                                              \
        _tile_loadd(6, (b), (ldb));                                                   \
        _tile_loadd(7, (b) + 32, (ldb));                                              \
        _tile_loadd(4, (a), (lda));                                                   \
        _tile_dpbf16ps(0, 4, 6);                                                      \
        _tile_dpbf16ps(1, 4, 7);                                                      \
        if (two) {                                                                    \
            _tile_loadd(5, (const char *)(a) + 16 * (lda), (lda));                    \
            _tile_dpbf16ps(2, 5, 6);                                                  \
            _tile_dpbf16ps(3, 5, 7);                                                  \
        }                                                                             \
    } while (0)

/* Rows [0, rows) of x times outputs [0, cols) of the panel at `w` (cols <= 32: the B tiles
 * of its first 32 outputs; the caller offsets `w`, the bias and y for the second 32), a
 * strip of 32 rows at a time over every block of pairs; each strip rounded to bfloat16
 * with the bias. `configured`: the rows the calling thread's tiles are set for (0: none
 * yet). Chunks of pairs kept in L1 across the strips were no faster here. */
static __attribute__((target("amx-tile,amx-bf16"))) void panel_half_amx(
        int rows, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K,
        const uint16_t *bias, uint16_t *y, int64_t ldy, int cols, int *configured) {
    float c[AMX_ROWS * AMX_HALF] __attribute__((aligned(64)));
    uint16_t tail[AMX_ROWS * 2 * PAIR_TILE] __attribute__((aligned(64)));
    const int64_t whole = K / (2 * PAIR_TILE), left = K - whole * 2 * PAIR_TILE;
    const int64_t ldb = 2 * NR * 2, ldc = AMX_HALF * 4;
    for (int m = 0; m < rows; m += AMX_ROWS) {
        const int mr = rows - m < AMX_ROWS ? rows - m : AMX_ROWS, two = mr > 16;
        const uint16_t *xs = x + m * ldx;
        if (*configured != mr) {
            configure_tiles_2x2(mr < 16 ? mr : 16, mr > 16 ? mr - 16 : 0);
            *configured = mr;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t t = 0; t < whole; t++)
            AMX_2X2(xs + t * 2 * PAIR_TILE, ldx * 2, w + t * PAIR_TILE * 2 * NR, ldb, two);
        if (left) {  /* the last inputs, zero-padded to a whole block (never read past a row) */
            memset(tail, 0, sizeof tail);
            for (int i = 0; i < mr; i++)
                memcpy(tail + i * 2 * PAIR_TILE, xs + i * ldx + whole * 2 * PAIR_TILE,
                       (size_t)left * sizeof(uint16_t));
            AMX_2X2(tail, 2 * PAIR_TILE * 2, w + whole * PAIR_TILE * 2 * NR, ldb, two);
        }
        _tile_stored(0, c, ldc);
        _tile_stored(1, c + 16, ldc);
        if (two) {
            _tile_stored(2, c + 16 * AMX_HALF, ldc);
            _tile_stored(3, c + 16 * AMX_HALF + 16, ldc);
        }
        __m512 acc[MR][4];
        for (int i0 = 0; i0 < mr; i0 += MR) {  /* store_bf16 takes MR rows at a time */
            const int n = mr - i0 < MR ? mr - i0 : MR;
            for (int i = 0; i < n; i++)
                for (int j = 0; j < 2; j++)  /* store_bf16 reads no more: cols <= 32 */
                    acc[i][j] = _mm512_load_ps(c + (i0 + i) * AMX_HALF + j * VEC);
            store_bf16(n, acc, bias, y + (m + i0) * ldy, ldy, cols);
        }
    }
}

/* Whether this CPU has AMX-BF16 and the kernel may use its tiles (cpu_amx.h). */
int hicache_linear_has_amx(void) { return amx_available(); }

/* Whether this CPU has AVX512-BF16 (vdpbf16ps). */
int hicache_linear_has_avx512bf16(void) { return avx512bf16_available(); }
#else
/* The AVX2 build has the plain path only (cpu_linear_avx2.h): vdpbf16ps and AMX are
 * AVX-512 CPUs' instructions. */
int hicache_linear_has_amx(void) { return 0; }
int hicache_linear_has_avx512bf16(void) { return 0; }
#endif

/* Pairs of one panel: ceil(K / 2) rounded up to whole AMX tiles. */
static inline int64_t padded_pairs(int64_t K) {
    return ((K + 1) / 2 + PAIR_TILE - 1) / PAIR_TILE * PAIR_TILE;
}

/* uint16 elements of the packed bfloat16 weight: whole panels of whole tiles of pairs. */
int64_t hicache_linear_packed_size_bf16(int64_t N, int64_t K) {
    return (N + NR - 1) / NR * padded_pairs(K) * 2 * NR;
}

/* W [N, K] bfloat16 -> packed (see the layout above). */
void hicache_linear_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    PACK_TUPLES(packed, w, N, K, NR, padded_pairs(K), 2);
}

/* y = x W^T (+ bias) in bfloat16 on path `isa`: ISA_AMX or ISA_AVX512BF16 (the caller
 * checked hicache_linear_has_amx / _has_avx512bf16), else AVX-512F. Returns 0, or -1 for a
 * shape it does not take. */
enum { ISA_AVX512F = 0, ISA_AVX512BF16 = 1, ISA_AMX = 2 };

int hicache_linear_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                        const uint16_t *packed, int64_t N, const uint16_t *bias, uint16_t *y,
                        int isa, int threads) {
    if (M < 0 || K < 1 || N < 1 || ldx < K || threads < 1 || isa < 0 || isa > ISA_AMX)
        return -1;
#ifndef __AVX512F__
    if (isa != ISA_AVX512F)  /* the AVX2 build: the plain path, in AVX2 */
        return -1;
#endif
    if (M == 0)
        return 0;
    const int64_t unit = isa == ISA_AMX ? 2 * AMX_ROWS : MR;  /* whole tiles of rows */
    int64_t most = X_BLOCK_BYTES / (K * (int64_t)sizeof(uint16_t)) / unit * unit;
    most = most < unit ? unit : most > MAX_BLOCK_ROWS ? MAX_BLOCK_ROWS : most;
    const int64_t blocks = (M + most - 1) / most;
    const int64_t block = ((M + blocks - 1) / blocks + unit - 1) / unit * unit;
    const int64_t panel_size = padded_pairs(K) * 2 * NR;
    /* a work item: half a panel (32 outputs) on AMX, so that a decode batch's items split
     * evenly over the threads whatever the panels' count; a panel on the other paths */
    const int64_t width = isa == ISA_AMX ? AMX_HALF : NR, items = (N + width - 1) / width;
    #pragma omp parallel num_threads(threads)
    {
        int configured = 0;  /* the rows this thread's tiles are configured for */
        (void)configured;    /* the AVX2 build has no tiles */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t u = 0; u < items; u++) {
                const int64_t col0 = u * width, start = b * block;
                const int64_t end = start + block < M ? start + block : M;
                const int cols = N - col0 < width ? (int)(N - col0) : (int)width;
                /* the item's first output's pairs in its panel */
                const uint16_t *w = packed + col0 / NR * panel_size + col0 % NR * 2;
                const uint16_t *bp = bias ? bias + col0 : NULL;
#ifdef __AVX512F__
                if (isa == ISA_AMX) {
                    panel_half_amx((int)(end - start), x + start * ldx, ldx, w, K, bp,
                                   y + start * N + col0, N, cols, &configured);
                    continue;
                }
#endif
                for (int64_t m = start; m < end; m += MR) {
                    const int mr = end - m < MR ? (int)(end - m) : MR;
                    const uint16_t *xm = x + m * ldx;
                    const int fetch = m == start;  /* the panel's first tile streams it */
                    uint16_t *ym = y + m * N + col0;
#ifdef __AVX512F__
                    if (isa == ISA_AVX512BF16)
                        tile_rows_bf16_dp(mr, xm, ldx, w, K, bp, ym, N, cols, fetch);
                    else
#endif
                        tile_rows_bf16_f(mr, xm, ldx, w, K, bp, ym, N, cols, fetch);
                }
            }
        }
#ifdef __AVX512F__
        if (configured)
            release_tiles();
#endif
    }
    return 0;
}
