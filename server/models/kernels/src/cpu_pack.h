/* Packing a row-major [N, K] weight into panels for a kernel: panel p holds outputs W p ..
 * W p + W - 1, as T tuples of E consecutive inputs each (tuple t: inputs E t .. E t + E - 1),
 * output by output within a tuple: dst[((p T + t) W + j) E + e] = src[(W p + j) K + E t + e],
 * zeros past N outputs or K inputs. The linear kernel's bfloat16 pairs (W 64, E 2) and the
 * head screen's int8 quads (W 16, E 4) are laid out so. */
#ifndef HICACHE_CPU_PACK_H
#define HICACHE_CPU_PACK_H

#define PACK_TUPLES(dst, src, N, K, W, T, E)                                                  \
    do {                                                                                      \
        const int64_t panels_ = ((N) + (W) - 1) / (W);                                        \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t p_ = 0; p_ < panels_; p_++)                                              \
            for (int64_t t_ = 0; t_ < (T); t_++)                                              \
                for (int64_t j_ = 0; j_ < (W); j_++)                                          \
                    for (int64_t e_ = 0; e_ < (E); e_++) {                                    \
                        const int64_t n_ = p_ * (W) + j_, k_ = (E) * t_ + e_;                 \
                        (dst)[((p_ * (T) + t_) * (W) + j_) * (E) + e_] =                      \
                            n_ < (N) && k_ < (K) ? (src)[n_ * (K) + k_] : 0;                  \
                    }                                                                         \
    } while (0)

#endif
