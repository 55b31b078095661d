/* cpuid.c — which SIMD instruction sets this CPU has and the OS saves. An ISA
 * counts only when CPUID reports it and XGETBV shows the OS enabled its
 * register state. */
#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

typedef struct cpu_features {
    int avx2_fma, avx512, avx512_bf16, amd;
} cpu_features;

static cpu_features detect(void)
{
    cpu_features f = {0, 0, 0, 0};
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) /* vendor "AuthenticAMD": b, d, c */
        f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return f;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave)
        return f;
    uint64_t xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 0x6) == 0x6;   /* SSE and AVX state */
    int zmm_ok = (xcr0 & 0xe6) == 0xe6; /* plus opmask and both ZMM halves */
    if (__get_cpuid_max(0, NULL) < 7)
        return f;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    int avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    int avx512dq = (b >> 17) & 1;
    f.avx2_fma = ymm_ok && avx2 && fma && f16c;
    f.avx512 = f.avx2_fma && zmm_ok && avx512f && avx512bw && avx512vl && avx512dq;
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = f.avx512 && ((a >> 5) & 1);
    return f;
}

static fmha_cpu_isa best_of(const cpu_features *f)
{
    return f->avx512_bf16 ? FMHA_CPU_ISA_AVX512_BF16
           : f->avx512    ? FMHA_CPU_ISA_AVX512
           : f->avx2_fma  ? FMHA_CPU_ISA_AVX2
                          : FMHA_CPU_ISA_SCALAR;
}

fmha_cpu_isa fmha_cpu_isa_detect(void)
{
    const cpu_features f = detect();
    return best_of(&f);
}

fmha_cpu_isa fmha_cpu_isa_auto(void)
{
    const cpu_features f = detect();
    const fmha_cpu_isa best = best_of(&f);
    return best == FMHA_CPU_ISA_AVX512_BF16 && !f.amd ? FMHA_CPU_ISA_AVX512 : best;
}
#else
fmha_cpu_isa fmha_cpu_isa_detect(void)
{
    return FMHA_CPU_ISA_SCALAR;
}

fmha_cpu_isa fmha_cpu_isa_auto(void)
{
    return FMHA_CPU_ISA_SCALAR;
}
#endif

const char *fmha_cpu_isa_name(fmha_cpu_isa isa)
{
    switch (isa) {
    case FMHA_CPU_ISA_AUTO: return "auto";
    case FMHA_CPU_ISA_SCALAR: return "scalar";
    case FMHA_CPU_ISA_AVX2: return "avx2";
    case FMHA_CPU_ISA_AVX512: return "avx512";
    case FMHA_CPU_ISA_AVX512_BF16: return "avx512-bf16";
    }
    return "unknown";
}
