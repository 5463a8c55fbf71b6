/* The part of cpu_attention.c that reads q and the KV pool and writes the output, included
 * once per element type (no include guard): T, LOAD(p) (16 elements of T at p as float32),
 * STORE(p, v) (v as 16 elements of T) and NAME(f) (f with the type's suffix) come from
 * cpu_attention.c. The math in between is float32 either way. */


/* K of keys [0, num_keys) (their slots from `slots`) transposed to [D][ld], columns
 * [num_keys, cols) zero (finite scores past the last key: P is 0 there); cols is a
 * multiple of 16. Each key's values land unchanged, so every Kt holds the same bits. */
static void NAME(transpose_keys)(float *kt, int64_t ld, int64_t cols, const T *k_cache,
                           const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                           int64_t kv_head, int64_t dim) {
    for (int64_t j0 = 0; j0 < cols; j0 += VEC)
        for (int64_t d0 = 0; d0 < dim; d0 += VEC) {
            __m512 r[VEC];
            for (int i = 0; i < VEC; ++i)
                r[i] = j0 + i < num_keys
                    ? LOAD(k_cache + (slots[j0 + i] * kv_heads + kv_head) * dim + d0)
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
static void NAME(transpose_block)(float *kt, const T *k_cache, const T *v_cache,
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
                    r[i] = LOAD(k_cache + at);
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


/* O[r][d0 .. d0 + 16 * CHUNK) = alpha_r * O[r] + sum_j P[r][j] * v_j[...] for 4 rows, keys
 * j < num_keys of the block (P is 0 past each row's own). CHUNK is a constant, so the
 * accumulators stay in registers. */
#define PV_TILE(CHUNK)                                                                      \
    static inline void NAME(pv_tile_##CHUNK)(float *o, const float *p, const float *alpha,  \
                                       const T *v_cache, const int64_t *slots,              \
                                       int64_t num_keys, int64_t kv_heads, int64_t kv_head, \
                                       int64_t dim, int64_t d0) {                           \
        __m512 acc[MICRO_ROWS][CHUNK];                                                      \
        for (int i = 0; i < MICRO_ROWS; ++i) {                                              \
            __m512 a = _mm512_set1_ps(alpha[i]);                                            \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * dim + d0 + c * VEC), a);  \
        }                                                                                   \
        for (int64_t j = 0; j < num_keys; ++j) {                                            \
            const T *vrow = v_cache + (slots[j] * kv_heads + kv_head) * dim + d0;           \
            __m512 vv[CHUNK];                                                               \
            for (int c = 0; c < CHUNK; ++c) vv[c] = LOAD(vrow + c * VEC);                   \
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

static inline void NAME(pv_tile)(float *o, const float *p, const float *alpha, const T *v_cache,
                           const int64_t *slots, int64_t num_keys, int64_t kv_heads,
                           int64_t kv_head, int64_t dim) {
    int64_t d0 = 0;
    for (; d0 + 4 * VEC <= dim; d0 += 4 * VEC)
        NAME(pv_tile_4)(o, p, alpha, v_cache, slots, num_keys, kv_heads, kv_head, dim, d0);
    for (; d0 < dim; d0 += VEC)
        NAME(pv_tile_1)(o, p, alpha, v_cache, slots, num_keys, kv_heads, kv_head, dim, d0);
}


/* Phase 2: one work item, the rows (token, group head) of up to TOKEN_TILE new tokens.
 * `kt`: the sequence's Kt from phase 1, or NULL for a sequence with one item (decode, short
 * extends), whose blocks are transposed here, each into the thread's L1-sized kt_block. */
static void NAME(run_item)(const Item *it, Scratch *w, const T *q, int64_t q_stride,
                     const float *kt, int64_t ld, const T *k_cache, const T *v_cache,
                     const int64_t *slots, const int64_t *seq, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, T *out) {
    const int64_t group = heads / kv_heads, prefix = seq[1], slot0 = seq[3];
    const int64_t rows = it->num_tokens * group;
    const int64_t padded = (rows + MICRO_ROWS - 1) / MICRO_ROWS * MICRO_ROWS;
    for (int64_t r = 0; r < padded; ++r) {
        int64_t t = (r < rows ? r : rows - 1) / group, g = (r < rows ? r : rows - 1) % group;
        int64_t token = it->first_token + t;
        const T *src = q + (seq[0] + token) * q_stride + (it->kv_head * group + g) * dim;
        for (int64_t d = 0; d < dim; d += VEC) _mm512_storeu_ps(w->qs + r * dim + d, LOAD(src + d));
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
            NAME(transpose_block)(w->kt_block, k_cache, v_cache, slots + slot0 + j0, block, next,
                            kv_heads, it->kv_head, dim);
        }
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            qk_tile(w->s + r * KEY_BLOCK, w->qs + r * dim, kb, kb_ld, dim, scale);
        for (int64_t r = 0; r < padded; ++r)
            w->alpha[r] = softmax_step(w->s + r * KEY_BLOCK, w->pos[r] - j0 + 1, &w->m[r],
                                       &w->l[r]);
        for (int64_t r = 0; r < padded; r += MICRO_ROWS)
            NAME(pv_tile)(w->o + r * dim, w->s + r * KEY_BLOCK, w->alpha + r, v_cache,
                    slots + slot0 + j0, block, kv_heads, it->kv_head, dim);
    }
    for (int64_t r = 0; r < rows; ++r) {
        int64_t t = r / group, g = r % group;
        T *dst = out + ((seq[0] + it->first_token + t) * heads + it->kv_head * group + g) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / w->l[r]);
        for (int64_t d = 0; d < dim; d += VEC)
            STORE(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + r * dim + d), inv));
    }
}


/* `workspace` holds hicache_paged_attention_workspace(...) floats (64-byte aligned, any
 * content). Returns 0, -1 for an unsupported shape, -2 when memory ran out. */
int NAME(hicache_paged_attention)(const T *q, int64_t q_stride, const T *k_cache,
                                const T *v_cache, const int64_t *slots, const int64_t *seqs,
                                int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                float scale, T *out, float *workspace, int num_threads) {
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
                NAME(transpose_keys)(kt + kt_off[p], ld, ld, k_cache, slots + sq[3], sq[1] + sq[2],
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
            NAME(run_item)(it, &w, q, q_stride, own, round_up(sq[1] + sq[2], KEY_BLOCK), k_cache,
                     v_cache, slots, sq, heads, kv_heads, dim, scale, out);
        }
    }
    free(kt_off);
    free(items);
    return 0;
}
