/* bf16_peak.c -- register-only throughput of vdpbf16ps (AVX512-BF16) and vfmadd231ps (AVX-512),
 * zmm, and of AMX's tdpbf16ps where the CPU has AMX-BF16 and Linux grants the tiles: the peaks
 * that benchmarks/bf16.py compares the kernels with. Compiled and run by it:
 *
 *     gcc -O2 -fopenmp bf16_peak.c -o bf16_peak && ./bf16_peak THREADS ROUNDS
 *
 * 16 independent accumulator chains (more than latency x throughput of either instruction),
 * operands in registers, nothing else in the loop. FLOPs: vfmadd231ps zmm = 16 lanes x 2;
 * vdpbf16ps zmm = 16 lanes x 2 bf16 products x 2. Each round runs both loops on THREADS
 * threads (interleaved), and prints per instruction the median over rounds of
 *   wall: FLOPs / wall time of the parallel region (all threads);
 *   cpu:  FLOPs / CPU time, summed over the threads' own CPU clocks, x THREADS: the rate the
 *         threads reach while they are on a core (other jobs on a shared machine take cores
 *         away from a parallel region, which the wall rate then counts as lost).
 * Output lines: "<instruction> wall <GF/s> cpu <GF/s>" (tdpbf16ps: 16,384 FLOP, ITERS / 64
 * iterations). Exit code 2: no AVX512-BF16 here.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ITERS 20000000L
#define ROUNDS_MAX 64

#include "../tvmflash/product_loops.h"

static double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, compare);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* one parallel run: (wall GF/s, cpu GF/s) */
static void measure(void (*loop)(long), double flop_per_iter, long iters, int threads, double *wall, double *cpu) {
    double cpu_sum = 0.0;
    double start = seconds(CLOCK_MONOTONIC);
#pragma omp parallel num_threads(threads) reduction(+ : cpu_sum)
    {
        double t0 = seconds(CLOCK_THREAD_CPUTIME_ID);
        loop(iters);
        cpu_sum += seconds(CLOCK_THREAD_CPUTIME_ID) - t0;
    }
    double elapsed = seconds(CLOCK_MONOTONIC) - start;
    double flops = flop_per_iter * 16 * iters * threads;
    *wall = flops / elapsed / 1e9;
    *cpu = flops / (cpu_sum / threads) / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    int rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (rounds < 1 || rounds > ROUNDS_MAX || threads < 1) return 1;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 2;
    int amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
    double dw[ROUNDS_MAX], dc[ROUNDS_MAX], fw[ROUNDS_MAX], fc[ROUNDS_MAX], tw[ROUNDS_MAX], tc[ROUNDS_MAX];
    loop_dpbf16(ITERS / 10); /* warm up (clocks) */
    for (int r = 0; r < rounds; r++) {
        measure(loop_dpbf16, 64.0, ITERS, threads, &dw[r], &dc[r]);
        measure(loop_fma, 32.0, ITERS, threads, &fw[r], &fc[r]);
        if (amx) measure(loop_tdpbf16, 16384.0, ITERS / 64, threads, &tw[r], &tc[r]);
    }
    printf("vdpbf16ps wall %.1f cpu %.1f\n", median(dw, rounds), median(dc, rounds));
    printf("vfmadd231ps wall %.1f cpu %.1f\n", median(fw, rounds), median(fc, rounds));
    if (amx) printf("tdpbf16ps wall %.1f cpu %.1f\n", median(tw, rounds), median(tc, rounds));
    return 0;
}
