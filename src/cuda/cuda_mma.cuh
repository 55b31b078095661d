/* cuda_mma.cuh — the parts of the mma.sync kernels (cuda_flash.cu's forward,
 * cuda_backward.cu's backward): ldmatrix operand fetches, the m16n8k16 MMA,
 * cp.async copies and the tile loader. Fragment layouts are the PTX ISA's for
 * m16n8k16: a thread's accumulator c[e] sits at row lane / 4 + 8 (e / 2),
 * column 2 (lane % 4) + e % 2 of its 16 x 8 tile. */
#ifndef FMHA_CUDA_MMA_CUH
#define FMHA_CUDA_MMA_CUH

#include "cuda_common.cuh"

namespace fmha_cuda
{

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a b for one m16n8k16 tile. */
template <bool BF16>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    if (BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
}

/* cp_async16 with an L2 prefetch of the 128 or 256 bytes around src (PF). */
template <int PF>
__device__ __forceinline__ void cp_async16_pf(uint32_t dst, const void *src, int bytes)
{
    if (PF == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst),
                     "l"(src), "r"(bytes));
    else if (PF == 128)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst),
                     "l"(src), "r"(bytes));
    else
        cp_async16(dst, src, bytes);
}

/* 4 bytes from global src to shared dst (bytes of them; the rest zero), through L1. */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Copies rows [0, rows) x columns [0, cols) of a strided global tile into a
 * [R][DS] shared tile, zero elsewhere. Aligned tiles go as 16-byte cp.async
 * chunks; others element by element (correct, slower). */
template <int D, int R, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T *s, const T *g, int64_t row_stride, int rows, int cols,
                                          int aligned)
{
    constexpr int DS = D + 8, CH = D / 8;
    if (aligned) {
        for (int c = threadIdx.x; c < R * CH; c += THREADS) {
            const int r = c / CH, ch = c % CH;
            const bool ok = r < rows && ch * 8 < cols;
            cp_async16(smem_u32(s + r * DS + ch * 8),
                       ok ? (const void *)(g + r * row_stride + ch * 8) : (const void *)g,
                       ok ? 16 : 0);
        }
    } else {
        for (int e = threadIdx.x; e < R * D; e += THREADS) {
            const int r = e / D, c = e % D;
            s[r * DS + c] = r < rows && c < cols ? g[r * row_stride + c] : T(0.0f);
        }
    }
}

} // namespace fmha_cuda

#endif /* FMHA_CUDA_MMA_CUH */
