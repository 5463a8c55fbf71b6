/* Paged causal attention on the CPU (AVX-512F, OpenMP): prefill, extend and decode rows of
 * any mix of sequences in one call, K/V read from the pool through each sequence's slots.
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
 * GQA: query head h reads KV head h / (H / KVH).
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
 * included); with vdpbf16ps each row has its own accumulators.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_bf16.h"
#include "cpu_exp.h"

#define KEY_BLOCK 64   /* keys per online-softmax step: 4 vectors of 16 */
#define TOKEN_TILE 16  /* new tokens of one sequence per work item */
#define MICRO_ROWS 4   /* query rows per register tile */
#define VEC 16         /* floats per AVX-512 vector */
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
static inline uint32_t lanes_below(int64_t n) {
    return n >= VEC ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1;
}
static inline __mmask16 key_lanes(int64_t lo, int64_t hi, int c) {
    return (__mmask16)(lanes_below(hi - c * VEC) & ~lanes_below(lo - c * VEC));
}

static inline float exp_scalar(float x) {
    return _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(x)));
}

/* r[c] <- column c of the 16 x 16 block whose rows are r[0..16) (three rounds of shuffles). */
static inline void transpose16(__m512 r[VEC]) {
    __m512 t[VEC];
    for (int i = 0; i < 8; ++i) {  /* pairs of rows interleaved within each 128-bit lane */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  /* r[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3 */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; ++i)  /* lanes regrouped across row quads ... */
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; ++k) {  /* ... and again: whole columns */
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    }
}

/* S[r][0..64) = scale * q_r . k_j for 4 rows, from Kt's block (column j = key j). */
static inline void qk_tile(float *s, const float *qs, const float *kt, int64_t ld, int64_t dim,
                           float scale) {
    __m512 acc[MICRO_ROWS][4];
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
        const float *row = kt + d * ld;
        __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16);
        __m512 k2 = _mm512_loadu_ps(row + 32), k3 = _mm512_loadu_ps(row + 48);
        for (int i = 0; i < MICRO_ROWS; ++i) {
            __m512 qv = _mm512_set1_ps(qs[i * dim + d]);
            acc[i][0] = _mm512_fmadd_ps(qv, k0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(qv, k1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(qv, k2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(qv, k3, acc[i][3]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < 4; ++c)
            _mm512_storeu_ps(s + i * KEY_BLOCK + c * VEC, _mm512_mul_ps(acc[i][c], sc));
}

/* One row's online-softmax step over a block: S row -> P (0 outside the row's keys [lo, hi)
 * of the block); m and l updated; returns the factor O must be multiplied by (exactly 1 when
 * m did not move). */
static inline float softmax_step(float *s, int64_t lo, int64_t hi, float *m, float *l) {
    if (hi <= 0 || lo >= KEY_BLOCK) {  /* none of this row's keys: P = 0, nothing moves */
        memset(s, 0, sizeof(float) * KEY_BLOCK);
        return 1.0f;
    }
    __mmask16 mask[4];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        mask[c] = key_lanes(lo, hi, c);
        mx = _mm512_mask_max_ps(mx, mask[c], mx, _mm512_loadu_ps(s + c * VEC));
    }
    float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx));
    float alpha = m_new == *m ? 1.0f : exp_scalar(*m - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
        __m512 p = _mm512_maskz_mov_ps(mask[c],
                                       exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + c * VEC), mv)));
        _mm512_storeu_ps(s + c * VEC, p);
        sum = _mm512_add_ps(sum, p);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
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

static int64_t kt_floats(const int64_t *seq, int64_t dim, int64_t window) {
    return shares_kt(seq) ? dim * (round_up(seq[1] + seq[2], KEY_BLOCK) - kt_from(seq, window))
                          : 0;
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

/* The bfloat16 paths that multiply bfloat16 pairs (AMX's tdpbf16ps, AVX512-BF16's
 * vdpbf16ps) read K and V in pairs, packed per block of 64 keys as below, and P in
 * bfloat16. */

/* One block of 64 keys' K (keys past `num_keys` zero) as the B tiles of S = Q K^T:
 * tile (t, g) at k_tiles + (4 t + g) * 256 words holds, row p, the dims (32 t + 2 p,
 * 32 t + 2 p + 1) of keys 16 g .. 16 g + 15 (a 16 x 16 transpose of 32-bit pairs). Asks for
 * each key's V row meanwhile (read by pack_v_pairs next). */
static void pack_k_pairs(uint32_t *k_tiles, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                         int64_t kv_head, int64_t dim) {
    for (int64_t g = 0; g < KEY_BLOCK / 16; ++g)
        for (int64_t t = 0; t < dim / PAIR_DIMS; ++t) {
            __m512 r[VEC];
            for (int i = 0; i < VEC; ++i) {
                const int64_t j = 16 * g + i;
                if (j < num_keys) {
                    const int64_t at = (slots[j] * kv_heads + kv_head) * dim + PAIR_DIMS * t;
                    _mm_prefetch((const char *)(v_cache + at), _MM_HINT_T1);
                    r[i] = _mm512_loadu_ps((const float *)(k_cache + at));
                } else {
                    r[i] = _mm512_setzero_ps();
                }
            }
            transpose16(r);
            for (int p = 0; p < VEC; ++p)
                _mm512_storeu_ps((float *)(k_tiles + ((4 * t + g) * 16 + p) * 16), r[p]);
        }
}

/* One block's V (keys past `num_keys` zero) as the B tiles of O += P V: tile (h, g) at
 * v_tiles + (h * dim / 16 + g) * 256 words holds, row p, keys (32 h + 2 p, 32 h + 2 p + 1)
 * interleaved over dims 16 g .. 16 g + 15. Asks for the next block's K rows meanwhile. */
static void pack_v_pairs(uint32_t *v_tiles, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *slots, int64_t num_keys, int64_t next_keys,
                         int64_t kv_heads, int64_t kv_head, int64_t dim) {
    const int64_t groups = dim / 16;
    for (int64_t h = 0; h < KEY_BLOCK / 32; ++h)
        for (int64_t p = 0; p < 16; ++p) {
            const int64_t ja = 32 * h + 2 * p, jb = ja + 1;
            const uint16_t *va = ja < num_keys ? v_cache + (slots[ja] * kv_heads + kv_head) * dim
                                               : NULL;
            const uint16_t *vb = jb < num_keys ? v_cache + (slots[jb] * kv_heads + kv_head) * dim
                                               : NULL;
            for (int64_t j = ja; j <= jb; ++j)
                if (j < next_keys)
                    _mm_prefetch((const char *)(k_cache + (slots[KEY_BLOCK + j] * kv_heads
                                                           + kv_head) * dim), _MM_HINT_T1);
            for (int64_t g = 0; g < groups; ++g) {
                const __m512i lo = va ? _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(va + 16 * g))) : _mm512_setzero_si512();
                const __m512i hi = vb ? _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(vb + 16 * g))) : _mm512_setzero_si512();
                _mm512_storeu_si512(v_tiles + ((h * groups + g) * 16 + p) * 16,
                                    _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* S[r][0..64) = q_r . k_j (unscaled, as AMX stores it) for 4 rows, one vdpbf16ps per pair
 * of dims: the block's K pairs as pack_k_pairs lays them out, q's pair broadcast. */
static inline __attribute__((always_inline, target("avx512bf16"))) void dp_qk_tile(
        float *s, const uint16_t *q16, const uint32_t *k_tiles, int64_t dim) {
    __m512 acc[MICRO_ROWS][4];
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < dim / 2; ++pair) {
        const uint32_t *row = k_tiles + (pair >> 4) * 4 * 256 + (pair & 15) * 16;
        __m512i k[4];
        for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_si512(row + c * 256);
        for (int i = 0; i < MICRO_ROWS; ++i) {
            uint32_t qp;
            memcpy(&qp, q16 + i * dim + 2 * pair, sizeof qp);
            const __m512i qv = _mm512_set1_epi32((int)qp);
            for (int c = 0; c < 4; ++c)
                acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)k[c], (__m512bh)qv);
        }
    }
    for (int i = 0; i < MICRO_ROWS; ++i)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + i * KEY_BLOCK + c * VEC, acc[i][c]);
}

/* softmax_step for the pair paths, in one pass over a row of S (unscaled, as the tile
 * stored it): scaled, m and l updated, P written as bfloat16 for PV (vcvtneps2bf16: every
 * AMX CPU has AVX512-BF16); returns alpha. */
static inline __attribute__((target("avx512bf16"))) float softmax_step_p16(
        const float *s, __m512 scale, int64_t lo, int64_t hi, float *m, float *l,
        uint16_t *p16) {
    if (hi <= 0 || lo >= KEY_BLOCK) {  /* none of this row's keys: P = 0, nothing moves */
        memset(p16, 0, sizeof(uint16_t) * KEY_BLOCK);
        return 1.0f;
    }
    __mmask16 mask[4];
    __m512 v[4], mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        mask[c] = key_lanes(lo, hi, c);
        v[c] = _mm512_mul_ps(_mm512_loadu_ps(s + c * VEC), scale);
        mx = _mm512_mask_max_ps(mx, mask[c], mx, v[c]);
    }
    const float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx));
    const float alpha = m_new == *m ? 1.0f : exp_scalar(*m - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
        const __m512 p = _mm512_maskz_mov_ps(mask[c], exp_ps(_mm512_sub_ps(v[c], mv)));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i *)(p16 + c * VEC), (__m256i)_mm512_cvtneps_pbh(p));
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* A pair path's work item starts: its rows' q (bfloat16) into the scratch, padded to
 * `padded` rows with copies of the last; positions; m, l and O reset. Returns the keys the
 * item reads (its last row's position + 1). */
static int64_t load_pair_rows(const Item *it, Scratch *w, const uint16_t *q, int64_t q_stride,
                              const int64_t *seq, int64_t heads, int64_t kv_heads, int64_t dim,
                              int64_t padded) {
    const int64_t group = heads / kv_heads, rows = it->num_tokens * group;
    for (int64_t r = 0; r < padded; ++r) {
        int64_t t = (r < rows ? r : rows - 1) / group, g = (r < rows ? r : rows - 1) % group;
        int64_t token = it->first_token + t;
        memcpy(w->q16 + r * dim, q + (seq[0] + token) * q_stride + (it->kv_head * group + g) * dim,
               sizeof(uint16_t) * dim);
        w->pos[r] = seq[1] + token;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        memset(w->o + r * dim, 0, sizeof(float) * dim);
    }
    return seq[1] + it->first_token + it->num_tokens;
}

/* The K and V pairs of the block of keys from j0 (of `num_keys`): in `tiles` when phase 1
 * packed the sequence's (from key `from` on), else packed now into the thread's scratch
 * from the sequence's slots `own`. */
static void block_pairs(Scratch *w, const uint32_t *tiles, int64_t from, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *own, int64_t num_keys,
                        int64_t j0, int64_t kv_heads, int64_t kv_head, int64_t dim,
                        const uint32_t **k_tiles, const uint32_t **v_tiles) {
    if (tiles != NULL) {
        *k_tiles = tiles + (j0 - from) * dim;
        *v_tiles = *k_tiles + KEY_BLOCK * dim / 2;
        return;
    }
    const int64_t block = num_keys - j0 < KEY_BLOCK ? num_keys - j0 : KEY_BLOCK;
    const int64_t next = num_keys - j0 - block < KEY_BLOCK ? num_keys - j0 - block : KEY_BLOCK;
    pack_k_pairs(w->k_tiles, k_cache, v_cache, own + j0, block, kv_heads, kv_head, dim);
    pack_v_pairs(w->v_tiles, k_cache, v_cache, own + j0, block, next, kv_heads, kv_head, dim);
    *k_tiles = w->k_tiles;
    *v_tiles = w->v_tiles;
}

/* float32: q, the pool and the output as they are. */
#define T float
#define LOAD(p) _mm512_loadu_ps(p)
#define STORE(p, v) _mm512_storeu_ps((p), (v))
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
