// A core's peak for the instruction a GEMM kernel on this CPU is built on: twelve independent
// chains (enough to cover the latency on two pipes), so the loop runs at the issue rate. The
// ceiling a kernel is measured against (docs/PERF.md). One mode per argument:
//
//   avx2    (default) 8-lane f32 FMAs, 16 FLOP each: the f32 GEMM on AVX2-only CPUs;
//   avx512  16-lane f32 FMAs, 32 FLOP each: the f32 GEMM (the `gemm` crate) on AVX-512 CPUs;
//   bf16    `vdpbf16ps` on 512 bits, 16 lanes of two bf16 products each, 64 FLOP: the bf16
//           products without AMX (`ops::gemm_bf16`'s avx512 path).
//
//   gcc -O2 -mavx2 -mfma -mavx512f -mavx512bf16 scripts/fma_peak.c -o /tmp/fma_peak
//   /tmp/fma_peak bf16; (/tmp/fma_peak bf16 & /tmp/fma_peak bf16 & wait)    # both cores at once
//
// A mode the CPU lacks dies of an illegal instruction, so check /proc/cpuinfo first.
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define CHAINS 12
static const long ITERS = 400000000 / CHAINS;

static double seconds(struct timespec t0, struct timespec t1) {
    return (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

// One timed loop per mode: CHAINS accumulators, each `acc = STEP(acc)`, FLOP_EACH per step.
// Each returns GFLOP/s and prints a checksum, so the chains are not optimised away.
#define PEAK_LOOP(VEC, INIT, STEP, FLOP_EACH)                                   \
    VEC acc[CHAINS];                                                            \
    for (int i = 0; i < CHAINS; i++) acc[i] = INIT((float)i);                   \
    struct timespec t0, t1;                                                     \
    clock_gettime(CLOCK_MONOTONIC, &t0);                                        \
    for (long k = 0; k < ITERS; k++) {                                          \
        _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++) acc[i] = STEP; \
    }                                                                           \
    clock_gettime(CLOCK_MONOTONIC, &t1);                                        \
    float sum = 0;                                                              \
    for (int i = 0; i < CHAINS; i++) sum += acc[i][0];                          \
    printf("(checksum %g) ", sum);                                              \
    return ITERS * CHAINS * (double)(FLOP_EACH) / seconds(t0, t1) / 1e9;

static double avx2(void) {
    const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    PEAK_LOOP(__m256, _mm256_set1_ps, _mm256_fmadd_ps(acc[i], b, c), 16)
}

__attribute__((target("avx512f"))) static double avx512(void) {
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    PEAK_LOOP(__m512, _mm512_set1_ps, _mm512_fmadd_ps(acc[i], b, c), 32)
}

__attribute__((target("avx512f,avx512bf16"))) static double bf16(void) {
    // Small operands, so the sums stay finite over the 400 M products a chain sees.
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-6f), _mm512_set1_ps(1e-6f));
    PEAK_LOOP(__m512, _mm512_set1_ps, _mm512_dpbf16_ps(acc[i], a, a), 64)
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "avx2";
    double rate;
    if (!strcmp(mode, "avx2")) {
        rate = avx2();
    } else if (!strcmp(mode, "avx512")) {
        rate = avx512();
    } else if (!strcmp(mode, "bf16")) {
        rate = bf16();
    } else {
        fprintf(stderr, "unknown mode '%s'; expected avx2, avx512 or bf16\n", mode);
        return 2;
    }
    printf("%s: %.1f GFLOP/s on one core\n", mode, rate);
    return 0;
}
