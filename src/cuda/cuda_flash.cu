/* cuda_flash.cu — the portable CUDA forward (sm_80 and later): a
 * FlashAttention-2-style kernel. A block owns BM queries of one (sequence,
 * head); each warp owns 16 of them. K/V tiles of BN keys stream through a
 * two-stage cp.async ring in shared memory; S = Q K^T and O += P V run on
 * mma.sync m16n8k16 (bf16/f16 in, f32 accumulate) with operands fetched by
 * ldmatrix, and the online softmax stays in registers: S's accumulator
 * fragment is P's operand fragment, so P never touches shared memory. */
#include "cuda_common.cuh"
#include "cuda_mma.cuh"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace
{
using namespace fmha_cuda;

/* Tile shape per head dim; each warp owns MT m16 tiles of queries, so every
 * K/V fragment read from shared memory feeds MT mma's. Shared memory is
 * (BM + 2 BN) x (D + 8) x 2 bytes for Q and K, 2 BN x (DV + 8) x 2 for V.
 *   D <= 128: 4 warps x 2 m-tiles, BN 64: 104 KiB at D = 128, two blocks per
 *             SM. On the H200 (2026-12-02, bench/NOTES.md) this ran 1.2-1.3x
 *             the one-m-tile version and 1.2x BN 32, despite ~200 bytes of
 *             spills at D = 128.
 *   D 192, 256: 8 warps x 1 m-tile (O alone is D/2 registers per thread).
 *   D 512: 4 warps x 1 m-tile, BN 32, and O's columns in halves: a block
 *             computes S over all 512 dims but P V for DV = 256 columns of
 *             V (O at 512 would be 256 registers per thread), so two blocks
 *             share each query tile (S computed twice) at 163 KiB. */
#ifndef FMHA_CUDA_MT /* tuning knobs for D <= 128 (gpu_run.sh variants) */
#define FMHA_CUDA_MT 2
#endif
#ifndef FMHA_CUDA_BN
#define FMHA_CUDA_BN 64
#endif
#ifndef FMHA_CUDA_QK_UNROLL /* head-dim steps of S = Q K^T unrolled together */
#define FMHA_CUDA_QK_UNROLL 1
#endif
constexpr int QK_UNROLL = FMHA_CUDA_QK_UNROLL;
template <int D> struct tile {
    static constexpr int MT = D <= 128 ? FMHA_CUDA_MT : 1;
    static constexpr int WARPS = D <= 128 || D > 256 ? 4 : 8;
    static constexpr int BM = 16 * MT * WARPS;
    static constexpr int BN = D <= 128 ? FMHA_CUDA_BN : D <= 256 ? 64 : 32;
    static constexpr int DV = D <= 256 ? D : 256; /* V and O columns per block */
    static constexpr int THREADS = WARPS * 32;
    static constexpr int DS =
        D + 8; /* row stride: +16 bytes keeps ldmatrix free of bank conflicts */
    static constexpr int DSV = DV + 8;
    static constexpr size_t SMEM = ((size_t)(BM + 2 * BN) * DS + (size_t)2 * BN * DSV) * 2;
};

/* DROPOUT is a template argument because the Philox rounds' registers would
 * otherwise be reserved on every path: at D = 128 they cost ~200 bytes of
 * spills per thread. MODS (the score modifiers: mask, ALiBi, sinks) too. */
template <int D, bool BF16, bool DROPOUT, bool MODS>
__global__ void __launch_bounds__(tile<D>::THREADS, 256 / tile<D>::THREADS)
    flash_fwd(const flash_params p, const int vsplit)
{
    typedef typename elem<BF16>::T T;
    constexpr int BM = tile<D>::BM, BN = tile<D>::BN, THREADS = tile<D>::THREADS, MT = tile<D>::MT;
    constexpr int DS = tile<D>::DS, DV = tile<D>::DV, DSV = tile<D>::DSV;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = (T *)smem;        /* [BM][DS] */
    T *sK = sQ + BM * DS;     /* [2][BN][DS] */
    T *sV = sK + 2 * BN * DS; /* [2][BN][DSV] */

    /* Blocks x = vsplit * tile + part: part owns V and O columns [vc0, vc0 + DV)
     * (vsplit is 1 where DV = D: those variants compile as if it were not there). */
    constexpr bool SPLIT = DV < D;
    const int parts = SPLIT ? vsplit : 1;
    const int vc0 = SPLIT ? (int)(blockIdx.x % parts) * DV : 0;
    block_span bs;
    if (!block_span_init(bs, p, BM, BN, parts))
        return;
    const int64_t m0 = bs.m0, q0 = bs.q0, sq = bs.sq, k0 = bs.k0, sk = bs.sk, tb = bs.tb;
    const int h = bs.h, b = bs.b, hk = bs.hk, rows = bs.rows;
    const int64_t kv_begin = bs.kv_begin, kv_end = bs.kv_end;
    const int ntiles = bs.ntiles;
    const T *gq = (const T *)p.q + tb * p.q_sb + (q0 + m0) * p.q_ss + h * p.q_sh;
    const T *gk = (const T *)p.k + tb * p.k_sb + k0 * p.k_ss + hk * p.k_sh;
    const T *gv = (const T *)p.v + tb * p.v_sb + k0 * p.v_ss + hk * p.v_sh + vc0;
    const int dv = p.dv - vc0; /* this block's columns of V, up to DV */

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    /* Fragment rows of this thread: m-tile mt, half rh -> block row
     * (warp * MT + mt) * 16 + lane / 4 + 8 rh. */

    load_tile<D, BM, THREADS>(sQ, gq, p.q_ss, rows, p.d, p.aligned);
    if (ntiles > 0) {
        const int n = (int)min64(BN, kv_end - kv_begin);
        load_tile<D, BN, THREADS>(sK, gk + kv_begin * p.k_ss, p.k_ss, n, p.d, p.aligned);
        load_tile<DV, BN, THREADS>(sV, gv + kv_begin * p.v_ss, p.v_ss, n, dv, p.aligned);
    }
    cp_async_commit();

    float o[MT][DV / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < DV / 8; i++)
            o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    float m_row[MT][2], l_row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        m_row[mt][0] = m_row[mt][1] = -INFINITY, l_row[mt][0] = l_row[mt][1] = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        const int64_t n0 = kv_begin + (int64_t)t * BN;
        const int nvalid = (int)min64(BN, kv_end - n0);
        if (t + 1 < ntiles) { /* the next tile streams in while this one computes */
            const int64_t n1 = n0 + BN;
            const int n = (int)min64(BN, kv_end - n1);
            load_tile<D, BN, THREADS>(sK + ((t + 1) & 1) * BN * DS, gk + n1 * p.k_ss, p.k_ss, n,
                                      p.d, p.aligned);
            load_tile<DV, BN, THREADS>(sV + ((t + 1) & 1) * BN * DSV, gv + n1 * p.v_ss, p.v_ss, n,
                                       dv, p.aligned);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T *cK = sK + (t & 1) * BN * DS, *cV = sV + (t & 1) * BN * DSV;

        /* S = Q K^T for the warp's MT x 16 rows x BN keys. */
        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
                s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll QK_UNROLL /* fully unrolled, ptxas hoists every Q fragment and spills */
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldmatrix_x4(a[mt], smem_u32(sQ + ((warp * MT + mt) * 16 + lane % 16) * DS +
                                            kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int np = 0; np < BN / 16; np++) {
                uint32_t bk[4];
                ldmatrix_x4(bk, smem_u32(cK + (np * 16 + lane % 8 + (lane / 16) * 8) * DS +
                                         kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma<BF16>(s[mt][2 * np], a[mt], bk[0], bk[1]);
                    mma<BF16>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        if (p.softcap_out != 0.0f) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[mt][i][e] = tanh_fast(s[mt][i][e] * p.softcap_in) * p.softcap_out;
        }

        if (MODS && (p.mask || p.alibi)) { /* the bias of each score, read per element */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int rh = 0; rh < 2; rh++) {
                    const int r = (warp * MT + mt) * 16 + lane / 4 + rh * 8;
                    if (r >= rows)
                        continue;
#pragma unroll
                    for (int i = 0; i < BN / 8; i++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int c = i * 8 + (lane % 4) * 2 + e;
                            if (c < nvalid)
                                s[mt][i][2 * rh + e] +=
                                    p.bias_unit * score_bias(p, b, h, m0 + r, n0 + c, sq, sk);
                        }
                }
        }

        /* Mask keys a row does not see (and the zero rows past the tile). */
        const bool full = block_span_full(bs, n0, BN);
        if (!full) { /* rare: the bounds are recomputed rather than held in registers */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int rh = 0; rh < 2; rh++)
                    mask_frag<BN>(p, (warp * MT + mt) * 16 + lane / 4 + rh * 8, rows, m0, sq, sk,
                                  n0, nvalid, lane,
                                  [&](int j, int e) -> float & { return s[mt][j][2 * rh + e]; });
        }

        /* Online softmax, per row: the four threads of a quad share a row. */
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                float mx = m_row[mt][rh];
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
                    mx = fmaxf(mx, fmaxf(s[mt][i][2 * rh], s[mt][i][2 * rh + 1]) * p.scale_log2);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float base = mx == -INFINITY ? 0.0f : mx; /* no key yet: all terms 0 */
                const float alpha = exp2_approx(m_row[mt][rh] - base);
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
#pragma unroll
                    for (int e = 2 * rh; e < 2 * rh + 2; e++) {
                        s[mt][i][e] = exp2_approx(fmaf(s[mt][i][e], p.scale_log2, -base));
                        sum += s[mt][i][e];
                    }
                l_row[mt][rh] = l_row[mt][rh] * alpha + sum; /* the quad adds up at the end */
                m_row[mt][rh] = mx;
#pragma unroll
                for (int i = 0; i < DV / 8; i++) {
                    o[mt][i][2 * rh] *= alpha;
                    o[mt][i][2 * rh + 1] *= alpha;
                }
            }

        if (DROPOUT) { /* after the sum: the normaliser counts dropped terms */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
#pragma unroll
                    for (int rh = 0; rh < 2; rh++) {
                        const int64_t row = m0 + (warp * MT + mt) * 16 + lane / 4 + rh * 8;
                        const int64_t col = n0 + i * 8 + (lane % 4) * 2; /* even: two keys */
                        uint32_t w[2];
                        dropout_pair_words(p, b, h, row, col, w);
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            float &x = s[mt][i][2 * rh + e];
                            x = w[e] >= p.drop_threshold ? x * p.drop_scale : 0.0f;
                        }
                    }
        }

        /* P as 16-bit A-operand fragments: S's accumulator layout is P's
         * operand layout, and packing now frees half of S's registers. */
        uint32_t pa[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                pa[mt][kk][0] = pack2<BF16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = pack2<BF16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = pack2<BF16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = pack2<BF16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }

            /* O += P V. */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
            for (int dp = 0; dp < DV / 16; dp++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv,
                                  smem_u32(cV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * DSV +
                                           dp * 16 + (lane / 16) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma<BF16>(o[mt][2 * dp], pa[mt][kk], bv[0], bv[1]);
                    mma<BF16>(o[mt][2 * dp + 1], pa[mt][kk], bv[2], bv[3]);
                }
            }
        }
        __syncthreads(); /* the next iteration's prefetch overwrites this stage */
    }

    /* Normalise and store; rows that saw no key are 0 with LSE -inf. */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float l = l_row[mt][rh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = (warp * MT + mt) * 16 + lane / 4 + rh * 8;
            if (r >= rows)
                continue;
            float m = m_row[mt][rh], f = 1.0f;
            if (MODS)
                add_sink(p.sinks, h, m, l, f);
            const float inv = l > 0.0f ? f / l : 0.0f;
            store_out_frag<DV>(p, block_out_row(p, bs, r), lane, vc0,
                               [&](int j, int e) { return o[mt][j][2 * rh + e] * inv; });
            if (p.lse && lane % 4 == 0 && vc0 == 0)
                store_lse(p, bs, r, m, l);
        }
}

template <int D, bool BF16, bool DROPOUT, bool MODS>
cudaError_t launch_variant(const flash_params &p, int64_t max_sq, int batch, cudaStream_t stream)
{
    const size_t smem = tile<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(flash_fwd<D, BF16, DROPOUT, MODS>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess)
        return err;
    const int vsplit = (p.dv + tile<D>::DV - 1) / tile<D>::DV;
    dim3 grid((unsigned)((max_sq + tile<D>::BM - 1) / tile<D>::BM * vsplit), (unsigned)p.heads,
              (unsigned)batch);
    flash_fwd<D, BF16, DROPOUT, MODS><<<grid, tile<D>::THREADS, smem, stream>>>(p, vsplit);
    return cudaGetLastError();
}

template <int D, bool BF16>
cudaError_t launch(const flash_params &p, int64_t max_sq, int batch, cudaStream_t stream)
{
    if (p.mods)
        return p.drop_threshold ? launch_variant<D, BF16, true, true>(p, max_sq, batch, stream)
                                : launch_variant<D, BF16, false, true>(p, max_sq, batch, stream);
    return p.drop_threshold ? launch_variant<D, BF16, true, false>(p, max_sq, batch, stream)
                            : launch_variant<D, BF16, false, false>(p, max_sq, batch, stream);
}

} // namespace

namespace fmha_cuda
{

fmha_status portable_variant(fmha_plan *plan)
{
    const int64_t dmax =
        plan->cfg.head_dim > plan->cfg.head_dim_v ? plan->cfg.head_dim : plan->cfg.head_dim_v;
#define FMHA_VARIANT(D)             \
    if (dmax <= D) {                \
        plan->head_dim_variant = D; \
        plan->tile_m = tile<D>::BM; \
        plan->tile_n = tile<D>::BN; \
        return FMHA_STATUS_OK;      \
    }
    FMHA_CUDA_PORTABLE_HEAD_DIMS(FMHA_VARIANT)
#undef FMHA_VARIANT
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "head dim %lld is above 512, the largest CUDA kernel", (long long)dmax);
}

fmha_status portable_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                             cudaStream_t stream)
{
    const bool bf16 = plan->cfg.dtype == FMHA_DTYPE_BF16;
    const int batch = (int)pb->batch;
    cudaError_t err = cudaErrorInvalidValue;
#define FMHA_LAUNCH(D)                                             \
    if (plan->head_dim_variant == D)                               \
        err = bf16 ? launch<D, true>(p, pb->max_sq, batch, stream) \
                   : launch<D, false>(p, pb->max_sq, batch, stream);
    FMHA_CUDA_PORTABLE_HEAD_DIMS(FMHA_LAUNCH)
#undef FMHA_LAUNCH
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the attention kernel launch");
}

} // namespace fmha_cuda
