/* peak.c — register-only loops of independent FMA / vdpbf16ps chains, long
 * enough to hide latency, timed on every thread at once. */
#include "peak.h"
#include "fmha.h"

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

enum { CHAINS = 12, ITERS = 10000000 };

/* The chains are spelled out so that they stay in registers at any -O level. */
#define UNROLL12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx512f"))) static double run_avx512_f32(void)
{
#define DECL(c) __m512 a##c = _mm512_set1_ps((float)c);
#define STEP(c) a##c = _mm512_fmadd_ps(a##c, a, b);
#define SUM(c)  sum += _mm512_reduce_add_ps(a##c);
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    UNROLL12(DECL)
    for (long i = 0; i < ITERS; i++) {
        UNROLL12(STEP)
    }
    float sum = 0;
    UNROLL12(SUM)
    return sum; /* keeps the loop alive */
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx2,fma"))) static double run_avx2_f32(void)
{
#define DECL(c) __m256 a##c = _mm256_set1_ps((float)c);
#define STEP(c) a##c = _mm256_fmadd_ps(a##c, a, b);
#define SUM(c)  sum += _mm256_cvtss_f32(a##c);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    UNROLL12(DECL)
    for (long i = 0; i < ITERS; i++) {
        UNROLL12(STEP)
    }
    float sum = 0;
    UNROLL12(SUM)
    return sum;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx512f,avx512bf16"))) static double run_avx512_bf16(void)
{
#define DECL(c) __m512 a##c = _mm512_set1_ps((float)c);
#define STEP(c) a##c = _mm512_dpbf16_ps(a##c, a, b);
#define SUM(c)  sum += _mm512_reduce_add_ps(a##c);
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
    UNROLL12(DECL)
    for (long i = 0; i < ITERS; i++) {
        UNROLL12(STEP)
    }
    float sum = 0;
    UNROLL12(SUM)
    return sum;
#undef DECL
#undef STEP
#undef SUM
}

static double timed(double (*fn)(void), double flops_per_iter_chain, int threads)
{
    volatile double sink = 0;
    double best = 0;
    for (int rep = 0; rep < 9; rep++) { /* the best of nine: a busy neighbour only slows */
        double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += fn();
        double t = omp_get_wtime() - t0;
        double g = flops_per_iter_chain * CHAINS * (double)ITERS * threads / t * 1e-9;
        if (g > best)
            best = g;
    }
    (void)sink;
    return best;
}

double fmha_peak_f32_gflops(int threads)
{
    fmha_cpu_isa isa = fmha_cpu_isa_detect();
    if (isa >= FMHA_CPU_ISA_AVX512)
        return timed(run_avx512_f32, 32.0, threads);
    if (isa == FMHA_CPU_ISA_AVX2)
        return timed(run_avx2_f32, 16.0, threads);
    return 0.0;
}

double fmha_peak_bf16_gflops(int threads)
{
    /* The machine's ceiling, whatever ISA a run is forced to. */
    if (fmha_cpu_isa_detect() != FMHA_CPU_ISA_AVX512_BF16)
        return 0.0;
    return timed(run_avx512_bf16, 64.0, threads);
}
