/* ptx.cuh — the Hopper kernel's inline PTX, a wrapper per instruction: mbarriers, TMA loads and
 * bulk stores, cluster barriers, wgmma fences and waits, setmaxnreg, shared-memory matrix
 * descriptors, named barriers and e4m3 packing. */
#pragma once

#include <cuda.h> /* CUtensorMap */

#include <stdint.h>

namespace
{

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

/* One box of a 4-D tensor map (head-dim column, row, head, batch) into
 * shared memory; its bytes count toward `bar`'s transaction. */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                         int c2, int c3, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

/* tma_load into the same offset of every block of the cluster in `mask`,
 * completing on each one's barrier at `bar`'s offset. */
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap *map, int c0,
                                                   int c1, int c2, int c3, uint32_t bar,
                                                   uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes."
                 "multicast::cluster "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
                 : "memory");
}

/* One box of shared memory out to a 4-D tensor map's coordinates (bulk tensor
 * store: rows and columns past the tensor's extents are not written), in the
 * thread's current bulk group. */
__device__ __forceinline__ void tma_store(const CUtensorMap *map, uint32_t src, int c0, int c1,
                                          int c2, int c3)
{
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
            "l"((uint64_t)map),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
        : "memory");
}

__device__ __forceinline__ void bulk_commit()
{
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* The thread's bulk stores have read their shared memory (it may be written again). */
__device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* The thread's bulk stores are complete. */
__device__ __forceinline__ void bulk_wait()
{
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/* This thread's shared-memory writes, ordered before the bulk copies that read them. */
__device__ __forceinline__ void fence_async_shared()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Arrives on the barrier at `bar`'s offset in block `rank` of the cluster. */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank)
{
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

/* Every thread of every block of the cluster. */
__device__ __forceinline__ void cluster_sync()
{
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}

__device__ __forceinline__ void wg_fence()
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads across a wgmma wait. */
template <int N> __device__ __forceinline__ void fence_regs(float *r)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(r[i])::"memory");
}

template <int N> __device__ __forceinline__ void fence_regs(uint32_t *r)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+r"(r[i])::"memory");
}

template <int R> __device__ __forceinline__ void regs_dealloc()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void regs_alloc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

/* Shared-memory matrix descriptor, 128-byte swizzle. For K-major operands
 * (Q, K) the 8-row groups are sbo = 1024 bytes apart and lbo is unused; for
 * the MN-major V, lbo is the distance between 64-column chunks. */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | (uint64_t)((lbo >> 4) & 0x3fffu) << 16 |
           (uint64_t)((sbo >> 4) & 0x3fffu) << 32 | (uint64_t)1 << 62;
}

/* The descriptor of `desc`'s matrix moved on by `bytes` (a multiple of 16):
 * shared addresses stay below 2^18, so the 14-bit address field takes the
 * sum without a carry, and a loop's descriptors cost one add each. */
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes)
{
    return desc + (bytes >> 4);
}

/* Four floats as e4m3 bytes, the first in the lowest byte (round to
 * nearest even, saturated to +-448). */
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d)
{
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (uint32_t)lo | (uint32_t)hi << 16;
}

__device__ __forceinline__ void named_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

} // namespace
