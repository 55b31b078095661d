/* cuda.h — the CUDA backend's entry points, callable from C. Built only when
 * CMake finds nvcc (FMHA_HAVE_CUDA); cuda_flash.cu holds the attention
 * kernel, cuda_fp8.cu the FP8 quantizer and fp8_smooth_k. */
#ifndef FMHA_CUDA_H
#define FMHA_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../internal.h"

/* OK when a device of compute capability >= 8.0 is current; else UNSUPPORTED
 * with the reason. */
fmha_status fmha_cuda_check_device(void);

/* 1 when the sm_90a kernel was built and the current device is compute
 * capability 9.0 (H100/H200), whose machine code it is. */
int fmha_cuda_hopper_usable(void);

/* Copies a packed batch's cu_seqlens_q/k (device memory) into host arrays of
 * varlen_batch + 1 entries each, which the caller frees, so that validation
 * can read them: one small synchronous copy per packed call. Leaves *q, *k
 * NULL (and returns OK) when there is nothing sensible to copy; validation
 * then reports the arguments. */
fmha_status fmha_cuda_fetch_cu_seqlens(const fmha_forward_args *args, int32_t **q, int32_t **k);

/* The layer's kernel for one call (select.c): the Hopper kernel reads q, k, v
 * through TMA, which needs 16-byte aligned rows; other views run on the
 * portable kernel. The FP8 kernel has no such twin: q and k views it cannot
 * read, and per-block descales, are UNSUPPORTED. */
fmha_status fmha_kernel_for_call(const fmha_kernel_info *kernel, const fmha_problem *pb,
                                 const fmha_kernel_info **out);

/* Whether the FP8 kernel adds each key tile's P V into O in f32 (two-level
 * accumulation; head dims up to 128, no dropout) or lets wgmma accumulate O
 * across tiles. FMHA_FP8_ACCUM=auto (or unset) takes two-level when the
 * longest key sequence, max_sk, passes FMHA_FP8_TWO_LEVEL_KEYS: measured on
 * the H200 (bench/RESULTS.md), the single-level sum's error grows with the
 * keys (relative L2 2.6e-3 at 4.6k keys, 4.1e-3 at 16k, 8.5e-3 at 75.6k, in
 * quadrature beside the 2.5e-2 of P in e4m3) while two-level costs 9-12% of
 * the speed. two_level and single force a mode; any other value is
 * INVALID_ARGUMENT (select.c). */
#define FMHA_FP8_TWO_LEVEL_KEYS 16384
fmha_status fmha_fp8_two_level(int64_t max_sk, int *two_level);

/* How the Hopper kernel deals its query tiles to the SMs (cuda_hopper.cu,
 * hopper_sched), from FMHA_CUDA_SCHEDULE: `tiles`, one block per tile;
 * `persistent`, one block per SM looping over tiles; `split` (or unset),
 * persistent with the last, partial round cut along the keys. Causal,
 * windowed and packed calls always run one block per tile. Measured on the
 * H200 (bench/NOTES.md, v5): persistent ran Flux 2-4% faster than tiles;
 * split, against persistent in one process, ties on Flux and gains 1.6-2.1%
 * on FA3's d128 grid. Any other value is INVALID_ARGUMENT (select.c). */
typedef enum { FMHA_SCHEDULE_TILES, FMHA_SCHEDULE_PERSISTENT, FMHA_SCHEDULE_SPLIT } fmha_schedule;
fmha_status fmha_cuda_schedule(fmha_schedule *schedule);

/* Whether the Hopper kernel runs two neighbouring query tiles of a head as
 * a cluster of two blocks that share each K/V tile load (TMA multicast;
 * 16-bit inputs, D >= 128, no dropout, uniform tiles: cuda_hopper.cu,
 * cluster_fits): FMHA_CUDA_CLUSTER=auto (or unset) where the keys are long
 * enough for it to pay, 1 wherever it fits, 0 never. Any other value is
 * INVALID_ARGUMENT. */
typedef enum { FMHA_CLUSTER_OFF, FMHA_CLUSTER_ON, FMHA_CLUSTER_AUTO } fmha_cluster_mode;
fmha_status fmha_cuda_clusters(fmha_cluster_mode *mode);

/* Runs a validated problem on the current device and args->stream. Checks
 * that every pointer is device memory before anything runs. */
fmha_status fmha_cuda_forward(const fmha_problem *pb, const fmha_kernel_info *kernel);

/* Device memory for a layer's scratch (cudaMalloc), and its release
 * (NULL is fine). */
fmha_status fmha_cuda_alloc(void **ptr, size_t bytes);
void fmha_cuda_free(void *ptr);

/* fmha_quantize_fp8_cuda after validation (fp8.c): checks the device and that
 * x, y and scales are device memory, then queues one kernel on `stream`
 * (cuda_fp8.cu). */
fmha_status fmha_cuda_quantize_fp8(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                   const fmha_fp8_groups *g, void *stream);

/* fp8_smooth_k on CUDA (cuda_fp8.cu), queued on `stream`: ks = k less its
 * mean over the tokens of each (batch entry, head, channel), contiguous f32
 * [batch][seqlen][heads][head_dim], and the means into `mean`
 * [batch][heads][head_dim]; `partial` is device scratch of
 * fmha_cuda_smooth_k_scratch(k) bytes (column sums, 8-byte aligned). */
size_t fmha_cuda_smooth_k_scratch(const fmha_tensor *k);
fmha_status fmha_cuda_smooth_k(const fmha_tensor *k, float *ks, float *mean, void *partial, void *stream);

/* After the attention on the smoothed K: the LSE of the unsmoothed scores,
 * lse[b][h][s] += scale * (q[b][s][h] . mean[b][h / group]), mean being
 * fmha_cuda_smooth_k's [batch][kv_heads][head_dim]. */
fmha_status fmha_cuda_unsmooth_lse(const fmha_tensor *q, float *lse, const float *mean, int64_t kv_heads,
                                   int64_t group, double scale, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_CUDA_H */
