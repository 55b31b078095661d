/* cuda_common.cuh — what the CUDA kernels share: the problem as a kernel
 * parameter block (flash_params), the element types, the softmax's fast math
 * and the host-side error helper. Included by cuda_flash.cu (portable) and
 * cuda_hopper.cu (sm_90a). */
#ifndef FMHA_CUDA_COMMON_CUH
#define FMHA_CUDA_COMMON_CUH

#include "cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

/* The head dims with a compiled kernel; any other head dim up to 256 runs
 * zero-padded in the next one up. */
#define FMHA_CUDA_HEAD_DIMS(X) X(64) X(96) X(128) X(192) X(256)

namespace fmha_cuda {

struct flash_params {
    const void *q, *k, *v;
    void *o;
    float *lse;
    int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
    const int32_t *cu_q, *cu_k;
    int varlen;
    int heads, group;
    int64_t sq, sk, total_q;
    int d, dv;
    float scale_log2; /* multiplies raw scores into the log2 domain */
    float softcap_in, softcap_out; /* softcap: tanh(s * in) * out; 0 = off */
    int causal;
    int64_t window_left, window_right;
    uint32_t drop_threshold;
    float drop_scale;
    uint64_t seed, offset;
    int out_dtype;
    int aligned; /* rows start 16-byte aligned and d, dv are multiples of 8 */
};

template <bool BF16> struct elem;
template <> struct elem<true> { typedef __nv_bfloat16 T; };
template <> struct elem<false> { typedef __half T; };

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

template <bool BF16> __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    uint32_t r;
    if (BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&r, &v, 4);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&r, &v, 4);
    }
    return r;
}

__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): absolute error ~1e-7, where the
 * tanh.approx instruction's 2^-11 relative error showed in the LSE. */
__device__ __forceinline__ float tanh_fast(float x)
{
    return 1.0f - __fdividef(2.0f, exp2_approx(2.8853900817779268f * x) + 1.0f);
}

inline fmha_status cuda_error(cudaError_t err, const char *what)
{
    return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "CUDA error in %s: %s (%s)", what,
                          cudaGetErrorString(err), cudaGetErrorName(err));
}

inline bool chunk_aligned(const fmha_tensor &t)
{
    return ((uintptr_t)t.data % 16) == 0 && t.stride_batch % 8 == 0 && t.stride_seq % 8 == 0 &&
           t.stride_head % 8 == 0 && t.head_dim % 8 == 0;
}

/* The validated problem as kernel parameters. */
inline void fill_flash_params(const fmha_problem *pb, flash_params *p)
{
    const fmha_forward_args *a = pb->args;
    const fmha_config *cfg = pb->cfg;
    memset(p, 0, sizeof *p);
    p->q = a->q.data;
    p->k = a->k.data;
    p->v = a->v.data;
    p->o = a->out.data;
    p->lse = a->lse;
    p->q_sb = a->q.stride_batch, p->q_ss = a->q.stride_seq, p->q_sh = a->q.stride_head;
    p->k_sb = a->k.stride_batch, p->k_ss = a->k.stride_seq, p->k_sh = a->k.stride_head;
    p->v_sb = a->v.stride_batch, p->v_ss = a->v.stride_seq, p->v_sh = a->v.stride_head;
    p->o_sb = a->out.stride_batch, p->o_ss = a->out.stride_seq, p->o_sh = a->out.stride_head;
    p->cu_q = a->cu_seqlens_q;
    p->cu_k = a->cu_seqlens_k;
    p->varlen = pb->varlen;
    p->heads = (int)pb->heads;
    p->group = (int)pb->group;
    p->sq = a->q.seqlen;
    p->sk = a->k.seqlen;
    p->total_q = a->q.seqlen;
    p->d = (int)pb->d;
    p->dv = (int)pb->dv;
    const double log2e = 1.4426950408889634;
    if (cfg->softcap > 0) {
        p->softcap_in = (float)(pb->scale / cfg->softcap);
        p->softcap_out = (float)(cfg->softcap * log2e);
        p->scale_log2 = 1.0f;
    } else {
        p->scale_log2 = (float)(pb->scale * log2e);
    }
    p->causal = cfg->causal;
    p->window_left = cfg->window_left;
    p->window_right = cfg->window_right;
    p->drop_threshold = pb->drop_threshold;
    p->drop_scale = (float)pb->drop_rescale;
    p->seed = a->seed;
    p->offset = a->offset;
    p->out_dtype = a->out.dtype;
    p->aligned = chunk_aligned(a->q) && chunk_aligned(a->k) && chunk_aligned(a->v);
}

#ifdef FMHA_HAVE_CUDA_HOPPER
/* cuda_hopper.cu: runs p on the sm_90a kernel. */
fmha_status hopper_forward(const fmha_problem *pb, const flash_params &p, cudaStream_t stream);
#endif

} // namespace fmha_cuda

#endif /* FMHA_CUDA_COMMON_CUH */
