/* cuda_hopper.cu — the Hopper forward (sm_90a), warp-specialized: a producer
 * warp streams Q once and K/V tiles through a shared-memory ring with the
 * tensor copy engine (TMA), completing on mbarriers; two consumer warpgroups
 * of 64 queries each run S = Q K^T and O += P V on wgmma and the online
 * softmax in registers (S's accumulator fragment is P's register operand).
 * Every feature of the portable kernel runs here: masks, softcap, GQA,
 * varlen, LSE, dropout (same Philox stream), head_dim_v (zero-padded to D).
 * A block may run several query tiles in turn, and pieces of tiles split
 * along the keys (hopper_sched: persistent blocks, split last round).
 *
 * The same kernel takes f8_e4m3 inputs (IN_E4M3): both GEMMs run on FP8
 * wgmma, whose B operand must be K-major, so V is first transposed into
 * scratch (vt_kernel below) with the keys of each 16-key group permuted to
 * match the order in which S's accumulator fragment hands P to the second
 * GEMM. The descales fold into the softmax scale and the final 1 / l. */
#include "../cuda_common.cuh"
#include "sched.cuh"

#include <cuda.h> /* CUtensorMap */
#include <cudaTypedefs.h>

#include <math.h>
#include <stdint.h>

#include <atomic>
#include <mutex>

namespace {
using namespace fmha_cuda;

enum in_kind { IN_F16 = 0, IN_BF16 = 1, IN_E4M3 = 2 }; /* the q, k, v dtype */

#include "wgmma.inc"

/* Tiles and pipeline, per head dim D (Q/K/V rows are stored as chunks of
 * 128 bytes, 64 columns of 16-bit or 128 of FP8: TMA's 128-byte swizzle is
 * wgmma's native layout). Measured on the H200, 2026-12-02 (bench/NOTES.md
 * has the runs):
 *   BM 128: two consumer warpgroups x wgmma's M of 64.
 *   BN 128 for D <= 128: BN 176 and 160 ran 1-5% slower (S + P + O need
 *      196+ of the consumers' 232 registers at 176; 16 bytes spilled).
 *   BN 64 for D >= 192: O alone is 96-128 registers; BN 80 tied at D = 256
 *      (608-615 against 613 TFLOP/s), and 2 stages of 128 keys would need
 *      256 KB of shared memory at D = 256 (limit 227 KB).
 *   STAGES 2: 3 stages at D <= 128 (224 KB) were within run-to-run spread.
 *   Registers 24 / 240 (producer / consumers; 40 / 232 before): FP8 with
 *      two-level accumulation 3-5% faster (spills 32 -> 8 bytes), 16-bit tied.
 *   Q in registers for S (D <= 128, not beside dropout or the two-level
 *      accumulator, where it spills): the S GEMM then reads only K from shared
 *      memory; Lumina2 +4%, FA3 d128 +1.6%, FP8 single-level +3-4%, Flux tied. */
#ifndef FMHA_HOPPER_BN_SMALL /* tuning knobs (gpu_run.sh variants): BN for D <= 128 */
#define FMHA_HOPPER_BN_SMALL 128
#endif
#ifndef FMHA_HOPPER_BN_LARGE /* BN for D >= 192 */
#define FMHA_HOPPER_BN_LARGE 64
#endif
#ifndef FMHA_HOPPER_STAGES_SMALL /* K/V ring depth for D <= 128 */
#define FMHA_HOPPER_STAGES_SMALL 2
#endif
#ifndef FMHA_HOPPER_Q_REGS /* S = Q K^T with Q in registers (D <= 128; 0 reads it from shared memory) */
#define FMHA_HOPPER_Q_REGS 1
#endif
#ifndef FMHA_HOPPER_REGS_LOAD /* registers per thread: producer warpgroup, consumers */
#define FMHA_HOPPER_REGS_LOAD 24
#endif
#ifndef FMHA_HOPPER_REGS_MMA
#define FMHA_HOPPER_REGS_MMA 240
#endif
/* setmaxnreg moves registers within the block's launch allocation (168 per
 * thread at 384 threads): a larger total makes the consumers' increase wait
 * forever. */
static_assert(FMHA_HOPPER_REGS_LOAD * 128 + FMHA_HOPPER_REGS_MMA * 256 <= 168 * 384,
              "producer and consumer registers exceed the block's allocation");
/* FP8:
 *   BN 128: V^T rows are BN keys of one byte, and the 128-byte swizzle that
 *      wgmma reads wants rows of 128 bytes.
 *   STAGES 2: 3 stages tied (759/641/745 against 776/636/745 TFLOP/s on Wan
 *      480p, Flux, FA3 d128). */
template <int D, int IN> struct htile {
    static constexpr bool FP8 = IN == IN_E4M3;
    static constexpr int EB = FP8 ? 1 : 2;   /* bytes per element */
    static constexpr int CW = 128 / EB;      /* columns per 128-byte swizzled row chunk */
    static constexpr int NCH = (D + CW - 1) / CW;
    static constexpr int WK = 32 / EB;       /* k of one wgmma: 32 bytes */
    static constexpr int BM = 128;
    static constexpr int BN = FP8 ? 128 : D <= 128 ? FMHA_HOPPER_BN_SMALL : FMHA_HOPPER_BN_LARGE;
    static constexpr int STAGES = D <= 128 ? FMHA_HOPPER_STAGES_SMALL : 2;
    static constexpr int THREADS = 384; /* producer warpgroup + 2 consumers */
    static constexpr bool Q_REGS = FMHA_HOPPER_Q_REGS && D <= 128;
    static constexpr uint32_t Q_BYTES = NCH * BM * 128;
    static constexpr uint32_t K_BYTES = NCH * BN * 128; /* one stage of K */
    /* One stage of V: 16-bit, like K (whole 64-column chunks); FP8, V^T's D rows of BN keys. */
    static constexpr uint32_t V_BYTES = FP8 ? D * BN : K_BYTES;
    /* The epilogue stages 16-bit O in a region of its own where it fits
     * (the next piece's Q then loads while this one ends), else in Q's rows. */
    static constexpr uint32_t RING_END = Q_BYTES + STAGES * (K_BYTES + V_BYTES);
    static constexpr uint32_t BARS = 8 * (3 + 4 * STAGES); /* + the wait anchor (pv_anchor) */
    static constexpr uint32_t O_ROWS = ((D + 63) / 64) * BM * 128; /* 16-bit O in 64-column chunks */
    static constexpr uint32_t O_BYTES = RING_END + O_ROWS + BARS + 1024 <= 227 * 1024 ? O_ROWS : 0;
    static constexpr uint32_t O_OFFSET = O_BYTES ? RING_END : 0;
    static constexpr uint32_t BAR_OFFSET = RING_END + O_BYTES;
    static constexpr size_t SMEM = BAR_OFFSET + BARS + 1024; /* + alignment slack */
    static_assert(O_BYTES || !FP8, "FP8 O is staged in its own region (Q's rows are half as wide)");
};

/* The rows and keys of a piece; false for a query block past its sequence. */
__device__ __forceinline__ bool tile_span(block_span &bs, const flash_params &p, const hopper_sched &s,
                                          const segment &g, int BM, int BN)
{
    const uint32_t x = (uint32_t)g.tile % (uint32_t)s.tiles_x, hb = (uint32_t)g.tile / (uint32_t)s.tiles_x;
    if (!block_span_at(bs, p, BM, BN, s.tiles_x - 1 - (int)x, (int)(hb % (uint32_t)p.heads),
                       (int)(hb / (uint32_t)p.heads)))
        return false;
    if (g.t_hi >= 0) {
        bs.kv_begin += (int64_t)g.t_lo * BN;
        bs.ntiles = g.t_hi - g.t_lo;
    }
    return true;
}

/* Walks this block's pieces in order: f(piece, span, g, nseg), g being the
 * key tiles through the K/V ring before the piece and nseg the pieces (Q
 * loads) before it. The producer and the consumers both walk with it, so
 * their ring slots and barrier phases agree. */
template <class F>
__device__ __forceinline__ void for_each_piece(const hopper_sched &s, const flash_params &p, int BM, int BN,
                                               F f)
{
    segment sg;
    uint32_t g = 0, nseg = 0;
    for (int item = 0; next_segment(s, blockIdx.x, item, sg); item++) {
        block_span bs;
        if (!tile_span(bs, p, s, sg, BM, BN))
            continue;
        f(sg, bs, g, nseg);
        g += bs.ntiles;
        nseg++;
    }
}

/* The lazy max's slack (consumer::softmax), log2 units: 16-bit P takes 2^8
 * with room to spare; FP8's P shares e4m3's 448 with the 2^p_shift that keeps
 * small P out of the subnormals (2^2 * 2^6). Measured against a max that
 * moves every tile (H200, 2026-12-03): FP8 single-level +4.1% (FA3 d128),
 * +6.2% (Wan 480p), +3.6% (Flux), two runs back to back; 16-bit, one process,
 * within the board's power-limited spread: FA3 d128 +3.8%, Flux +0.6% and
 * -1.6%, Wan 720p +0.3%. */
__host__ __device__ constexpr float lazy_tau(int in) { return in == IN_E4M3 ? 2.0f : 8.0f; }

struct hopper_params {
    flash_params p;
    hopper_sched s;
    CUtensorMap tq, tk, tv; /* FP8: tv maps V^T */
    CUtensorMap to;         /* out, in boxes of 64 rows (o_tma) */
    int o_vec;              /* out rows take 16-byte stores (16-bit out, aligned) */
    int o_tma;              /* ... and, unpacked, bulk tensor stores through `to` */
    float p_shift;          /* FP8: P is stored times 2^p_shift, to stay above e4m3's subnormals */
    float tau;              /* lazy_tau of the launch's input kind (a parameter: as a constant, ptxas
                               spills 8 bytes more in the dropout variants) */
};

/* ------------------------------------------------------------ PTX wrappers */

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
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                         int c3, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

/* tma_load into the same offset of every block of the cluster in `mask`,
 * completing on each one's barrier at `bar`'s offset. */
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                                   int c3, uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
                 : "memory");
}

/* One box of shared memory out to a 4-D tensor map's coordinates (bulk tensor
 * store: rows and columns past the tensor's extents are not written), in the
 * thread's current bulk group. */
__device__ __forceinline__ void tma_store(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2, int c3)
{
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                     (uint64_t)map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

/* The thread's bulk stores have read their shared memory (it may be written again). */
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

/* The thread's bulk stores are complete. */
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/* This thread's shared-memory writes, ordered before the bulk copies that read them. */
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

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
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* ptxas moves a wgmma wait up past arithmetic that does not need it: left
 * alone it puts the wait for P V ahead of the softmax that should overlap
 * that GEMM (cuobjdump: WARPGROUP.DEPBAR before the max's shuffles, in every
 * variant), so each tile's softmax waited for its P V. It keeps the wait
 * behind memory operations, though: a shared-memory load whose address
 * depends on both row sums, which exist only once every exp2 is done,
 * anchors it there. The load reads one of two zero words; its value is
 * unused. (A store of the sums anchors it too, and measured 1-2% slower
 * on FP8.) */
__device__ __forceinline__ void pv_anchor(uint32_t anchor, const float *l_row)
{
    asm volatile("{\n .reg .u32 unused;\n ld.volatile.shared.u32 unused, [%0];\n}\n"
                 :
                 : "r"(anchor + ((__float_as_uint(l_row[0]) ^ __float_as_uint(l_row[1])) & 4u))
                 : "memory");
}

/* Keeps the compiler from moving accumulator reads across a wgmma wait. */
template <int N> __device__ __forceinline__ void fence_regs(float *r)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(r[i])::"memory");
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
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

/* Four floats as e4m3 bytes, the first in the lowest byte (round to
 * nearest even, saturated to +-448). */
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d)
{
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (uint32_t)lo | (uint32_t)hi << 16;
}

/* Where the FP8 kernel's V^T keeps key k of a 16-key group: position q holds
 * key vt_key(q) (consumer::pack says why). */
__host__ __device__ __forceinline__ int vt_key(int q)
{
    return 8 * ((q & 3) >> 1) + 2 * (q >> 2) + (q & 1);
}

/* First V^T column of packed sequence b, whose keys start at token k0: every
 * sequence starts on a 16-key group and owns the columns up to the next one's
 * start, so the groups line up with its tiles. */
__host__ __device__ __forceinline__ int64_t vt_start(int64_t k0, int64_t b)
{
    return (k0 + 16 * b + 15) & ~(int64_t)15;
}

/* ------------------------------------------------------------- mainloop */

/* The parts of one consumer warpgroup's step, on its 64 rows. Accumulator
 * element x[4 j + 2 rh + e] is row row0 + 8 rh, column 8 j + 2 (lane % 4) + e. */
template <int D, int IN> struct consumer {
    typedef htile<D, IN> TL;
    static constexpr int BN = TL::BN;
    static constexpr int PA = BN / TL::WK; /* P's register fragments, one per wgmma of O += P V */
    static constexpr int QA = D / TL::WK;  /* S's k steps: 32 bytes of the head dim each */

    /* Q_REGS: the warpgroup's 64 rows of Q as wgmma's register A operand, one
     * fragment per k step (ldmatrix from the swizzled rows: matrices 0..3 are
     * rows 0-7 / 8-15 of the warp's 16 at the step's first / second 16 bytes). */
    static __device__ __forceinline__ void load_q(uint32_t (*qa)[4], uint32_t q_rows, int warp, int lane)
    {
        const int r = 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int ks = 0; ks < QA; ks++) {
            const int u = 2 * (ks % 4) + lane / 16;
            const uint32_t addr = q_rows + (ks / 4) * TL::BM * 128 + r * 128 + ((u ^ (r % 8)) * 16);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(qa[ks][0]), "=r"(qa[ks][1]), "=r"(qa[ks][2]), "=r"(qa[ks][3])
                         : "r"(addr));
        }
    }

    /* Issues S = Q K^T: one wgmma per 32 bytes of the head dim, four per
     * 128-byte chunk; Q from shared memory, or from qa (QR). */
    template <bool QR>
    static __device__ __forceinline__ void issue_scores(float *sc, uint32_t q_rows, const uint32_t (*qa)[4],
                                                        uint32_t k_stage)
    {
        const uint64_t kd = smem_desc(k_stage, 16, 1024), qd = smem_desc(q_rows, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < QA; ks++) {
            const uint32_t col = (ks % 4) * 32u;
            const uint64_t kdesc = desc_at(kd, (ks / 4) * BN * 128 + col);
            if (QR)
                wgmma<BN, IN>::rsk(sc, qa[ks], kdesc, ks > 0);
            else
                wgmma<BN, IN>::ss(sc, desc_at(qd, (ks / 4) * TL::BM * 128 + col), kdesc, ks > 0);
        }
    }

    /* Issues O += P V (accumulate = 0: O = P V). 16-bit: V is [BN keys][D] in
     * 64-column chunks BN * 128 bytes apart (MN-major). FP8: V^T is [D][BN
     * keys], one 128-byte row per output column (K-major). */
    static __device__ __forceinline__ void issue_pv(float *o, const uint32_t (*pa)[4], uint32_t v_stage,
                                                    int accumulate)
    {
        const uint64_t vd = TL::FP8 ? smem_desc(v_stage, 16, 1024) : smem_desc(v_stage, BN * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < PA; kk++) {
            const uint64_t desc = desc_at(vd, TL::FP8 ? kk * 32 : kk * 16 * 128);
            wgmma<D, IN>::rs(o, pa[kk], desc, kk > 0 || accumulate);
        }
    }

    /* Softcap, then -inf where a row does not see a key (tile edges only). */
    static __device__ __forceinline__ void mask(float *sc, const flash_params &p, float cap_in,
                                               int64_t n0, int nvalid, bool full, int row0, int rows,
                                               int64_t m0, int64_t sq, int64_t sk, int lane)
    {
        if (p.softcap_out != 0.0f) {
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                sc[i] = tanh_fast(sc[i] * cap_in) * p.softcap_out;
        }
        if (full)
            return;
#pragma unroll
        for (int rh = 0; rh < 2; rh++)
            mask_frag<BN>(p, row0 + 8 * rh, rows, m0, sq, sk, n0, nvalid, lane,
                          [&](int j, int e) -> float & { return sc[4 * j + 2 * rh + e]; });
    }

    /* Online softmax: the running max and sum, P = exp2 in place (times
     * 2^shift), and the factor alpha by which O must shrink. A row's keys sit
     * in one quad. The max moves lazily: a warp keeps its rows' old maxima,
     * and O unscaled, unless one of its rows grew by more than tau
     * (hopper_params, log2 units), so P stays below 2^tau (times 2^shift).
     * Returns whether the max moved, i.e. whether O must be rescaled. */
    static __device__ __forceinline__ bool softmax(float *sc, float *m_row, float *l_row, float *alpha,
                                                   float scale_log2, float shift, float tau)
    {
        float mx[2];
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            /* The max of the raw scores, scaled once: scale_log2 > 0 keeps the order. */
            float x = sc[2 * rh];
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
                x = fmaxf(x, fmaxf(sc[4 * j + 2 * rh], sc[4 * j + 2 * rh + 1]));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            mx[rh] = fmaxf(m_row[rh], x * scale_log2);
        }
        const bool grow = __any_sync(0xffffffffu, mx[0] > m_row[0] + tau || mx[1] > m_row[1] + tau);
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            const float m = grow ? mx[rh] : m_row[rh];
            const float base = m == -INFINITY ? 0.0f : m; /* no key yet: all terms 0 */
            alpha[rh] = grow ? exp2_approx(m_row[rh] - base) : 1.0f;
            const float nb = shift - base;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[4 * j + 2 * rh + e];
                    x = exp2_approx(fmaf(x, scale_log2, nb));
                    sum += x;
                }
            l_row[rh] = l_row[rh] * alpha[rh] + sum; /* the quad adds up at the end */
            m_row[rh] = m;
        }
        return grow;
    }

    static __device__ __forceinline__ void rescale(float *o, const float *alpha)
    {
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }

    /* Two-level accumulation: O = O * alpha + T, in f32, for the product T of
     * one tile (FP8 wgmma keeps fewer bits than f32 when it accumulates). */
    static __device__ __forceinline__ void merge(float *o, const float *t, const float *alpha)
    {
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            o[4 * j] = fmaf(o[4 * j], alpha[0], t[4 * j]);
            o[4 * j + 1] = fmaf(o[4 * j + 1], alpha[0], t[4 * j + 1]);
            o[4 * j + 2] = fmaf(o[4 * j + 2], alpha[1], t[4 * j + 2]);
            o[4 * j + 3] = fmaf(o[4 * j + 3], alpha[1], t[4 * j + 3]);
        }
    }

    /* After the sum: the normaliser counts dropped terms. */
    static __device__ __forceinline__ void dropout(float *sc, const flash_params &p, int64_t seq_head,
                                                   int64_t row, int64_t n0, int lane)
    {
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int64_t col = n0 + j * 8 + (lane % 4) * 2; /* even: one draw, two keys */
                const fmha_u32x4 w = fmha_dropout_words(p.seed, p.offset, seq_head, row + 8 * rh, col);
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[4 * j + 2 * rh + e];
                    x = (col & 2 ? w.v[2 + e] : w.v[e]) >= p.drop_threshold ? x * p.drop_scale : 0.0f;
                }
            }
    }

    /* P as wgmma's register A operand. 16-bit: keys 16 kk .. 16 kk + 15 in
     * the accumulator's own order. FP8: register v1 + 2 v2 of fragment kq
     * holds row rh = v1 at k positions 16 v2 + 4 (lane % 4) + v0, v0 = 0..3;
     * taking them from this thread's accumulators x[4 j + 2 v1 + e], j = 4 kq
     * + 2 v2 + v0 / 2, e = v0 % 2, puts key 8 (v0 / 2) + 2 (lane % 4) + e of
     * the 16-key group at position 4 (lane % 4) + v0: vt_kernel stores V^T in
     * that order (vt_key). */
    static __device__ __forceinline__ void pack(const float *sc, uint32_t (*pa)[4])
    {
        if (TL::FP8) {
#pragma unroll
            for (int kq = 0; kq < PA; kq++)
#pragma unroll
                for (int v2 = 0; v2 < 2; v2++)
#pragma unroll
                    for (int v1 = 0; v1 < 2; v1++) {
                        const float *x0 = sc + 4 * (4 * kq + 2 * v2) + 2 * v1, *x1 = x0 + 4;
                        pa[kq][v1 + 2 * v2] = pack4_e4m3(x0[0], x0[1], x1[0], x1[1]);
                    }
        } else {
#pragma unroll
            for (int kk = 0; kk < PA; kk++) {
                pa[kk][0] = pack2<IN == IN_BF16>(sc[8 * kk + 0], sc[8 * kk + 1]);
                pa[kk][1] = pack2<IN == IN_BF16>(sc[8 * kk + 2], sc[8 * kk + 3]);
                pa[kk][2] = pack2<IN == IN_BF16>(sc[8 * kk + 4], sc[8 * kk + 5]);
                pa[kk][3] = pack2<IN == IN_BF16>(sc[8 * kk + 6], sc[8 * kk + 7]);
            }
        }
    }
};

/* ----------------------------------------------------------------- kernel */

/* Named barriers: 0 is __syncthreads; 1, 2 each consumer's epilogue; 3, 4
 * the ping-pong turns (consumer 0's, consumer 1's). */
constexpr int BAR_EPILOGUE = 1, BAR_TURN = 3;

__device__ __forceinline__ void named_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int D, int IN, bool DROPOUT, bool TWO_LEVEL, int CL>
__global__ void __launch_bounds__(384, 1) hopper_fwd(const __grid_constant__ hopper_params hp)
{
    typedef htile<D, IN> TL;
    /* CL = 2: a cluster of two blocks on neighbouring query tiles of one head
     * (hopper_sched.cuh); each loads half of every K/V tile into both. */
    static_assert(CL == 1 || (CL == 2 && !TL::FP8), "clusters share 16-bit K/V tiles only");
    const uint32_t rank = CL == 1 ? 0u : blockIdx.x % CL;
    typedef consumer<D, IN> C;
    constexpr int BM = TL::BM, BN = TL::BN, NCH = TL::NCH, STAGES = TL::STAGES, CW = TL::CW;
    /* pv_anchor: 16-bit +3-7% and FP8 two-level +2-4%; FP8 single-level,
     * whose softmax is bound by the exp2 unit rather than by waiting for
     * P V, lost 1-4% with it (H200, 2026-12-03, bench/NOTES.md v8). */
    constexpr bool PV_ANCHOR = !TL::FP8 || TWO_LEVEL;
    const flash_params &p = hp.p;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t sQ = (raw + 1023u) & ~1023u; /* the swizzle repeats every 1024 bytes */
    const uint32_t sK = sQ + TL::Q_BYTES, sV = sK + STAGES * TL::K_BYTES;
    /* mbarriers: Q full; per stage K full, V full, K empty, V empty; Q empty. */
    const uint32_t bar_q = sQ + TL::BAR_OFFSET;
    auto k_full = [&](int s) { return bar_q + 8u * (1u + s); };
    auto v_full = [&](int s) { return bar_q + 8u * (1u + STAGES + s); };
    auto k_empty = [&](int s) { return bar_q + 8u * (1u + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bar_q + 8u * (1u + 3 * STAGES + s); };
    const uint32_t q_empty = bar_q + 8u * (1u + 4 * STAGES);
    const uint32_t anchor = q_empty + 8u; /* two words, zero: pv_anchor */

    if (threadIdx.x == 0) {
        mbar_init(bar_q, 1);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 8 * CL); /* one arrival per consumer warp of the cluster */
            mbar_init(v_empty(s), 8 * CL);
        }
        mbar_init(q_empty, 8);
        asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(anchor), "r"(0u) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (CL > 1) /* the peer's loads and arrivals reach these barriers too */
        cluster_sync();
    else
        __syncthreads();
    /* combine_kernel may launch now: it waits for this grid's end (griddepcontrol.wait). */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    const int wg = threadIdx.x / 128;
    if (wg == 0) { /* ---------------------------------------------- producer */
        regs_dealloc<FMHA_HOPPER_REGS_LOAD>();
        if (threadIdx.x != 0)
            return;
        uint32_t fills = 0; /* K/V tiles through the ring */
        for_each_piece(hp.s, p, BM, BN, [&](const segment &, const block_span &bs, uint32_t g, uint32_t nseg) {
            /* TMA coordinates are 32-bit: the piece in a few registers (24 here). */
            const int hk = bs.hk, tb = (int)bs.tb, ntiles = bs.ntiles, h = bs.h;
            const int k_row = (int)(bs.k0 + bs.kv_begin), q_row = (int)(bs.q0 + bs.m0);
            /* FP8: V^T tiles are one box of D rows x BN keys (vt_start). */
            const int vt_col = (int)(p.varlen ? vt_start(bs.k0, bs.b) + bs.kv_begin : bs.kv_begin);
            /* A whole tile lands in this block; with CL = 2 this block loads
             * rows [rank BN / 2, (rank + 1) BN / 2) into both (box of BN / 2 rows). */
            auto load = [&](uint32_t dst, const CUtensorMap *map, int row, uint32_t bar) {
                mbar_expect_tx(bar, TL::K_BYTES);
                for (int c = 0; c < NCH; c++)
                    if (CL == 1)
                        tma_load(dst + c * BN * 128, map, c * CW, row, hk, tb, bar);
                    else
                        tma_load_multicast(dst + c * BN * 128 + rank * (BN / CL) * 128, map, c * CW,
                                           row + (int)rank * (BN / CL), hk, tb, bar, (1u << CL) - 1);
            };
            auto row_of = [&](int t) { return k_row + t * BN; };
            auto load_v = [&](uint32_t dst, int t, uint32_t bar) {
                if (!TL::FP8)
                    return load(dst, &hp.tv, row_of(t), bar);
                mbar_expect_tx(bar, TL::V_BYTES);
                tma_load(dst, &hp.tv, vt_col + t * BN, 0, hk, p.varlen ? 0 : tb, bar);
            };
            auto load_k = [&](int t) { /* key tile t of the piece, ring slot g + t */
                const uint32_t G = g + t, s = G % STAGES;
                if (G >= STAGES)
                    mbar_wait(k_empty(s), ((G / STAGES) - 1) & 1);
                load(sK + s * TL::K_BYTES, &hp.tk, row_of(t), k_full(s));
            };
            /* K runs one tile ahead of V, as the consumers use them: K0 K1 V0 K2
             * V1 ...; the next piece's K0 and Q go in while this one's last
             * tiles run (Q once the consumers have released it). */
            if (ntiles > 0)
                load_k(0);
            if (nseg > 0)
                mbar_wait(q_empty, (nseg - 1) & 1);
            mbar_expect_tx(bar_q, TL::Q_BYTES);
            for (int c = 0; c < NCH; c++)
                tma_load(sQ + c * BM * 128, &hp.tq, c * CW, q_row, h, tb, bar_q);
            for (int t = 0; t < ntiles; t++) {
                if (t + 1 < ntiles)
                    load_k(t + 1);
                const uint32_t G = g + t, s = G % STAGES;
                if (G >= STAGES)
                    mbar_wait(v_empty(s), ((G / STAGES) - 1) & 1);
                load_v(sV + s * TL::V_BYTES, t, v_full(s));
            }
            fills = g + ntiles;
        });
        /* The peer's consumers arrive on this block's empty barriers: stay
         * until the ring's last fills have been released by both. */
        for (uint32_t G = fills > STAGES ? fills - STAGES : 0; CL > 1 && G < fills; G++) {
            mbar_wait(k_empty(G % STAGES), (G / STAGES) & 1);
            mbar_wait(v_empty(G % STAGES), (G / STAGES) & 1);
        }
        return;
    }

    /* ------------------------------------------------------------ consumers */
    regs_alloc<FMHA_HOPPER_REGS_MMA>();
    const int cw = wg - 1; /* rows [64 cw, 64 cw + 64) of the block */
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int row0 = cw * 64 + warp * 16 + lane / 4; /* this thread's rows: row0, row0 + 8 */
    const uint32_t q_rows = sQ + cw * 64 * 128;
    auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    };
    /* A K/V stage is free once every consumer warp of the cluster is done with it. */
    auto release_kv = [&](uint32_t bar) {
        if (CL == 1)
            return release(bar);
        __syncwarp();
        if (lane < CL)
            mbar_arrive_cluster(bar, lane);
    };
    /* Q in registers where they are free: not beside dropout's draws or the
     * two-level accumulator (ptxas: 68 and 160 bytes of spills). */
    constexpr bool QR = TL::Q_REGS && !DROPOUT && !TWO_LEVEL;
    /* When the consumers let go of Q's shared memory: QR, once it is in
     * registers; else after the piece's last S, unless the epilogue stages O
     * in Q's rows (no room for O's own region), then after the epilogue. */
    const bool q_late = !QR && TL::O_BYTES == 0 && hp.o_vec;
    /* O out by bulk tensor stores: launch decides (hp.o_tma); the constant
     * repeats its region test so that variants staging O in Q's rows carry
     * no store path. */
    const bool o_tma = TL::O_BYTES != 0 && hp.o_tma;

    /* Ping-pong: the two consumers take turns issuing their GEMMs, so one's
     * softmax runs while the other's GEMMs hold the tensor cores. Consumer 1
     * hands the first turn to consumer 0. */
    if (cw == 1)
        named_arrive(BAR_TURN + 0, 256);

    for_each_piece(hp.s, p, BM, BN, [&](const segment &sg, const block_span &bs, uint32_t g, uint32_t nseg) {
        const int64_t m0 = bs.m0, sq = bs.sq, sk = bs.sk, kv_begin = bs.kv_begin, kv_end = bs.kv_end;
        const int rows = bs.rows, ntiles = bs.ntiles;
        const int64_t seq_head = (int64_t)bs.b * p.heads + bs.h;
        auto tile_n0 = [&](int t) { return kv_begin + (int64_t)t * BN; };
        auto tile_full = [&](int t) { return block_span_full(bs, tile_n0(t), BN); };
        auto tile_valid = [&](int t) { return (int)min64(BN, kv_end - tile_n0(t)); };
        auto stage = [&](int t) { return (g + t) % STAGES; };
        auto phase = [&](int t) { return ((g + t) / STAGES) & 1; };
        auto q_done_after_s = [&](int t) { /* t: the key tile whose S has landed */
            if (!QR && !q_late && t == ntiles - 1)
                release(q_empty);
        };

        /* FP8: q and k's descales scale the scores (before the softcap), v's the
         * output; P carries a factor 2^p_shift that 1 / l cancels. */
        float scale_log2 = p.scale_log2, cap_in = p.softcap_in, shift = 0.0f, o_scale = 1.0f;
        if (TL::FP8) {
            const int64_t di = p.descale_per_kv_head ? (int64_t)bs.b * p.kv_heads + bs.hk : 0;
            const float qk = (p.descale_q ? p.descale_q[di] : 1.0f) * (p.descale_k ? p.descale_k[di] : 1.0f);
            if (p.softcap_out != 0.0f)
                cap_in *= qk;
            else
                scale_log2 *= qk;
            shift = hp.p_shift;
            o_scale = p.descale_v ? p.descale_v[di] : 1.0f;
        }

        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; i++)
            o[i] = 0.0f;
        float t_acc[D / 2]; /* two-level: one tile's P V (unused, and dropped, otherwise) */
        float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.0f, 0.0f};
        float alpha[2] = {0.0f, 0.0f}, alpha_p[2] = {0.0f, 0.0f};
        uint32_t pa[C::PA][4];
        /* P V of the tile in pa, into O or (two-level) into t_acc. */
        auto issue_pv = [&](uint32_t v_stage) {
            if (TWO_LEVEL)
                C::issue_pv(t_acc, pa, v_stage, 0);
            else
                C::issue_pv(o, pa, v_stage, 1);
        };
        /* After P V has landed: O in step with the running max. */
        auto fold_pv = [&]() {
            if (TWO_LEVEL) {
                fence_regs<D / 2>(t_acc);
                C::merge(o, t_acc, alpha_p); /* t_acc's P used alpha_p's max */
                alpha_p[0] = alpha[0];
                alpha_p[1] = alpha[1];
            } else {
                fence_regs<D / 2>(o);
            }
        };

        mbar_wait(bar_q, nseg & 1);
        uint32_t qa[QR ? C::QA : 1][4];
        if (QR) {
            C::load_q(qa, q_rows, warp, lane);
            release(q_empty);
        }

        if (ntiles > 0) { /* tile 0: S only */
            float sc[BN / 2];
            mbar_wait(k_full(stage(0)), phase(0));
            named_sync(BAR_TURN + cw, 256);
            wg_fence();
            C::template issue_scores<QR>(sc, q_rows, qa, sK + stage(0) * TL::K_BYTES);
            wg_commit();
            named_arrive(BAR_TURN + (1 - cw), 256);
            wg_wait<0>();
            fence_regs<BN / 2>(sc);
            release_kv(k_empty(stage(0)));
            q_done_after_s(0);
            C::mask(sc, p, cap_in, tile_n0(0), tile_valid(0), tile_full(0), row0, rows, m0, sq, sk, lane);
            C::softmax(sc, m_row, l_row, alpha, scale_log2, shift, hp.tau);
            alpha_p[0] = alpha[0];
            alpha_p[1] = alpha[1];
            if (DROPOUT)
                C::dropout(sc, p, seq_head, m0 + row0, tile_n0(0), lane);
            C::pack(sc, pa);
        }
        /* Tile t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} in flight together; the
         * softmax of S_t overlaps the second GEMM. */
        for (int t = 1; t < ntiles; t++) {
            const int s = stage(t), sp = stage(t - 1);
            float sc[BN / 2];
            mbar_wait(k_full(s), phase(t));
            named_sync(BAR_TURN + cw, 256);
            wg_fence();
            C::template issue_scores<QR>(sc, q_rows, qa, sK + s * TL::K_BYTES);
            wg_commit();
            mbar_wait(v_full(sp), phase(t - 1));
            wg_fence(); /* the barrier's wait loop ends the fenced group S_t was issued in */
            issue_pv(sV + sp * TL::V_BYTES);
            wg_commit();
            named_arrive(BAR_TURN + (1 - cw), 256);
            wg_wait<1>();
            fence_regs<BN / 2>(sc);
            release_kv(k_empty(s));
            q_done_after_s(t);
            C::mask(sc, p, cap_in, tile_n0(t), tile_valid(t), tile_full(t), row0, rows, m0, sq, sk, lane);
            const bool grow = C::softmax(sc, m_row, l_row, alpha, scale_log2, shift, hp.tau);
            if (PV_ANCHOR)
                pv_anchor(anchor, l_row);
            wg_wait<0>();
            fold_pv();
            release_kv(v_empty(sp));
            if (!TWO_LEVEL && grow)
                C::rescale(o, alpha);
            if (DROPOUT)
                C::dropout(sc, p, seq_head, m0 + row0, tile_n0(t), lane);
            C::pack(sc, pa);
        }
        if (ntiles > 0) { /* the last tile's O += P V */
            const int sp = stage(ntiles - 1);
            mbar_wait(v_full(sp), phase(ntiles - 1));
            wg_fence();
            issue_pv(sV + sp * TL::V_BYTES);
            wg_commit();
            wg_wait<0>();
            fold_pv();
            release_kv(v_empty(sp));
        }

        /* Epilogue: normalise; rows that saw no key are 0 with LSE -inf. A
         * piece of a split tile leaves O / l and its log2 LSE in its slot. */
        float inv[2], l_sum[2];
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float l = l_row[rh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            l_sum[rh] = l;
            inv[rh] = l > 0.0f ? o_scale / l : 0.0f;
        }
        if (sg.slot >= 0) {
            float *po = hp.s.part_o + (int64_t)sg.slot * BM * D;
            float *pl = hp.s.part_lse + (int64_t)sg.slot * BM;
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int r = row0 + 8 * rh;
                if (r >= rows)
                    continue;
                if (lane % 4 == 0)
                    pl[r] = l_sum[rh] > 0.0f ? m_row[rh] - shift + log2f(l_sum[rh]) : -INFINITY;
                /* Columns c and c + 1 in one 8-byte store (c even; a column
                 * past dv lands in the row's padding, which the merge skips). */
                float *prow = po + (int64_t)r * D + (lane % 4) * 2;
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    if (8 * j + (lane % 4) * 2 < p.dv)
                        *(float2 *)(prow + 8 * j) =
                            make_float2(o[4 * j + 2 * rh] * inv[rh], o[4 * j + 2 * rh + 1] * inv[rh]);
            }
        } else {
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int r = row0 + 8 * rh;
                if (p.lse && lane % 4 == 0 && r < rows)
                    store_lse(p, bs, r, m_row[rh] - shift, l_sum[rh]);
            }
            if (hp.o_vec) {
                /* Stage the warpgroup's 64 rows in O's region (or, where it has
                 * none, in its own consumed Q rows), in 64-column swizzled
                 * chunks, then write them out: o_tma, as boxes of 64 rows by
                 * one thread's bulk tensor stores, which run on while the next
                 * piece starts; else as whole 16-byte pieces of rows. */
                unsigned char *smem = smem_raw + (sQ - raw) + TL::O_OFFSET;
                const bool out_bf16 = p.out_dtype == FMHA_DTYPE_BF16;
                if (o_tma) { /* the region is free once the last piece's stores have read it */
                    if (threadIdx.x % 128 == 0)
                        bulk_wait_read();
                    named_sync(BAR_EPILOGUE + cw, 128);
                }
#pragma unroll
                for (int j = 0; j < D / 8; j++)
#pragma unroll
                    for (int rh = 0; rh < 2; rh++) {
                        const int r = row0 + 8 * rh;
                        const uint32_t off = (j / 8) * BM * 128 + r * 128 + (((j % 8) ^ (r % 8)) * 16) +
                                             (lane % 4) * 4;
                        const float x0 = o[4 * j + 2 * rh] * inv[rh], x1 = o[4 * j + 2 * rh + 1] * inv[rh];
                        *(uint32_t *)(smem + off) = out_bf16 ? pack2<true>(x0, x1) : pack2<false>(x0, x1);
                    }
                if (o_tma)
                    fence_async_shared();
                named_sync(BAR_EPILOGUE + cw, 128);
                if (o_tma) {
                    if (threadIdx.x % 128 == 0) {
                        const uint32_t rows0 = sQ + TL::O_OFFSET + cw * 64 * 128;
                        for (int c = 0; 64 * c < p.dv; c++)
                            tma_store(&hp.to, rows0 + c * BM * 128, 64 * c, (int)(bs.m0 + cw * 64), bs.h,
                                      (int)bs.tb);
                        bulk_commit();
                    }
                } else {
                    /* The staged rows hold D / 8 pieces each, of which dv / 8
                     * are out's: dividing by the constant costs a shift or a
                     * multiply (by dv / 8, a division routine), and rows are one
                     * stride apart from row 0's address. Not unrolled: unrolled,
                     * ptxas hoists the walk's offsets out of the kernel and
                     * spills them (28 bytes at head dim 128). */
                    constexpr int UNITS = D / 8;
                    static_assert(UNITS % 2 == 0, "64 rows of pieces are whole rounds of 128 threads");
                    const int units = p.dv / 8;
                    char *const out0 = block_out_row(p, bs, 0);
                    const int64_t row_bytes = p.o_ss * 2; /* 16-bit out */
#pragma unroll 1
                    for (int k = 0; k < UNITS / 2; k++) {
                        const int idx = threadIdx.x % 128 + 128 * k;
                        const int r = cw * 64 + idx / UNITS, u = idx % UNITS;
                        if (r >= rows || u >= units)
                            continue;
                        const uint4 val =
                            *(const uint4 *)(smem + (u / 8) * BM * 128 + r * 128 + (((u % 8) ^ (r % 8)) * 16));
                        *(uint4 *)(out0 + r * row_bytes + u * 16) = val;
                    }
                }
            } else {
#pragma unroll
                for (int rh = 0; rh < 2; rh++) {
                    const int r = row0 + 8 * rh;
                    if (r < rows)
                        store_out_frag<D>(p, block_out_row(p, bs, r), lane,
                                          [&](int j, int e) { return o[4 * j + 2 * rh + e] * inv[rh]; });
                }
            }
        }
        if (q_late || (!QR && ntiles == 0))
            release(q_empty);
    });
    /* Shared memory must outlive the bulk stores that read it. */
    if (o_tma && threadIdx.x % 128 == 0)
        bulk_wait();
}

/* Merges the pieces of each split tile (hopper_sched): O = sum_i w_i O_i
 * with w_i = 2^lse_i / sum_j 2^lse_j. A thread takes COMBINE_COLS columns of
 * one row of split tile r = blockIdx.x and folds the pieces in online,
 * COMBINE_BATCH at a time so that their loads are in flight together. Every
 * thread finds the pieces' slots itself: no shared memory, no barrier, and
 * after the wait for the kernel one round of loads per batch (one batch for
 * the two or three pieces of a tail of at least a third as many tiles as
 * blocks). Measured on Flux's split tail (H200, Nsight Compute, 2026-12-04):
 * 7.7-8.6 us, against 13.2-14.1 for 16 rows a block with the weights in
 * shared memory and four rounds of loads a thread. */
constexpr int COMBINE_COLS = 8, COMBINE_BATCH = 4, COMBINE_THREADS = 128;

__global__ void __launch_bounds__(COMBINE_THREADS)
    combine_kernel(const flash_params p, const hopper_sched s, int BM, int o_vec)
{
    const int r = blockIdx.x / s.cl, rank = blockIdx.x % s.cl; /* split tile unit r (hopper_sched.cuh) */
    int c1, c2;
    split_blocks(s, r, c1, c2);
    if (c1 == c2) /* one piece: written whole */
        return;
    const segment whole = {(s.dp_tiles + r) * s.cl + rank, 0, -1, -1};
    block_span bs;
    if (!tile_span(bs, p, s, whole, BM, 16))
        return;
    const int chunks = s.part_ld / COMBINE_COLS; /* part_ld: a multiple of 8 */
    const int item = blockIdx.y * COMBINE_THREADS + threadIdx.x;
    const int row = item / chunks, col = (item - row * chunks) * COMBINE_COLS;
    if (row >= bs.rows || col >= p.dv)
        return;
    const float *__restrict__ lse = s.part_lse;
    const float4 *__restrict__ part = (const float4 *)s.part_o;
    float m = -INFINITY, l = 0.0f, acc[COMBINE_COLS] = {};
    /* Launched while the kernel runs (programmatic dependent launch): its pieces are complete past here. */
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    for (int c0 = c1; c0 <= c2; c0 += COMBINE_BATCH) {
        float ls[COMBINE_BATCH];
        float4 x[COMBINE_BATCH][COMBINE_COLS / 4];
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            const int slot = c0 + u <= c2 ? piece_slot(s, (c0 + u) * s.cl + rank, r) : -1;
            ls[u] = -INFINITY;
            if (slot >= 0) {
                const int64_t at = (int64_t)slot * BM + row;
                ls[u] = lse[at];
#pragma unroll
                for (int v = 0; v < COMBINE_COLS / 4; v++)
                    x[u][v] = __ldg(part + (at * s.part_ld + col) / 4 + v);
            }
        }
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            if (ls[u] == -INFINITY) /* no piece, or a row that saw no key in it */
                continue;
            const float mn = fmaxf(m, ls[u]), f = exp2f(m - mn), w = exp2f(ls[u] - mn);
            l = l * f + w;
            m = mn;
#pragma unroll
            for (int v = 0; v < COMBINE_COLS / 4; v++) {
                acc[4 * v + 0] = fmaf(acc[4 * v + 0], f, w * x[u][v].x);
                acc[4 * v + 1] = fmaf(acc[4 * v + 1], f, w * x[u][v].y);
                acc[4 * v + 2] = fmaf(acc[4 * v + 2], f, w * x[u][v].z);
                acc[4 * v + 3] = fmaf(acc[4 * v + 3], f, w * x[u][v].w);
            }
        }
    }
    if (p.lse && col == 0)
        store_lse(p, bs, row, m, l);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    char *orow = block_out_row(p, bs, row);
    if (o_vec && col + COMBINE_COLS <= p.dv) { /* 16-bit out, 16-byte aligned rows */
        static_assert(COMBINE_COLS == 8, "one 16-byte store of 16-bit out");
        const bool bf16 = p.out_dtype == FMHA_DTYPE_BF16;
        uint32_t pair[COMBINE_COLS / 2];
#pragma unroll
        for (int e = 0; e < COMBINE_COLS / 2; e++)
            pair[e] = bf16 ? pack2<true>(acc[2 * e] * inv, acc[2 * e + 1] * inv)
                           : pack2<false>(acc[2 * e] * inv, acc[2 * e + 1] * inv);
        *(uint4 *)(orow + 2 * col) = make_uint4(pair[0], pair[1], pair[2], pair[3]);
    } else {
#pragma unroll
        for (int e = 0; e < COMBINE_COLS; e++)
            if (col + e < p.dv)
                store_out(p, orow, col + e, acc[e] * inv);
    }
}

/* ------------------------------------------------------------------- host */

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled()
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = nullptr;
        return (PFN_cuTensorMapEncodeTiled_v12000)f;
    }();
    return fn;
}

/* A 4-D map (columns, rows, heads, batch) over a tensor of `eb`-byte
 * elements, in boxes of 128 bytes of columns x box_rows rows, 128-byte
 * swizzled. Coordinates past the tensor's extents read as zeros. */
fmha_status make_map_raw(CUtensorMap *map, void *data, CUtensorMapDataType type, int eb,
                         const int64_t dims_in[4], const int64_t strides_in[3], int box_rows,
                         const char *name)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR,
                              "the CUDA driver has no cuTensorMapEncodeTiled (driver older than 12.0?)");
    cuuint64_t dims[4], strides[3];
    for (int i = 0; i < 4; i++)
        dims[i] = (cuuint64_t)dims_in[i];
    /* Strides of extent-1 axes are never followed; any legal value does. */
    for (int i = 0; i < 3; i++)
        strides[i] = (cuuint64_t)(dims_in[i + 1] > 1 ? strides_in[i] * eb : 16);
    cuuint32_t box[4] = {(cuuint32_t)(128 / eb), (cuuint32_t)box_rows, 1, 1};
    cuuint32_t estr[4] = {1, 1, 1, 1};
    CUresult r = encode(map, type, 4, data, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR,
                              "cuTensorMapEncodeTiled refused %s (error %d): strides (%lld, %lld, "
                              "%lld) elements",
                              name, (int)r, (long long)strides_in[0], (long long)strides_in[1],
                              (long long)strides_in[2]);
    return FMHA_STATUS_OK;
}

/* The map of q, k or v: (head-dim column, token, head, batch). */
fmha_status make_map(CUtensorMap *map, const fmha_tensor &t, int box_rows, int in, const char *name)
{
    const int64_t dims[4] = {t.head_dim, t.seqlen, t.heads, t.batch};
    const int64_t strides[3] = {t.stride_seq, t.stride_head, t.stride_batch};
    const CUtensorMapDataType type = in == IN_E4M3  ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                     : in == IN_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                     : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return make_map_raw(map, t.data, type, in == IN_E4M3 ? 1 : 2, dims, strides, box_rows, name);
}

cudaError_t scratch_alloc(void **ptr, size_t bytes, cudaStream_t stream);

/* Every query tile of the launch sees the same keys: not causal, windowed
 * or packed. */
bool uniform_tiles(const flash_params &p)
{
    return !p.varlen && !p.causal && p.window_left < 0 && p.window_right < 0;
}

/* The launch's schedule (hopper_sched.cuh) for `resident` blocks at a time,
 * in FMHA_CUDA_SCHEDULE's mode (cuda.h). */
hopper_sched plan(const flash_params &p, int64_t max_sq, int batch, int BM, int BN, int resident,
                  fmha_schedule mode, int cl)
{
    const int64_t tiles_x = (max_sq + BM - 1) / BM;
    return sched_plan(tiles_x * p.heads * batch, tiles_x, (p.sk + BN - 1) / BN, resident, uniform_tiles(p),
                      mode, cl);
}

/* Clusters where the tiles' keys number at least this many, unless
 * FMHA_CUDA_CLUSTER says otherwise. Measured (H200, bench_cuda.py --ab
 * FMHA_CUDA_CLUSTER=0,1, three same-process runs, bench/RESULTS.md): in
 * clusters FA3 d128 (16384 keys) +2.9%, +3.6%, +0.9%, d256 +0.7%, +2.6%,
 * +2.0%, Wan 480p (32760) +8.7%, +3.5%, Wan 720p (75600) -0.1%, -0.3%; Flux
 * (4608) -0.6%, -2.3%, -2.2%. The two blocks of a cluster wait on each
 * other's consumers at every K/V slot, a cost that long key ranges spread
 * over more tiles; what they gain is likely power (L2 -> SM traffic falls
 * from 3.5-3.8 to 3.0 TB/s, and long runs sit at the board's power limit),
 * not measured directly. */
constexpr int64_t CLUSTER_MIN_KEYS = 8192;

/* Whether a launch of a variant that has clusters (launch: 16-bit, D >=
 * 128) runs in them: no dropout, uniform tiles, an even number of query
 * tiles per head, a persistent schedule; under auto, keys as above. */
bool cluster_fits(const flash_params &p, int64_t tiles_x, fmha_schedule mode, fmha_cluster_mode cm)
{
    return cm != FMHA_CLUSTER_OFF && (cm == FMHA_CLUSTER_ON || p.sk >= CLUSTER_MIN_KEYS) &&
           !p.drop_threshold && uniform_tiles(p) && mode != FMHA_SCHEDULE_TILES && tiles_x % 2 == 0;
}

/* The kernel on its schedule; a split tail's partials live in pooled
 * scratch until combine_kernel has merged them. */
template <int D, int IN, bool DROPOUT, bool TWO_LEVEL, int CL>
cudaError_t launch_variant(hopper_params &hp, int64_t max_sq, int batch, fmha_schedule mode,
                           cudaStream_t stream)
{
    typedef htile<D, IN> TL;
    static_assert(TL::SMEM <= 227 * 1024, "tile exceeds the 227 KB of shared memory per block");
    auto kernel = hopper_fwd<D, IN, DROPOUT, TWO_LEVEL, CL>;
    const size_t smem = TL::SMEM;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = CL, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(TL::THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &cluster;
    cfg.numAttrs = CL > 1;
    /* Once per device: the shared-memory attribute, and how many blocks fit at once. */
    static std::atomic<int> resident_on[64];
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess)
        return err;
    int resident = dev >= 0 && dev < 64 ? resident_on[dev].load(std::memory_order_relaxed) : 0;
    if (resident == 0) {
        int sms = 0, per_sm = 0, clusters = 0;
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (err == cudaSuccess && CL == 1)
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TL::THREADS, smem);
        if (err == cudaSuccess && CL > 1) {
            cfg.gridDim = dim3(sms - sms % CL);
            err = cudaOccupancyMaxActiveClusters(&clusters, (void *)kernel, &cfg);
        }
        if (err != cudaSuccess)
            return err;
        resident = CL == 1 ? sms * per_sm : clusters * CL;
        if (dev >= 0 && dev < 64 && resident > 0)
            resident_on[dev].store(resident, std::memory_order_relaxed);
    }
    hp.s = plan(hp.p, max_sq, batch, TL::BM, TL::BN, resident, mode, CL);
    if (hp.s.ctas <= 0) /* -1: more tiles than the schedule numbers */
        return hp.s.ctas == 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
    void *parts = nullptr;
    if (hp.s.sk_tiles > 0) {
        const int64_t slots = 2 * (int64_t)hp.s.ctas * CL * TL::BM;
        if ((err = scratch_alloc(&parts, (size_t)(slots * (D + 1)) * sizeof(float), stream)) != cudaSuccess)
            return err;
        hp.s.part_ld = D;
        hp.s.part_o = (float *)parts;
        hp.s.part_lse = hp.s.part_o + slots * D;
    }
    cfg.gridDim = dim3((unsigned)(hp.s.ctas * CL));
    err = cudaLaunchKernelEx(&cfg, kernel, hp);
    if (err == cudaSuccess && hp.s.sk_tiles > 0) {
        cudaLaunchAttribute early;
        early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        early.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cc = {};
        cc.gridDim = dim3((unsigned)(hp.s.sk_tiles * CL),
                          (unsigned)((TL::BM * (D / COMBINE_COLS) + COMBINE_THREADS - 1) / COMBINE_THREADS));
        cc.blockDim = dim3(COMBINE_THREADS);
        cc.stream = stream;
        cc.attrs = &early;
        cc.numAttrs = 1;
        err = cudaLaunchKernelEx(&cc, combine_kernel, (const flash_params)hp.p, (const hopper_sched)hp.s,
                                 (int)TL::BM, hp.o_vec);
    }
    if (parts)
        cudaFreeAsync(parts, stream);
    return err;
}

/* ------------------------------------------------------------- FP8 host */

/* V^T for the FP8 kernel: vt[tb][hk][c][col] = v[key][hk][c] with key =
 * 16 (col / 16) + vt_key(col % 16) of the sequence whose columns hold col
 * (vt_start), 0 past its keys. A block covers 64 columns of one (sequence,
 * KV head): it reads their keys' rows, then writes 4 columns per thread. */
constexpr int VT_COLS = 64;

__global__ void __launch_bounds__(256) vt_kernel(const flash_params p, uint8_t *vt, int64_t cols,
                                                 int vec4)
{
    __shared__ uint8_t tile[VT_COLS][256 + 4]; /* [key][channel]; the pad spreads banks */
    const int b = blockIdx.z, hk = blockIdx.y;
    int64_t k0 = 0, len = p.sk, c0 = 0, own = cols, tb = b;
    if (p.varlen) {
        k0 = p.cu_k[b];
        len = p.cu_k[b + 1] - k0;
        c0 = vt_start(k0, b);
        own = vt_start(p.cu_k[b + 1], b + 1) - c0;
        tb = 0;
    }
    const int64_t x0 = (int64_t)blockIdx.x * VT_COLS;
    if (x0 >= own)
        return;
    const uint8_t *v = (const uint8_t *)p.v + tb * p.v_sb + hk * p.v_sh;
    const int dv = p.dv;
    if (vec4) {
        const int words = dv / 4;
        for (int i = threadIdx.x; i < VT_COLS * words; i += blockDim.x) {
            const int r = i / words, w = i % words;
            const int64_t key = x0 + r;
            const uint32_t x = key < len ? *(const uint32_t *)(v + (k0 + key) * p.v_ss + 4 * w) : 0u;
            *(uint32_t *)&tile[r][4 * w] = x;
        }
    } else {
        for (int i = threadIdx.x; i < VT_COLS * dv; i += blockDim.x) {
            const int r = i / dv, c = i % dv;
            const int64_t key = x0 + r;
            tile[r][c] = key < len ? v[(k0 + key) * p.v_ss + c] : 0;
        }
    }
    __syncthreads();
    const int groups = VT_COLS / 4;
    uint8_t *out = vt + ((tb * p.kv_heads + hk) * (int64_t)dv) * cols + c0 + x0;
    for (int i = threadIdx.x; i < dv * groups; i += blockDim.x) {
        const int c = i / groups, g = i % groups;
        if (x0 + 4 * g >= own) /* own is a multiple of 16 */
            continue;
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int q = 4 * g + e;
            w |= (uint32_t)tile[(q & ~15) + vt_key(q & 15)][c] << (8 * e);
        }
        *(uint32_t *)(out + (int64_t)c * cols + 4 * g) = w;
    }
}

/* Stream-ordered scratch from a pool of fmha's own per device, which keeps
 * its memory between calls (the default pool would hand it back to the
 * driver at every synchronisation). */
cudaError_t scratch_alloc(void **ptr, size_t bytes, cudaStream_t stream)
{
    static std::mutex mu;
    static cudaMemPool_t pools[64];
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

/* Where an FP8 call's V^T lies (vt_kernel): extents and element strides of
 * [batch, kv head, channel, column]. */
struct vt_view {
    void *data;
    int64_t dims[4], strides[3]; /* innermost first */
};

/* The tensor maps, then the kernel variant: dropout, or two-level
 * accumulation (FP8 at D <= 128 only: it holds one tile's P V beside O,
 * which at D = 256, or with dropout's draws at D = 128, spills: ptxas, 380
 * bytes), or neither. */
template <int D, int IN>
fmha_status launch(hopper_params &hp, const fmha_problem *pb, const vt_view *vt, bool two_level,
                   cudaStream_t stream)
{
    typedef htile<D, IN> TL;
    const fmha_forward_args *a = pb->args;
    hp.tau = lazy_tau(IN);
    fmha_status st;
    fmha_schedule mode;
    fmha_cluster_mode clusters;
    if ((st = fmha_cuda_schedule(&mode)) != FMHA_STATUS_OK ||
        (st = fmha_cuda_clusters(&clusters)) != FMHA_STATUS_OK)
        return st;
    const int64_t max_sq = pb->max_sq;
    const int batch = (int)pb->batch;
    constexpr bool TWO = TL::FP8 && D <= 128;
    constexpr int CL2 = TL::FP8 || D < 128 ? 1 : 2; /* clusters: 16-bit variants at D >= 128 */
    const bool cl = CL2 > 1 && cluster_fits(hp.p, (max_sq + TL::BM - 1) / TL::BM, mode, clusters);
    /* In clusters each block loads half of a K/V tile's rows. */
    const int kv_rows = cl ? TL::BN / CL2 : TL::BN;
    if ((st = make_map(&hp.tq, a->q, TL::BM, IN, "q")) != FMHA_STATUS_OK ||
        (st = make_map(&hp.tk, a->k, kv_rows, IN, "k")) != FMHA_STATUS_OK)
        return st;
    st = TL::FP8 ? make_map_raw(&hp.tv, vt->data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, vt->dims,
                                vt->strides, D, "v^t")
                 : make_map(&hp.tv, a->v, kv_rows, IN, "v");
    if (st != FMHA_STATUS_OK)
        return st;
    /* Unpacked 16-bit out with a region of its own to stage O in: written by
     * bulk tensor stores. Not packed batches (a box's rows past its sequence
     * are the next sequence's), nor O staged in Q's rows (the next piece's Q
     * would have to wait for the stores to read them). */
    hp.o_tma = hp.o_vec && !hp.p.varlen && TL::O_BYTES != 0;
    if (hp.o_tma && (st = make_map(&hp.to, a->out, 64, a->out.dtype == FMHA_DTYPE_BF16 ? IN_BF16 : IN_F16,
                                   "out")) != FMHA_STATUS_OK)
        return st;
    const cudaError_t err =
        hp.p.drop_threshold ? launch_variant<D, IN, true, false, 1>(hp, max_sq, batch, mode, stream)
        : two_level && TWO  ? launch_variant<D, IN, false, TWO, 1>(hp, max_sq, batch, mode, stream)
        : cl                ? launch_variant<D, IN, false, false, CL2>(hp, max_sq, batch, mode, stream)
                            : launch_variant<D, IN, false, false, 1>(hp, max_sq, batch, mode, stream);
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the Hopper attention kernel launch");
}

/* The smallest compiled head dim that holds the call; vt != NULL for FP8. */
fmha_status launch_head_dim(hopper_params &hp, const fmha_problem *pb, const vt_view *vt,
                            bool two_level, cudaStream_t stream)
{
    const int64_t dmax = pb->d > pb->dv ? pb->d : pb->dv;
    const bool bf16 = pb->cfg->dtype == FMHA_DTYPE_BF16;
#define FMHA_LAUNCH(D)                                                                            \
    if (dmax <= D)                                                                                \
        return bf16 ? launch<D, IN_BF16>(hp, pb, vt, two_level, stream)                           \
                    : launch<D, IN_F16>(hp, pb, vt, two_level, stream);
#define FMHA_LAUNCH_FP8(D)                                                                        \
    if (dmax <= D)                                                                                \
        return launch<D, IN_E4M3>(hp, pb, vt, two_level, stream);
    if (vt) {
        FMHA_CUDA_FP8_HEAD_DIMS(FMHA_LAUNCH_FP8)
    } else {
        FMHA_CUDA_HEAD_DIMS(FMHA_LAUNCH)
    }
#undef FMHA_LAUNCH
#undef FMHA_LAUNCH_FP8
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED, "head dim %lld is above 256, the largest CUDA kernel",
                          (long long)dmax);
}

hopper_params params_of(const fmha_problem *pb, const flash_params &p)
{
    hopper_params h;
    memset(&h, 0, sizeof h);
    h.p = p;
    h.o_vec = pb->args->out.dtype != FMHA_DTYPE_F32 && chunk_aligned(pb->args->out);
    return h;
}

} // namespace

namespace fmha_cuda {

fmha_status hopper_forward(const fmha_problem *pb, const flash_params &p, cudaStream_t stream)
{
    hopper_params h = params_of(pb, p);
    return launch_head_dim(h, pb, nullptr, false, stream);
}

/* FP8: V^T into pooled scratch on the stream, then the kernel; the scratch
 * goes back to the pool behind the kernel. */
fmha_status hopper_fp8_forward(const fmha_problem *pb, const flash_params &p, cudaStream_t stream)
{
    int two_level;
    fmha_status st = fmha_fp8_two_level(pb->max_sk, &two_level);
    if (st != FMHA_STATUS_OK)
        return st;
    const fmha_forward_args *a = pb->args;
    hopper_params h = params_of(pb, p);
    /* P <= 2^tau (the lazy max), times drop_scale after dropout: scaled by
     * 2^shift it stays below e4m3's 448. */
    const double pmax = (pb->drop_threshold ? pb->drop_rescale : 1.0) * exp2(lazy_tau(IN_E4M3));
    h.p_shift = (float)fmin(8.0, floor(log2(448.0 / pmax)));

    const int64_t nseq = pb->batch, kvh = pb->kv_heads, dv = pb->dv;
    const int64_t cols = p.varlen ? vt_start(a->k.seqlen, nseq) : (a->k.seqlen + 15) & ~(int64_t)15;
    const int64_t vt_batch = p.varlen ? 1 : nseq;
    vt_view vt = {nullptr, {cols, dv, kvh, vt_batch}, {cols, dv * cols, kvh * dv * cols}};
    cudaError_t err = scratch_alloc(&vt.data, (size_t)(vt_batch * kvh * dv * cols), stream);
    if (err != cudaSuccess)
        return cuda_error(err, "allocating V^T scratch for FP8 attention");
    const fmha_tensor &v = a->v;
    const int vec4 = dv % 4 == 0 && (uintptr_t)v.data % 4 == 0 &&
                     (v.stride_seq % 4 == 0 || v.seqlen == 1) && (v.stride_head % 4 == 0 || v.heads == 1) &&
                     (v.stride_batch % 4 == 0 || v.batch == 1);
    const int64_t max_own = p.varlen ? (pb->max_sk + 15 + 32) & ~(int64_t)15 : cols;
    dim3 grid((unsigned)((max_own + VT_COLS - 1) / VT_COLS), (unsigned)kvh, (unsigned)nseq);
    vt_kernel<<<grid, 256, 0, stream>>>(p, (uint8_t *)vt.data, cols, vec4);
    if ((err = cudaGetLastError()) != cudaSuccess)
        st = cuda_error(err, "the FP8 V^T kernel launch");
    else
        st = launch_head_dim(h, pb, &vt, two_level, stream);
    cudaFreeAsync(vt.data, stream);
    return st;
}

} // namespace fmha_cuda
