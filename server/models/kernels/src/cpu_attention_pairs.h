/* The bfloat16 pair paths' parts (AMX's tdpbf16ps, AVX512-BF16's vdpbf16ps): K and V packed in
 * pairs per block of 64 keys, S = Q K^T and O += P V with vdpbf16ps, the online-softmax step
 * that writes P in bfloat16, a work item's rows. Included once by cpu_attention.c, after the
 * Item and Scratch types and the float32 helpers it uses (no include guard). */

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
            v16_transpose(r);
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
 * stored it): scaled, soft-capped (`softcap`, 0: not), m and l updated, P written as
 * bfloat16 for PV (vcvtneps2bf16: every AMX CPU has AVX512-BF16); returns alpha. */
static inline __attribute__((target("avx512bf16"))) float softmax_step_p16(
        const float *s, __m512 scale, float softcap, int64_t lo, int64_t hi, float *m,
        float *l, uint16_t *p16) {
    if (hi <= 0 || lo >= KEY_BLOCK) {  /* none of this row's keys: P = 0, nothing moves */
        memset(p16, 0, sizeof(uint16_t) * KEY_BLOCK);
        return 1.0f;
    }
    __mmask16 mask[4];
    __m512 v[4], mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        mask[c] = key_lanes(lo, hi, c);
        v[c] = softcap_ps(_mm512_mul_ps(_mm512_loadu_ps(s + c * VEC), scale), softcap);
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

/* O[r][d0 .. d0 + 16 * CHUNK) = alpha_r * O[r] + sum over the block's key pairs of
 * (P[r][2j], P[r][2j+1]) . (v_2j, v_2j+1)[...] for 4 rows, one vdpbf16ps per pair of keys:
 * V as pack_v_pairs lays it out, P's pair (bfloat16) broadcast. */
#define DP_PV_TILE(CHUNK)                                                                   \
    static inline __attribute__((always_inline, target("avx512bf16"))) void                 \
    dp_pv_tile_##CHUNK(float *o, const uint16_t *p16, const float *alpha,                   \
                       const uint32_t *v_tiles, int64_t key_pairs, int64_t dim, int64_t d0) { \
        const int64_t groups = dim / VEC;                                                   \
        __m512 acc[MICRO_ROWS][CHUNK];                                                      \
        for (int i = 0; i < MICRO_ROWS; ++i) {                                              \
            const __m512 a = _mm512_set1_ps(alpha[i]);                                      \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * dim + d0 + c * VEC), a);  \
        }                                                                                   \
        for (int64_t j = 0; j < key_pairs; ++j) {                                           \
            const uint32_t *row = v_tiles + ((j >> 4) * groups + d0 / VEC) * 256            \
                                  + (j & 15) * 16;                                          \
            __m512i vv[CHUNK];                                                              \
            for (int c = 0; c < CHUNK; ++c) vv[c] = _mm512_loadu_si512(row + c * 256);      \
            for (int i = 0; i < MICRO_ROWS; ++i) {                                          \
                uint32_t pp;                                                                \
                memcpy(&pp, p16 + i * KEY_BLOCK + 2 * j, sizeof pp);                        \
                const __m512i pv = _mm512_set1_epi32((int)pp);                              \
                for (int c = 0; c < CHUNK; ++c)                                             \
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)vv[c], (__m512bh)pv); \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MICRO_ROWS; ++i)                                                \
            for (int c = 0; c < CHUNK; ++c)                                                 \
                _mm512_storeu_ps(o + i * dim + d0 + c * VEC, acc[i][c]);                    \
    }
DP_PV_TILE(4)
DP_PV_TILE(1)
