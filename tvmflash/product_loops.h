/* product_loops.h -- the register-only loops of vfmadd231ps zmm (fp32 FMAs, 32 FLOP),
 * vdpbf16ps zmm (AVX512-BF16 dot products, 64 FLOP) and AMX's tdpbf16ps (16 x 16 fp32 +=
 * 16 x 32 times 32 x 16 bf16: 16,384 FLOP): 16 instructions per iteration, independent
 * accumulators (16 zmm chains; 4 tiles, as a 2 x 2 AMX micro-kernel holds), operands in
 * registers, nothing else in the loop. Shared by tvmflash/product_probe.c (which bf16 product
 * path the kernels take) and benchmarks/bf16_peak.c (the peaks beside the figures).
 */
#ifndef TVMFLASH_PRODUCT_LOOPS_H
#define TVMFLASH_PRODUCT_LOOPS_H

#define ZERO(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define OP(op, r) op " %%zmm1, %%zmm0, %%zmm" #r "\n\t"
#define SIXTEEN(M, x) M(x, 16) M(x, 17) M(x, 18) M(x, 19) M(x, 20) M(x, 21) M(x, 22) M(x, 23) \
                      M(x, 24) M(x, 25) M(x, 26) M(x, 27) M(x, 28) M(x, 29) M(x, 30) M(x, 31)
#define ZERO_(x, r) ZERO(r)
#define CLOBBERS "zmm0", "zmm1", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20", "zmm21", "zmm22", "zmm23", \
                 "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31", "cc"

/* operands: bf16 pairs (1, 1) and tiny values / fp32 1 and 1e-30: nothing overflows */
#define LOOP(op)                                                              \
    __asm__ volatile("vpbroadcastd %[a], %%zmm0\n\t"                          \
                     "vpbroadcastd %[b], %%zmm1\n\t" SIXTEEN(ZERO_, 0)        \
                     "1:\n\t" SIXTEEN(OP, op) "dec %[n]\n\t"                  \
                     "jnz 1b\n\t"                                             \
                     : [n] "+r"(iters)                                        \
                     : [a] "r"(0x3f803f80), [b] "r"(0x0d800d80)               \
                     : CLOBBERS)

__attribute__((target("avx512f,avx512bf16"), noinline)) static void loop_dpbf16(long iters) { LOOP("vdpbf16ps"); }
__attribute__((target("avx512f"), noinline)) static void loop_fma(long iters) { LOOP("vfmadd231ps"); }

/* AMX: Linux grants the tile registers per process on request; 0 where it did (or had). */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

static int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0; }

struct amx_config {
    unsigned char palette, start_row, reserved[14];
    unsigned short bytes_per_row[16];
    unsigned char rows[16];
} __attribute__((packed));

/* tiles 0-3: accumulators, 4-7: A and B operands (bf16 1.0 and tiny values: nothing overflows) */
__attribute__((target("amx-tile,amx-bf16"), noinline)) static void loop_tdpbf16(long iters) {
    static unsigned short a[16 * 32] __attribute__((aligned(64))), b[16 * 32] __attribute__((aligned(64)));
    struct amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    for (int i = 0; i < 16 * 32; i++) {
        a[i] = 0x3f80;
        b[i] = 0x0d80;
    }
    /* gcc 12 does not see that ldtilecfg reads the struct, and at -O2 drops the stores to it */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, 64); _tile_loadd(5, b, 64); _tile_loadd(6, a, 64); _tile_loadd(7, b, 64);
    for (long i = 0; i < iters; i++) {
        for (int r = 0; r < 4; r++) {
            _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 6, 5); _tile_dpbf16ps(3, 6, 7);
        }
    }
    _tile_release();
}

#endif
