/* cuda_backend.cu — the CUDA backend's table of operations (backend.h):
 * device queries, device memory (the scratch pool), cu_seqlens for validation, and the forward
 * call handed to the plan's kernel (cuda_flash.cu's portable one, the
 * Hopper kernel in hopper/, or cuda_decode.cu's for decode calls), the
 * backward to cuda_backward.cu's. The FP8 quantizer and fp8_smooth_k are
 * cuda_fp8.cu's. */
#include "cuda_common.cuh"
#include "../alloc.h"
#include "../backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

using namespace fmha_cuda;

namespace
{
const char *const layer_fix = ", but the layer runs on CUDA: pass device memory (cudaMalloc) or "
                              "build the layer with device cpu";
} // namespace

/* cuda_common.cuh: one pool per device, created on first use. */
cudaError_t fmha_cuda::scratch_alloc(void **ptr, size_t bytes, cudaStream_t stream)
{
    static std::mutex mu;
    static cudaMemPool_t pools[64];
    if (fmha_alloc_injected_failure())
        return cudaErrorMemoryAllocation;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess)
        return err;
    if (dev < 0 || dev >= 64)
        return cudaErrorInvalidDevice;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (!pools[dev]) {
            cudaMemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = cudaMemAllocationTypePinned;
            props.location.type = cudaMemLocationTypeDevice;
            props.location.id = dev;
            if ((err = cudaMemPoolCreate(&pools[dev], &props)) != cudaSuccess)
                return err;
            uint64_t keep = UINT64_MAX;
            cudaMemPoolSetAttribute(pools[dev], cudaMemPoolAttrReleaseThreshold, &keep);
        }
    }
    return cudaMallocFromPoolAsync(ptr, bytes, pools[dev], stream);
}

extern "C" int fmha_cuda_device_count(void)
{
    return device_count();
}

extern "C" fmha_status fmha_cuda_device_describe(int dev, char *buf, size_t len)
{
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, dev);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "CUDA device %d: %s", dev,
                              cudaGetErrorString(err));
    }
    snprintf(buf, len, "%s, sm_%d%d, %d SMs, %.1f GiB", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return FMHA_STATUS_OK;
}

extern "C" fmha_status fmha_cuda_fetch_cu_seqlens(const fmha_forward_args *a, int32_t **q,
                                                  int32_t **k)
{
    *q = *k = NULL;
    if (!a || !a->cu_seqlens_q || !a->cu_seqlens_k || a->varlen_batch <= 0 ||
        a->varlen_batch >= INT32_MAX)
        return FMHA_STATUS_OK;
    fmha_status st = check_device_pointer(a->cu_seqlens_q, "cu_seqlens_q", layer_fix);
    if (st == FMHA_STATUS_OK)
        st = check_device_pointer(a->cu_seqlens_k, "cu_seqlens_k", layer_fix);
    if (st != FMHA_STATUS_OK)
        return st;
    const size_t bytes = sizeof(int32_t) * (size_t)(a->varlen_batch + 1);
    *q = (int32_t *)fmha_malloc(bytes);
    *k = (int32_t *)fmha_malloc(bytes);
    if (!*q || !*k) {
        fmha_free(*q);
        fmha_free(*k);
        *q = *k = NULL;
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory copying cu_seqlens");
    }
    /* On the call's stream, after the work queued there (which may be what
     * wrote the offsets): a plain cudaMemcpy would order after the legacy
     * default stream instead, and not after a non-blocking stream's work. */
    const cudaStream_t s = (cudaStream_t)a->stream;
    cudaError_t err = cudaMemcpyAsync(*q, a->cu_seqlens_q, bytes, cudaMemcpyDeviceToHost, s);
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(*k, a->cu_seqlens_k, bytes, cudaMemcpyDeviceToHost, s);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(s);
    if (err != cudaSuccess) {
        fmha_free(*q);
        fmha_free(*k);
        *q = *k = NULL;
        return cuda_error(err, "copying cu_seqlens to the host");
    }
    return FMHA_STATUS_OK;
}

struct named_ptr {
    const void *ptr;
    const char *name;
};

/* The first of n pointers (NULL ones skipped) that is not device memory,
 * refused by name. */
static fmha_status check_device_pointers(const named_ptr *ptrs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!ptrs[i].ptr)
            continue;
        fmha_status st = check_device_pointer(ptrs[i].ptr, ptrs[i].name, layer_fix);
        if (st != FMHA_STATUS_OK)
            return st;
    }
    return FMHA_STATUS_OK;
}

/* Runs a call on the kernel of its plan, on the current device and
 * args->stream, after checking that every pointer is device memory. */
static fmha_status cuda_forward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws)
{
    const fmha_forward_args *a = pb->args;
    const named_ptr ptrs[] = {{a->q.data, "q"},
                              {a->k.data, "k"},
                              {a->v.data, "v"},
                              {a->out.data, "out"},
                              {a->lse, "lse"},
                              {a->cu_seqlens_q, "cu_seqlens_q"},
                              {a->cu_seqlens_k, "cu_seqlens_k"},
                              {a->descale_q, "descale_q"},
                              {a->descale_k, "descale_k"},
                              {a->descale_v, "descale_v"},
                              {a->mask.data, "mask.data"},
                              {a->alibi_slopes, "alibi_slopes"},
                              {a->sinks, "sinks"}};
    fmha_status st = check_device_pointers(ptrs, sizeof ptrs / sizeof *ptrs);
    if (st != FMHA_STATUS_OK)
        return st;
    if (pb->max_sq == 0) /* packed batch of empty query sequences: no row to write */
        return FMHA_STATUS_OK;
    if (plan->kernel->role == FMHA_ROLE_DECODE) /* the decode kernel reads KV caches */
        return decode_forward(plan, pb, ws, (cudaStream_t)a->stream);
    flash_params p;
    fill_flash_params(pb, &p);
    cudaStream_t stream = (cudaStream_t)a->stream;
    int *bad = nullptr; /* device-checked offsets: the check's verdict, read by the kernel */
    if (pb->varlen && pb->device_checked) {
        cudaError_t err = scratch_alloc((void **)&bad, sizeof(int), stream);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return cuda_error(err, "reserving device scratch to check cu_seqlens");
        }
        if ((st = fmha_cuda_check_cu_seqlens(pb, bad, stream)) != FMHA_STATUS_OK) {
            cudaFreeAsync(bad, stream);
            return st;
        }
        p.cu_bad = bad;
    }
    switch (plan->kernel->info.id) {
    case FMHA_KERNEL_ID_cuda_flash_sm80: st = portable_forward(plan, pb, p, stream); break;
#ifdef FMHA_HAVE_CUDA_HOPPER
    case FMHA_KERNEL_ID_cuda_hopper_sm90: st = hopper_forward(plan, pb, p, stream); break;
    case FMHA_KERNEL_ID_cuda_hopper_fp8_sm90: st = hopper_fp8_forward(plan, pb, p, stream); break;
#endif
    default:
        st = fmha_set_error(FMHA_STATUS_UNSUPPORTED, "kernel %s is not in this build",
                            plan->kernel->info.name);
    }
    if (bad)
        cudaFreeAsync(bad, stream);
    return st;
}

/* Runs a validated backward call on the backward kernel, on the current
 * device and args->stream, after checking that every pointer is device memory. */
static fmha_status cuda_backward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws)
{
    (void)ws;
    const fmha_backward_args *a = pb->bwd;
    const named_ptr ptrs[] = {{a->q.data, "q"},
                              {a->k.data, "k"},
                              {a->v.data, "v"},
                              {a->out.data, "out"},
                              {a->dout.data, "dout"},
                              {a->lse, "lse"},
                              {a->dq.data, "dq"},
                              {a->dk.data, "dk"},
                              {a->dv.data, "dv"},
                              {a->cu_seqlens_q, "cu_seqlens_q"},
                              {a->cu_seqlens_k, "cu_seqlens_k"},
                              {a->mask.data, "mask.data"},
                              {a->alibi_slopes, "alibi_slopes"},
                              {a->sinks, "sinks"},
                              {a->dsinks, "dsinks"}};
    fmha_status st = check_device_pointers(ptrs, sizeof ptrs / sizeof *ptrs);
    if (st != FMHA_STATUS_OK)
        return st;
    if (plan->kernel->role != FMHA_ROLE_BACKWARD)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED, "kernel %s is not a backward kernel",
                              plan->kernel->info.name);
    return portable_backward(plan, pb);
}

static int cuda_level(void)
{
    int dev = 0, major = 0, minor = 0;
    if (device_count() == 0 || cudaGetDevice(&dev) != cudaSuccess)
        return 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return 10 * major + minor;
}

/* The Hopper kernels are sm_90a machine code: compute capability 9.0 only. */
static int cuda_runs_sm90a(void)
{
#ifdef FMHA_HAVE_CUDA_HOPPER
    return cuda_level() == 90;
#else
    return 0;
#endif
}

static fmha_status cuda_plan_variant(fmha_plan *plan)
{
    plan->max_cluster = 1;
    plan->has_two_level = 0;
    if (plan->kernel->role == FMHA_ROLE_BACKWARD)
        return backward_variant(plan);
    if (plan->kernel->role == FMHA_ROLE_DECODE)
        return decode_variant(plan);
#ifdef FMHA_HAVE_CUDA_HOPPER
    if (plan->kernel->info.id != FMHA_KERNEL_ID_cuda_flash_sm80)
        return hopper_variant(plan);
#endif
    return portable_variant(plan);
}

static fmha_status cuda_scratch(void **ptr, size_t bytes, void *stream)
{
    const cudaError_t err = scratch_alloc(ptr, bytes, (cudaStream_t)stream);
    if (err != cudaSuccess) {
        cudaGetLastError();
        *ptr = nullptr; /* whatever the failed call left there */
        return cuda_error(err, "reserving device scratch");
    }
    return FMHA_STATUS_OK;
}

static void cuda_scratch_free(void *ptr, void *stream)
{
    if (ptr)
        cudaFreeAsync(ptr, (cudaStream_t)stream);
}

static fmha_status cuda_unsmooth(const fmha_problem *pb, const fmha_tensor *q, float *lse,
                                 const float *mean, void *stream)
{
    return fmha_cuda_unsmooth_lse(q, lse, mean, pb->kv_heads, pb->group, pb->scale, stream);
}

extern "C" const fmha_backend fmha_cuda_backend = {
    FMHA_DEVICE_CUDA,
    "cuda",
    check_device,
    cuda_level,
    cuda_level,
    cuda_runs_sm90a,
    cuda_plan_variant,
    fmha_cuda_fetch_cu_seqlens,
    cuda_forward,
    fmha_cuda_count_non_finite,
    device_alloc,
    device_free,
    cuda_scratch,
    cuda_scratch_free,
    fmha_cuda_quantize_fp8,
    fmha_cuda_smooth_k_scratch,
    fmha_cuda_smooth_k,
    cuda_unsmooth,
    fmha_cuda_quantize_rows,
    fmha_cuda_host_kvcache,
    fmha_cuda_kv_append,
    fmha_cuda_merge,
    fmha_cuda_copy,
    fmha_cuda_fill_f32,
    cuda_backward,
};
