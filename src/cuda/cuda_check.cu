/* cuda_check.cu — checks of a call's data on the device.
 * fmha_config.check_finite on CUDA: counts the NaN and inf elements of a
 * view and finds the first, in one launch, by their exponent bits (all
 * ones; for E4M3FN, whose only non-finite codes are NaN, the seven low
 * bits). A packed forward's cu_seqlens that the host did not read
 * (fmha_problem.device_checked): checked in one launch before the attention
 * kernel, which fills out and lse with NaN and sets a flag that stops the
 * attention kernel where an offset breaks fmha.h's rules. */
#include "../alloc.h"
#include "cuda_common.cuh"

namespace
{

struct check_params {
    const char *data;
    int64_t batch, seqlen, heads, d;
    int64_t s_b, s_s, s_h;             /* strides in bytes */
    int bytes;                         /* per element: 4, 2 or 1 */
    uint32_t mask;                     /* exponent bits of the element */
    unsigned long long *count, *first; /* first: row-major [b][s][h][c] index */
};

__global__ void count_non_finite_kernel(check_params p)
{
    const int64_t rows = p.batch * p.seqlen * p.heads;
    unsigned long long n = 0, first = ~0ull;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t h = r % p.heads, s = r / p.heads % p.seqlen, b = r / (p.heads * p.seqlen);
        const char *row = p.data + b * p.s_b + s * p.s_s + h * p.s_h;
        for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
            uint32_t u = p.bytes == 4   ? ((const uint32_t *)row)[c]
                         : p.bytes == 2 ? ((const uint16_t *)row)[c]
                                        : ((const uint8_t *)row)[c];
            if ((u & p.mask) == p.mask) {
                n++;
                first = min(first, (unsigned long long)(r * p.d + c));
            }
        }
    }
    if (n) {
        atomicAdd(p.count, n);
        atomicMin(p.first, first);
    }
}

struct cu_check_params {
    const int32_t *cu_q, *cu_k;
    int64_t n, total_q, total_k, max_q, max_k;
    char *out;
    int out_dtype;
    int64_t o_ss, o_sh; /* bytes */
    int64_t heads, dv;
    float *lse; /* [heads, total_q]; NULL: none */
    int *bad;   /* written: 1 where an offset breaks the rules, else 0 */
};

/* Entry b of offsets cu (n sequences over `total` tokens) breaks fmha.h's
 * rules: cu[0] = 0, never decreasing, within the tensor, no sequence longer
 * than max_len. */
__device__ __forceinline__ bool cu_entry_bad(const int32_t *cu, int64_t b, int64_t total,
                                             int64_t max_len)
{
    const int64_t x = cu[b];
    if (x < 0 || x > total || (b == 0 && x != 0))
        return true;
    return b > 0 && (x < cu[b - 1] || x - cu[b - 1] > max_len);
}

/* Every block reads the offsets; where one breaks the rules, the blocks
 * fill out and lse with NaN. Block 0 writes the flag. */
__global__ void check_cu_seqlens_kernel(const cu_check_params p)
{
    int bad = 0;
    for (int64_t b = threadIdx.x; b <= p.n; b += blockDim.x)
        bad |= cu_entry_bad(p.cu_q, b, p.total_q, p.max_q) |
               cu_entry_bad(p.cu_k, b, p.total_k, p.max_k);
    bad = __syncthreads_or(bad);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *p.bad = bad != 0;
    if (!bad)
        return;
    for (int64_t r = blockIdx.x; r < p.total_q * p.heads; r += gridDim.x) {
        const int64_t t = r / p.heads, h = r % p.heads;
        char *row = p.out + t * p.o_ss + h * p.o_sh;
        for (int64_t c = threadIdx.x; c < p.dv; c += blockDim.x)
            fmha_cuda::store_any(row, p.out_dtype, c, NAN);
        if (threadIdx.x == 0 && p.lse)
            p.lse[h * p.total_q + t] = NAN;
    }
}

} // namespace

extern "C" fmha_status fmha_cuda_check_cu_seqlens(const fmha_problem *pb, int *bad, void *stream)
{
    const fmha_forward_args *a = pb->args;
    cu_check_params p;
    const int64_t oes = (int64_t)fmha_dtype_size(a->out.dtype);
    p.cu_q = a->cu_seqlens_q;
    p.cu_k = a->cu_seqlens_k;
    p.n = pb->batch;
    p.total_q = a->q.seqlen;
    p.total_k = a->k.seqlen;
    p.max_q = pb->max_sq;
    p.max_k = pb->max_sk;
    p.out = (char *)a->out.data;
    p.out_dtype = a->out.dtype;
    p.o_ss = a->out.stride_seq * oes;
    p.o_sh = a->out.stride_head * oes;
    p.heads = pb->heads;
    p.dv = pb->dv;
    p.lse = a->lse;
    p.bad = bad;
    const int64_t rows = p.total_q * p.heads;
    const unsigned blocks = (unsigned)(rows < 512 ? (rows > 0 ? rows : 1) : 512);
    check_cu_seqlens_kernel<<<blocks, 128, 0, (cudaStream_t)stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK
                              : fmha_cuda::cuda_error(err, "cu_seqlens check launch");
}

extern "C" fmha_status fmha_cuda_count_non_finite(const fmha_tensor *t, int64_t *count,
                                                  int64_t first[4], void *stream)
{
    *count = 0;
    const int64_t rows = t->batch * t->seqlen * t->heads;
    if (rows == 0)
        return FMHA_STATUS_OK;
    const int es = (int)fmha_dtype_size(t->dtype);
    check_params p;
    p.data = (const char *)t->data;
    p.batch = t->batch, p.seqlen = t->seqlen, p.heads = t->heads, p.d = t->head_dim;
    p.s_b = t->stride_batch * es, p.s_s = t->stride_seq * es, p.s_h = t->stride_head * es;
    p.bytes = es;
    p.mask = es == 4                       ? 0x7f800000u
             : es == 1                     ? 0x7fu
             : t->dtype == FMHA_DTYPE_BF16 ? 0x7f80u
                                           : 0x7c00u;
    void *buf = nullptr;
    if (fmha_alloc_injected_failure())
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "checking an input for NaN and inf: allocation failure injected");
    cudaError_t aerr = cudaMalloc(&buf, 2 * sizeof(unsigned long long));
    if (aerr != cudaSuccess) {
        cudaGetLastError();
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "checking an input for NaN and inf: %s",
                              cudaGetErrorString(aerr));
    }
    p.count = (unsigned long long *)buf;
    p.first = p.count + 1;
    cudaStream_t s = (cudaStream_t)stream;
    const unsigned long long init[2] = {0, ~0ull};
    unsigned long long got[2] = {0, 0};
    const int blocks = (int)fmha_cuda::min64(rows, 4096);
    cudaError_t err = cudaMemcpyAsync(buf, init, sizeof init, cudaMemcpyHostToDevice, s);
    if (err == cudaSuccess) {
        count_non_finite_kernel<<<blocks, 128, 0, s>>>(p);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(got, buf, sizeof got, cudaMemcpyDeviceToHost, s);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(s);
    cudaFree(buf);
    if (err != cudaSuccess)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "checking %s for NaN and inf: %s",
                              "an input", cudaGetErrorString(err));
    *count = (int64_t)got[0];
    if (got[0]) {
        const int64_t i = (int64_t)got[1], r = i / t->head_dim;
        first[3] = i % t->head_dim;
        first[2] = r % t->heads;
        first[1] = r / t->heads % t->seqlen;
        first[0] = r / (t->heads * t->seqlen);
    }
    return FMHA_STATUS_OK;
}
