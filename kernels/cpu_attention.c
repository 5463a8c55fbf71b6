/* Paged causal attention on the CPU (AVX-512F, OpenMP): prefill, extend and decode rows of
 * any mix of sequences in one call, K/V read from the pool through each sequence's slots.
 *
 * Layouts (float32, kernels/cpu_attention.py checks them):
 *
 *   q            [T, H, D] rows `q_stride` floats apart (a view into q|k|v is fine)
 *   k/v_cache    [num_slots, KVH, D] contiguous: one layer of the device KV pool
 *   slots        [sum of seq_lens] int64: every sequence's slots, one after another
 *   seqs         [num_seqs, 4] int64: (first row in T, prefix_len, extend_len, first slot)
 *   out          [T, H, D] contiguous
 *
 * New token t of a sequence (position prefix + t) attends its keys 0 .. prefix + t. GQA:
 * query head h reads KV head h / (H / KVH).
 *
 * What must stay true: a row's result depends only on its query and its keys, never on the
 * other rows of the call nor on how the sequence was split into prefix and extend. So a
 * token prefilled from scratch, one computed extending a cached prefix, and one decoded get
 * the same bits, and so do their K/V in the next layer. Each row runs the same arithmetic in
 * the same order: keys in blocks of KEY_BLOCK from key 0 (absolute, not from the extend),
 * online softmax per block; keys past a row's position are skipped exactly (their P is 0,
 * and a block with none of the row's keys leaves m, l and O untouched).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

#define KEY_BLOCK 64   /* keys per online-softmax step: 4 vectors of 16 */
#define TOKEN_TILE 16  /* new tokens of one sequence per work item */
#define MICRO_ROWS 4   /* query rows per register tile */
#define VEC 16         /* floats per AVX-512 vector */
#define MAX_HEAD_DIM 256

typedef struct {
    int64_t seq, kv_head, first_token, num_tokens;
} Item;

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

/* K of keys [0, num_keys) (their slots from `slots`) transposed to [D][ld], columns
 * [num_keys, cols) zero (finite scores past the last key: P is 0 there); cols is a
 * multiple of 16. Each key's values land unchanged, so every Kt holds the same bits. */
static void transpose_keys(float *kt, int64_t ld, int64_t cols, const float *k_cache,
                           const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                           int64_t kv_head, int64_t dim) {
    for (int64_t j0 = 0; j0 < cols; j0 += VEC)
        for (int64_t d0 = 0; d0 < dim; d0 += VEC) {
            __m512 r[VEC];
            for (int i = 0; i < VEC; ++i)
                r[i] = j0 + i < num_keys
                    ? _mm512_loadu_ps(k_cache + (slots[j0 + i] * kv_heads + kv_head) * dim + d0)
                    : _mm512_setzero_ps();
            transpose16(r);
            for (int c = 0; c < VEC; ++c) _mm512_storeu_ps(kt + (d0 + c) * ld + j0, r[c]);
        }
}

/* transpose_keys of one block for a decode row (or a short extend), asking meanwhile for
 * the lines it will read next: with each key's chunk of K, the same chunk of that key's V
 * (read after this block's scores) and of the next block's key's K. A decode row reads
 * every row once, through slots the hardware prefetcher cannot follow across pages; asked
 * for one line per load, spread over the block's work, the memory keeps many lines in
 * flight without stalling the loads. Into L2: more lines than L1's fill buffers hold. */
static void transpose_block(float *kt, const float *k_cache, const float *v_cache,
                            const int64_t *slots, int64_t num_keys, int64_t next_keys,
                            int64_t kv_heads, int64_t kv_head, int64_t dim) {
    for (int64_t j0 = 0; j0 < KEY_BLOCK; j0 += VEC)
        for (int64_t d0 = 0; d0 < dim; d0 += VEC) {
            __m512 r[VEC];
            for (int i = 0; i < VEC; ++i) {
                const int64_t j = j0 + i;
                if (j < num_keys) {
                    const int64_t at = (slots[j] * kv_heads + kv_head) * dim + d0;
                    _mm_prefetch((const char *)(v_cache + at), _MM_HINT_T1);
                    r[i] = _mm512_loadu_ps(k_cache + at);
                } else {
                    r[i] = _mm512_setzero_ps();
                }
                if (j < next_keys)
                    _mm_prefetch((const char *)(k_cache + (slots[KEY_BLOCK + j] * kv_heads
                                                           + kv_head) * dim + d0), _MM_HINT_T1);
            }
            transpose16(r);
            for (int c = 0; c < VEC; ++c) _mm512_storeu_ps(kt + (d0 + c) * KEY_BLOCK + j0, r[c]);
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

/* One row's online-softmax step over a block: S row -> P (0 past `valid` keys); m and l
 * updated; returns the factor O must be multiplied by (exactly 1 when m did not move). */
static inline float softmax_step(float *s, int64_t valid, float *m, float *l) {
    if (valid <= 0) {  /* none of this row's keys: P = 0, nothing else moves */
        memset(s, 0, sizeof(float) * KEY_BLOCK);
        return 1.0f;
    }
    __mmask16 mask[4];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        int64_t n = valid - c * VEC;
        mask[c] = n >= VEC ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
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

/* O[r][d0 .. d0 + 16 * CHUNK) = alpha_r * O[r] + sum_j P[r][j] * v_j[...] for 4 rows, keys
 * j < num_keys of the block (P is 0 past each row's own). CHUNK is a constant, so the
 * accumulators stay in registers. */
#define PV_TILE(CHUNK)                                                                      \
    static inline void pv_tile_##CHUNK(float *o, const float *p, const float *alpha,        \
                                       const float *v_cache, const int64_t *slots,          \
                                       int64_t num_keys, int64_t kv_heads, int64_t kv_head, \
                                       int64_t dim, int64_t d0) {                           \
        __m512 acc[MICRO_ROWS][CHUNK];                                                      \
        for (int i = 0; i < MICRO_ROWS; ++i) {                                              \
            __m512 a = _mm512_set1_ps(alpha[i]);                                            \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * dim + d0 + c * VEC), a);  \
        }                                                                                   \
        for (int64_t j = 0; j < num_keys; ++j) {                                            \
            const float *vrow = v_cache + (slots[j] * kv_heads + kv_head) * dim + d0;       \
            __m512 vv[CHUNK];                                                               \
            for (int c = 0; c < CHUNK; ++c) vv[c] = _mm512_loadu_ps(vrow + c * VEC);        \
            for (int i = 0; i < MICRO_ROWS; ++i) {                                          \
                __m512 pj = _mm512_set1_ps(p[i * KEY_BLOCK + j]);                           \
                for (int c = 0; c < CHUNK; ++c)                                             \
                    acc[i][c] = _mm512_fmadd_ps(pj, vv[c], acc[i][c]);                      \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MICRO_ROWS; ++i)                                                \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                _mm512_storeu_ps(o + i * dim + d0 + c * VEC, acc[i][c]);                    \
    }
PV_TILE(4)
PV_TILE(1)

static inline void pv_tile(float *o, const float *p, const float *alpha, const float *v_cache,
                           const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                           int64_t kv_head, int64_t dim) {
    int64_t d0 = 0;
    for (; d0 + 4 * VEC <= dim; d0 += 4 * VEC)
        pv_tile_4(o, p, alpha, v_cache, slots, num_keys, kv_heads, kv_head, dim, d0);
    for (; d0 < dim; d0 += VEC)
        pv_tile_1(o, p, alpha, v_cache, slots, num_keys, kv_heads, kv_head, dim, d0);
}

typedef struct {
    float *qs, *s, *o, *m, *l, *alpha;
    float *kt_block;  /* [D][KEY_BLOCK]: one block of Kt, for a sequence with one item */
    int64_t *pos;
} Scratch;

/* Phase 2: one work item, the rows (token, group head) of up to TOKEN_TILE new tokens.
 * `kt`: the sequence's Kt from phase 1, or NULL for a sequence with one item (decode, short
 * extends), whose blocks are transposed here, each into the thread's L1-sized kt_block. */
static void run_item(const Item *it, Scratch *w, const float *q, int64_t q_stride,
                     const float *kt, int64_t ld, const float *k_cache, const float *v_cache,
                     const int64_t *slots, const int64_t *seq, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, float *out) {
    const int64_t group = heads / kv_heads, prefix = seq[1], slot0 = seq[3];
    const int64_t rows = it->num_tokens * group;
    const int64_t padded = (rows + MICRO_ROWS - 1) / MICRO_ROWS * MICRO_ROWS;
    for (int64_t r = 0; r < padded; ++r) {
        int64_t t = (r < rows ? r : rows - 1) / group, g = (r < rows ? r : rows - 1) % group;
        int64_t token = it->first_token + t;
        const float *src = q + (seq[0] + token) * q_stride + (it->kv_head * group + g) * dim;
        memcpy(w->qs + r * dim, src, sizeof(float) * dim);
        w->pos[r] = prefix + token;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        memset(w->o + r * dim, 0, sizeof(float) * dim);
    }
    const int64_t num_keys = prefix + it->first_token + it->num_tokens;  /* last row's + 1 */
    for (int64_t j0 = 0; j0 < num_keys; j0 += KEY_BLOCK) {
        int64_t block = num_keys - j0 < KEY_BLOCK ? num_keys - j0 : KEY_BLOCK;
        const float *kb = w->kt_block;
        int64_t kb_ld = KEY_BLOCK;
        if (kt != NULL) {
            kb = kt + j0;
            kb_ld = ld;
        } else {
            const int64_t next = num_keys - j0 - block < KEY_BLOCK ? num_keys - j0 - block
                                                                   : KEY_BLOCK;
            transpose_block(w->kt_block, k_cache, v_cache, slots + slot0 + j0, block, next,
                            kv_heads, it->kv_head, dim);
        }
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            qk_tile(w->s + r * KEY_BLOCK, w->qs + r * dim, kb, kb_ld, dim, scale);
        for (int64_t r = 0; r < padded; ++r)
            w->alpha[r] = softmax_step(w->s + r * KEY_BLOCK, w->pos[r] - j0 + 1, &w->m[r],
                                       &w->l[r]);
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            pv_tile(w->o + r * dim, w->s + r * KEY_BLOCK, w->alpha + r, v_cache,
                    slots + slot0 + j0, block, kv_heads, it->kv_head, dim);
    }
    for (int64_t r = 0; r < rows; ++r) {
        int64_t t = r / group, g = r % group;
        float *dst = out + ((seq[0] + it->first_token + t) * heads + it->kv_head * group + g) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / w->l[r]);
        for (int64_t d = 0; d < dim; d += VEC)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + r * dim + d), inv));
    }
}

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Floats of workspace one thread needs: a block of Kt, and for its rows queries, scores,
 * output, m, l, alpha, and positions as int64. */
static int64_t scratch_floats(int64_t group, int64_t dim) {
    const int64_t rows = round_up(TOKEN_TILE * group, MICRO_ROWS);
    return round_up(rows * (2 * dim + KEY_BLOCK + 3 + 2) + KEY_BLOCK * dim, VEC);
}

/* Floats of workspace a call needs: every (seq, kv head)'s transposed K, then one scratch
 * per thread. */
/* Whether (seq, kv head) pairs of this sequence get a whole-sequence Kt in phase 1: those
 * with several items share it; a one-item sequence transposes block by block instead. */
static int shares_kt(const int64_t *seq) { return seq[2] > TOKEN_TILE; }

static int64_t kt_floats(const int64_t *seq, int64_t dim) {
    return shares_kt(seq) ? dim * round_up(seq[1] + seq[2], KEY_BLOCK) : 0;
}

int64_t hicache_paged_attention_workspace(const int64_t *seqs, int64_t num_seqs,
                                          int64_t heads, int64_t kv_heads, int64_t dim,
                                          int num_threads) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; ++i) n += kv_heads * kt_floats(seqs + 4 * i, dim);
    return n + (int64_t)num_threads * scratch_floats(heads / kv_heads, dim);
}

/* `workspace` holds hicache_paged_attention_workspace(...) floats (64-byte aligned, any
 * content). Returns 0, -1 for an unsupported shape, -2 when memory ran out. */
int hicache_paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                const float *v_cache, const int64_t *slots, const int64_t *seqs,
                                int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                float scale, float *out, float *workspace, int num_threads) {
    if (dim % VEC != 0 || dim > MAX_HEAD_DIM || kv_heads <= 0 || heads % kv_heads != 0)
        return -1;
    /* Kt of every sharing (seq, kv head) at kt_off in the workspace; work items, heaviest
     * first */
    int64_t *kt_off = malloc(sizeof(int64_t) * (num_seqs * kv_heads + 1));
    int64_t num_items = 0;
    if (!kt_off) return -2;
    kt_off[0] = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t *sq = seqs + 4 * i;
        for (int64_t h = 0; h < kv_heads; ++h)
            kt_off[i * kv_heads + h + 1] = kt_off[i * kv_heads + h] + kt_floats(sq, dim);
        num_items += kv_heads * ((sq[2] + TOKEN_TILE - 1) / TOKEN_TILE);
    }
    Item *items = malloc(sizeof(Item) * (size_t)num_items);
    if (!items) {
        free(kt_off);
        return -2;
    }
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        for (int64_t t = (seqs[4 * i + 2] - 1) / TOKEN_TILE * TOKEN_TILE; t >= 0; t -= TOKEN_TILE)
            for (int64_t h = 0; h < kv_heads; ++h) {
                int64_t left = seqs[4 * i + 2] - t;
                items[n++] = (Item){i, h, t, left < TOKEN_TILE ? left : TOKEN_TILE};
            }
    const int64_t group = heads / kv_heads;
    const int64_t max_rows = round_up(TOKEN_TILE * group, MICRO_ROWS);
    float *kt = workspace, *scratch = workspace + kt_off[num_seqs * kv_heads];
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_seqs * kv_heads; ++p) {
            const int64_t *sq = seqs + 4 * (p / kv_heads);
            int64_t ld = round_up(sq[1] + sq[2], KEY_BLOCK);
            if (shares_kt(sq))
                transpose_keys(kt + kt_off[p], ld, ld, k_cache, slots + sq[3], sq[1] + sq[2],
                               kv_heads, p % kv_heads, dim);
        }
        float *mine = scratch + omp_get_thread_num() * scratch_floats(group, dim);
        Scratch w = {.kt_block = mine, .qs = mine + KEY_BLOCK * dim};
        w.o = w.qs + max_rows * dim;
        w.s = w.o + max_rows * dim;
        w.m = w.s + max_rows * KEY_BLOCK;
        w.l = w.m + max_rows;
        w.alpha = w.l + max_rows;
        w.pos = (int64_t *)(w.alpha + max_rows);  /* 8-byte aligned: max_rows is even */
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_items; ++p) {
            const Item *it = items + p;
            const int64_t *sq = seqs + 4 * it->seq;
            const float *own = shares_kt(sq) ? kt + kt_off[it->seq * kv_heads + it->kv_head]
                                             : NULL;
            run_item(it, &w, q, q_stride, own, round_up(sq[1] + sq[2], KEY_BLOCK), k_cache,
                     v_cache, slots, sq, heads, kv_heads, dim, scale, out);
        }
    }
    free(kt_off);
    free(items);
    return 0;
}
