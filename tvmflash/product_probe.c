/* product_probe.c -- register-only throughput of the bf16 product paths on one core:
 * vfmadd231ps zmm (fp32 FMAs, 32 FLOP), vdpbf16ps zmm (AVX512-BF16 dot products, 64 FLOP) and,
 * where the CPU has AMX-BF16 and Linux grants this process its tiles, tdpbf16ps (16,384 FLOP).
 * product_rates.py compiles it once per machine into the cache directory, runs it and keeps
 * the result: which path the bf16 kernels take follows it (a Zen 4 runs vdpbf16ps at the FMA's
 * instruction rate, 2x the FLOPs; some Xeons at half of it, no gain at all).
 *
 * 16 independent accumulator chains (more than latency x throughput of either instruction on
 * the CPUs seen), operands in registers, nothing else in the loop; ROUNDS interleaved runs of
 * each, and the best rate of each (the one least disturbed by other jobs on a shared core).
 * Output: "vfmadd231ps <GFLOP/s>\nvdpbf16ps <GFLOP/s>\n", then "tdpbf16ps <GFLOP/s>\n" where AMX
 * ran (AMX's loop runs ITERS / 64 iterations: each instruction is 256x vdpbf16ps's work).
 * Exit 2: the CPU lacks AVX512-BF16
 * (never run then: the caller checks the CPU's flags first; this is a second guard).
 */
#include <stdio.h>
#include <time.h>

#define ITERS 1000000L
#define ROUNDS 9

#include "product_loops.h"

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* GFLOP/s of one run of iters iterations */
static double rate(void (*loop)(long), double flop_per_instruction, long iters) {
    double start = seconds();
    loop(iters);
    return flop_per_instruction * 16 * iters / (seconds() - start) / 1e9;
}

int main(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 2;
    int amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
    double fma = 0.0, dot = 0.0, tile = 0.0;
    loop_fma(ITERS / 4); /* warm up (clocks) */
    for (int r = 0; r < ROUNDS; r++) {
        double f = rate(loop_fma, 32.0, ITERS), d = rate(loop_dpbf16, 64.0, ITERS);
        double t = amx ? rate(loop_tdpbf16, 16384.0, ITERS / 64) : 0.0;
        fma = f > fma ? f : fma;
        dot = d > dot ? d : dot;
        tile = t > tile ? t : tile;
    }
    printf("vfmadd231ps %.3f\nvdpbf16ps %.3f\n", fma, dot);
    if (amx) printf("tdpbf16ps %.3f\n", tile);
    return 0;
}
