/* The part of cpu_attention.c that reads q and the KV pool and writes the output, included
 * once per element type (no include guard): T, LOAD(p) (16 elements of T at p as float32),
 * STORE(p, v) (v as 16 elements of T) and NAME(f) (f with the type's suffix) come from
 * cpu_attention.c. The math in between is float32 either way. With AMX_PATH or DP_PATH
 * (bfloat16 only) the work items multiply bfloat16 pairs (pair_run_item), on AMX's tiles
 * or with vdpbf16ps, phase 1 packing K and V in pairs (pack_k_pairs, pack_v_pairs of
 * cpu_attention_pairs.h) instead of transposing K. */
#ifndef AMX_PATH
#define AMX_PATH 0
#define AMX_PATH_DEFAULTED
#endif
#ifndef DP_PATH
#define DP_PATH 0
#define DP_PATH_DEFAULTED
#endif
#define PAIR_PATH (AMX_PATH || DP_PATH)

/* The item's output rows: O / l of each (token, group head), in T. */
static void NAME(store_rows)(const Item *it, const Scratch *w, const int64_t *seq,
                             int64_t heads, int64_t group, int64_t dim, T *out) {
    for (int64_t r = 0; r < it->num_tokens * group; ++r) {
        int64_t t = r / group, g = r % group;
        T *dst = out + ((seq[0] + it->first_token + t) * heads + it->kv_head * group + g) * dim;
        const v16f inv = v16_set1_ps(1.0f / w->l[r]);
        for (int64_t d = 0; d < dim; d += VEC)
            STORE(dst + d, v16_mul_ps(v16_loadu_ps(w->o + r * dim + d), inv));
    }
}

#if !PAIR_PATH
/* K of keys [0, num_keys) (their slots from `slots`) transposed to [D][ld], columns
 * [num_keys, cols) zero (finite scores past the last key: P is 0 there); cols is a
 * multiple of 16. Each key's values land unchanged, so every Kt holds the same bits. */
static void NAME(transpose_keys)(float *kt, int64_t ld, int64_t cols, const T *k_cache,
                           const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                           int64_t kv_head, int64_t dim) {
    for (int64_t j0 = 0; j0 < cols; j0 += VEC)
        for (int64_t d0 = 0; d0 < dim; d0 += VEC) {
            v16f r[VEC];
            for (int i = 0; i < VEC; ++i)
                r[i] = j0 + i < num_keys
                    ? LOAD(k_cache + (slots[j0 + i] * kv_heads + kv_head) * dim + d0)
                    : v16_setzero_ps();
            v16_transpose(r);
            for (int c = 0; c < VEC; ++c) v16_storeu_ps(kt + (d0 + c) * ld + j0, r[c]);
        }
}

/* transpose_keys of one block for a decode row (or a short extend), asking meanwhile for
 * the lines it will read next: with each key's chunk of K, the same chunk of that key's V
 * (read after this block's scores) and of the next block's key's K. A decode row reads
 * every row once, through slots the hardware prefetcher cannot follow across pages; asked
 * for one line per load, spread over the block's work, the memory keeps many lines in
 * flight without stalling the loads. Into L2: more lines than L1's fill buffers hold. */
static void NAME(transpose_block)(float *kt, const T *k_cache, const T *v_cache,
                            const int64_t *slots, int64_t num_keys, int64_t next_keys,
                            int64_t kv_heads, int64_t kv_head, int64_t dim) {
    for (int64_t j0 = 0; j0 < KEY_BLOCK; j0 += VEC)
        for (int64_t d0 = 0; d0 < dim; d0 += VEC) {
            v16f r[VEC];
            for (int i = 0; i < VEC; ++i) {
                const int64_t j = j0 + i;
                if (j < num_keys) {
                    const int64_t at = (slots[j] * kv_heads + kv_head) * dim + d0;
                    _mm_prefetch((const char *)(v_cache + at), _MM_HINT_T1);
                    r[i] = LOAD(k_cache + at);
                } else {
                    r[i] = v16_setzero_ps();
                }
                if (j < next_keys)
                    _mm_prefetch((const char *)(k_cache + (slots[KEY_BLOCK + j] * kv_heads
                                                           + kv_head) * dim + d0), _MM_HINT_T1);
            }
            v16_transpose(r);
            for (int c = 0; c < VEC; ++c) v16_storeu_ps(kt + (d0 + c) * KEY_BLOCK + j0, r[c]);
        }
}

/* O[r][d0 .. d0 + 16 * CHUNK) = alpha_r * O[r] + sum_j P[r][j] * v_j[...] for 4 rows, keys
 * j < num_keys of the block (P is 0 past each row's own). CHUNK is a constant, so the
 * accumulators stay in registers. */
#define PV_TILE(CHUNK)                                                                      \
    static inline void NAME(pv_tile_##CHUNK)(float *o, const float *p, const float *alpha,  \
                                       const T *v_cache, const int64_t *slots,              \
                                       int64_t num_keys, int64_t kv_heads, int64_t kv_head, \
                                       int64_t dim, int64_t d0) {                           \
        v16f acc[MICRO_ROWS][CHUNK];                                                        \
        for (int i = 0; i < MICRO_ROWS; ++i) {                                              \
            v16f a = v16_set1_ps(alpha[i]);                                                 \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                acc[i][c] = v16_mul_ps(v16_loadu_ps(o + i * dim + d0 + c * VEC), a);        \
        }                                                                                   \
        for (int64_t j = 0; j < num_keys; ++j) {                                            \
            const T *vrow = v_cache + (slots[j] * kv_heads + kv_head) * dim + d0;           \
            v16f vv[CHUNK];                                                                 \
            for (int c = 0; c < CHUNK; ++c) vv[c] = LOAD(vrow + c * VEC);                   \
            for (int i = 0; i < MICRO_ROWS; ++i) {                                          \
                v16f pj = v16_set1_ps(p[i * KEY_BLOCK + j]);                                \
                for (int c = 0; c < CHUNK; ++c)                                             \
                    acc[i][c] = v16_fmadd_ps(pj, vv[c], acc[i][c]);                         \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MICRO_ROWS; ++i)                                                \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                v16_storeu_ps(o + i * dim + d0 + c * VEC, acc[i][c]);                       \
    }
#if PV_CHUNK == 4
PV_TILE(4)
#endif
PV_TILE(1)

/* pv_tile_* for rows [0, padded) (whole tiles of 4): each chunk of dims for every row tile
 * before the next chunk, so the block's V of that chunk stays in L1. */
static inline void NAME(pv_rows)(float *o, const float *p, const float *alpha, int64_t padded,
                                 const T *v_cache, const int64_t *slots, int64_t num_keys,
                                 int64_t kv_heads, int64_t kv_head, int64_t dim) {
    int64_t d0 = 0;
#if PV_CHUNK == 4
    for (; d0 + 4 * VEC <= dim; d0 += 4 * VEC)
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            NAME(pv_tile_4)(o + r * dim, p + r * KEY_BLOCK, alpha + r, v_cache, slots, num_keys,
                            kv_heads, kv_head, dim, d0);
#endif
    for (; d0 < dim; d0 += VEC)
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            NAME(pv_tile_1)(o + r * dim, p + r * KEY_BLOCK, alpha + r, v_cache, slots, num_keys,
                            kv_heads, kv_head, dim, d0);
}

/* Phase 2: one work item, the rows (token, group head) of up to TOKEN_TILE new tokens.
 * `kt`: the sequence's Kt from phase 1 (keys from kt_from on), or NULL for a sequence with
 * one item (decode, short extends), whose blocks are transposed here, each into the
 * thread's L1-sized kt_block. Blocks from the first its first row reads (`window`). */
static void NAME(run_item)(const Item *it, Scratch *w, const T *q, int64_t q_stride,
                     const float *kt, const T *k_cache, const T *v_cache,
                     const int64_t *slots, const int64_t *seq, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, int64_t window, float softcap, T *out) {
    const int64_t group = heads / kv_heads, prefix = seq[1], slot0 = seq[3];
    const int64_t from = kt_from(seq, window), ld = kt_ld(seq, window);
    const int64_t rows = it->num_tokens * group;
    const int64_t padded = (rows + MICRO_ROWS - 1) / MICRO_ROWS * MICRO_ROWS;
    for (int64_t r = 0; r < padded; ++r) {
        int64_t t = (r < rows ? r : rows - 1) / group, g = (r < rows ? r : rows - 1) % group;
        int64_t token = it->first_token + t;
        const T *src = q + (seq[0] + token) * q_stride + (it->kv_head * group + g) * dim;
        for (int64_t d = 0; d < dim; d += VEC) v16_storeu_ps(w->qs + r * dim + d, LOAD(src + d));
        w->pos[r] = prefix + token;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        memset(w->o + r * dim, 0, sizeof(float) * dim);
    }
    const int64_t num_keys = prefix + it->first_token + it->num_tokens;  /* last row's + 1 */
    for (int64_t j0 = first_block(prefix + it->first_token, window); j0 < num_keys;
         j0 += KEY_BLOCK) {
        int64_t block = num_keys - j0 < KEY_BLOCK ? num_keys - j0 : KEY_BLOCK;
        const float *kb = w->kt_block;
        int64_t kb_ld = KEY_BLOCK;
        if (kt != NULL) {
            kb = kt + (j0 - from);
            kb_ld = ld;
        } else {
            const int64_t next = num_keys - j0 - block < KEY_BLOCK ? num_keys - j0 - block
                                                                   : KEY_BLOCK;
            NAME(transpose_block)(w->kt_block, k_cache, v_cache, slots + slot0 + j0, block, next,
                            kv_heads, it->kv_head, dim);
        }
        for (int c0 = 0; c0 < KEY_BLOCK / VEC; c0 += QK_COLS)
            for (int64_t r = 0; r < padded; r += MICRO_ROWS)
                qk_tile(w->s + r * KEY_BLOCK, w->qs + r * dim, kb, kb_ld, dim, scale, c0);
        for (int64_t r = 0; r < padded; ++r)
            w->alpha[r] = softmax_step(w->s + r * KEY_BLOCK, first_key(w->pos[r], window) - j0,
                                       w->pos[r] - j0 + 1, softcap, &w->m[r], &w->l[r]);
        NAME(pv_rows)(w->o, w->s, w->alpha, padded, v_cache, slots + slot0 + j0, block,
                      kv_heads, it->kv_head, dim);
    }
    NAME(store_rows)(it, w, seq, heads, group, dim, out);
}

#endif

#if PAIR_PATH
#if AMX_PATH
#define PAIR_TARGET "amx-tile,amx-bf16,avx512bf16"
#define PAIR_ROWS AMX_ROWS
#else
#define PAIR_TARGET "avx512bf16"
#define PAIR_ROWS MICRO_ROWS
#endif
/* run_item on the pair paths: the rows of up to TOKEN_TILE new tokens, padded with copies
 * of the last to whole tiles (AMX's 16 rows, or 4 for vdpbf16ps); per block S = Q K^T from
 * the K pairs, softmax_step_p16 (P in bfloat16), O = alpha O + P V from the V pairs.
 * `tiles`: the sequence's K and V tiles from phase 1 (the block of key j0's K tiles at
 * (j0 - kt_from) * dim words, its V tiles right after), or NULL for a sequence with one
 * item, whose blocks are packed here into the thread's scratch. */
static __attribute__((target(PAIR_TARGET))) void NAME(pair_run_item)(
        const Item *it, Scratch *w, const uint16_t *q, int64_t q_stride,
        const uint32_t *tiles, const uint16_t *k_cache, const uint16_t *v_cache,
        const int64_t *slots, const int64_t *seq, int64_t heads, int64_t kv_heads,
        int64_t dim, float scale, int64_t window, float softcap, uint16_t *out) {
    const int64_t rows = it->num_tokens * (heads / kv_heads);
    const int64_t padded = round_up(rows, PAIR_ROWS);
    const int64_t num_keys = load_pair_rows(it, w, q, q_stride, seq, heads, kv_heads, dim,
                                            padded);
    /* AMX's padding rows get P = 0 once and are never normalised nor stored (vdpbf16ps
     * runs its few as rows) */
    const int64_t live = AMX_PATH ? rows : padded;
    memset(w->p16 + live * KEY_BLOCK, 0, sizeof(uint16_t) * (padded - live) * KEY_BLOCK);
    const v16f sc = v16_set1_ps(scale);
    for (int64_t j0 = first_block(w->pos[0], window); j0 < num_keys; j0 += KEY_BLOCK) {
        const uint32_t *k_tiles, *v_tiles;
        block_pairs(w, tiles, kt_from(seq, window), k_cache, v_cache, slots + seq[3],
                    num_keys, j0, kv_heads, it->kv_head, dim, &k_tiles, &v_tiles);
#if AMX_PATH
        for (int64_t r0 = 0; r0 < padded; r0 += AMX_ROWS) {
            AMX_ZERO_C();
            for (int64_t t = 0; t < dim / PAIR_DIMS; ++t)
                AMX_DOT4(w->q16 + r0 * dim + PAIR_DIMS * t, dim * 2, k_tiles + 4 * t * 256,
                         256, 64);
            AMX_STORE_C(w->s + r0 * KEY_BLOCK, KEY_BLOCK * 4);
        }
#else
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            dp_qk_tile(w->s + r * KEY_BLOCK, w->q16 + r * dim, k_tiles, dim);
#endif
        for (int64_t r = 0; r < live; ++r)
            w->alpha[r] = softmax_step_p16(w->s + r * KEY_BLOCK, sc, softcap,
                                           first_key(w->pos[r], window) - j0,
                                           w->pos[r] - j0 + 1, &w->m[r], &w->l[r],
                                           w->p16 + r * KEY_BLOCK);
#if AMX_PATH
        for (int64_t r0 = 0; r0 < padded; r0 += AMX_ROWS)
            for (int64_t d0 = 0; d0 < dim; d0 += KEY_BLOCK) {
                AMX_ZERO_C();
                for (int64_t h = 0; h < KEY_BLOCK / 32; ++h)
                    AMX_DOT4(w->p16 + r0 * KEY_BLOCK + 32 * h, KEY_BLOCK * 2,
                             v_tiles + (h * dim / 16 + d0 / 16) * 256, 256, 64);
                const float *c = w->c_tile;
                AMX_STORE_C(w->c_tile, KEY_BLOCK * 4);
                for (int64_t i = 0; i < AMX_ROWS && r0 + i < rows; ++i) {
                    const v16f a = v16_set1_ps(w->alpha[r0 + i]);
                    float *o = w->o + (r0 + i) * dim + d0;
                    for (int k = 0; k < 4; ++k)
                        v16_storeu_ps(o + k * VEC, v16_add_ps(
                            v16_mul_ps(v16_loadu_ps(o + k * VEC), a),
                            v16_loadu_ps(c + i * KEY_BLOCK + k * VEC)));
                }
            }
#else
        const int64_t key_pairs = ((num_keys - j0 < KEY_BLOCK ? num_keys - j0 : KEY_BLOCK) + 1) / 2;
        for (int64_t r = 0; r < padded; r += MICRO_ROWS) {
            int64_t d0 = 0;
            for (; d0 + 4 * VEC <= dim; d0 += 4 * VEC)
                dp_pv_tile_4(w->o + r * dim, w->p16 + r * KEY_BLOCK, w->alpha + r, v_tiles,
                             key_pairs, dim, d0);
            for (; d0 < dim; d0 += VEC)
                dp_pv_tile_1(w->o + r * dim, w->p16 + r * KEY_BLOCK, w->alpha + r, v_tiles,
                             key_pairs, dim, d0);
        }
#endif
    }
    NAME(store_rows)(it, w, seq, heads, heads / kv_heads, dim, out);
}
#undef PAIR_TARGET
#undef PAIR_ROWS
#endif

/* `workspace` holds hicache_paged_attention_workspace(...) floats for this window or window 0
 * (64-byte aligned, any content). `window` W > 0: each row reads its W latest keys; 0: every
 * key. `softcap` c > 0: the scaled scores s become c * tanh(s / c) before the softmax; 0: not.
 * Returns 0, -1 for an unsupported shape, window or softcap, -2 when memory ran out. */
int NAME(hicache_paged_attention)(const T *q, int64_t q_stride, const T *k_cache,
                                const T *v_cache, const int64_t *slots, const int64_t *seqs,
                                int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                float scale, int64_t window, float softcap, T *out,
                                float *workspace, int num_threads) {
    if (dim % VEC != 0 || dim > MAX_HEAD_DIM || kv_heads <= 0 || heads % kv_heads != 0
        || window < 0 || !(softcap >= 0.0f && softcap < INFINITY)
        || (AMX_PATH && dim % KEY_BLOCK != 0) || (DP_PATH && dim % PAIR_DIMS != 0))
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
            kt_off[i * kv_heads + h + 1] = kt_off[i * kv_heads + h] + kt_floats(sq, dim, window);
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
    float *kt = workspace, *scratch = workspace + kt_off[num_seqs * kv_heads];
#if PAIR_PATH
    /* phase 1's work: (seq * kv_heads + kv head, first key) of every block to pack; the
     * workspace's floats over a block's bound the count (each Kt is a vector longer than
     * its blocks: kt_ld), the blocks listed give it */
    int64_t num_blocks = kt_off[num_seqs * kv_heads] / (KEY_BLOCK * dim), b = 0;
    int64_t *blocks = malloc(sizeof(int64_t) * (size_t)(2 * num_blocks + 1));
    if (!blocks) {
        free(kt_off);
        free(items);
        return -2;
    }
    for (int64_t pair = 0; pair < num_seqs * kv_heads; ++pair) {
        const int64_t *sq = seqs + 4 * (pair / kv_heads);
        if (shares_kt(sq))
            for (int64_t j0 = kt_from(sq, window); j0 < sq[1] + sq[2]; j0 += KEY_BLOCK) {
                blocks[2 * b] = pair;
                blocks[2 * b + 1] = j0;
                ++b;
            }
    }
    num_blocks = b;
#endif
#pragma omp parallel num_threads(num_threads)
    {
#if PAIR_PATH
#if AMX_PATH
        configure_tiles(AMX_ROWS);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_blocks; ++p) {
            /* phase 1 in pairs: each block of a sharing (seq, kv head) as K and V tiles */
            const int64_t pair = blocks[2 * p], j0 = blocks[2 * p + 1];
            const int64_t *sq = seqs + 4 * (pair / kv_heads);
            const int64_t keys = sq[1] + sq[2];
            const int64_t block = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
            uint32_t *k_tiles = (uint32_t *)(kt + kt_off[pair]) + (j0 - kt_from(sq, window)) * dim;
            pack_k_pairs(k_tiles, k_cache, v_cache, slots + sq[3] + j0, block, kv_heads,
                         pair % kv_heads, dim);
            pack_v_pairs(k_tiles + KEY_BLOCK * dim / 2, k_cache, v_cache, slots + sq[3] + j0,
                         block, 0, kv_heads, pair % kv_heads, dim);
        }
#else
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_seqs * kv_heads; ++p) {
            const int64_t *sq = seqs + 4 * (p / kv_heads), from = kt_from(sq, window);
            const int64_t ld = kt_ld(sq, window);
            if (shares_kt(sq))
                NAME(transpose_keys)(kt + kt_off[p], ld, ld - VEC, k_cache, slots + sq[3] + from,
                                     sq[1] + sq[2] - from, kv_heads, p % kv_heads, dim);
        }
#endif
        Scratch w = scratch_at(scratch + omp_get_thread_num() * scratch_floats(group, dim),
                               group, dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_items; ++p) {
            const Item *it = items + p;
            const int64_t *sq = seqs + 4 * it->seq;
#if PAIR_PATH
            const uint32_t *own = shares_kt(sq)
                ? (const uint32_t *)(kt + kt_off[it->seq * kv_heads + it->kv_head]) : NULL;
            NAME(pair_run_item)(it, &w, q, q_stride, own, k_cache, v_cache, slots, sq, heads,
                                kv_heads, dim, scale, window, softcap, out);
#else
            const float *own = shares_kt(sq) ? kt + kt_off[it->seq * kv_heads + it->kv_head]
                                             : NULL;
            NAME(run_item)(it, &w, q, q_stride, own, k_cache, v_cache, slots, sq, heads,
                           kv_heads, dim, scale, window, softcap, out);
#endif
        }
#if AMX_PATH
        release_tiles();
#endif
    }
#if PAIR_PATH
    free(blocks);
#endif
    free(kt_off);
    free(items);
    return 0;
}

#ifdef AMX_PATH_DEFAULTED
#undef AMX_PATH
#undef AMX_PATH_DEFAULTED
#endif
#ifdef DP_PATH_DEFAULTED
#undef DP_PATH
#undef DP_PATH_DEFAULTED
#endif
#undef PAIR_PATH
