// A core's f32 FMA peak on AVX2: twelve independent chains of 8-lane FMAs (enough to cover the
// FMA latency on two pipes), so the loop runs at the issue rate. The ceiling a GEMM kernel on
// this CPU is measured against (docs/PERF.md).
//
//   gcc -O2 -mavx2 -mfma scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
//   (/tmp/fma_peak & /tmp/fma_peak & wait)    # both cores at once
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    __m256 acc[12];
    const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
    const long n = 400000000 / 12;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    float sum = 0;  // kept, so the chains are not optimised away
    for (int i = 0; i < 12; i++) sum += acc[i][0];
    printf("%.1f GFLOP/s on one core (checksum %g)\n", n * 12.0 * 16 / s / 1e9, sum);
    return 0;
}
