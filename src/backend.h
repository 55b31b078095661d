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

/* A layer's scratch in its backend's memory, grown on demand by the
 * backend, kept between calls and released with fmha_backend.free. */
typedef struct fmha_workspace {
    void *buf;
    size_t size;
} fmha_workspace;

/* Host copies of a decode call's index arrays (fmha_backend.host_kvcache). */
typedef struct fmha_kvcache_host {
    int32_t *cache_seqlens, *cache_batch_idx, *block_table;
} fmha_kvcache_host;

/* A validated FP8 quantization: its scaling groups are n_batch x n_head x
 * n_block, each spanning batch_span batches, head_span heads and `rows`
 * tokens (the last block of a sequence may be shorter); `count` entries of
 * scales, in that order. */
typedef struct fmha_fp8_groups {
    int64_t n_batch, n_head, n_block;
    int64_t batch_span, head_span, rows;
    int64_t count;
} fmha_fp8_groups;

/* A row-major LSE array seen as [batch, heads, seqlen] with seqlen
 * contiguous: lse[b, h, s] = data[b * stride_batch + h * stride_head + s].
 * fmha_forward_args' lse is stride_head = seqlen, stride_batch = heads *
 * seqlen; sequence parallelism (src/sp/) also takes row ranges of one. */
typedef struct fmha_lse_view {
    float *data;
    int64_t stride_batch, stride_head;
} fmha_lse_view;

/* The most parts one merge takes: CUDA passes them all in the kernel's
 * parameters. A merge of merges is the merge, so more go in steps. */
#define FMHA_MERGE_MAX_PARTS 32

/* A validated merge of partial attention outputs (fmha_merge_partials):
 * parts[i] and out share one shape [batch, seqlen, heads, dv], the parts one
 * dtype; lses[i] and lse (data NULL: not wanted) index [batch, heads, seqlen].
 * out may be one part's very view and lse that part's LSE (in place). */
typedef struct fmha_merge_problem {
    int n;
    const fmha_tensor *parts;
    const fmha_lse_view *lses;
    fmha_tensor out;
    fmha_lse_view lse;
} fmha_merge_problem;

/* fp8_compute = int8_qk: each row (token, head) of x (f32/f16/bf16, head
 * dim <= 256) less `mean` (NULL: nothing; else [x.batch][heads][head_dim],
 * smooth_k's), rotated by the orthonormal Hadamard matrix where `rotate`
 * (head dim a power of two from 32), then coded into y's bytes, INT8 (int8)
 * or e4m3, with one scale per row (per_row: scales in the LSE's layout
 * [batch][heads][seqlen]) or per (batch, head) (scales [nseq][heads]; a
 * packed x, batch 1, repeats its row nseq times); `amax` holds batch * heads
 * floats. */
typedef struct fmha_rows_job {
    const fmha_tensor *x;
    const float *mean;
    const fmha_tensor *y;
    int int8, per_row, rotate;
    int64_t nseq;
    float *scales, *amax;
} fmha_rows_job;

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
    /* Scratch of one call whose work is queued on `stream` (sequence
     * parallelism's buffers, decode's rotated q): on CUDA stream-ordered
     * from fmha's pool, so that neither taking nor releasing it waits for
     * the device (the pool keeps the memory for the next call); on the CPU
     * the heap. scratch_free releases it once the work queued on `stream`
     * so far is done. */
    fmha_status (*scratch)(void **ptr, size_t bytes, void *stream);
    void (*scratch_free)(void *ptr, void *stream);
    /* A validated FP8 quantization, queued on `stream` where the device has one. */
    fmha_status (*quantize_fp8)(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                const fmha_fp8_groups *g, void *stream);
    /* fp8_smooth_k: ks = k less its mean over the tokens of each (batch, KV
     * head, channel), contiguous f32 [batch][seqlen][heads][head_dim] (ks
     * NULL: the means alone); the means into mean [batch][heads][head_dim];
     * `scratch` holds smooth_k_scratch(k) bytes. */
    size_t (*smooth_k_scratch)(const fmha_tensor *k);
    fmha_status (*smooth_k)(const fmha_tensor *k, float *ks, float *mean, void *scratch,
                            void *stream);
    /* After attention over the smoothed K: lse[b][h][s] += scale * (q . mean
     * of its KV head), the LSE of the unsmoothed scores. */
    fmha_status (*unsmooth_lse)(const fmha_problem *pb, const fmha_tensor *q, float *lse,
                                const float *mean, void *stream);
    /* fp8_compute = int8_qk's quantizer (fmha_rows_job), jobs queued
     * together. NULL where no kernel reads its codes. */
    fmha_status (*quantize_rows)(const fmha_rows_job *jobs, int n, void *stream);

    /* Decode: host copies of a call's cache_seqlens, cache_batch_idx and
     * block_table (device memory) for validation to read, each NULL where the
     * call has none or validation will not read it (no sequence; a block
     * table stride below 1), each freed with fmha_free. NULL where
     * the backend's memory is the host's. */
    fmha_status (*host_kvcache)(const fmha_kvcache_args *a, fmha_kvcache_host *h);
    /* Decode (a validated fmha_kvcache_args): writes the new keys and values
     * into the caches, the keys rotated where a->rotary_dim > 0, and then q
     * rotated into q_rot (a view of q's shape and dtype in the backend's
     * memory). NULL where no kernel of the backend reads caches. */
    fmha_status (*kv_append)(const fmha_problem *pb, const fmha_kvcache_args *a,
                             const fmha_tensor *q_rot);

    /* What sequence parallelism (src/sp/) does between attention calls, in
     * the backend's memory, queued on `stream` where the device has one. */
    /* A validated merge (fmha_merge_partials, the ring's running result). */
    fmha_status (*merge)(const fmha_merge_problem *mp, void *stream);
    /* dst = src element by element (f32, f16, bf16, converted as
     * fmha_store_f32 does), views of one shape. */
    fmha_status (*copy)(const fmha_tensor *dst, const fmha_tensor *src, void *stream);
    /* p[0 .. n) = value. */
    fmha_status (*fill_f32)(float *p, int64_t n, float value, void *stream);

    /* Runs a validated backward call (pb->bwd) on the backward kernel of
     * `plan` (fmha_plan_backward's). NULL where the backend has none: the
     * chooser then refuses every backward on it. */
    fmha_status (*backward)(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws);
} fmha_backend;

#ifdef __cplusplus
}
#endif
#endif /* FMHA_BACKEND_H */
