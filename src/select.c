/* select.c — the kernel chooser. fmha_plan_make decides, once per layer, which
 * kernel of kernels.def runs a configuration (and so whether it is supported
 * at all), reading every column of the table and every environment knob;
 * fmha_plan_for_call refines that choice with a call's own facts. Nothing
 * else in the library chooses a kernel. */
#include "select.h"
#include "backends.h"
#include "validate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

const fmha_kernel_desc fmha_kernels[FMHA_KERNEL_COUNT] = {
/* One row per device; the forward, backward and decode macros of kernels.def
 * fill their columns and the defaults of the kind. */
#define FMHA_CPU_ROW(name, isa, compute_, inputs_, descales_, caches_, role_, ops_)          \
    [FMHA_KERNEL_ID_##name] = {.info = {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CPU, isa, #name}, \
                               .level = isa,                                                 \
                               .mods = 1,                                                    \
                               .compute = #compute_,                                         \
                               .inputs = inputs_,                                            \
                               .descales = descales_,                                        \
                               .max_head_dim = 65536,                                        \
                               .fallback = -1,                                               \
                               .caches = caches_,                                            \
                               .role = role_,                                                \
                               .ops = FMHA_KERNEL_ID_##ops_},
#define FMHA_CUDA_ROW(name, family_, min_sm, sm90a_, compute_, inputs_, max_d, descales_, tma_, \
                      fallback_, caches_, role_, mods_)                                         \
    [FMHA_KERNEL_ID_##                                                                          \
        name] = {.info = {FMHA_KERNEL_ID_##name, FMHA_DEVICE_CUDA, FMHA_CPU_ISA_AUTO, #name},   \
                 .level = min_sm,                                                               \
                 .mods = mods_,                                                                 \
                 .family = #family_,                                                            \
                 .compute = #compute_,                                                          \
                 .inputs = inputs_,                                                             \
                 .descales = descales_,                                                         \
                 .max_head_dim = max_d,                                                         \
                 .sm90a = sm90a_,                                                               \
                 .tma = tma_,                                                                   \
                 .fallback = fallback_,                                                         \
                 .caches = caches_,                                                             \
                 .role = role_,                                                                 \
                 .ops = FMHA_KERNEL_ID_##name},
#define FMHA_CPU_KERNEL(name, isa, compute, inputs) \
    FMHA_CPU_ROW(name, isa, compute, inputs, FMHA_DL_ALL, 1, FMHA_ROLE_FORWARD, name)
#define FMHA_CPU_BWD_KERNEL(name, isa, compute, inputs, ops) \
    FMHA_CPU_ROW(name, isa, compute, inputs, 0, 0, FMHA_ROLE_BACKWARD, ops)
#define FMHA_CUDA_KERNEL(name, family, min_sm, sm90a, compute, inputs, max_d, descales, fallback, \
                         caches, mods)                                                            \
    FMHA_CUDA_ROW(name, family, min_sm, sm90a, compute, inputs, max_d, descales,                  \
                  FMHA_TMA_##compute, FMHA_KERNEL_ID_##fallback, caches, FMHA_ROLE_FORWARD, mods)
#define FMHA_CUDA_BWD_KERNEL(name, family, min_sm, compute, inputs, max_d, mods) \
    FMHA_CUDA_ROW(name, family, min_sm, 0, compute, inputs, max_d, 0, 0, -1, 0,  \
                  FMHA_ROLE_BACKWARD, mods)
#define FMHA_CUDA_DEC_KERNEL(name, family, min_sm, compute, inputs, max_d, mods)                  \
    FMHA_CUDA_ROW(name, family, min_sm, 0, compute, inputs, max_d, 0, 0, -1, 1, FMHA_ROLE_DECODE, \
                  mods)
#define FMHA_KERNEL_ID_NONE (-1)
#define FMHA_TMA_MMA        0
#define FMHA_TMA_WGMMA      1
#include "kernels.def"
#undef FMHA_TMA_MMA
#undef FMHA_TMA_WGMMA
#undef FMHA_KERNEL_ID_NONE
#undef FMHA_CPU_ROW
#undef FMHA_CUDA_ROW
};

/* ------------------------------------------------------------------ knobs */

/* The index of `env` in names[0..n) (case-insensitive), or -1. */
static int name_index(const char *env, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcasecmp(env, names[i]))
            return i;
    return -1;
}

static fmha_status bad_knob(const char *var, const char *env, const char *allowed)
{
    return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "%s=%s is not %s", var, env, allowed);
}

/* Every environment variable fmha reads, read here once per plan: a layer
 * keeps what it saw at fmha_layer_init. Only the variables that can matter to
 * cfg are read (all of them for cfg NULL), so that a bad value is reported
 * where it would take effect. */
fmha_status fmha_knobs_read(const fmha_config *cfg, fmha_knobs *k)
{
    const char *env;
    const int cpu = !cfg || (cfg->device == FMHA_DEVICE_CPU && cfg->cpu_isa == FMHA_CPU_ISA_AUTO);
    const int cuda = !cfg || cfg->device == FMHA_DEVICE_CUDA;
    const int fp8 = !cfg || cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF;
    memset(k, 0, sizeof *k);
    k->cpu_isa = FMHA_CPU_ISA_AUTO;
    k->schedule = FMHA_SCHEDULE_SPLIT;
    k->cluster = FMHA_CLUSTER_AUTO;
    k->decode_l2_prefetch = 256; /* 1-4% over none on every shape of the H100 sweep (NOTES.md) */
    k->fp8_accum = FMHA_FP8_ACCUM_AUTO;
    if (cpu && (env = getenv("FMHA_CPU_ISA")) && *env) {
        const char *names[FMHA_CPU_ISA_LAST + 1];
        for (int i = 0; i <= FMHA_CPU_ISA_LAST; i++)
            names[i] = fmha_cpu_isa_name((fmha_cpu_isa)i);
        const int i = name_index(env, names, FMHA_CPU_ISA_LAST + 1);
        if (i < 0) {
            char list[128] = "one of ";
            for (int j = FMHA_CPU_ISA_SCALAR; j <= FMHA_CPU_ISA_LAST; j++)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s, ", names[j]);
            snprintf(list + strlen(list), sizeof list - strlen(list), "auto");
            return bad_knob("FMHA_CPU_ISA", env, list);
        }
        k->cpu_isa = (fmha_cpu_isa)i;
    }
    if (cuda && (env = getenv("FMHA_CUDA_KERNEL")) && *env) {
        static const char *const names[] = {"portable", "hopper", "auto"};
        const int i = name_index(env, names, 3);
        if (i < 0)
            return bad_knob("FMHA_CUDA_KERNEL", env, "one of portable, hopper, auto");
        k->cuda_family = i < 2 ? names[i] : NULL;
    }
    if (cuda && (env = getenv("FMHA_CUDA_SCHEDULE")) && *env) {
        static const char *const names[] = {"tiles", "persistent", "split"};
        const int i = name_index(env, names, 3);
        if (i < 0)
            return bad_knob("FMHA_CUDA_SCHEDULE", env, "one of tiles, persistent, split");
        k->schedule = (fmha_schedule)i;
    }
    if (cuda && (env = getenv("FMHA_CUDA_CLUSTER")) && *env && strcmp(env, "auto")) {
        if (strcmp(env, "0") && strcmp(env, "1"))
            return bad_knob("FMHA_CUDA_CLUSTER", env, "auto, 0 or 1");
        k->cluster = env[0] == '1' ? FMHA_CLUSTER_ON : FMHA_CLUSTER_OFF;
    }
    if (cuda && (env = getenv("FMHA_CUDA_DECODE_L2PF")) && *env) { /* a tuning knob */
        static const char *const names[] = {"0", "128", "256"};
        const int i = name_index(env, names, 3);
        if (i < 0)
            return bad_knob("FMHA_CUDA_DECODE_L2PF", env, "one of 0, 128, 256 (bytes)");
        k->decode_l2_prefetch = i * 128;
    }
    if (cuda && (env = getenv("FMHA_FP8_ACCUM")) && *env) {
        static const char *const names[] = {"auto", "single", "two_level"};
        const int i = name_index(env, names, 3);
        if (i < 0)
            return bad_knob("FMHA_FP8_ACCUM", env, "one of auto, two_level, single");
        k->fp8_accum = (fmha_fp8_accum)i;
    }
    if (fp8 && (env = getenv("FMHA_FP8_ATTN")) && *env) {
        if (strcmp(env, "0") && strcmp(env, "1"))
            return bad_knob("FMHA_FP8_ATTN", env, "0 (FP8 attention off) or 1");
        k->fp8_attn_off = env[0] == '0';
    }
    return FMHA_STATUS_OK;
}

/* --------------------------------------------------------------- chooser */

static const char *const role_names[3] = {"forward", "backward", "decode"};

/* Whether kernel k runs cfg's calls of `role`. */
static int accepts(const fmha_kernel_desc *k, const fmha_config *cfg, fmha_kernel_role role)
{
    return k->role == role && k->info.device == cfg->device && (k->inputs >> cfg->dtype & 1u) &&
           cfg->head_dim <= k->max_head_dim && cfg->head_dim_v <= k->max_head_dim;
}

/* The CPU kernel: of those that take cfg's inputs (rows of `role`), the one of the highest ISA up to the one asked for (cfg.cpu_isa,
 * else FMHA_CPU_ISA, else the backend's preference). */
static fmha_status choose_cpu(const fmha_config *cfg, const fmha_knobs *kn, const fmha_backend *be,
                              fmha_kernel_role role, const fmha_kernel_desc **out)
{
    fmha_cpu_isa want = cfg->cpu_isa != FMHA_CPU_ISA_AUTO ? cfg->cpu_isa : kn->cpu_isa;
    if (want == FMHA_CPU_ISA_AUTO)
        want = (fmha_cpu_isa)be->preferred_level();
    const fmha_cpu_isa best = (fmha_cpu_isa)be->level();
    if (want > best)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CPU ISA %s was requested but this CPU/OS supports at most %s",
                              fmha_cpu_isa_name(want), fmha_cpu_isa_name(best));
    *out = NULL;
    for (int i = 0; i < FMHA_KERNEL_COUNT; i++) {
        const fmha_kernel_desc *k = &fmha_kernels[i];
        if (accepts(k, cfg, role) && k->level <= (int)want && (!*out || k->level > (*out)->level))
            *out = k;
    }
    if (!*out) /* the scalar kernels take every input they can */
        return fmha_set_error(
            FMHA_STATUS_UNSUPPORTED, "no CPU %s kernel takes %s inputs%s", role_names[role],
            fmha_dtype_name(cfg->dtype),
            role == FMHA_ROLE_BACKWARD ? ": the backward takes f32, f16 or bf16 q, k, v" : "");
    return FMHA_STATUS_OK;
}

/* The CUDA kernel: of those that take cfg and run on the current device (and
 * are of FMHA_CUDA_KERNEL's family, where it names one), the one of the
 * highest compute capability. */
static fmha_status choose_cuda(const fmha_config *cfg, const fmha_knobs *kn, const fmha_backend *be,
                               fmha_kernel_role role, const fmha_kernel_desc **out)
{
    int takes_dtype = 0, takes_dims = 0, family_here = 0;
    int64_t max_d = 0;
    for (int i = 0; i < FMHA_KERNEL_COUNT; i++) {
        const fmha_kernel_desc *k = &fmha_kernels[i];
        if (k->info.device != FMHA_DEVICE_CUDA || k->role != role ||
            !(k->inputs >> cfg->dtype & 1u))
            continue;
        takes_dtype = 1;
        max_d = k->max_head_dim > max_d ? k->max_head_dim : max_d;
        takes_dims |= accepts(k, cfg, role);
    }
    if (!takes_dtype && role != FMHA_ROLE_FORWARD)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "no CUDA %s kernel takes %s inputs: run the %s on device cpu",
                              role_names[role], fmha_dtype_name(cfg->dtype), role_names[role]);
    if (!takes_dtype)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CUDA kernels take f16 or bf16 q, k, v, or f8_e4m3 on Hopper (got "
                              "%s): convert the inputs, or use device cpu",
                              fmha_dtype_name(cfg->dtype));
    if (!takes_dims)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CUDA kernels take head dims up to %lld (got %lld, %lld): use "
                              "device cpu",
                              (long long)max_d, (long long)cfg->head_dim,
                              (long long)cfg->head_dim_v);
    fmha_status st = be->check_device();
    if (st != FMHA_STATUS_OK)
        return st;
    const int level = be->level(), sm90a = be->runs_sm90a();
    /* The family asked for limits the choice where one of its kernels takes
     * these inputs (FMHA_CUDA_KERNEL chooses among the 16-bit kernels; f8
     * inputs have one kernel). */
    const char *family = kn->cuda_family;
    for (int i = 0; family && i < FMHA_KERNEL_COUNT; i++)
        family_here |=
            accepts(&fmha_kernels[i], cfg, role) && !strcmp(fmha_kernels[i].family, family);
    if (!family_here)
        family = NULL;
    *out = NULL;
    for (int i = 0; i < FMHA_KERNEL_COUNT; i++) {
        const fmha_kernel_desc *k = &fmha_kernels[i];
        if (accepts(k, cfg, role) && k->level <= level && (!k->sm90a || sm90a) &&
            (!family || !strcmp(k->family, family)) && (!*out || k->level > (*out)->level))
            *out = k;
    }
    if (*out)
        return FMHA_STATUS_OK;
    if (family)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "FMHA_CUDA_KERNEL=%s, but the sm_90a kernel needs a compute "
                              "capability 9.0 GPU and a build with it: unset FMHA_CUDA_KERNEL",
                              family);
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "%s attention on CUDA needs a compute capability 9.0 GPU (H100/H200) "
                          "and a build with the sm_90a kernel: use device cpu, or f16/bf16 inputs",
                          fmha_dtype_name(cfg->dtype));
}

/* The kernel of `role` for plan->cfg, and its variant. A backend without a
 * backward operation has no backward at all. */
static fmha_status choose(fmha_plan *plan, fmha_kernel_role role)
{
    const fmha_backend *be = fmha_backend_of(plan->cfg.device);
    if (!be)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "this fmha was built without a CUDA backend (no nvcc at build "
                              "time): use device cpu");
    if (role == FMHA_ROLE_BACKWARD && !be->backward)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "the %s backward is not built yet: run fmha_backward on a layer "
                              "of device cpu (host copies of the tensors); the %s forward is "
                              "unaffected",
                              be->name, be->name);
    fmha_status st = plan->cfg.device == FMHA_DEVICE_CPU
                         ? choose_cpu(&plan->cfg, &plan->knobs, be, role, &plan->kernel)
                         : choose_cuda(&plan->cfg, &plan->knobs, be, role, &plan->kernel);
    if (st != FMHA_STATUS_OK)
        return st;
    plan->cluster = 1;
    return be->plan_variant(plan);
}

/* fp8_compute: the FP8 kernel the chooser gives the same configuration with
 * f8_e4m3 inputs, else cfg.dtype's kernel. Only UNSUPPORTED falls back: an
 * invalid configuration stays an error, and so does one whose fallback
 * cannot run either. */
static fmha_status choose_fp8(const fmha_config *cfg, fmha_plan *plan)
{
    plan->cfg.dtype = FMHA_DTYPE_F8_E4M3;
    plan->cfg.fp8_compute = FMHA_FP8_COMPUTE_OFF;
    plan->cfg.fp8_smooth_k = 0;
    const int per_block = cfg->fp8_compute == FMHA_FP8_COMPUTE_PER_BLOCK;
    const int int8_qk = cfg->fp8_compute == FMHA_FP8_COMPUTE_INT8_QK;
    char why[512] = "";
    fmha_status st = FMHA_STATUS_UNSUPPORTED;
    if (plan->knobs.fp8_attn_off) {
        snprintf(why, sizeof why, "FMHA_FP8_ATTN=0 in the environment turns it off");
    } else if ((st = choose(plan, FMHA_ROLE_FORWARD)) == FMHA_STATUS_OK && per_block &&
               !(plan->kernel->descales & FMHA_DL_PER_BLOCK)) {
        st = FMHA_STATUS_UNSUPPORTED;
        snprintf(why, sizeof why, "%s takes per-tensor or per-KV-head descales, not per-block ones",
                 plan->kernel->info.name);
    } else if (st == FMHA_STATUS_OK && int8_qk && !(plan->kernel->descales & FMHA_DL_INT8_QK)) {
        st = FMHA_STATUS_UNSUPPORTED;
        snprintf(why, sizeof why,
                 "%s has no INT8 Q K^T (fp8_compute = int8_qk runs on Hopper GPUs)",
                 plan->kernel->info.name);
    } else if (st == FMHA_STATUS_OK && int8_qk) {
        const int rotate = fmha_int8_qk_rotates(cfg->head_dim);
        plan->path = FMHA_LAYER_PATH_FP8;
        plan->int8_qk = 1;
        snprintf(plan->reason, sizeof plan->reason,
                 "fp8_compute = int8_qk: K's per-channel mean subtracted, q and k (%s)%s coded "
                 "to INT8 on each call (q one scale per token and head, k one per sequence and "
                 "KV head), v to f8_e4m3 (one scale per sequence and KV head); INT8 Q K^T and "
                 "FP8 P V on %s",
                 fmha_dtype_name(cfg->dtype), rotate ? " rotated by the Hadamard matrix," : "",
                 plan->kernel->info.name);
        return FMHA_STATUS_OK;
    } else if (st == FMHA_STATUS_OK) {
        char per[48] = "tensor";
        if (per_block)
            snprintf(per, sizeof per, "%d tokens of a head", FMHA_FP8_BLOCK_ROWS);
        plan->path = FMHA_LAYER_PATH_FP8;
        snprintf(plan->reason, sizeof plan->reason,
                 "fp8_compute: q, k, v (%s) quantized to f8_e4m3 on each call, one scale per "
                 "%s%s; FP8 attention on %s",
                 fmha_dtype_name(cfg->dtype), per,
                 cfg->fp8_smooth_k ? ", K's per-channel mean subtracted first" : "",
                 plan->kernel->info.name);
        return FMHA_STATUS_OK;
    } else if (st == FMHA_STATUS_UNSUPPORTED) {
        snprintf(why, sizeof why, "%s", fmha_last_error());
    } else {
        return st;
    }
    plan->cfg.dtype = cfg->dtype;
    if ((st = choose(plan, FMHA_ROLE_FORWARD)) != FMHA_STATUS_OK)
        return st;
    plan->path = FMHA_LAYER_PATH_FP8_FALLBACK;
    snprintf(plan->reason, sizeof plan->reason,
             "FP8 attention is unavailable for this configuration (%s): running %s on %s "
             "instead",
             why, fmha_dtype_name(cfg->dtype), plan->kernel->info.name);
    return FMHA_STATUS_OK;
}

fmha_status fmha_plan_make(const fmha_config *cfg, fmha_plan *plan)
{
    fmha_status st = fmha_validate_config(cfg);
    if (st != FMHA_STATUS_OK)
        return st;
    memset(plan, 0, sizeof *plan);
    plan->cfg = *cfg;
    if ((st = fmha_knobs_read(cfg, &plan->knobs)) != FMHA_STATUS_OK)
        return st;
    if (cfg->fp8_compute != FMHA_FP8_COMPUTE_OFF)
        return choose_fp8(cfg, plan);
    if ((st = choose(plan, FMHA_ROLE_FORWARD)) != FMHA_STATUS_OK)
        return st;
    plan->path = FMHA_LAYER_PATH_DIRECT;
    snprintf(plan->reason, sizeof plan->reason, "fp8_compute is off: q, k, v run as %s on %s",
             fmha_dtype_name(cfg->dtype), plan->kernel->info.name);
    return FMHA_STATUS_OK;
}

fmha_status fmha_kernel_select(const fmha_config *cfg, fmha_kernel_info *info)
{
    fmha_clear_error();
    fmha_plan plan;
    fmha_status st = fmha_plan_make(cfg, &plan);
    if (st != FMHA_STATUS_OK)
        return st;
    if (!info)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "kernel info out-pointer is NULL");
    *info = plan.kernel->info;
    return FMHA_STATUS_OK;
}

fmha_status fmha_plan_backward(const fmha_plan *fwd, fmha_plan *bwd)
{
    *bwd = *fwd;
    if (fwd->path == FMHA_LAYER_PATH_FP8) /* a fallback layer ran cfg.dtype: it has one */
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "fp8_compute layers have no backward (the quantizer has no "
                              "gradient): run the backward on a layer with fp8_compute off");
    if (fwd->cfg.dtype == FMHA_DTYPE_F8_E4M3)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "f8_e4m3 inputs have no backward: train on f32, f16 or bf16 q, k, v");
    fmha_status st = choose(bwd, FMHA_ROLE_BACKWARD);
    if (st != FMHA_STATUS_OK)
        return st;
    snprintf(bwd->reason, sizeof bwd->reason, "backward of %s q, k, v on %s",
             fmha_dtype_name(bwd->cfg.dtype), bwd->kernel->info.name);
    return FMHA_STATUS_OK;
}

fmha_status fmha_kernel_select_backward(const fmha_config *cfg, fmha_kernel_info *info)
{
    fmha_clear_error();
    fmha_plan plan, bwd;
    fmha_status st = fmha_plan_make(cfg, &plan);
    if (st != FMHA_STATUS_OK || (st = fmha_plan_backward(&plan, &bwd)) != FMHA_STATUS_OK)
        return st;
    if (!info)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "kernel info out-pointer is NULL");
    *info = bwd.kernel->info;
    return FMHA_STATUS_OK;
}

/* ------------------------------------------------------------- per call */

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
           tma_stride_ok(t->heads, t->stride_head, eb) &&
           tma_stride_ok(t->batch, t->stride_batch, eb);
}

/* Clusters where the tiles' keys number at least this many, unless
 * FMHA_CUDA_CLUSTER says otherwise. Measured (H200, bench_cuda.py --ab
 * FMHA_CUDA_CLUSTER=0,1, three same-process runs, bench/NOTES.md, v11): in
 * clusters FA3 d128 (16384 keys) +2.9%, +3.6%, +0.9%, d256 +0.7%, +2.6%,
 * +2.0%, Wan 480p (32760) +8.7%, +3.5%, Wan 720p (75600) -0.1%, -0.3%; Flux
 * (4608) -0.6%, -2.3%, -2.2%. The two blocks of a cluster wait on each
 * other's consumers at every K/V slot, a cost that long key ranges spread
 * over more tiles; what they gain is likely power (L2 -> SM traffic falls
 * from 3.5-3.8 to 3.0 TB/s, and long runs sit at the board's power limit). */
#define CLUSTER_MIN_KEYS 8192

/* Whether a call runs in 2-block clusters: a variant that has them, no
 * dropout, every query tile seeing the same keys (not causal, windowed or
 * packed), an even number of query tiles per head, a persistent schedule;
 * under auto, keys as above. */
static int cluster_fits(const fmha_plan *plan, const fmha_problem *pb)
{
    const fmha_config *c = &plan->cfg;
    const int uniform = !pb->varlen && !c->causal && c->window_left < 0 && c->window_right < 0;
    const int64_t tiles_x = plan->tile_m ? (pb->max_sq + plan->tile_m - 1) / plan->tile_m : 1;
    return plan->max_cluster > 1 && plan->knobs.cluster != FMHA_CLUSTER_OFF &&
           (plan->knobs.cluster == FMHA_CLUSTER_ON || pb->max_sk >= CLUSTER_MIN_KEYS) &&
           !pb->drop_threshold && uniform && plan->knobs.schedule != FMHA_SCHEDULE_TILES &&
           tiles_x % 2 == 0;
}

fmha_status fmha_plan_decode(const fmha_plan *fwd, fmha_plan *dec)
{
    *dec = *fwd;
    if (fwd->kernel->caches)
        return FMHA_STATUS_OK;
    fmha_status st = choose(dec, FMHA_ROLE_DECODE);
    if (st != FMHA_STATUS_OK)
        return st;
    snprintf(dec->reason, sizeof dec->reason, "decode of %s caches on %s",
             fmha_dtype_name(dec->cfg.dtype), dec->kernel->info.name);
    return FMHA_STATUS_OK;
}

fmha_status fmha_plan_check_mods(const fmha_plan *plan, const fmha_problem *pb)
{
    const fmha_forward_args *a = pb->args;
    if (!fmha_has_score_mods(a) || plan->kernel->mods)
        return FMHA_STATUS_OK;
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "%s is given, but %s runs no score modifiers (attention masks, ALiBi "
                          "slopes and sinks run on CPU layers%s): use device cpu, or express "
                          "the mask as causal or window_left / window_right",
                          a->mask.data      ? "mask"
                          : a->alibi_slopes ? "alibi_slopes"
                                            : "sinks",
                          plan->kernel->info.name,
                          plan->kernel->info.device == FMHA_DEVICE_CUDA
                              ? ", and in the forward and backward of f16/bf16 CUDA layers"
                              : "");
}

fmha_status fmha_plan_for_call(const fmha_plan *plan, const fmha_problem *pb, fmha_plan *call)
{
    const fmha_forward_args *a = pb->args;
    *call = *plan;
    const fmha_kernel_desc *k = plan->kernel;
    if (fmha_has_score_mods(a) && !k->mods && k->fallback >= 0 && fmha_kernels[k->fallback].mods) {
        /* score modifiers: the kernel that takes them (Hopper's portable twin) */
        call->kernel = &fmha_kernels[k->fallback];
        call->max_cluster = 1;
        fmha_status st = fmha_backend_of(k->info.device)->plan_variant(call);
        if (st != FMHA_STATUS_OK)
            return st;
        snprintf(call->reason, sizeof call->reason, "%s takes no score modifiers: %s instead",
                 k->info.name, call->kernel->info.name);
        k = call->kernel;
    }
    fmha_status mods = fmha_plan_check_mods(call, pb);
    if (mods != FMHA_STATUS_OK)
        return mods;
    if (pb->kv_cache && a->k.dtype == FMHA_DTYPE_F8_E4M3 && !(k->inputs >> a->k.dtype & 1u)) {
        /* FP8 caches: the kernel that also takes f8_e4m3 rows (the CPU's f32 tables) */
        fmha_plan f8 = *plan;
        f8.cfg.dtype = FMHA_DTYPE_F8_E4M3;
        fmha_status st = choose(&f8, k->role);
        if (st != FMHA_STATUS_OK)
            return st;
        *call = f8;
        call->cfg.dtype = plan->cfg.dtype;
        snprintf(call->reason, sizeof call->reason, "%s does not read f8_e4m3 caches: %s",
                 k->info.name, call->kernel->info.name);
        k = call->kernel;
    }
    if (!pb->varlen && !pb->kv_cache && pb->max_sk == 0 && k->info.device != FMHA_DEVICE_CPU)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "seqlen_k 0 (no key for any query) is answered on the CPU only "
                              "(out 0, lse -inf): on %s, skip the call and fill out with 0 "
                              "and lse with -inf",
                              k->info.name);
    if (a->q.dtype == FMHA_DTYPE_F8_E4M3 && !(k->descales >> a->descale_layout & 1u))
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "per-block descales (FMHA_DESCALE_PER_BLOCK) run on the CPU only: on "
                              "CUDA use FMHA_DESCALE_PER_TENSOR or FMHA_DESCALE_PER_KV_HEAD");
    if (k->tma) {
        /* The FP8 kernel reads v through its own transposed copy. */
        const int nt = k->fallback < 0 && a->q.dtype == FMHA_DTYPE_F8_E4M3 ? 2 : 3;
        const fmha_tensor *ts[3] = {&a->q, &a->k, &a->v};
        const char *names[3] = {"q", "k", "v"};
        for (int i = 0; i < nt; i++) {
            if (tma_addressable(ts[i]))
                continue;
            if (k->fallback >= 0) {
                call->kernel = &fmha_kernels[k->fallback];
                call->max_cluster = 1;
                fmha_status st = fmha_backend_of(k->info.device)->plan_variant(call);
                if (st != FMHA_STATUS_OK)
                    return st;
                snprintf(call->reason, sizeof call->reason,
                         "%s reads 16-byte aligned rows, and %s's are not: %s instead",
                         k->info.name, names[i], call->kernel->info.name);
                return FMHA_STATUS_OK;
            }
            return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                  "%s %s on CUDA needs 16-byte aligned rows (data %% 16 == 0, "
                                  "strides multiples of 16 elements; got strides %lld, %lld, "
                                  "%lld): pad head_dim to a multiple of 16 or copy %s to a "
                                  "contiguous tensor",
                                  fmha_dtype_name(ts[i]->dtype), names[i],
                                  (long long)ts[i]->stride_seq, (long long)ts[i]->stride_head,
                                  (long long)ts[i]->stride_batch, names[i]);
        }
    }
    call->cluster = cluster_fits(call, pb) ? call->max_cluster : 1;
    call->two_level = call->has_two_level && fmha_fp8_two_level(call->knobs.fp8_accum, pb->max_sk);
    return FMHA_STATUS_OK;
}

int fmha_fp8_two_level(fmha_fp8_accum accum, int64_t max_sk)
{
    return accum == FMHA_FP8_ACCUM_AUTO ? max_sk > FMHA_FP8_TWO_LEVEL_KEYS
                                        : accum == FMHA_FP8_ACCUM_TWO_LEVEL;
}

void fmha_plan_describe(const fmha_plan *plan, char *buf, size_t len)
{
    static const char *const schedules[] = {"tiles", "persistent", "split"};
    static const char *const clusters[] = {"off", "on", "auto"};
    const fmha_kernel_desc *k = plan->kernel;
    int n = snprintf(buf, len, "%s (%s): %s inputs", k->info.name, k->compute,
                     fmha_dtype_name(plan->cfg.dtype));
    if (n >= 0 && (size_t)n < len && plan->head_dim_variant)
        n += snprintf(buf + n, len - n, ", head dim %d variant", plan->head_dim_variant);
    if (n >= 0 && (size_t)n < len)
        n += snprintf(buf + n, len - n, ", tile %dx%d", plan->tile_m, plan->tile_n);
    if (n >= 0 && (size_t)n < len && k->info.device == FMHA_DEVICE_CUDA && k->tma)
        n += snprintf(buf + n, len - n, ", schedule %s, clusters %s",
                      schedules[plan->knobs.schedule], clusters[plan->knobs.cluster]);
    if (n >= 0 && (size_t)n < len && plan->workspace)
        snprintf(buf + n, len - n, ", workspace %zu bytes", plan->workspace);
}
