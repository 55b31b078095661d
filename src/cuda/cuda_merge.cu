/* cuda_merge.cu — the CUDA backend's operations between attention calls
 * (backend.h): the merge of partial outputs by their LSEs (one block per
 * query row, the weights computed once per row), view copies across dtypes
 * and LSE fills. The semantics are cpu/cpu_merge.c's, in f32 as there. */
#include "cuda_common.cuh"

#include <math.h>

namespace
{
using namespace fmha_cuda;

struct merge_part {
    const char *data;
    int64_t s_b, s_s, s_h; /* bytes */
    const float *lse;
    int64_t l_b, l_h; /* elements */
};

struct merge_params {
    int n, in_dtype, out_dtype;
    int64_t batch, seqlen, heads, dv;
    merge_part parts[FMHA_MERGE_MAX_PARTS];
    char *out;
    int64_t o_b, o_s, o_h;
    float *lse;
    int64_t l_b, l_h;
};

/* One block per query row (b, s, h); thread 0 computes the weights. A part
 * of LSE -inf weighs 0 and is not read; NaN or +inf makes the row NaN. */
__global__ void merge_kernel(const merge_params p)
{
    __shared__ float w[FMHA_MERGE_MAX_PARTS], ls[FMHA_MERGE_MAX_PARTS];
    __shared__ float total;
    __shared__ int state; /* 0 merge, 1 no key (0, -inf), 2 NaN */
    const int64_t r = blockIdx.x;
    const int64_t h = r % p.heads, s = r / p.heads % p.seqlen, b = r / (p.heads * p.seqlen);
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        int nan = 0;
        for (int i = 0; i < p.n; i++) {
            const float x = p.parts[i].lse[b * p.parts[i].l_b + h * p.parts[i].l_h + s];
            ls[i] = x;
            if (x != x || x == INFINITY)
                nan = 1;
            else if (x > m)
                m = x;
        }
        if (nan || m == -INFINITY) {
            state = nan ? 2 : 1;
            total = nan ? NAN : -INFINITY;
        } else {
            float sum = 0.0f;
            for (int i = 0; i < p.n; i++) {
                w[i] = ls[i] == -INFINITY ? 0.0f : expf(ls[i] - m);
                sum += w[i];
            }
            for (int i = 0; i < p.n; i++)
                w[i] /= sum;
            state = 0;
            total = m + logf(sum);
        }
    }
    __syncthreads();
    char *orow = p.out + b * p.o_b + s * p.o_s + h * p.o_h;
    for (int64_t c = threadIdx.x; c < p.dv; c += blockDim.x) {
        float acc = state == 2 ? NAN : 0.0f;
        if (state == 0)
            for (int i = 0; i < p.n; i++)
                if (ls[i] != -INFINITY) {
                    const merge_part &q = p.parts[i];
                    acc +=
                        w[i] * load_any(q.data + b * q.s_b + s * q.s_s + h * q.s_h, p.in_dtype, c);
                }
        store_any(orow, p.out_dtype, c, acc);
    }
    if (threadIdx.x == 0 && p.lse)
        p.lse[b * p.l_b + h * p.l_h + s] = total;
}

struct copy_params {
    const char *src;
    char *dst;
    int src_dtype, dst_dtype;
    int64_t batch, seqlen, heads, d;
    int64_t s_b, s_s, s_h, d_b, d_s, d_h; /* bytes */
};

__global__ void copy_kernel(const copy_params p)
{
    const int64_t rows = p.batch * p.seqlen * p.heads;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t h = r % p.heads, s = r / p.heads % p.seqlen, b = r / (p.heads * p.seqlen);
        const char *from = p.src + b * p.s_b + s * p.s_s + h * p.s_h;
        char *to = p.dst + b * p.d_b + s * p.d_s + h * p.d_h;
        for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x)
            store_any(to, p.dst_dtype, c, load_any(from, p.src_dtype, c));
    }
}

__global__ void fill_kernel(float *p, int64_t n, float value)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        p[i] = value;
}

const char *const merge_fix = ": the CUDA merge takes device memory (fmha_merge_partials merges "
                              "host memory)";

int threads_for(int64_t d)
{
    return d >= 256 ? 256 : d >= 128 ? 128 : d >= 64 ? 64 : 32;
}

} // namespace

using fmha_cuda::check_device_pointer;
using fmha_cuda::cuda_error;

extern "C" fmha_status fmha_cuda_merge(const fmha_merge_problem *mp, void *stream)
{
    fmha_status st = fmha_cuda::check_device();
    if (st != FMHA_STATUS_OK ||
        (st = check_device_pointer(mp->out.data, "out.data", merge_fix)) != FMHA_STATUS_OK)
        return st;
    merge_params p;
    memset(&p, 0, sizeof p);
    const fmha_tensor &o = mp->out;
    const int64_t oes = (int64_t)fmha_dtype_size(o.dtype);
    const int64_t ies = (int64_t)fmha_dtype_size(mp->parts[0].dtype);
    p.n = mp->n;
    p.in_dtype = mp->parts[0].dtype;
    p.out_dtype = o.dtype;
    p.batch = o.batch;
    p.seqlen = o.seqlen;
    p.heads = o.heads;
    p.dv = o.head_dim;
    for (int i = 0; i < mp->n; i++) {
        const fmha_tensor &t = mp->parts[i];
        if ((st = check_device_pointer(t.data, "a part's data", merge_fix)) != FMHA_STATUS_OK ||
            (st = check_device_pointer(mp->lses[i].data, "a part's lse", merge_fix)) !=
                FMHA_STATUS_OK)
            return st;
        p.parts[i] = {(const char *)t.data,   t.stride_batch * ies, t.stride_seq * ies,
                      t.stride_head * ies,    mp->lses[i].data,     mp->lses[i].stride_batch,
                      mp->lses[i].stride_head};
    }
    p.out = (char *)o.data;
    p.o_b = o.stride_batch * oes;
    p.o_s = o.stride_seq * oes;
    p.o_h = o.stride_head * oes;
    p.lse = mp->lse.data;
    p.l_b = mp->lse.stride_batch;
    p.l_h = mp->lse.stride_head;
    if (p.lse && (st = check_device_pointer(p.lse, "lse", merge_fix)) != FMHA_STATUS_OK)
        return st;
    const int64_t rows = o.batch * o.seqlen * o.heads;
    if (rows > INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "the CUDA merge takes at most 2^31 - 1 query rows (got %lld): "
                              "merge a batch at a time",
                              (long long)rows);
    merge_kernel<<<(unsigned)rows, threads_for(o.head_dim), 0, (cudaStream_t)stream>>>(p);
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "merge launch");
}

extern "C" fmha_status fmha_cuda_copy(const fmha_tensor *dst, const fmha_tensor *src, void *stream)
{
    copy_params p;
    const int64_t ses = (int64_t)fmha_dtype_size(src->dtype);
    const int64_t des = (int64_t)fmha_dtype_size(dst->dtype);
    p.src = (const char *)src->data;
    p.dst = (char *)dst->data;
    p.src_dtype = src->dtype;
    p.dst_dtype = dst->dtype;
    p.batch = dst->batch;
    p.seqlen = dst->seqlen;
    p.heads = dst->heads;
    p.d = dst->head_dim;
    p.s_b = src->stride_batch * ses, p.s_s = src->stride_seq * ses, p.s_h = src->stride_head * ses;
    p.d_b = dst->stride_batch * des, p.d_s = dst->stride_seq * des, p.d_h = dst->stride_head * des;
    const int64_t rows = p.batch * p.seqlen * p.heads;
    if (rows == 0)
        return FMHA_STATUS_OK;
    const unsigned blocks = (unsigned)(rows < 65536 ? rows : 65536);
    copy_kernel<<<blocks, threads_for(p.d), 0, (cudaStream_t)stream>>>(p);
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "copy launch");
}

extern "C" fmha_status fmha_cuda_fill_f32(float *ptr, int64_t n, float value, void *stream)
{
    if (n == 0)
        return FMHA_STATUS_OK;
    const int64_t blocks = (n + 255) / 256;
    fill_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, (cudaStream_t)stream>>>(ptr, n,
                                                                                             value);
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "fill launch");
}
