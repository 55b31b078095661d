/* cuda_hopper.cu — the Hopper forward (sm_90a), warp-specialized: a producer
 * warp streams Q once and K/V tiles through a shared-memory ring with the
 * tensor copy engine (TMA), completing on mbarriers; two consumer warpgroups
 * of 64 queries each run S = Q K^T and O += P V on wgmma and the online
 * softmax in registers (S's accumulator fragment is P's register operand).
 * Every feature of the portable kernel runs here: masks, softcap, GQA,
 * varlen, LSE, dropout (same Philox stream), head_dim_v (zero-padded to D). */
#include "cuda_common.cuh"

#include <cuda.h> /* CUtensorMap */
#include <cudaTypedefs.h>

#include <stdint.h>

namespace {
using namespace fmha_cuda;

#include "wgmma.inc"

/* Tiles and pipeline, per head dim D (Q/K/V rows are stored as 64-column
 * chunks of 128 bytes: TMA's 128-byte swizzle is wgmma's native layout).
 * Measured on the H200, 2026-12-02 (bench/NOTES.md has the runs):
 *   BM 128: two consumer warpgroups x wgmma's M of 64.
 *   BN 128 for D <= 128: BN 176 and 160 ran 1-5% slower (S + P + O need
 *      196+ of the consumers' 232 registers at 176; 16 bytes spilled).
 *   BN 64 for D >= 192: O alone is 96-128 registers; BN 80 tied at D = 256
 *      (608-615 against 613 TFLOP/s), and 2 stages of 128 keys would need
 *      256 KB of shared memory at D = 256 (limit 227 KB).
 *   STAGES 2: 3 stages at D <= 128 (224 KB) were within run-to-run spread. */
#ifndef FMHA_HOPPER_BN_SMALL /* tuning knobs (gpu_run.sh variants): BN for D <= 128 */
#define FMHA_HOPPER_BN_SMALL 128
#endif
#ifndef FMHA_HOPPER_BN_LARGE /* BN for D >= 192 */
#define FMHA_HOPPER_BN_LARGE 64
#endif
#ifndef FMHA_HOPPER_STAGES_SMALL /* K/V ring depth for D <= 128 */
#define FMHA_HOPPER_STAGES_SMALL 2
#endif
template <int D> struct htile {
    static constexpr int NCH = (D + 63) / 64;
    static constexpr int BM = 128;
    static constexpr int BN = D <= 128 ? FMHA_HOPPER_BN_SMALL : FMHA_HOPPER_BN_LARGE;
    static constexpr int STAGES = D <= 128 ? FMHA_HOPPER_STAGES_SMALL : 2;
    static constexpr int THREADS = 384; /* producer warpgroup + 2 consumers */
    static constexpr uint32_t Q_BYTES = NCH * BM * 128;
    static constexpr uint32_t KV_BYTES = NCH * BN * 128; /* one stage of K (or V) */
    static constexpr uint32_t BAR_OFFSET = Q_BYTES + 2 * STAGES * KV_BYTES;
    static constexpr size_t SMEM = BAR_OFFSET + 8 * (1 + 4 * STAGES) + 1024; /* + alignment slack */
};

struct hopper_params {
    flash_params p;
    CUtensorMap tq, tk, tv;
    int o_vec; /* out rows take 16-byte stores (16-bit out, aligned) */
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

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
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

/* ------------------------------------------------------------- mainloop */

/* The parts of one consumer warpgroup's step, on its 64 rows. Accumulator
 * element x[4 j + 2 rh + e] is row row0 + 8 rh, column 8 j + 2 (lane % 4) + e. */
template <int D, bool BF16> struct consumer {
    typedef htile<D> TL;
    static constexpr int BN = TL::BN;

    /* Issues S = Q K^T: D / 16 steps of k 16, 4 per 64-column chunk (32 bytes each). */
    static __device__ __forceinline__ void issue_scores(float *sc, uint32_t q_rows, uint32_t k_stage)
    {
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const uint32_t col = (ks % 4) * 32u;
            wgmma<BN, BF16>::ss(sc, smem_desc(q_rows + (ks / 4) * TL::BM * 128 + col, 16, 1024),
                                smem_desc(k_stage + (ks / 4) * BN * 128 + col, 16, 1024), ks > 0);
        }
    }

    /* Issues O += P V: V is [BN keys][D] in 64-column chunks BN * 128 bytes apart. */
    static __device__ __forceinline__ void issue_pv(float *o, const uint32_t (*pa)[4], uint32_t v_stage)
    {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
            wgmma<D, BF16>::rs(o, pa[kk], smem_desc(v_stage + kk * 16 * 128, BN * 128, 1024), 1);
    }

    /* Softcap, then -inf where a row does not see a key (tile edges only). */
    static __device__ __forceinline__ void mask(float *sc, const flash_params &p, int64_t n0, int nvalid,
                                               bool full, int row0, int rows, int64_t m0, int64_t sq,
                                               int64_t sk, int lane)
    {
        if (p.softcap_out != 0.0f) {
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                sc[i] = tanh_fast(sc[i] * p.softcap_in) * p.softcap_out;
        }
        if (full)
            return;
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            const int r = row0 + 8 * rh;
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
                        sc[4 * j + 2 * rh + e] = -INFINITY;
                }
        }
    }

    /* Online softmax: new running max and sum, P = exp2 in place, and the
     * factor alpha by which O must shrink. A row's keys sit in one quad. */
    static __device__ __forceinline__ void softmax(float *sc, float *m_row, float *l_row, float *alpha,
                                                   float scale_log2)
    {
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float mx = m_row[rh];
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
                mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * rh], sc[4 * j + 2 * rh + 1]) * scale_log2);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = mx == -INFINITY ? 0.0f : mx; /* no key yet: all terms 0 */
            alpha[rh] = exp2_approx(m_row[rh] - base);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[4 * j + 2 * rh + e];
                    x = exp2_approx(fmaf(x, scale_log2, -base));
                    sum += x;
                }
            l_row[rh] = l_row[rh] * alpha[rh] + sum; /* the quad adds up at the end */
            m_row[rh] = mx;
        }
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

    /* P as wgmma's register A operand: keys 16 kk .. 16 kk + 15. */
    static __device__ __forceinline__ void pack(const float *sc, uint32_t (*pa)[4])
    {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            pa[kk][0] = pack2<BF16>(sc[8 * kk + 0], sc[8 * kk + 1]);
            pa[kk][1] = pack2<BF16>(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack2<BF16>(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack2<BF16>(sc[8 * kk + 6], sc[8 * kk + 7]);
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

template <int D, bool BF16, bool DROPOUT>
__global__ void __launch_bounds__(384, 1) hopper_fwd(const __grid_constant__ hopper_params hp)
{
    typedef htile<D> TL;
    typedef consumer<D, BF16> C;
    constexpr int BM = TL::BM, BN = TL::BN, NCH = TL::NCH, STAGES = TL::STAGES;
    const flash_params &p = hp.p;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t sQ = (raw + 1023u) & ~1023u; /* the swizzle repeats every 1024 bytes */
    const uint32_t sK = sQ + TL::Q_BYTES, sV = sK + STAGES * TL::KV_BYTES;
    /* mbarriers: Q full; per stage K full, V full, K empty, V empty. */
    const uint32_t bar_q = sQ + TL::BAR_OFFSET;
    auto k_full = [&](int s) { return bar_q + 8u * (1u + s); };
    auto v_full = [&](int s) { return bar_q + 8u * (1u + STAGES + s); };
    auto k_empty = [&](int s) { return bar_q + 8u * (1u + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bar_q + 8u * (1u + 3 * STAGES + s); };

    block_span bs;
    if (!block_span_init(bs, p, BM, BN))
        return;
    const int64_t m0 = bs.m0, q0 = bs.q0, sq = bs.sq, k0 = bs.k0, sk = bs.sk, tb = bs.tb;
    const int h = bs.h, b = bs.b, hk = bs.hk, rows = bs.rows;
    const int64_t kv_begin = bs.kv_begin, kv_end = bs.kv_end;
    const int ntiles = bs.ntiles;

    if (threadIdx.x == 0) {
        mbar_init(bar_q, 1);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 8); /* one arrival per consumer warp */
            mbar_init(v_empty(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) { /* ---------------------------------------------- producer */
        regs_dealloc<40>();
        if (threadIdx.x == 0) {
            auto load = [&](uint32_t dst, const CUtensorMap *map, int row, uint32_t bar) {
                mbar_expect_tx(bar, TL::KV_BYTES);
                for (int c = 0; c < NCH; c++)
                    tma_load(dst + c * BN * 128, map, c * 64, row, hk, (int)tb, bar);
            };
            auto row_of = [&](int t) { return (int)(k0 + kv_begin + (int64_t)t * BN); };
            mbar_expect_tx(bar_q, TL::Q_BYTES);
            for (int c = 0; c < NCH; c++)
                tma_load(sQ + c * BM * 128, &hp.tq, c * 64, (int)(q0 + m0), h, (int)tb, bar_q);
            /* K runs one tile ahead of V, as the consumers use them: K0 K1 V0 K2 V1 ... */
            if (ntiles > 0)
                load(sK, &hp.tk, row_of(0), k_full(0));
            for (int t = 0; t < ntiles; t++) {
                if (t + 1 < ntiles) {
                    const int s = (t + 1) % STAGES;
                    if (t + 1 >= STAGES)
                        mbar_wait(k_empty(s), (((t + 1) / STAGES) - 1) & 1);
                    load(sK + s * TL::KV_BYTES, &hp.tk, row_of(t + 1), k_full(s));
                }
                const int s = t % STAGES;
                if (t >= STAGES)
                    mbar_wait(v_empty(s), ((t / STAGES) - 1) & 1);
                load(sV + s * TL::KV_BYTES, &hp.tv, row_of(t), v_full(s));
            }
        }
        return;
    }

    /* ------------------------------------------------------------ consumers */
    regs_alloc<232>();
    const int cw = wg - 1; /* rows [64 cw, 64 cw + 64) of the block */
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int row0 = cw * 64 + warp * 16 + lane / 4; /* this thread's rows: row0, row0 + 8 */
    const uint32_t q_rows = sQ + cw * 64 * 128;
    const int64_t seq_head = (int64_t)b * p.heads + h;
    auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    };
    auto tile_n0 = [&](int t) { return kv_begin + (int64_t)t * BN; };
    auto tile_full = [&](int t) { return block_span_full(bs, tile_n0(t), BN); };
    auto tile_valid = [&](int t) { return (int)min64(BN, kv_end - tile_n0(t)); };

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        o[i] = 0.0f;
    float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.0f, 0.0f}, alpha[2];
    uint32_t pa[BN / 16][4];

    /* Ping-pong: the two consumers take turns issuing their GEMMs, so one's
     * softmax runs while the other's GEMMs hold the tensor cores. Consumer 1
     * hands the first turn to consumer 0. */
    if (cw == 1)
        named_arrive(BAR_TURN + 0, 256);
    mbar_wait(bar_q, 0);

    if (ntiles > 0) { /* tile 0: S only */
        float sc[BN / 2];
        mbar_wait(k_full(0), 0);
        named_sync(BAR_TURN + cw, 256);
        wg_fence();
        C::issue_scores(sc, q_rows, sK);
        wg_commit();
        named_arrive(BAR_TURN + (1 - cw), 256);
        wg_wait<0>();
        fence_regs<BN / 2>(sc);
        release(k_empty(0));
        C::mask(sc, p, tile_n0(0), tile_valid(0), tile_full(0), row0, rows, m0, sq, sk, lane);
        C::softmax(sc, m_row, l_row, alpha, p.scale_log2);
        if (DROPOUT)
            C::dropout(sc, p, seq_head, m0 + row0, tile_n0(0), lane);
        C::pack(sc, pa);
    }
    /* Tile t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} in flight together; the
     * softmax of S_t overlaps the second GEMM. */
    for (int t = 1; t < ntiles; t++) {
        const int s = t % STAGES, sp = (t - 1) % STAGES;
        float sc[BN / 2];
        mbar_wait(k_full(s), (t / STAGES) & 1);
        named_sync(BAR_TURN + cw, 256);
        wg_fence();
        C::issue_scores(sc, q_rows, sK + s * TL::KV_BYTES);
        wg_commit();
        mbar_wait(v_full(sp), ((t - 1) / STAGES) & 1);
        C::issue_pv(o, pa, sV + sp * TL::KV_BYTES);
        wg_commit();
        named_arrive(BAR_TURN + (1 - cw), 256);
        wg_wait<1>();
        fence_regs<BN / 2>(sc);
        release(k_empty(s));
        C::mask(sc, p, tile_n0(t), tile_valid(t), tile_full(t), row0, rows, m0, sq, sk, lane);
        C::softmax(sc, m_row, l_row, alpha, p.scale_log2);
        wg_wait<0>();
        fence_regs<D / 2>(o);
        release(v_empty(sp));
        C::rescale(o, alpha);
        if (DROPOUT)
            C::dropout(sc, p, seq_head, m0 + row0, tile_n0(t), lane);
        C::pack(sc, pa);
    }
    if (ntiles > 0) { /* the last tile's O += P V */
        const int sp = (ntiles - 1) % STAGES;
        mbar_wait(v_full(sp), ((ntiles - 1) / STAGES) & 1);
        wg_fence();
        C::issue_pv(o, pa, sV + sp * TL::KV_BYTES);
        wg_commit();
        wg_wait<0>();
        fence_regs<D / 2>(o);
        release(v_empty(sp));
    }

    /* Epilogue: normalise; rows that saw no key are 0 with LSE -inf. */
    float inv[2];
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        float l = l_row[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[rh] = l > 0.0f ? 1.0f / l : 0.0f;
        const int r = row0 + 8 * rh;
        if (p.lse && lane % 4 == 0 && r < rows)
            store_lse(p, bs, r, m_row[rh], l);
    }
    if (hp.o_vec) {
        /* Stage the warpgroup's 64 rows in its own (consumed) Q rows, in the
         * same swizzled chunks, then write whole 16-byte pieces of rows. */
        unsigned char *smem = smem_raw + (sQ - raw);
        const bool out_bf16 = p.out_dtype == FMHA_DTYPE_BF16;
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
        named_sync(BAR_EPILOGUE + cw, 128);
        const int units = p.dv / 8; /* 16-byte pieces per row */
        for (int idx = threadIdx.x % 128; idx < 64 * units; idx += 128) {
            const int r = cw * 64 + idx / units, u = idx % units;
            if (r >= rows)
                continue;
            const uint4 val =
                *(const uint4 *)(smem + (u / 8) * BM * 128 + r * 128 + (((u % 8) ^ (r % 8)) * 16));
            *(uint4 *)(block_out_row(p, bs, r) + u * 16) = val;
        }
        return;
    }
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = row0 + 8 * rh;
        if (r >= rows)
            continue;
        char *orow = block_out_row(p, bs, r);
#pragma unroll
        for (int j = 0; j < D / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = j * 8 + (lane % 4) * 2 + e;
                if (c >= p.dv)
                    continue;
                store_out(p, orow, c, o[4 * j + 2 * rh + e] * inv[rh]);
            }
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

/* A 4-D map (head-dim columns, rows, heads, batch) over a 16-bit tensor, in
 * boxes of 64 columns x box_rows rows, 128-byte swizzled. Coordinates past
 * the tensor's extents read as zeros. */
fmha_status make_map(CUtensorMap *map, const fmha_tensor &t, int box_rows, bool bf16, const char *name)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR,
                              "the CUDA driver has no cuTensorMapEncodeTiled (driver older than 12.0?)");
    cuuint64_t dims[4] = {(cuuint64_t)t.head_dim, (cuuint64_t)t.seqlen, (cuuint64_t)t.heads,
                          (cuuint64_t)t.batch};
    /* Strides of extent-1 axes are never followed; any legal value does. */
    int64_t ss = t.seqlen > 1 ? t.stride_seq : 8, sh = t.heads > 1 ? t.stride_head : 8,
            sb = t.batch > 1 ? t.stride_batch : 8;
    cuuint64_t strides[3] = {(cuuint64_t)ss * 2, (cuuint64_t)sh * 2, (cuuint64_t)sb * 2};
    cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
    cuuint32_t estr[4] = {1, 1, 1, 1};
    CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        4, t.data, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR,
                              "cuTensorMapEncodeTiled refused %s (error %d): strides (%lld, %lld, "
                              "%lld) elements",
                              name, (int)r, (long long)t.stride_seq, (long long)t.stride_head,
                              (long long)t.stride_batch);
    return FMHA_STATUS_OK;
}

template <int D, bool BF16, bool DROPOUT>
cudaError_t launch_variant(const hopper_params &hp, int64_t max_sq, int batch, cudaStream_t stream)
{
    static_assert(htile<D>::SMEM <= 227 * 1024, "tile exceeds the 227 KB of shared memory per block");
    const size_t smem = htile<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(hopper_fwd<D, BF16, DROPOUT>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess)
        return err;
    dim3 grid((unsigned)((max_sq + htile<D>::BM - 1) / htile<D>::BM), (unsigned)hp.p.heads,
              (unsigned)batch);
    hopper_fwd<D, BF16, DROPOUT><<<grid, htile<D>::THREADS, smem, stream>>>(hp);
    return cudaGetLastError();
}

template <int D, bool BF16>
fmha_status launch(hopper_params &hp, const fmha_problem *pb, cudaStream_t stream)
{
    const fmha_forward_args *a = pb->args;
    fmha_status st;
    if ((st = make_map(&hp.tq, a->q, htile<D>::BM, BF16, "q")) != FMHA_STATUS_OK ||
        (st = make_map(&hp.tk, a->k, htile<D>::BN, BF16, "k")) != FMHA_STATUS_OK ||
        (st = make_map(&hp.tv, a->v, htile<D>::BN, BF16, "v")) != FMHA_STATUS_OK)
        return st;
    const int64_t max_sq = pb->max_sq;
    const int batch = (int)pb->batch;
    cudaError_t err = hp.p.drop_threshold ? launch_variant<D, BF16, true>(hp, max_sq, batch, stream)
                                        : launch_variant<D, BF16, false>(hp, max_sq, batch, stream);
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the Hopper attention kernel launch");
}

} // namespace

namespace fmha_cuda {

fmha_status hopper_forward(const fmha_problem *pb, const flash_params &p, cudaStream_t stream)
{
    const bool bf16 = pb->cfg->dtype == FMHA_DTYPE_BF16;
    const int64_t dmax = pb->d > pb->dv ? pb->d : pb->dv;
    hopper_params h;
    memset(&h, 0, sizeof h);
    h.p = p;
    h.o_vec = pb->args->out.dtype != FMHA_DTYPE_F32 && chunk_aligned(pb->args->out);
#define FMHA_LAUNCH(D)                                                                            \
    if (dmax <= D)                                                                                \
        return bf16 ? launch<D, true>(h, pb, stream) : launch<D, false>(h, pb, stream);
    FMHA_CUDA_HEAD_DIMS(FMHA_LAUNCH)
#undef FMHA_LAUNCH
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED, "head dim %lld is above 256, the largest CUDA kernel",
                          (long long)dmax);
}

} // namespace fmha_cuda
