/* backend.h — what the layer code needs of a backend, as one table of
 * operations per device (CPU: cpu/cpu_backend.c; CUDA: cuda/cuda_backend.cu).
 * The layer, the chooser and the FP8 path reach a device only through this
 * table; backends.c is the one place that knows which backends were built.
 * Types only. */
#ifndef FMHA_BACKEND_H
#define FMHA_BACKEND_H

#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A layer's host scratch, grown on demand and kept between calls. */
typedef struct fmha_workspace {
    void *buf;
    size_t size;
} fmha_workspace;

/* A validated FP8 quantization: its scaling groups are n_batch x n_head x
 * n_block, each spanning batch_span batches, head_span heads and `rows`
 * tokens (the last block of a sequence may be shorter); `count` entries of
 * scales, in that order. */
typedef struct fmha_fp8_groups {
    int64_t n_batch, n_head, n_block;
    int64_t batch_span, head_span, rows;
    int64_t count;
} fmha_fp8_groups;

typedef struct fmha_backend {
    fmha_device device;
    const char *name; /* "cpu", "cuda" */

    /* OK when this machine can run the backend's kernels, else UNSUPPORTED
     * with the reason. */
    fmha_status (*check_device)(void);
    /* What the machine offers: CPU, the best fmha_cpu_isa; CUDA, the current
     * device's compute capability x 10 (0: none). */
    int (*level)(void);
    /* What AUTO takes: CPU, fmha_cpu_isa_auto (avx512-bf16 only where vdpbf16ps
     * pays, cpu/cpu.h); CUDA, as level. */
    int (*preferred_level)(void);
    /* 1 when kernels of sm_90a machine code were built and the current device
     * runs them (compute capability 9.0). */
    int (*runs_sm90a)(void);
    /* Fills the plan's variant fields for its kernel and configuration. */
    fmha_status (*plan_variant)(fmha_plan *plan);

    /* Host copies of a packed call's cu_seqlens, which validation reads; NULL
     * where they are host memory already. The caller frees them. */
    fmha_status (*host_cu_seqlens)(const fmha_forward_args *args, int32_t **q, int32_t **k);
    /* Runs a validated call on the kernel of `plan` (fmha_plan_for_call's). */
    fmha_status (*forward)(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws);

    /* The NaN and inf elements of a validated view (f8_e4m3: NaN codes): how
     * many, and the [batch, seq, head, channel] of the first in that order
     * (untouched when there is none). Synchronous. */
    fmha_status (*count_non_finite)(const fmha_tensor *t, int64_t *count, int64_t first[4],
                                    void *stream);

    /* Memory the kernels read (a layer's FP8 scratch), and its release. */
    fmha_status (*alloc)(void **ptr, size_t bytes);
    void (*free)(void *ptr);
    /* A validated FP8 quantization, queued on `stream` where the device has one. */
    fmha_status (*quantize_fp8)(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                const fmha_fp8_groups *g, void *stream);
    /* fp8_smooth_k: ks = k less its mean over the tokens of each (batch, KV
     * head, channel), contiguous f32 [batch][seqlen][heads][head_dim]; the
     * means into mean [batch][heads][head_dim]; `scratch` holds
     * smooth_k_scratch(k) bytes. */
    size_t (*smooth_k_scratch)(const fmha_tensor *k);
    fmha_status (*smooth_k)(const fmha_tensor *k, float *ks, float *mean, void *scratch,
                            void *stream);
    /* After attention over the smoothed K: lse[b][h][s] += scale * (q . mean
     * of its KV head), the LSE of the unsmoothed scores. */
    fmha_status (*unsmooth_lse)(const fmha_problem *pb, const fmha_tensor *q, float *lse,
                                const float *mean, void *stream);

    /* Runs a validated backward call (pb->bwd) on the backward kernel of
     * `plan` (fmha_plan_backward's). NULL where the backend has none: the
     * chooser then refuses every backward on it. */
    fmha_status (*backward)(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws);
} fmha_backend;

#ifdef __cplusplus
}
#endif
#endif /* FMHA_BACKEND_H */
