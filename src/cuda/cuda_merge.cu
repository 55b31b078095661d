/* cuda_merge.cu — the CUDA backend's operations between attention calls
 * (backend.h): the merge of partial outputs by their LSEs (one warp per
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

/* Four elements of a row from element c on (c a multiple of 4, the row
 * aligned to four elements), as f32. */
__device__ __forceinline__ float4 load4_any(const char *row, int dtype, int64_t c)
{
    if (dtype == FMHA_DTYPE_F32)
        return *(const float4 *)(row + c * 4);
    const uint2 u = *(const uint2 *)(row + c * 2);
    float2 lo, hi;
    if (dtype == FMHA_DTYPE_BF16) {
        lo = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x);
        hi = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
    } else {
        lo = __half22float2(*(const __half2 *)&u.x);
        hi = __half22float2(*(const __half2 *)&u.y);
    }
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ void store4_any(char *row, int dtype, int64_t c, float4 x)
{
    if (dtype == FMHA_DTYPE_F32) {
        *(float4 *)(row + c * 4) = x;
        return;
    }
    uint2 u;
    if (dtype == FMHA_DTYPE_BF16) {
        *(__nv_bfloat162 *)&u.x = __floats2bfloat162_rn(x.x, x.y);
        *(__nv_bfloat162 *)&u.y = __floats2bfloat162_rn(x.z, x.w);
    } else {
        *(__half2 *)&u.x = __floats2half2_rn(x.x, x.y);
        *(__half2 *)&u.y = __floats2half2_rn(x.z, x.w);
    }
    *(uint2 *)(row + c * 2) = u;
}

constexpr int merge_rows = 8; /* query rows per block, one warp each */
constexpr unsigned full_warp = 0xffffffffu;

/* One warp per query row (b, s, h): lane i reads part i's LSE, the warp
 * reduces max and sum by shuffles, and the lanes then sweep the row's
 * columns (four at a time where `vec`: every row aligned to four elements
 * and dv a multiple of four). A part of LSE -inf weighs 0 and is not read;
 * NaN or +inf makes the row NaN. Each element is read and written by the
 * same lane, so out may be one of the parts. */
__global__ void __launch_bounds__(merge_rows * 32)
    merge_kernel(const merge_params p, int64_t rows, int vec)
{
    __shared__ float ws[merge_rows][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * merge_rows + warp;
    if (r >= rows)
        return;
    const int64_t h = r % p.heads, s = r / p.heads % p.seqlen, b = r / (p.heads * p.seqlen);
    float x = -INFINITY;
    if (lane < p.n)
        x = p.parts[lane].lse[b * p.parts[lane].l_b + h * p.parts[lane].l_h + s];
    const unsigned bad = __ballot_sync(full_warp, x != x || x == INFINITY);
    const unsigned live = __ballot_sync(full_warp, x == x && x != -INFINITY);
    float m = bad ? -INFINITY : x;
    for (int o = 16; o; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(full_warp, m, o));
    float w = !bad && x != -INFINITY ? expf(x - m) : 0.0f, sum = w;
    for (int o = 16; o; o >>= 1)
        sum += __shfl_xor_sync(full_warp, sum, o);
    const int state = bad ? 2 : m == -INFINITY ? 1 : 0; /* merge, no key (0, -inf), NaN */
    ws[warp][lane] = state == 0 ? w / sum : 0.0f;
    __syncwarp();
    const float fill = state == 2 ? NAN : 0.0f;
    char *orow = p.out + b * p.o_b + s * p.o_s + h * p.o_h;
    if (vec) {
        for (int64_t c = 4 * lane; c < p.dv; c += 128) {
            float4 acc = make_float4(fill, fill, fill, fill);
            if (state == 0)
                for (unsigned todo = live; todo; todo &= todo - 1) {
                    const int i = __ffs(todo) - 1;
                    const merge_part &q = p.parts[i];
                    const float wi = ws[warp][i];
                    const float4 v =
                        load4_any(q.data + b * q.s_b + s * q.s_s + h * q.s_h, p.in_dtype, c);
                    acc.x += wi * v.x, acc.y += wi * v.y, acc.z += wi * v.z, acc.w += wi * v.w;
                }
            store4_any(orow, p.out_dtype, c, acc);
        }
    } else {
        for (int64_t c = lane; c < p.dv; c += 32) {
            float acc = fill;
            if (state == 0)
                for (unsigned todo = live; todo; todo &= todo - 1) {
                    const int i = __ffs(todo) - 1;
                    const merge_part &q = p.parts[i];
                    acc += ws[warp][i] *
                           load_any(q.data + b * q.s_b + s * q.s_s + h * q.s_h, p.in_dtype, c);
                }
            store_any(orow, p.out_dtype, c, acc);
        }
    }
    if (lane == 0 && p.lse)
        p.lse[b * p.l_b + h * p.l_h + s] = state == 0   ? m + logf(sum)
                                           : state == 1 ? -INFINITY
                                                        : NAN;
}

/* Whether every row of t (bytes per element es) starts on a four-element
 * boundary and its width is a multiple of four: merge_kernel's vector path. */
bool rows_aligned4(const fmha_tensor &t, int64_t es)
{
    const int64_t a = 4 * es;
    return t.head_dim % 4 == 0 && (uintptr_t)t.data % a == 0 && t.stride_batch * es % a == 0 &&
           t.stride_seq * es % a == 0 && t.stride_head * es % a == 0;
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
    if (rows == 0)
        return FMHA_STATUS_OK;
    bool vec = rows_aligned4(o, oes);
    for (int i = 0; i < mp->n && vec; i++)
        vec = rows_aligned4(mp->parts[i], ies);
    const int64_t blocks = (rows + merge_rows - 1) / merge_rows;
    merge_kernel<<<(unsigned)blocks, merge_rows * 32, 0, (cudaStream_t)stream>>>(p, rows, vec);
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
