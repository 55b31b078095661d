/* cuda_int8.cu — the quantizer of fp8_compute = int8_qk: rows of head_dim
 * elements, less K's means where given, optionally rotated by the
 * orthonormal Hadamard matrix, to INT8 or e4m3 codes with one scale per row
 * or per (batch, head).
 *
 * A block takes TOK tokens of one (batch, head); each warp walks TOK / 8 of
 * them, a row in its registers (N consecutive elements per lane, N = 1, 2, 4
 * or 8, 32 N >= head_dim, so the rotation's butterflies are register adds and, past N,
 * shuffles). Per (batch, head) scales take two launches: the amax of the
 * block's rows, one atomic per block, then the codes. */
#include "cuda.h"
#include "cuda_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <type_traits>

namespace
{
using namespace fmha_cuda;

constexpr int WARPS = 8, TOK = 64; /* tokens of one (batch, head) per block */

/* One tensor's rows (fmha_rows_job, resolved). */
struct rows_job {
    const void *x;
    int64_t x_sb, x_ss, x_sh; /* element strides */
    const float *mean;        /* [batch][heads][d] subtracted first, or NULL */
    uint8_t *y;
    int64_t y_sb, y_ss, y_sh;
    int64_t batch, seqlen, heads, d;
    int64_t nseq; /* per (batch, head) scales: rows of the scale array (packed: sequences) */
    int int8;     /* codes: INT8 (else e4m3) */
    int per_row;  /* scales per row, in the LSE's layout, else per (batch, head) */
    int rotate;   /* Hadamard rotation first (d = 32 N) */
    int vec;      /* rows start aligned for N-element loads */
    float *scales;
    float *amax;    /* [batch][heads] scratch of the per-(batch, head) pass */
    int64_t chunks; /* blocks per (batch, head) */
    int64_t block0; /* this job's first block in the launch */
};

/* A launch's jobs (up to three: q, k, v), blocks numbered job by job. */
struct rows_params {
    rows_job job[3];
    int n;
};

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32(float x)
{
    return x;
}
template <> __device__ __forceinline__ float to_f32(__half x)
{
    return __half2float(x);
}
template <> __device__ __forceinline__ float to_f32(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

/* N consecutive elements from src (one vector load where aligned). */
template <typename T, int N> struct row_load {
    static __device__ __forceinline__ void run(const T *src, float *v, int n_valid, bool vec)
    {
        constexpr int BYTES = N * (int)sizeof(T);
        if (BYTES == 16 || BYTES == 8 || BYTES == 4) {
            if (vec && n_valid == N) {
                typedef typename std::conditional<
                    BYTES == 16, uint4,
                    typename std::conditional<BYTES == 8, uint2, uint32_t>::type>::type W;
                union {
                    W w;
                    T t[N];
                } u;
                u.w = __ldg((const W *)src);
#pragma unroll
                for (int e = 0; e < N; e++)
                    v[e] = to_f32(u.t[e]);
                return;
            }
        }
#pragma unroll
        for (int e = 0; e < N; e++)
            v[e] = e < n_valid ? to_f32(src[e]) : 0.0f;
    }
};

/* Row (b, s, h) of job p: lane's elements lane * N + e, less the mean,
 * rotated. RAW: the load alone (the rest in finish_row), so that a warp's
 * loads of several rows are in flight together. */
template <typename T, int N>
__device__ __forceinline__ void load_row(const rows_job &p, int64_t b, int64_t s, int64_t h,
                                         int lane, float *v)
{
    const int64_t i0 = (int64_t)lane * N;
    const int n_valid = (int)max64(0, min64(N, p.d - i0));
    const T *src = (const T *)p.x + b * p.x_sb + s * p.x_ss + h * p.x_sh + i0;
    if (n_valid > 0)
        row_load<T, N>::run(src, v, n_valid, p.vec);
    else
#pragma unroll
        for (int e = 0; e < N; e++)
            v[e] = 0.0f;
}

template <int N>
__device__ __forceinline__ void finish_row(const rows_job &p, int64_t b, int64_t h, int lane,
                                           float *v)
{
    const int64_t i0 = (int64_t)lane * N;
    if (p.mean) {
        const float *m = p.mean + (b * p.heads + h) * p.d + i0;
#pragma unroll
        for (int e = 0; e < N; e++)
            if (i0 + e < p.d)
                v[e] -= m[e];
    }
    if (!p.rotate)
        return;
        /* Fast Walsh-Hadamard transform over d = 32 N: strides below N inside a
     * lane, the rest across lanes (partner lane ^ (stride / N)); then
     * 1 / sqrt(d). */
#pragma unroll
    for (int h2 = 1; h2 < N; h2 *= 2)
#pragma unroll
        for (int e = 0; e < N; e++)
            if (!(e & h2)) {
                const float a = v[e], c = v[e + h2];
                v[e] = a + c;
                v[e + h2] = a - c;
            }
#pragma unroll
    for (int m = 1; m < 32; m *= 2)
#pragma unroll
        for (int e = 0; e < N; e++) {
            const float other = __shfl_xor_sync(0xffffffffu, v[e], m);
            v[e] = (lane & m) ? other - v[e] : v[e] + other;
        }
    const float norm = rsqrtf((float)(32 * N));
#pragma unroll
    for (int e = 0; e < N; e++)
        v[e] *= norm;
}

template <int N> __device__ __forceinline__ float warp_amax(const float *v)
{
    float m = 0.0f;
#pragma unroll
    for (int e = 0; e < N; e++)
        m = fmaxf(m, fabsf(v[e]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

/* This block's job (copied out by constant indices: a dynamic index into
 * the parameters would put them in local memory) and (chunk, head, batch);
 * false past the last job. */
__device__ __forceinline__ bool block_job(const rows_params &p, rows_job &q, int64_t &c, int64_t &h,
                                          int64_t &b)
{
    const int64_t blk = blockIdx.x;
    const int j = p.n > 2 && blk >= p.job[2].block0 ? 2 : p.n > 1 && blk >= p.job[1].block0 ? 1 : 0;
    q = j == 2 ? p.job[2] : j == 1 ? p.job[1] : p.job[0];
    const int64_t r = blk - q.block0;
    c = r % q.chunks;
    h = (r / q.chunks) % q.heads;
    b = r / (q.chunks * q.heads);
    return b < q.batch;
}

/* Per (batch, head) scales, pass 1: the amax of this block's rows into
 * amax[b][h] (non-negative floats order as their bits). */
template <typename T, int N>
__global__ void __launch_bounds__(WARPS * 32) rows_amax(const __grid_constant__ rows_params p)
{
    __shared__ float red[WARPS];
    int64_t c, h, b;
    rows_job q;
    if (!block_job(p, q, c, h, b))
        return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t s_end = min64(q.seqlen, (c + 1) * TOK);
    float m = 0.0f;
    for (int64_t s = c * TOK + warp; s < s_end; s += WARPS) {
        float v[N];
        load_row<T, N>(q, b, s, h, lane, v);
        finish_row<N>(q, b, h, lane, v);
        m = fmaxf(m, warp_amax<N>(v));
    }
    if (lane == 0)
        red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < WARPS; w++)
            m = fmaxf(m, red[w]);
        atomicMax((int *)&q.amax[b * q.heads + h], __float_as_int(m));
    }
}

/* The codes, and the per-row scales (or per (batch, head) ones from pass 1). */
template <typename T, int N>
__global__ void __launch_bounds__(WARPS * 32) rows_quantize(const __grid_constant__ rows_params p)
{
    int64_t c, h, b;
    rows_job q;
    if (!block_job(p, q, c, h, b))
        return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float qmax = q.int8 ? 127.0f : 448.0f;
    float scale = 1.0f;
    if (!q.per_row) {
        const float amax = q.amax[b * q.heads + h];
        scale = amax > 0.0f ? amax / qmax : 1.0f;
        if (c == 0 && threadIdx.x == 0) /* one row per sequence (packed x: batch 1) */
            for (int64_t r = b; r < q.nseq; r += q.batch)
                q.scales[r * q.heads + h] = scale;
    }
    const int64_t s_end = min64(q.seqlen, (c + 1) * TOK);
    for (int64_t s = c * TOK + warp; s < s_end; s += WARPS) {
        float v[N];
        load_row<T, N>(q, b, s, h, lane, v);
        finish_row<N>(q, b, h, lane, v);
        if (q.per_row) {
            const float amax = warp_amax<N>(v);
            scale = amax > 0.0f ? amax / qmax : 1.0f;
            if (lane == 0) /* the LSE's layout: [batch][heads][seqlen] */
                q.scales[(b * q.heads + h) * q.seqlen + s] = scale;
        }
        const float inv = 1.0f / scale;
        uint8_t code[N];
#pragma unroll
        for (int e = 0; e < N; e++) {
            const float x = v[e] * inv;
            code[e] = q.int8 ? (uint8_t)(int8_t)__float2int_rn(fminf(fmaxf(x, -127.0f), 127.0f))
                             : (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
        }
        const int64_t i0 = (int64_t)lane * N;
        uint8_t *y = q.y + b * q.y_sb + s * q.y_ss + h * q.y_sh + i0;
        if (N == 4 && q.vec && i0 + N <= q.d) {
            *(uint32_t *)y = code[0] | (uint32_t)code[1] << 8 | (uint32_t)code[2] << 16 |
                             (uint32_t)code[3] << 24;
        } else {
#pragma unroll
            for (int e = 0; e < N; e++)
                if (i0 + e < q.d)
                    y[e] = code[e];
        }
    }
}

template <typename T, int N>
cudaError_t launch_rows(const rows_params &all, const rows_params &pass1, cudaStream_t st)
{
    if (pass1.n > 0) {
        const rows_job &l1 = pass1.job[pass1.n - 1];
        rows_amax<T, N>
            <<<(unsigned)(l1.block0 + l1.chunks * l1.heads * l1.batch), WARPS * 32, 0, st>>>(pass1);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            return err;
    }
    const rows_job &la = all.job[all.n - 1];
    rows_quantize<T, N>
        <<<(unsigned)(la.block0 + la.chunks * la.heads * la.batch), WARPS * 32, 0, st>>>(all);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const rows_params &all, const rows_params &pass1, int n, cudaStream_t st)
{
    switch (n) {
    case 1: return launch_rows<T, 1>(all, pass1, st);
    case 2: return launch_rows<T, 2>(all, pass1, st);
    case 4: return launch_rows<T, 4>(all, pass1, st);
    default: return launch_rows<T, 8>(all, pass1, st);
    }
}

/* Elements per lane for rows of d: 1, 2, 4 or 8 (a row's 32 N >= d). */
int lane_elems(int64_t d)
{
    return d <= 32 ? 1 : d <= 64 ? 2 : d <= 128 ? 4 : 8;
}

/* The job as the kernels take it; UNSUPPORTED where its shape is out of reach. */
fmha_status resolve(const fmha_rows_job &j, rows_job &q)
{
    const fmha_tensor *x = j.x, *y = j.y;
    const int64_t d = x->head_dim, n = lane_elems(d);
    if (d > 256 || (j.rotate && (d < 32 || (d & (d - 1)))))
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "the row quantizer takes head dims up to 256 (rotated: a power of "
                              "two from 32), not %lld",
                              (long long)d);
    const int64_t es = (int64_t)fmha_dtype_size(x->dtype), vb = n * es;
    q.x = x->data;
    q.x_sb = x->stride_batch, q.x_ss = x->stride_seq, q.x_sh = x->stride_head;
    q.mean = j.mean;
    q.y = (uint8_t *)y->data;
    q.y_sb = y->stride_batch, q.y_ss = y->stride_seq, q.y_sh = y->stride_head;
    q.batch = x->batch, q.seqlen = x->seqlen, q.heads = x->heads, q.d = d;
    q.nseq = j.nseq;
    q.int8 = j.int8, q.per_row = j.per_row, q.rotate = j.rotate;
    q.vec = (uintptr_t)x->data % vb == 0 && (x->stride_seq * es) % vb == 0 &&
            (x->stride_head * es) % vb == 0 && (x->stride_batch * es) % vb == 0 &&
            (uintptr_t)y->data % n == 0 && y->stride_seq % n == 0 && y->stride_head % n == 0 &&
            y->stride_batch % n == 0;
    q.scales = j.scales, q.amax = j.amax;
    q.chunks = x->seqlen > 0 ? (x->seqlen + TOK - 1) / TOK : 1; /* seqlen 0: the scales still */
    return FMHA_STATUS_OK;
}

} // namespace

extern "C" fmha_status fmha_cuda_quantize_rows(const fmha_rows_job *jobs, int njobs, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    /* One pair of launches per run of jobs with the same elements per lane
     * (q, k and v together when head_dim_v = head_dim). */
    for (int first = 0; first < njobs;) {
        const int n = lane_elems(jobs[first].x->head_dim);
        const fmha_dtype dt = jobs[first].x->dtype;
        rows_params all = {}, pass1 = {};
        int last = first;
        fmha_status s;
        /* One job per launch: q, k and v in one launch measured slower (Flux,
         * H100: 185 against 123 us for the three). */
        for (; last < njobs && last - first < 1; last++) {
            rows_job q;
            if ((s = resolve(jobs[last], q)) != FMHA_STATUS_OK)
                return s;
            if (q.batch == 0 || q.heads == 0)
                continue;
            const int64_t blocks = q.chunks * q.heads * q.batch;
            q.block0 = all.n ? all.job[all.n - 1].block0 + all.job[all.n - 1].chunks *
                                                               all.job[all.n - 1].heads *
                                                               all.job[all.n - 1].batch
                             : 0;
            if (q.block0 + blocks >= INT32_MAX)
                return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                                      "the row quantizer takes below 2^31 blocks of %d tokens",
                                      TOK);
            all.job[all.n++] = q;
            if (!q.per_row) {
                q.block0 = pass1.n
                               ? pass1.job[pass1.n - 1].block0 + pass1.job[pass1.n - 1].chunks *
                                                                     pass1.job[pass1.n - 1].heads *
                                                                     pass1.job[pass1.n - 1].batch
                               : 0;
                pass1.job[pass1.n++] = q;
                cudaError_t err =
                    cudaMemsetAsync(q.amax, 0, (size_t)(q.batch * q.heads) * sizeof(float), st);
                if (err != cudaSuccess)
                    return fmha_cuda::cuda_error(err, "clearing the int8_qk quantizer's amax");
            }
        }
        cudaError_t err = cudaSuccess;
        if (all.n > 0) {
            switch (dt) {
            case FMHA_DTYPE_F32: err = launch_dtype<float>(all, pass1, n, st); break;
            case FMHA_DTYPE_F16: err = launch_dtype<__half>(all, pass1, n, st); break;
            default: err = launch_dtype<__nv_bfloat16>(all, pass1, n, st); break;
            }
        }
        if (err != cudaSuccess)
            return fmha_cuda::cuda_error(err, "the int8_qk quantizer launches");
        first = last;
    }
    return FMHA_STATUS_OK;
}
