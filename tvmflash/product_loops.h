/* product_loops.h -- the register-only loops of vfmadd231ps zmm (fp32 FMAs, 32 FLOP) and
 * vdpbf16ps zmm (AVX512-BF16 dot products, 64 FLOP): 16 independent accumulator chains,
 * operands in registers, nothing else in the loop. Shared by tvmflash/product_probe.c (which
 * bf16 product path the kernels take) and benchmarks/bf16_peak.c (the peaks beside the figures).
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

#endif
