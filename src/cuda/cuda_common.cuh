/* cuda_common.cuh — what the CUDA kernels share: the problem as a kernel
 * parameter block (flash_params), the element types, the softmax's fast math
 * and the host-side error helper. Included by every CUDA source. */
#ifndef FMHA_CUDA_COMMON_CUH
#define FMHA_CUDA_COMMON_CUH

#include "cuda.h"
#include "../alloc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

/* The head dims with a compiled kernel; any other head dim up to 256 runs
 * zero-padded in the next one up. The portable forward has 512 too (up to
 * 512 runs there). */
#define FMHA_CUDA_HEAD_DIMS(X)          X(64) X(96) X(128) X(192) X(256)
#define FMHA_CUDA_PORTABLE_HEAD_DIMS(X) FMHA_CUDA_HEAD_DIMS(X) X(512)
/* The FP8 kernel's: its rows are 128-byte chunks of 128 columns. */
#define FMHA_CUDA_FP8_HEAD_DIMS(X) X(64) X(128) X(256)

namespace fmha_cuda
{

struct flash_params {
    const void *q, *k, *v;
    void *o;
    float *lse;
    int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
    const int32_t *cu_q, *cu_k;
    int varlen;
    /* Packed calls whose offsets the host did not read
     * (fmha_problem.device_checked): nonzero where fmha_cuda_check_cu_seqlens
     * found them broken, and then no block computes (out and lse are NaN);
     * NULL otherwise. */
    const int *cu_bad;
    int heads, group;
    int64_t sq, sk, total_q;
    int d, dv;
    float scale_log2;              /* multiplies raw scores into the log2 domain */
    float softcap_in, softcap_out; /* softcap: tanh(s * in) * out; 0 = off */
    int causal;
    int64_t window_left, window_right;
    uint32_t drop_threshold;
    float drop_scale;
    uint64_t seed, offset;
    /* The call's place in a larger problem, for the dropout stream (fmha_problem) */
    int64_t pos_row0, pos_col0, pos_head0, pos_heads;
    int out_dtype;
    int aligned; /* rows start 16-byte aligned and d, dv are multiples of 8 */
    /* f8_e4m3 inputs: descales in device memory (NULL = 1), one per tensor or
     * per (sequence, KV head). */
    const float *descale_q, *descale_k, *descale_v;
    int descale_per_kv_head;
    /* fp8_compute = int8_qk: one q scale per row, in the LSE's layout, beside
     * descale_q (which then holds 1) */
    const float *q_row_scale;
    int q_scale_per_row;
    int kv_heads;
    /* The score modifiers (fmha_forward_args), in device memory: the mask
     * (type FMHA_MASK_*, strides in elements), ALiBi slopes, sinks; a bias
     * enters S times bias_unit (S's units per unit of score). mods: any. */
    const void *mask;
    int mask_type;
    int64_t mask_sb, mask_sh, mask_sq, mask_sk;
    const float *alibi;
    int64_t alibi_sb;
    const float *sinks;
    float bias_unit;
    int mods;
};

template <bool BF16> struct elem;
template <> struct elem<true> {
    typedef __nv_bfloat16 T;
};
template <> struct elem<false> {
    typedef __half T;
};

/* The dropout words of keys col and col + 1 (col even) of query row `row`
 * of head h of sequence b, at the call's place in the whole problem: word e
 * keeps key col + e iff it is >= drop_threshold. One Philox draw serves both
 * unless an odd pos_col0 puts the pair across two draws. */
__device__ __forceinline__ void dropout_pair_words(const flash_params &p, int64_t b, int64_t h,
                                                   int64_t row, int64_t col, uint32_t wd[2])
{
    const int64_t seq_head = b * p.pos_heads + p.pos_head0 + h, r = row + p.pos_row0;
    const int64_t g = col + p.pos_col0;
    const fmha_u32x4 w = fmha_dropout_words(p.seed, p.offset, seq_head, r, g);
    const int e = (int)(g & 3);
    wd[0] = e == 0 ? w.v[0] : e == 1 ? w.v[1] : e == 2 ? w.v[2] : w.v[3];
    wd[1] = e == 0   ? w.v[1]
            : e == 1 ? w.v[2]
            : e == 2 ? w.v[3]
                     : fmha_dropout_words(p.seed, p.offset, seq_head, r, g + 1).v[0];
}

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

/* One block's queries [m0, m0 + rows) of sequence b, head h, and the keys
 * [kv_begin, kv_end) any of them sees. Both kernels number their query blocks
 * the same way: (query block from the end, head, sequence), in blockIdx for
 * the portable kernel and as one index for the Hopper one. */
struct block_span {
    int64_t m0, q0, sq, k0, sk, tb; /* q0, k0: packed offsets; tb: batch index into the tensors */
    int h, b, hk, rows;
    int64_t lo_first, hi_first, lo_last, hi_last; /* visible keys of the first and the last row */
    int64_t kv_begin, kv_end;
    int ntiles; /* tiles of BN keys from kv_begin */
};

/* Query block `mblock` of head h, sequence b; false when the block lies
 * past its sequence's end. Late query blocks see
 * the most keys under a causal mask, so they are numbered (and start) first.
 * Tiles start at a multiple of 16 keys: a thread's key pair (2c, 2c + 1) then
 * never straddles two dropout draws of four keys, and the FP8 kernel's V^T
 * permutation (16-key groups) lines up with the tile. */
__device__ __forceinline__ bool block_span_at(block_span &s, const flash_params &p, int BM, int BN,
                                              int64_t mblock, int h, int b)
{
    s.m0 = mblock * BM;
    s.h = h;
    s.b = b;
    s.q0 = 0, s.sq = p.sq, s.k0 = 0, s.sk = p.sk, s.tb = s.b;
    if (p.varlen) {
        s.q0 = p.cu_q[s.b];
        s.sq = p.cu_q[s.b + 1] - s.q0;
        s.k0 = p.cu_k[s.b];
        s.sk = p.cu_k[s.b + 1] - s.k0;
        s.tb = 0;
        if (p.cu_bad && *p.cu_bad)
            return false;
    }
    if (s.m0 >= s.sq)
        return false;
    s.rows = (int)min64(BM, s.sq - s.m0);
    s.hk = s.h / p.group;
    /* The visible intervals move right with the row. */
    fmha_mask_range(p.causal, p.window_left, p.window_right, s.m0, s.sq, s.sk, &s.lo_first,
                    &s.hi_first);
    fmha_mask_range(p.causal, p.window_left, p.window_right, s.m0 + s.rows - 1, s.sq, s.sk,
                    &s.lo_last, &s.hi_last);
    s.kv_begin = s.lo_first & ~(int64_t)15;
    s.kv_end = s.hi_last;
    s.ntiles = s.kv_end > s.kv_begin ? (int)((s.kv_end - s.kv_begin + BN - 1) / BN) : 0;
    return true;
}

/* The block's span, where blockIdx.x = parts x query block + part (the
 * blocks that split a query tile's output columns share its span). */
__device__ __forceinline__ bool block_span_init(block_span &s, const flash_params &p, int BM,
                                                int BN, int parts = 1)
{
    return block_span_at(s, p, BM, BN, (int64_t)(gridDim.x / parts - 1 - blockIdx.x / parts),
                         blockIdx.y, blockIdx.z);
}

/* Every row of the block sees every key of [n0, n0 + BN): no mask needed. */
__device__ __forceinline__ bool block_span_full(const block_span &s, int64_t n0, int BN)
{
    return n0 + BN <= s.kv_end && s.lo_last <= n0 && n0 + BN <= s.hi_first;
}

/* Output row r of the block. */
__device__ __forceinline__ char *block_out_row(const flash_params &p, const block_span &s, int r)
{
    return (char *)p.o + (s.tb * p.o_sb + (s.q0 + s.m0 + r) * p.o_ss + s.h * p.o_sh) *
                             (p.out_dtype == FMHA_DTYPE_F32 ? 4 : 2);
}

/* Element i of an array of dtype `dtype` (f32, bf16 or f16), read as f32
 * and written from f32 (round to nearest even). */
__device__ __forceinline__ float load_any(const void *base, int dtype, int64_t i)
{
    if (dtype == FMHA_DTYPE_F32)
        return ((const float *)base)[i];
    if (dtype == FMHA_DTYPE_BF16)
        return __bfloat162float(((const __nv_bfloat16 *)base)[i]);
    return __half2float(((const __half *)base)[i]);
}

__device__ __forceinline__ void store_any(void *base, int dtype, int64_t i, float x)
{
    if (dtype == FMHA_DTYPE_F32)
        ((float *)base)[i] = x;
    else if (dtype == FMHA_DTYPE_BF16)
        ((__nv_bfloat16 *)base)[i] = __float2bfloat16_rn(x);
    else
        ((__half *)base)[i] = __float2half_rn(x);
}

/* Element c of an output row, in out's dtype. */
__device__ __forceinline__ void store_out(const flash_params &p, char *orow, int c, float x)
{
    store_any(orow, p.out_dtype, c, x);
}

/* The score modifiers' bias at query i, key j of sequence b, head h (sq
 * queries, sk keys): the additive mask's value minus the ALiBi slope times
 * the distance from the query's diagonal, or -inf where a boolean mask
 * hides the key (fmha.h). */
__device__ __forceinline__ float score_bias(const flash_params &p, int64_t b, int64_t h, int64_t i,
                                            int64_t j, int64_t sq, int64_t sk)
{
    float x = 0.0f;
    if (p.alibi) {
        const int64_t dist = i + sk - sq - j;
        x = -p.alibi[b * p.alibi_sb + h] * (float)(dist < 0 ? -dist : dist);
    }
    if (p.mask) {
        const int64_t e = b * p.mask_sb + h * p.mask_sh + i * p.mask_sq + j * p.mask_sk;
        if (p.mask_type == FMHA_MASK_BOOL)
            return ((const unsigned char *)p.mask)[e] ? x : -INFINITY;
        x += load_any(p.mask,
                      p.mask_type == FMHA_MASK_ADD_F32   ? FMHA_DTYPE_F32
                      : p.mask_type == FMHA_MASK_ADD_F16 ? FMHA_DTYPE_F16
                                                         : FMHA_DTYPE_BF16,
                      e);
    }
    return x;
}

/* The sink of head h (fmha.h; sinks NULL: none) into a finished row: its
 * running max m (log2 domain) and sum l become those of the row plus one key
 * of value 0 and logit sink; the output, o / l before, is o * (*scale) / l
 * after. The forward's and decode's last step. */
__device__ __forceinline__ void add_sink(const float *sinks, int h, float &m, float &l,
                                         float &scale)
{
    scale = 1.0f;
    if (!sinks)
        return;
    const float x = sinks[h] * 1.4426950408889634f;
    if (x == -INFINITY || m != m || l != l)
        return;
    const float mn = fmaxf(m, x);
    scale = exp2f(m - mn);
    l = l * scale + exp2f(x - mn);
    m = mn;
}

/* -inf on this thread's scores of row r (of `rows`) that the row does not
 * see among the tile's keys [n0, n0 + nvalid); x(j, e) is the score of key
 * n0 + 8 j + 2 (lane % 4) + e, j < BN / 8 (both kernels' accumulator layout). */
template <int BN, class X>
__device__ __forceinline__ void mask_frag(const flash_params &p, int r, int rows, int64_t m0,
                                          int64_t sq, int64_t sk, int64_t n0, int nvalid, int lane,
                                          X x)
{
    int64_t lo = 0, hi = 0;
    if (r < rows)
        fmha_mask_range(p.causal, p.window_left, p.window_right, m0 + r, sq, sk, &lo, &hi);
    const int jlo = (int)max64(lo - n0, -1), jhi = (int)min64(hi - n0, nvalid);
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = j * 8 + (lane % 4) * 2 + e;
            if (c < jlo || c >= jhi)
                x(j, e) = -INFINITY;
        }
}

/* This thread's part of an output row in both kernels' accumulator layout:
 * f(c, j, e) for column c = c0 + 8 j + 2 (lane % 4) + e (e = 0, 1), j < D / 8
 * (c0: the first column a block owns, where blocks split the row); columns
 * from dv on are padding and skipped. */
template <int D, class F>
__device__ __forceinline__ void for_out_frag(const flash_params &p, int lane, int c0, F f)
{
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = c0 + j * 8 + (lane % 4) * 2 + e;
            if (c < p.dv)
                f(c, j, e);
        }
}

/* The row's elements in out's dtype; x(j, e) is column c0 + 8 j + 2 (lane % 4) + e. */
template <int D, class X>
__device__ __forceinline__ void store_out_frag(const flash_params &p, char *orow, int lane, int c0,
                                               X x)
{
    for_out_frag<D>(p, lane, c0, [&](int c, int j, int e) { store_out(p, orow, c, x(j, e)); });
}

/* LSE of row r from its running max (log2 domain) and sum; -inf for a row
 * that saw no key. */
__device__ __forceinline__ void store_lse(const flash_params &p, const block_span &s, int r,
                                          float m_log2, float l)
{
    const int64_t idx = p.varlen ? (int64_t)s.h * p.total_q + s.q0 + s.m0 + r
                                 : ((int64_t)s.b * p.heads + s.h) * s.sq + s.m0 + r;
    /* A NaN row (docs/reliability.md) keeps a NaN LSE; a row of no key -inf. */
    p.lse[idx] = l > 0.0f || l != l ? (m_log2 + log2f(l)) * 0.69314718055994531f : -INFINITY;
}

/* A failed CUDA call as fmha's status: OUT_OF_MEMORY where the device ran
 * out of memory (the caller can free some and retry), else BACKEND_ERROR. */
inline fmha_status cuda_error(cudaError_t err, const char *what)
{
    return fmha_set_error(
        err == cudaErrorMemoryAllocation ? FMHA_STATUS_OUT_OF_MEMORY : FMHA_STATUS_BACKEND_ERROR,
        "CUDA error in %s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

/* Stream-ordered scratch from a pool of fmha's own per device, which keeps
 * its memory between calls (the default pool would hand it back to the
 * driver at every synchronisation); freed with cudaFreeAsync on the same
 * stream. Capturable in a CUDA graph. Defined in cuda_backend.cu. */
cudaError_t scratch_alloc(void **ptr, size_t bytes, cudaStream_t stream);

/* Device memory for a layer's scratch (cudaMalloc; an injected allocation
 * failure, tests/, refuses it), and its release (NULL is fine). */
inline fmha_status device_alloc(void **ptr, size_t bytes)
{
    *ptr = nullptr;
    if (fmha_alloc_injected_failure())
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "reserving %zu bytes of device scratch: allocation failure injected",
                              bytes);
    cudaError_t err = cudaMalloc(ptr, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        *ptr = nullptr;
        return fmha_set_error(err == cudaErrorMemoryAllocation ? FMHA_STATUS_OUT_OF_MEMORY
                                                               : FMHA_STATUS_BACKEND_ERROR,
                              "reserving %zu bytes of device scratch: %s", bytes,
                              cudaGetErrorString(err));
    }
    return FMHA_STATUS_OK;
}

inline void device_free(void *ptr)
{
    if (ptr)
        cudaFree(ptr);
}

/* Device or managed memory passes; anything the runtime calls host memory is
 * refused as "<name> is host memory<fix>". */
inline fmha_status check_device_pointer(const void *ptr, const char *name, const char *fix)
{
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return cuda_error(err, "cudaPointerGetAttributes");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "%s is host memory%s", name, fix);
    return FMHA_STATUS_OK;
}

/* CUDA devices the runtime sees; 0 without a driver or GPU. */
inline int device_count()
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

/* OK when a device of compute capability >= 8.0 is current; else UNSUPPORTED
 * with the reason. */
inline fmha_status check_device()
{
    if (device_count() == 0)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "no CUDA device found (driver missing or no GPU): use device cpu");
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major < 8)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "CUDA device %d has compute capability %d.%d; fmha's CUDA kernels "
                              "need 8.0 (Ampere) or later",
                              dev, major, minor);
    return FMHA_STATUS_OK;
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
    p->pos_row0 = pb->pos_row0;
    p->pos_col0 = pb->pos_col0;
    p->pos_head0 = pb->pos_head0;
    p->pos_heads = pb->pos_heads;
    p->out_dtype = a->out.dtype;
    p->aligned = chunk_aligned(a->q) && chunk_aligned(a->k) && chunk_aligned(a->v);
    p->descale_q = a->descale_q;
    p->descale_k = a->descale_k;
    p->descale_v = a->descale_v;
    p->descale_per_kv_head = a->descale_layout == FMHA_DESCALE_PER_KV_HEAD;
    p->kv_heads = (int)pb->kv_heads;
    p->q_row_scale = pb->q_row_scale;
    p->q_scale_per_row = pb->q_row_scale != NULL;
    p->mask = a->mask.data;
    p->mask_type = a->mask.type;
    p->mask_sb = a->mask.stride_batch, p->mask_sh = a->mask.stride_head;
    p->mask_sq = a->mask.stride_q, p->mask_sk = a->mask.stride_k;
    p->alibi = a->alibi_slopes;
    p->alibi_sb = a->alibi_stride_batch;
    p->sinks = a->sinks;
    p->bias_unit = cfg->softcap > 0 ? (float)log2e : (float)(1.0 / pb->scale);
    p->mods = fmha_has_score_mods(a);
}

/* cuda_flash.cu: the portable kernel's variant for a plan (head dim, tile),
 * and a call on it. */
fmha_status portable_variant(fmha_plan *plan);
fmha_status portable_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                             cudaStream_t stream);

/* cuda_backward.cu: the backward kernel's variant for a plan (head dim), and
 * a validated backward call (pb->bwd) on it. */
fmha_status backward_variant(fmha_plan *plan);
fmha_status portable_backward(const fmha_plan *plan, const fmha_problem *pb);

/* cuda_decode.cu: the decode kernel's variant for a plan (head dim), and a
 * validated decode call (pb->kv_cache) on it, its splits' partials in `ws`. */
fmha_status decode_variant(fmha_plan *plan);
fmha_status decode_forward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws,
                           cudaStream_t stream);

#ifdef FMHA_HAVE_CUDA_HOPPER
/* The Hopper kernels: the variant for a plan (compiled head dim, tile,
 * clusters, two-level accumulation), and a call on the sm_90a kernel (f16/bf16
 * inputs) or its FP8 variant (f8_e4m3 inputs), as the call's plan says. */
fmha_status hopper_variant(fmha_plan *plan);
fmha_status hopper_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                           cudaStream_t stream);
fmha_status hopper_fp8_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                               cudaStream_t stream);
#endif

} // namespace fmha_cuda

#endif /* FMHA_CUDA_COMMON_CUH */
