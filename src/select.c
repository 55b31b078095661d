/* select.c — the kernel chooser: the one function that decides which kernel
 * runs a configuration, and so whether it is supported at all. */
#include "internal.h"
#include "cpu/cpu.h"
#ifdef FMHA_HAVE_CUDA
#include "cuda/cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const fmha_kernel_info kernel_table[FMHA_KERNEL_COUNT] = {
#define FMHA_CPU_KERNEL(name, isa, compute) {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CPU, isa, #name},
#define FMHA_CUDA_KERNEL(name, min_sm) {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CUDA, FMHA_CPU_ISA_AUTO, #name},
#include "kernels.def"
#undef FMHA_CPU_KERNEL
#undef FMHA_CUDA_KERNEL
};

/* The ISA asked for: the config's, else FMHA_CPU_ISA (any fmha_cpu_isa_name),
 * else AUTO's pick. */
static fmha_status requested_isa(const fmha_config *cfg, fmha_cpu_isa *isa)
{
    fmha_cpu_isa best = fmha_cpu_isa_detect();
    fmha_cpu_isa want = cfg->cpu_isa;
    const char *env = getenv("FMHA_CPU_ISA");
    if (want == FMHA_CPU_ISA_AUTO && env && *env) {
        int i = FMHA_CPU_ISA_AUTO;
        while (i <= FMHA_CPU_ISA_LAST && strcasecmp(env, fmha_cpu_isa_name((fmha_cpu_isa)i)))
            i++;
        if (i > FMHA_CPU_ISA_LAST) {
            char names[128] = "";
            for (int j = FMHA_CPU_ISA_SCALAR; j <= FMHA_CPU_ISA_LAST; j++)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s, ",
                         fmha_cpu_isa_name((fmha_cpu_isa)j));
            return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "FMHA_CPU_ISA=%s is not one of %sauto",
                                  env, names);
        }
        want = (fmha_cpu_isa)i;
    }
    if (want == FMHA_CPU_ISA_AUTO)
        want = fmha_cpu_isa_auto();
    if (want > best)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CPU ISA %s was requested but this CPU/OS supports at most %s",
                              fmha_cpu_isa_name(want), fmha_cpu_isa_name(best));
    *isa = want;
    return FMHA_STATUS_OK;
}

#ifdef FMHA_HAVE_CUDA
/* The Hopper kernel on a compute capability 9.0 device, else the portable
 * one; FMHA_CUDA_KERNEL=portable|hopper|auto overrides (benchmarks, tests). */
static fmha_status requested_cuda_kernel(int *id)
{
    const char *env = getenv("FMHA_CUDA_KERNEL");
    int hopper = fmha_cuda_hopper_usable();
    if (env && *env && !strcasecmp(env, "portable"))
        hopper = 0;
    else if (env && *env && !strcasecmp(env, "hopper")) {
        if (!hopper)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "FMHA_CUDA_KERNEL=hopper, but the sm_90a kernel needs a compute "
                                  "capability 9.0 GPU and a build with it: unset FMHA_CUDA_KERNEL");
    } else if (env && *env && strcasecmp(env, "auto"))
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "FMHA_CUDA_KERNEL=%s is not one of portable, hopper, auto", env);
    *id = hopper ? FMHA_KERNEL_ID_cuda_hopper_sm90 : FMHA_KERNEL_ID_cuda_flash_sm80;
    return FMHA_STATUS_OK;
}

/* TMA addresses 16-byte aligned rows with strides below 2^40 bytes; the
 * stride of an axis of extent 1 is never followed (the kernel's tensor map
 * replaces it), so it may be anything. */
static int tma_stride_ok(int64_t extent, int64_t stride, int64_t eb)
{
    return extent == 1 || (stride * eb % 16 == 0 && stride < ((int64_t)1 << 39) / eb);
}

static int tma_addressable(const fmha_tensor *t)
{
    const int64_t eb = (int64_t)fmha_dtype_size(t->dtype);
    return (uintptr_t)t->data % 16 == 0 && tma_stride_ok(t->seqlen, t->stride_seq, eb) &&
           tma_stride_ok(t->heads, t->stride_head, eb) && tma_stride_ok(t->batch, t->stride_batch, eb);
}

fmha_status fmha_kernel_for_call(const fmha_kernel_info *kernel, const fmha_problem *pb,
                                 const fmha_kernel_info **out)
{
    const fmha_forward_args *a = pb->args;
    *out = kernel;
    if (kernel->id == FMHA_KERNEL_ID_cuda_hopper_sm90 &&
        !(tma_addressable(&a->q) && tma_addressable(&a->k) && tma_addressable(&a->v)))
        *out = &kernel_table[FMHA_KERNEL_ID_cuda_flash_sm80];
    if (kernel->id != FMHA_KERNEL_ID_cuda_hopper_fp8_sm90)
        return FMHA_STATUS_OK;
    /* The FP8 kernel has no portable twin: what it cannot take is an error. */
    if (a->descale_layout == FMHA_DESCALE_PER_BLOCK)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "per-block descales (FMHA_DESCALE_PER_BLOCK) run on the CPU only: on "
                              "CUDA use FMHA_DESCALE_PER_TENSOR or FMHA_DESCALE_PER_KV_HEAD");
    const fmha_tensor *ts[2] = {&a->q, &a->k};
    const char *names[2] = {"q", "k"};
    for (int i = 0; i < 2; i++)
        if (!tma_addressable(ts[i]))
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "f8_e4m3 %s on CUDA needs 16-byte aligned rows (data %% 16 == 0, "
                                  "strides multiples of 16 elements; got strides %lld, %lld, %lld): "
                                  "pad head_dim to a multiple of 16 or copy %s to a contiguous "
                                  "tensor",
                                  names[i], (long long)ts[i]->stride_seq,
                                  (long long)ts[i]->stride_head, (long long)ts[i]->stride_batch,
                                  names[i]);
    return FMHA_STATUS_OK;
}

/* FMHA_FP8_ACCUM: unset or auto (two-level past FMHA_FP8_TWO_LEVEL_KEYS keys),
 * two_level, or single. */
fmha_status fmha_fp8_two_level(int64_t max_sk, int *two_level)
{
    const char *env = getenv("FMHA_FP8_ACCUM");
    if (!env || !*env || !strcasecmp(env, "auto"))
        *two_level = max_sk > FMHA_FP8_TWO_LEVEL_KEYS;
    else if (!strcasecmp(env, "two_level") || !strcasecmp(env, "single"))
        *two_level = !strcasecmp(env, "two_level");
    else
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "FMHA_FP8_ACCUM=%s is not one of auto, two_level, single", env);
    return FMHA_STATUS_OK;
}

fmha_status fmha_cuda_schedule(fmha_schedule *schedule)
{
    static const char *names[] = {"tiles", "persistent", "split"};
    const char *env = getenv("FMHA_CUDA_SCHEDULE");
    *schedule = FMHA_SCHEDULE_SPLIT;
    if (!env || !*env)
        return FMHA_STATUS_OK;
    for (int i = 0; i < 3; i++)
        if (!strcasecmp(env, names[i])) {
            *schedule = (fmha_schedule)i;
            return FMHA_STATUS_OK;
        }
    return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                          "FMHA_CUDA_SCHEDULE=%s is not one of tiles, persistent, split", env);
}

fmha_status fmha_cuda_clusters(fmha_cluster_mode *mode)
{
    const char *env = getenv("FMHA_CUDA_CLUSTER");
    *mode = FMHA_CLUSTER_AUTO;
    if (!env || !*env || !strcmp(env, "auto"))
        return FMHA_STATUS_OK;
    if (!strcmp(env, "0") || !strcmp(env, "1")) {
        *mode = env[0] == '1' ? FMHA_CLUSTER_ON : FMHA_CLUSTER_OFF;
        return FMHA_STATUS_OK;
    }
    return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "FMHA_CUDA_CLUSTER=%s is not auto, 0 or 1",
                          env);
}
#endif

/* What every selection starts with: a valid configuration and somewhere to
 * put the answer. */
static fmha_status select_begin(const fmha_config *cfg, const fmha_kernel_info *info)
{
    fmha_clear_error();
    fmha_status st = fmha_validate_config(cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    if (!info)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "kernel info out-pointer is NULL");
    return FMHA_STATUS_OK;
}

fmha_status fmha_kernel_select(const fmha_config *cfg, fmha_kernel_info *info)
{
    fmha_status st = select_begin(cfg, info);
    if (st != FMHA_STATUS_OK)
        return st;
    if (cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF) {
        fmha_layer_path path;
        return fmha_kernel_select_fp8(cfg, info, &path, NULL, 0);
    }
    if (cfg->device == FMHA_DEVICE_CUDA) {
#ifdef FMHA_HAVE_CUDA
        const int f8 = cfg->dtype == FMHA_DTYPE_F8_E4M3;
        if (!f8 && cfg->dtype != FMHA_DTYPE_BF16 && cfg->dtype != FMHA_DTYPE_F16)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "CUDA kernels take f16 or bf16 q, k, v, or f8_e4m3 on Hopper (got "
                                  "%s): convert the inputs, or use device cpu",
                                  fmha_dtype_name(cfg->dtype));
        if (cfg->head_dim > 256 || cfg->head_dim_v > 256)
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "CUDA kernels take head dims up to 256 (got %lld, %lld): use "
                                  "device cpu",
                                  (long long)cfg->head_dim, (long long)cfg->head_dim_v);
        if ((st = fmha_cuda_check_device()) != FMHA_STATUS_OK)
            return st;
        /* f8_e4m3 runs on the Hopper kernel's FP8 variant only. */
        if (f8) {
            if (!fmha_cuda_hopper_usable())
                return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                      "f8_e4m3 attention on CUDA needs a compute capability 9.0 GPU "
                                      "(H100/H200) and a build with the sm_90a kernel: use device "
                                      "cpu, or f16/bf16 inputs");
            *info = kernel_table[FMHA_KERNEL_ID_cuda_hopper_fp8_sm90];
            return FMHA_STATUS_OK;
        }
        int id = FMHA_KERNEL_ID_cuda_flash_sm80;
        if ((st = requested_cuda_kernel(&id)) != FMHA_STATUS_OK)
            return st;
        *info = kernel_table[id];
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
    case FMHA_CPU_ISA_AVX512_BF16:
        id = cfg->dtype == FMHA_DTYPE_BF16 ? FMHA_KERNEL_ID_cpu_avx512_bf16dp
                                           : FMHA_KERNEL_ID_cpu_avx512_f32;
        break;
    case FMHA_CPU_ISA_AVX512: id = FMHA_KERNEL_ID_cpu_avx512_f32; break;
    case FMHA_CPU_ISA_AVX2: id = FMHA_KERNEL_ID_cpu_avx2_f32; break;
    default: id = FMHA_KERNEL_ID_cpu_scalar_f32; break;
    }
    *info = kernel_table[id];
    return FMHA_STATUS_OK;
}

/* FMHA_FP8_ATTN: unset, 1 or 0 (0 sends fp8_compute layers to their fallback). */
static fmha_status fp8_attn_env(int *off)
{
    const char *env = getenv("FMHA_FP8_ATTN");
    *off = env && !strcmp(env, "0");
    if (env && *env && strcmp(env, "0") && strcmp(env, "1"))
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "FMHA_FP8_ATTN=%s is not 0 (FP8 attention off) or 1", env);
    return FMHA_STATUS_OK;
}

/* fp8_compute: the FP8 kernel the chooser gives the same configuration with
 * f8_e4m3 inputs, else cfg.dtype's kernel. Only UNSUPPORTED falls back: an
 * invalid configuration stays an error, and so does one whose fallback
 * cannot run either. */
fmha_status fmha_kernel_select_fp8(const fmha_config *cfg, fmha_kernel_info *info,
                                   fmha_layer_path *path, char *reason, size_t len)
{
    fmha_status st = select_begin(cfg, info);
    if (st != FMHA_STATUS_OK)
        return st;
    fmha_config c8 = *cfg;
    c8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    c8.fp8_smooth_k = 0;
    c8.dtype = FMHA_DTYPE_F8_E4M3;
    char why[512] = "";
    int off;
    if ((st = fp8_attn_env(&off)) != FMHA_STATUS_OK)
        return st;
    if (off) {
        snprintf(why, sizeof why, "FMHA_FP8_ATTN=0 in the environment turns it off");
    } else {
        st = fmha_kernel_select(&c8, info);
        /* What the CUDA FP8 path does not take. */
        const char *lacks = st == FMHA_STATUS_OK && info->device == FMHA_DEVICE_CUDA &&
                                    cfg->fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK
                                ? "the CUDA FP8 kernel takes per-tensor or per-KV-head descales, not "
                                  "per-block ones"
                                : NULL;
        if (lacks) {
            st = FMHA_STATUS_UNSUPPORTED;
            snprintf(why, sizeof why, "%s", lacks);
        } else if (st == FMHA_STATUS_OK) {
            char per[48] = "tensor";
            if (cfg->fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK)
                snprintf(per, sizeof per, "%d tokens of a head", FMHA_FP8_BLOCK_ROWS);
            *path = FMHA_LAYER_PATH_FP8;
            if (reason)
                snprintf(reason, len,
                         "fp8_compute: q, k, v (%s) quantized to f8_e4m3 on each call, one "
                         "scale per %s%s; FP8 attention on %s",
                         fmha_dtype_name(cfg->dtype), per,
                         cfg->fp8_smooth_k ? ", K's per-channel mean subtracted first" : "",
                         info->name);
            return FMHA_STATUS_OK;
        } else if (st == FMHA_STATUS_UNSUPPORTED) {
            snprintf(why, sizeof why, "%s", fmha_last_error());
        } else {
            return st;
        }
    }
    fmha_config c0 = c8;
    c0.dtype = cfg->dtype;
    if ((st = fmha_kernel_select(&c0, info)) != FMHA_STATUS_OK)
        return st;
    *path = FMHA_LAYER_PATH_FP8_FALLBACK;
    if (reason)
        snprintf(reason, len,
                 "FP8 attention is unavailable for this configuration (%s): running %s on %s "
                 "instead",
                 why, fmha_dtype_name(cfg->dtype), info->name);
    return FMHA_STATUS_OK;
}
