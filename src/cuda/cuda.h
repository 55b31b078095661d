/* cuda.h — the CUDA backend's entry points, callable from C. Built only when
 * CMake finds nvcc (FMHA_HAVE_CUDA). The layer reaches them through
 * fmha_cuda_backend (backend.h, defined in cuda_backend.cu); cuda_fp8.cu
 * holds the FP8 quantizer and fp8_smooth_k, cuda_check.cu the finite check. */
#ifndef FMHA_CUDA_H
#define FMHA_CUDA_H

#include "../backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Copies a packed batch's cu_seqlens_q/k (device memory) into host arrays of
 * varlen_batch + 1 entries each, which the caller frees, so that validation
 * can read them: one small synchronous copy per packed call. Leaves *q, *k
 * NULL (and returns OK) when there is nothing sensible to copy; validation
 * then reports the arguments. */
fmha_status fmha_cuda_fetch_cu_seqlens(const fmha_forward_args *args, int32_t **q, int32_t **k);

/* A packed forward's device-checked cu_seqlens (fmha_problem.device_checked):
 * one launch on `stream`, before the attention kernel, that writes *bad
 * (device memory) 1 and fills out and lse with NaN when an offset breaks
 * fmha.h's rules, else writes *bad 0. */
fmha_status fmha_cuda_check_cu_seqlens(const fmha_problem *pb, int *bad, void *stream);

/* fmha_backend.count_non_finite: one launch on `stream` over t (device
 * memory), then a synchronous copy of the count and the first index. */
fmha_status fmha_cuda_count_non_finite(const fmha_tensor *t, int64_t *count, int64_t first[4],
                                       void *stream);

/* fmha_quantize_fp8_cuda after validation: checks the device and that x, y
 * and scales are device memory, then queues one kernel on `stream`. */
fmha_status fmha_cuda_quantize_fp8(const fmha_tensor *x, const fmha_tensor *y, float *scales,
                                   const fmha_fp8_groups *g, void *stream);

/* fp8_smooth_k on CUDA, queued on `stream` (fmha_backend.smooth_k): three
 * launches, column sums over 256-token chunks added in a fixed order (no
 * atomics); `partial` is device scratch of fmha_cuda_smooth_k_scratch(k)
 * bytes. */
size_t fmha_cuda_smooth_k_scratch(const fmha_tensor *k);

/* Between attention calls (cuda_merge.cu), queued on `stream`: the merge of
 * partial outputs (fmha_backend.merge; checks the device and that out, the
 * parts and their LSEs are device memory), view copies, LSE fills. */
fmha_status fmha_cuda_merge(const fmha_merge_problem *mp, void *stream);
fmha_status fmha_cuda_copy(const fmha_tensor *dst, const fmha_tensor *src, void *stream);
fmha_status fmha_cuda_fill_f32(float *p, int64_t n, float value, void *stream);
fmha_status fmha_cuda_smooth_k(const fmha_tensor *k, float *ks, float *mean, void *partial,
                               void *stream);

/* After the attention on the smoothed K: the LSE of the unsmoothed scores,
 * lse[b][h][s] += scale * (q[b][s][h] . mean[b][h / group]), mean being
 * fmha_cuda_smooth_k's [batch][kv_heads][head_dim]. */
fmha_status fmha_cuda_unsmooth_lse(const fmha_tensor *q, float *lse, const float *mean,
                                   int64_t kv_heads, int64_t group, double scale, void *stream);

/* fmha_backend.quantize_rows on CUDA (cuda_int8.cu), queued on `stream`:
 * one launch per job, two for per-(batch, head) scales. */
fmha_status fmha_cuda_quantize_rows(const fmha_rows_job *jobs, int n, void *stream);

/* Decode (cuda_decode.cu): fmha_backend.host_kvcache (checks that the
 * arrays are device memory; one synchronous copy on the call's stream) and
 * fmha_backend.kv_append (queued on the call's stream). */
fmha_status fmha_cuda_host_kvcache(const fmha_kvcache_args *a, fmha_kvcache_host *h);
fmha_status fmha_cuda_kv_append(const fmha_problem *pb, const fmha_kvcache_args *a,
                                const fmha_tensor *q_rot);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_CUDA_H */
