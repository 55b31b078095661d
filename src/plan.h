/* plan.h — the plan of a layer: which kernel of kernels.def runs its
 * configuration, in which variant, with how much workspace, and why. Types
 * only: select.c makes plans (once, at fmha_layer_init) and refines them per
 * call; backends read them. */
#ifndef FMHA_PLAN_H
#define FMHA_PLAN_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Kernel ids, in the order of kernels.def. */
enum {
#define FMHA_CPU_KERNEL(name, ...)      FMHA_KERNEL_ID_##name,
#define FMHA_CUDA_KERNEL(name, ...)     FMHA_KERNEL_ID_##name,
#define FMHA_CPU_BWD_KERNEL(name, ...)  FMHA_KERNEL_ID_##name,
#define FMHA_CUDA_BWD_KERNEL(name, ...) FMHA_KERNEL_ID_##name,
#define FMHA_CUDA_DEC_KERNEL(name, ...) FMHA_KERNEL_ID_##name,
#include "kernels.def"
    FMHA_KERNEL_COUNT
};

/* kernels.def's bit sets: input dtypes and descale layouts. */
#define FMHA_IN_F32         (1u << FMHA_DTYPE_F32)
#define FMHA_IN_F16         (1u << FMHA_DTYPE_F16)
#define FMHA_IN_BF16        (1u << FMHA_DTYPE_BF16)
#define FMHA_IN_F8          (1u << FMHA_DTYPE_F8_E4M3)
#define FMHA_IN_ALL         (FMHA_IN_F32 | FMHA_IN_F16 | FMHA_IN_BF16 | FMHA_IN_F8)
#define FMHA_DL_PER_TENSOR  (1u << FMHA_DESCALE_PER_TENSOR)
#define FMHA_DL_PER_KV_HEAD (1u << FMHA_DESCALE_PER_KV_HEAD)
#define FMHA_DL_PER_BLOCK   (1u << FMHA_DESCALE_PER_BLOCK)
#define FMHA_DL_ALL         (FMHA_DL_PER_TENSOR | FMHA_DL_PER_KV_HEAD | FMHA_DL_PER_BLOCK)
/* Not a public layout: fp8_compute = int8_qk's INT8 q and k (layer_fp8.c) */
#define FMHA_DL_INT8_QK (1u << 8)

/* Whether int8_qk rotates q and k by the Hadamard matrix at this head dim:
 * powers of two from 32 to 256 (the quantizer's rows). */
static inline int fmha_int8_qk_rotates(int64_t head_dim)
{
    return head_dim >= 32 && head_dim <= 256 && !(head_dim & (head_dim - 1));
}

/* What a row of kernels.def is chosen for: forward calls, backward calls
 * (fmha_plan_backward), or decode calls alone (fmha_plan_decode; a forward
 * kernel that reads caches serves decode calls too). */
typedef enum { FMHA_ROLE_FORWARD, FMHA_ROLE_BACKWARD, FMHA_ROLE_DECODE } fmha_kernel_role;

/* One row of kernels.def. */
typedef struct fmha_kernel_desc {
    fmha_kernel_info info; /* id, device, cpu_isa, name: what fmha_layer_kernel reports */
    int level;             /* CPU: the fmha_cpu_isa it needs; CUDA: compute capability x 10 */
    const char *family;    /* CUDA: FMHA_CUDA_KERNEL's name for it; CPU: NULL */
    const char *compute;   /* "f32", "bf16dp", "mma", "wgmma" */
    unsigned inputs;       /* FMHA_IN_* */
    unsigned descales;     /* FMHA_DL_* */
    int64_t max_head_dim;
    int sm90a;    /* machine code for compute capability 9.0 alone */
    int tma;      /* reads q, k, v through TMA: rows checked per call */
    int fallback; /* kernel id for views TMA cannot read; -1 = UNSUPPORTED */
    int caches;   /* reads keys and values through KV caches (decode) */
    int mods;     /* takes the score modifiers (attention masks, ALiBi, sinks) */
    fmha_kernel_role role;
    int ops; /* CPU: the kernel id whose micro-kernel table it runs on (itself for a forward) */
} fmha_kernel_desc;

/* The table, indexed by kernel id (defined in select.c). */
extern const fmha_kernel_desc fmha_kernels[FMHA_KERNEL_COUNT];

/* How the Hopper kernel deals its query tiles to the SMs (FMHA_CUDA_SCHEDULE):
 * `tiles`, one block per tile; `persistent`, one block per SM looping over
 * tiles; `split` (the default), persistent with the last, partial round cut
 * along the keys. Causal, windowed and packed calls always run one block per
 * tile. Measured reasons: bench/NOTES.md (v5). */
typedef enum { FMHA_SCHEDULE_TILES, FMHA_SCHEDULE_PERSISTENT, FMHA_SCHEDULE_SPLIT } fmha_schedule;

/* Whether the Hopper kernel may run two neighbouring query tiles of a head
 * as a 2-block cluster sharing each K/V tile load (FMHA_CUDA_CLUSTER): auto
 * (default) where the keys are long enough for it to pay, 1 wherever it
 * fits, 0 never. */
typedef enum { FMHA_CLUSTER_OFF, FMHA_CLUSTER_ON, FMHA_CLUSTER_AUTO } fmha_cluster_mode;

/* Whether the FP8 kernel adds each key tile's P V into O in f32 (two-level)
 * or lets wgmma accumulate O across tiles (FMHA_FP8_ACCUM): auto (default)
 * takes two-level past FMHA_FP8_TWO_LEVEL_KEYS keys, where the single-level
 * sum's error grows with the keys (bench/RESULTS.md, FP8 on the GPU). */
typedef enum {
    FMHA_FP8_ACCUM_AUTO,
    FMHA_FP8_ACCUM_SINGLE,
    FMHA_FP8_ACCUM_TWO_LEVEL
} fmha_fp8_accum;
#define FMHA_FP8_TWO_LEVEL_KEYS 16384

/* The environment's knobs, read once per plan. */
typedef struct fmha_knobs {
    fmha_cpu_isa cpu_isa;      /* FMHA_CPU_ISA; AUTO when unset */
    const char *cuda_family;   /* FMHA_CUDA_KERNEL: "portable", "hopper" or NULL (auto) */
    fmha_schedule schedule;    /* FMHA_CUDA_SCHEDULE */
    fmha_cluster_mode cluster; /* FMHA_CUDA_CLUSTER */
    fmha_fp8_accum fp8_accum;  /* FMHA_FP8_ACCUM */
    int fp8_attn_off;          /* FMHA_FP8_ATTN=0 */
    int decode_l2_prefetch; /* FMHA_CUDA_DECODE_L2PF: the decode loads' L2 prefetch, 0/128/256 B */
} fmha_knobs;

typedef struct fmha_plan {
    const fmha_kernel_desc *kernel;
    fmha_layer_path path;
    int int8_qk;     /* fp8_compute = int8_qk: q and k are INT8 codes (layer_fp8.c says how) */
    fmha_config cfg; /* what the kernel runs: the layer's, with f8_e4m3 inputs on the FP8 path */
    fmha_knobs knobs;

    /* The variant, filled by the backend (fmha_backend.plan_variant). */
    int head_dim_variant; /* CUDA: the compiled head dim that holds the call; 0 = any */
    int tile_m, tile_n;   /* queries x keys of a tile */
    int max_cluster;      /* 2 where the variant runs 2-block clusters, else 1 */
    int has_two_level;    /* the FP8 variant has two-level accumulation */
    size_t workspace;     /* bytes of scratch the layer keeps between calls (CPU) */

    /* Refined per call by fmha_plan_for_call. */
    int cluster;   /* 1 or 2 blocks per cluster */
    int two_level; /* FP8: two-level accumulation */

    char reason[768]; /* why this kernel and path, one line */
} fmha_plan;

#ifdef __cplusplus
}
#endif
#endif /* FMHA_PLAN_H */
