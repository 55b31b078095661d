/* cuda_check.cu — fmha_config.check_finite on CUDA: counts the NaN and inf
 * elements of a view and finds the first, in one launch, by their exponent
 * bits (all ones; for E4M3FN, whose only non-finite codes are NaN, the
 * seven low bits). */
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

} // namespace

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
