/* Paged causal attention on the CPU (cpu_v16.h's vectors: AVX-512F or AVX2; OpenMP): prefill,
 * extend and decode rows of any mix of sequences in one call, K/V read from the pool through
 * each sequence's slots.
 *
 * Layouts (float32; or bfloat16 as uint16: hicache_paged_attention_bf16, and where the CPU
 * has them hicache_paged_attention_bf16_amx (AMX, head dims a multiple of 64) and
 * hicache_paged_attention_bf16_dp (AVX512-BF16, head dims a multiple of 32);
 * kernels/cpu_attention.py checks them):
 *
 *   q            [T, H, D] rows `q_stride` elements apart (a view into q|k|v is fine)
 *   k/v_cache    [num_slots, KVH, D] contiguous: one layer of the device KV pool
 *   slots        [sum of seq_lens] int64: every sequence's slots, one after another
 *   seqs         [num_seqs, 4] int64: (first row in T, prefix_len, extend_len, first slot)
 *   out          [T, H, D] contiguous
 *
 * New token t of a sequence (position p = prefix + t) attends its keys 0 .. p, or with a
 * window W > 0 (a sliding-window layer; 0: full attention) its W latest, p - W < j <= p.
 * GQA: query head h reads KV head h / (H / KVH). With a softcap c > 0 (Gemma 2) each scaled
 * score s is c * tanh(s / c) before the softmax (softcap_ps), a function of that score alone.
 *
 * What must stay true: a row's result depends only on its query and its keys, never on the
 * other rows of the call nor on how the sequence was split into prefix and extend. So a
 * token prefilled from scratch, one computed extending a cached prefix, and one decoded get
 * the same bits, and so do their K/V in the next layer. Each row runs the same arithmetic in
 * the same order: keys in blocks of KEY_BLOCK from key 0 (absolute, not from the extend),
 * online softmax per block; keys past a row's position are skipped exactly (their P is 0,
 * and a block with none of the row's keys leaves m, l and O untouched). A window keeps the
 * blocks where they are: a row starts at the block holding its first key p - W + 1, and the
 * keys before that key in the block get P = 0 as keys past p do, so whichever block an item
 * starts at (its first row's), a row's own arithmetic is the same. On AMX a tile's 16
 * rows share its instructions, but row i of a C tile is row i of A times B: the same
 * arithmetic for a row whatever rows sit beside it (the padding rows of a part-filled tile
 * included); with vdpbf16ps each row has its own accumulators. The pair paths' packing and
 * tiles are in cpu_attention_pairs.h, the per-type work in cpu_attention_typed.h.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include "cpu_amx.h"
#endif
#include "cpu_bf16.h"
#include "cpu_exp.h"
#include "cpu_tanh.h"

#define KEY_BLOCK 64   /* keys per online-softmax step: 4 vectors of 16 */
#define TOKEN_TILE 16  /* new tokens of one sequence per work item */
#define MICRO_ROWS 4   /* query rows per register tile */
#define VEC 16         /* floats per v16f (cpu_v16.h): an AVX-512 vector, or two AVX2 ones */
#define MAX_HEAD_DIM 256
#define PAIR_DIMS 32   /* head dims per row of K's pair tiles (16 pairs): the pair paths' unit */

typedef struct {
    int64_t seq, kv_head, first_token, num_tokens;
} Item;

/* The first key the row at position `pos` reads (0, or with a window W > 0 the W latest),
 * and the first key of the block holding it (blocks of KEY_BLOCK from key 0). */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}
static inline int64_t first_block(int64_t pos, int64_t window) {
    return first_key(pos, window) / KEY_BLOCK * KEY_BLOCK;
}

/* Of lanes c * 16 .. c * 16 + 15 of a block, those whose keys lie in [lo, hi) (keys counted
 * from the block's first). */
static inline v16mask key_lanes(int64_t lo, int64_t hi, int c) {
    return v16_lanes(lo - c * VEC, hi - c * VEC);
}

static inline float exp_scalar(float x) {
    return v16_cvtss_f32(exp_ps(v16_set1_ps(x)));
}

/* 16-key columns of a block per qk_tile, and 16-dim chunks of O per pv_tile: 4 in AVX-512's
 * 32 registers (16 accumulators), 1 in AVX2's 16 (4 rows of two halves). A work item runs
 * every row tile of a column (a chunk) before the next, so that column of Kt (chunk of V)
 * stays in L1 meanwhile. Each score is one FMA chain over d in order, each O element one
 * over the keys in order, whatever the tile or the order of tiles. */
#ifdef __AVX512F__
#define QK_COLS 4
#define PV_CHUNK 4
#else
#define QK_COLS 1
#define PV_CHUNK 1
#endif

/* S[r][16 c0 .. 16 (c0 + QK_COLS)) = scale * q_r . k_j for 4 rows, from Kt's block (column
 * j = key j). */
static inline void qk_tile(float *s, const float *qs, const float *kt, int64_t ld, int64_t dim,
                           float scale, int c0) {
    const v16f sc = v16_set1_ps(scale);
    v16f acc[MICRO_ROWS][QK_COLS];
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < QK_COLS; ++c) acc[i][c] = v16_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
        const float *row = kt + d * ld + c0 * VEC;
        v16f k[QK_COLS];
        for (int c = 0; c < QK_COLS; ++c) k[c] = v16_loadu_ps(row + c * VEC);
        for (int i = 0; i < MICRO_ROWS; ++i) {
            const v16f qv = v16_set1_ps(qs[i * dim + d]);
            for (int c = 0; c < QK_COLS; ++c) acc[i][c] = v16_fmadd_ps(qv, k[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < QK_COLS; ++c)
            v16_storeu_ps(s + i * KEY_BLOCK + (c0 + c) * VEC, v16_mul_ps(acc[i][c], sc));
}

/* Scaled scores soft-capped (Gemma 2's attn_logit_softcapping): cap * tanh(s / cap), a
 * division, tanh, a product, in transformers' order; cap 0: s unchanged. Per score, so a
 * row's bits still depend only on its query and its keys. */
static inline v16f softcap_ps(v16f s, float cap) {
    if (cap == 0.0f) return s;
    const v16f c = v16_set1_ps(cap);
    return v16_mul_ps(tanh_ps(v16_div_ps(s, c)), c);
}

/* One row's online-softmax step over a block: S row (scaled; soft-capped here by `softcap`)
 * -> P (0 outside the row's keys [lo, hi) of the block); m and l updated; returns the factor
 * O must be multiplied by (exactly 1 when m did not move). */
static inline float softmax_step(float *s, int64_t lo, int64_t hi, float softcap, float *m,
                                 float *l) {
    if (hi <= 0 || lo >= KEY_BLOCK) {  /* none of this row's keys: P = 0, nothing moves */
        memset(s, 0, sizeof(float) * KEY_BLOCK);
        return 1.0f;
    }
    v16mask mask[4];
    v16f v[4], mx = v16_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        mask[c] = key_lanes(lo, hi, c);
        v[c] = softcap_ps(v16_loadu_ps(s + c * VEC), softcap);
        mx = v16_mask_max_ps(mx, mask[c], mx, v[c]);
    }
    float m_new = fmaxf(*m, v16_reduce_max_ps(mx));
    float alpha = m_new == *m ? 1.0f : exp_scalar(*m - m_new);
    const v16f mv = v16_set1_ps(m_new);
    v16f sum = v16_setzero_ps();
    for (int c = 0; c < 4; ++c) {
        v16f p = v16_maskz_mov_ps(mask[c], exp_ps(v16_sub_ps(v[c], mv)));
        v16_storeu_ps(s + c * VEC, p);
        sum = v16_add_ps(sum, p);
    }
    *l = *l * alpha + v16_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

typedef struct {
    float *qs, *s, *o, *m, *l, *alpha;
    float *kt_block;  /* [D][KEY_BLOCK]: one block of Kt, for a sequence with one item */
    /* the AMX path's: q and P in bfloat16, one block of K and of V as B tiles, a C tile */
    uint16_t *q16, *p16;
    uint32_t *k_tiles, *v_tiles;
    float *c_tile;
    int64_t *pos;
} Scratch;

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#define AMX_ROWS 16  /* query rows per AMX tile */

/* Rows of one work item's scratch: whole register tiles and whole AMX tiles. */
static int64_t scratch_rows(int64_t group) { return round_up(TOKEN_TILE * group, AMX_ROWS); }

/* Floats of workspace one thread needs: a block of Kt, and for its rows queries, scores,
 * output, m, l, alpha; the AMX path's bfloat16 q and P, K and V tiles of a block, a C tile;
 * and positions as int64. */
static int64_t scratch_floats(int64_t group, int64_t dim) {
    const int64_t rows = scratch_rows(group);
    return round_up(rows * (2 * dim + KEY_BLOCK + 3) + KEY_BLOCK * dim, VEC)
        + round_up(rows * (dim + KEY_BLOCK) / 2 + KEY_BLOCK * dim + AMX_ROWS * KEY_BLOCK, VEC)
        + 2 * rows;
}

/* The thread's Scratch in `mine` (scratch_floats(group, dim) floats). */
static Scratch scratch_at(float *mine, int64_t group, int64_t dim) {
    const int64_t rows = scratch_rows(group);
    Scratch w = {.kt_block = mine, .qs = mine + KEY_BLOCK * dim};
    w.o = w.qs + rows * dim;
    w.s = w.o + rows * dim;
    w.m = w.s + rows * KEY_BLOCK;
    w.l = w.m + rows;
    w.alpha = w.l + rows;
    float *amx = mine + round_up(rows * (2 * dim + KEY_BLOCK + 3) + KEY_BLOCK * dim, VEC);
    w.c_tile = amx;
    w.k_tiles = (uint32_t *)(w.c_tile + AMX_ROWS * KEY_BLOCK);
    w.v_tiles = w.k_tiles + KEY_BLOCK * dim / 2;
    w.q16 = (uint16_t *)(w.v_tiles + KEY_BLOCK * dim / 2);
    w.p16 = w.q16 + rows * dim;
    w.pos = (int64_t *)(amx + round_up(rows * (dim + KEY_BLOCK) / 2 + KEY_BLOCK * dim
                                       + AMX_ROWS * KEY_BLOCK, VEC));  /* 64-byte aligned */
    return w;
}

/* Whether (seq, kv head) pairs of this sequence get a whole-sequence Kt in phase 1: those
 * with several items share it; a one-item sequence transposes block by block instead. */
static int shares_kt(const int64_t *seq) { return seq[2] > TOKEN_TILE; }

/* A shared Kt (or K/V tiles) holds keys from the first block its first new token reads, to
 * the end of the sequence's last block. */
static int64_t kt_from(const int64_t *seq, int64_t window) { return first_block(seq[1], window); }

/* A shared Kt's row length: its keys' blocks and one vector more, so that its rows lie an
 * odd number of cache lines apart and the lines of one column of keys (a row each) spread
 * over L1's sets (a power-of-two stride would put them all in one set, 8 ways deep). */
static int64_t kt_ld(const int64_t *seq, int64_t window) {
    return round_up(seq[1] + seq[2], KEY_BLOCK) - kt_from(seq, window) + VEC;
}

static int64_t kt_floats(const int64_t *seq, int64_t dim, int64_t window) {
    return shares_kt(seq) ? dim * kt_ld(seq, window) : 0;
}

/* Floats of workspace a call needs: every (seq, kv head)'s transposed K, then one scratch
 * per thread. Window 0 needs the most: a size for it serves every window. */
int64_t hicache_paged_attention_workspace(const int64_t *seqs, int64_t num_seqs,
                                          int64_t heads, int64_t kv_heads, int64_t dim,
                                          int64_t window, int num_threads) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; ++i) n += kv_heads * kt_floats(seqs + 4 * i, dim, window);
    return n + (int64_t)num_threads * scratch_floats(heads / kv_heads, dim);
}

#ifdef __AVX512F__
#include "cpu_attention_pairs.h"
#endif

/* float32: q, the pool and the output as they are. */
#define T float
#define LOAD(p) v16_loadu_ps(p)
#define STORE(p, v) v16_storeu_ps((p), (v))
#define NAME(f) f##_f32
#include "cpu_attention_typed.h"
#undef T
#undef LOAD
#undef STORE
#undef NAME

/* bfloat16 (uint16): q, K, V read as float32 (exactly), the math in float32, the output
 * rounded once to bfloat16. */
#define T uint16_t
#define LOAD(p) bf16_to_f32(_mm256_loadu_si256((const __m256i *)(p)))
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), round_bf16(v))
#define NAME(f) f##_bf16
#include "cpu_attention_typed.h"
#undef NAME

#ifdef __AVX512F__
/* bfloat16 on AMX (head dims a multiple of 64): QK^T and PV on the tiles, per block of 64
 * keys from key 0 as above, the online softmax in float32 between them; P is rounded to
 * bfloat16 for PV (as torch's bfloat16 flash attention does). Each row of a C tile is its
 * A row times B, so a row's bits still depend only on its query and its keys. */
#define AMX_PATH 1
#define NAME(f) f##_bf16_amx
#include "cpu_attention_typed.h"
#undef NAME
#undef AMX_PATH

/* bfloat16 with vdpbf16ps (AVX512-BF16, head dims a multiple of PAIR_DIMS): AMX's
 * arithmetic on 16-lane vectors per block of 64 keys from key 0 (S from K's pairs, the
 * online softmax in float32, P rounded to bfloat16, O = alpha O + P V from V's pairs), each
 * row alone in its own lanes' accumulators: a row's bits depend only on its query and keys. */
#define DP_PATH 1
#define NAME(f) f##_bf16_dp
#include "cpu_attention_typed.h"

int hicache_paged_attention_has_amx(void) { return amx_available(); }

int hicache_paged_attention_has_avx512bf16(void) { return avx512bf16_available(); }
#else
/* the AVX2 build has neither pair path */
int hicache_paged_attention_has_amx(void) { return 0; }

int hicache_paged_attention_has_avx512bf16(void) { return 0; }
#endif
