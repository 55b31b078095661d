/* select.c — the kernel chooser: the one function that decides which kernel
 * runs a configuration, and so whether it is supported at all. */
#include "internal.h"
#include "cpu/cpu.h"
#ifdef FMHA_HAVE_CUDA
#include "cuda/cuda.h"
#endif

#include <stdlib.h>
#include <strings.h>

static const fmha_kernel_info kernel_table[FMHA_KERNEL_COUNT] = {
#define FMHA_CPU_KERNEL(name, isa, compute) {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CPU, isa, #name},
#define FMHA_CUDA_KERNEL(name, min_sm) {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CUDA, FMHA_CPU_ISA_AUTO, #name},
#include "kernels.def"
#undef FMHA_CPU_KERNEL
#undef FMHA_CUDA_KERNEL
};

/* The ISA asked for: the config's, else FMHA_CPU_ISA, else the best there is. */
static fmha_status requested_isa(const fmha_config *cfg, fmha_cpu_isa *isa)
{
    fmha_cpu_isa best = fmha_cpu_isa_detect();
    fmha_cpu_isa want = cfg->cpu_isa;
    const char *env = getenv("FMHA_CPU_ISA");
    if (want == FMHA_CPU_ISA_AUTO && env && *env) {
        if (!strcasecmp(env, "scalar"))
            want = FMHA_CPU_ISA_SCALAR;
        else if (!strcasecmp(env, "avx2"))
            want = FMHA_CPU_ISA_AVX2;
        else if (!strcasecmp(env, "avx512"))
            want = FMHA_CPU_ISA_AVX512;
        else if (strcasecmp(env, "auto"))
            return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                                  "FMHA_CPU_ISA=%s is not one of scalar, avx2, avx512, auto", env);
    }
    if (want == FMHA_CPU_ISA_AUTO)
        want = best;
    if (want > best)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CPU ISA %s was requested but this CPU/OS supports at most %s",
                              fmha_cpu_isa_name(want), fmha_cpu_isa_name(best));
    *isa = want;
    return FMHA_STATUS_OK;
}

fmha_status fmha_kernel_select(const fmha_config *cfg, fmha_kernel_info *info)
{
    fmha_clear_error();
    fmha_status st = fmha_validate_config(cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    if (!info)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "kernel info out-pointer is NULL");
    if (cfg->dtype == FMHA_DTYPE_F8_E4M3)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "f8_e4m3 attention is not available yet: use f32, f16 or bf16");
    if (cfg->device == FMHA_DEVICE_CUDA) {
#ifdef FMHA_HAVE_CUDA
        if (cfg->dtype != FMHA_DTYPE_BF16 && cfg->dtype != FMHA_DTYPE_F16)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "CUDA kernels take f16 or bf16 q, k, v (got %s): convert the "
                                  "inputs, or use device cpu",
                                  fmha_dtype_name(cfg->dtype));
        if (cfg->head_dim > 256 || cfg->head_dim_v > 256)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "CUDA kernels take head dims up to 256 (got %lld, %lld): use "
                                  "device cpu",
                                  (long long)cfg->head_dim, (long long)cfg->head_dim_v);
        if ((st = fmha_cuda_check_device()) != FMHA_STATUS_OK)
            return st;
        *info = kernel_table[FMHA_KERNEL_ID_cuda_flash_sm80];
        return FMHA_STATUS_OK;
#else
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "this fmha was built without a CUDA backend (no nvcc at build "
                              "time): use device cpu");
#endif
    }

    fmha_cpu_isa isa = FMHA_CPU_ISA_SCALAR;
    if ((st = requested_isa(cfg, &isa)) != FMHA_STATUS_OK)
        return st;
    int id;
    switch (isa) {
    case FMHA_CPU_ISA_AVX512:
        id = cfg->dtype == FMHA_DTYPE_BF16 && fmha_cpu_has_avx512_bf16()
                 ? FMHA_KERNEL_ID_cpu_avx512_bf16dp
                 : FMHA_KERNEL_ID_cpu_avx512_f32;
        break;
    case FMHA_CPU_ISA_AVX2: id = FMHA_KERNEL_ID_cpu_avx2_f32; break;
    default: id = FMHA_KERNEL_ID_cpu_scalar_f32; break;
    }
    *info = kernel_table[id];
    return FMHA_STATUS_OK;
}
