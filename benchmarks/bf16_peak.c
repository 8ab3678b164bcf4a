/* bf16_peak.c -- register-only throughput of vdpbf16ps (AVX512-BF16) and vfmadd231ps (AVX-512),
 * zmm, the peaks that benchmarks/bf16.py compares the kernels with. Compiled and run by it:
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
 * Output lines: "<instruction> wall <GF/s> cpu <GF/s>". Exit code 2: no AVX512-BF16 here.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ITERS 20000000L
#define ROUNDS_MAX 64

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
static void measure(void (*loop)(long), double flop_per_iter, int threads, double *wall, double *cpu) {
    double cpu_sum = 0.0;
    double start = seconds(CLOCK_MONOTONIC);
#pragma omp parallel num_threads(threads) reduction(+ : cpu_sum)
    {
        double t0 = seconds(CLOCK_THREAD_CPUTIME_ID);
        loop(ITERS);
        cpu_sum += seconds(CLOCK_THREAD_CPUTIME_ID) - t0;
    }
    double elapsed = seconds(CLOCK_MONOTONIC) - start;
    double flops = flop_per_iter * 16 * ITERS * threads;
    *wall = flops / elapsed / 1e9;
    *cpu = flops / (cpu_sum / threads) / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    int rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (rounds < 1 || rounds > ROUNDS_MAX || threads < 1) return 1;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 2;
    double dw[ROUNDS_MAX], dc[ROUNDS_MAX], fw[ROUNDS_MAX], fc[ROUNDS_MAX];
    loop_dpbf16(ITERS / 10); /* warm up (clocks) */
    for (int r = 0; r < rounds; r++) {
        measure(loop_dpbf16, 64.0, threads, &dw[r], &dc[r]);
        measure(loop_fma, 32.0, threads, &fw[r], &fc[r]);
    }
    printf("vdpbf16ps wall %.1f cpu %.1f\n", median(dw, rounds), median(dc, rounds));
    printf("vfmadd231ps wall %.1f cpu %.1f\n", median(fw, rounds), median(fc, rounds));
    return 0;
}
