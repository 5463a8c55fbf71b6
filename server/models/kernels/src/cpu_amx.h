/* AMX's tiles for the bfloat16 kernels (cpu_linear.c, cpu_attention.c): whether the CPU
 * has them and Linux lets this process use them, and one tile configuration. The callers
 * compile their tile code per function (`target("amx-tile,amx-bf16")`), so the rest of
 * each .so runs on any AVX-512 CPU (kernels/cpu_build.py puts this header in their keys).
 *
 * The configuration is per thread: each OpenMP thread loads it before its first tile
 * instruction of a call (configure_tiles) and releases the tiles at the end. */
#ifndef HICACHE_CPU_AMX_H
#define HICACHE_CPU_AMX_H
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

long syscall(long number, ...);  /* unistd.h declares it only under _GNU_SOURCE */

#define AMX_XFEATURE_XTILEDATA 18
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tmm0-7: rows[t] rows of 64 bytes each (0: tmm t unused). */
static inline void configure_tile_rows(const int rows[8]) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    /* ldtilecfg through asm with the config as a memory input: GCC 12's _tile_loadconfig
     * does not tell the optimiser it reads the struct, which then drops the stores */
    __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
}

/* tmm0-4: `rows` rows of 64 bytes; tmm5, tmm6: 16 rows of 64 bytes (B tiles: 16 pairs). */
static inline void configure_tiles(int rows) {
    const int all[8] = {rows, rows, rows, rows, rows, 16, 16, 0};
    configure_tile_rows(all);
}

/* The four C tiles (tmm0-3) set to zero; and stored, row-major, C_j at c + 16 j, rows
 * `ldc` bytes apart. */
#define AMX_ZERO_C()                                                                  \
    do {                                                                              \
        _tile_zero(0);                                                                \
        _tile_zero(1);                                                                \
        _tile_zero(2);                                                                \
        _tile_zero(3);                                                                \
    } while (0)
#define AMX_STORE_C(c, ldc)                                                           \
    do {                                                                              \
        _tile_stored(0, (c), (ldc));                                                  \
        _tile_stored(1, (c) + 16, (ldc));                                             \
        _tile_stored(2, (c) + 32, (ldc));                                             \
        _tile_stored(3, (c) + 48, (ldc));                                             \
    } while (0)

/* C_j += A B_j for j = 0, 1: A (tmm4) from `a`, rows `lda` bytes apart; B_j (tmm5, tmm6)
 * from b + j * `step` elements, rows `ldb` bytes apart. */
#define AMX_DOT2(a, lda, b, step, ldb)                                                \
    do {                                                                              \
        _tile_loadd(4, (a), (lda));                                                   \
        _tile_loadd(5, (b), (ldb));                                                   \
        _tile_dpbf16ps(0, 4, 5);                                                      \
        _tile_loadd(6, (b) + (step), (ldb));                                          \
        _tile_dpbf16ps(1, 4, 6);                                                      \
    } while (0)

/* The same for j = 0..3 (tmm5 and tmm6 loaded in turn). */
#define AMX_DOT4(a, lda, b, step, ldb)                                                \
    do {                                                                              \
        AMX_DOT2(a, lda, b, step, ldb);                                               \
        _tile_loadd(5, (b) + 2 * (step), (ldb));                                      \
        _tile_dpbf16ps(2, 4, 5);                                                      \
        _tile_loadd(6, (b) + 3 * (step), (ldb));                                      \
        _tile_dpbf16ps(3, 4, 6);                                                      \
    } while (0)

static inline void release_tiles(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* AMX-TILE and AMX-BF16 in CPUID (and AVX512-BF16, which every AMX CPU has and the
 * kernels' tile code uses beside the tiles), and Linux's permission for the tile state
 * (asked once per process, as torch does; a process-wide grant). */
static inline int amx_available(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5)))
        return 0;
    return syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
}

#endif
