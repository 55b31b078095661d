/* cuda_backward.cu — the portable CUDA backward (sm_80 and later),
 * deterministic without atomics, as the CPU's. Three kernels on the call's
 * stream:
 *   rowsum  D = rowsum(dO * O) for every query row, indexed as the LSE;
 *   dkdv    a block owns BN keys of one (sequence, KV head); for each query
 *           head of the group it walks the query rows that see them, BQ at a
 *           time: dV += P^T dO, dK += dS^T Q (GQA's sum over the group is a
 *           loop, not a copy);
 *   dq      a block owns BM query rows of one (sequence, head) and walks the
 *           keys they see, BN at a time: dQ += dS K.
 * Both recompute S = Q K^T and P = 2^(S scale log2 e - LSE log2 e) from the
 * forward's LSE, and dP = dO V^T, on mma.sync m16n8k16 (16-bit operands, f32
 * accumulation); P and dS become 16-bit operands as the forward's P does.
 * dS = P (dP - D), times 1 - tanh^2 under softcap; dropout's factors are the
 * forward's Philox words, drawn again. The score modifiers (MODS variants)
 * add the forward's bias to S before P; with sinks, dsinks[h] = -sum P_sink D
 * over head h's rows, one block per head. Each gradient element is summed by one
 * thread in a fixed order, so the bits depend on the inputs alone; the cost
 * is S and dP computed twice. Head dims up to 128 keep dK and dV in one pass;
 * head dim 256 runs dV and dK as two passes (both accumulators would not fit
 * a thread's registers). K/V and Q/dO tiles load once per step (no
 * double-buffered ring as the forward's): this kernel is the correct portable
 * path, not yet a tuned one. */
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "../alloc.h"

#include <stdint.h>
#include <string.h>

namespace
{
using namespace fmha_cuda;

#define FMHA_CUDA_BWD_HEAD_DIMS(X) X(64) X(128) X(256)

constexpr float LOG2E_F = 1.4426950408889634f;

struct bwd_params {
    flash_params f; /* q, k, v, out, lse, shape, masks, dropout; cu_q, cu_k device */
    const void *dout;
    int64_t do_sb, do_ss, do_sh;
    int do_dtype;
    int do_direct; /* dout in the inputs' dtype with 16-byte rows: cp.async */
    void *g[3];    /* dq, dk, dv; NULL: not wanted */
    int64_t g_sb[3], g_ss[3], g_sh[3], g_rows[3], g_heads[3], g_dim[3];
    int g_dtype[3];
    float *D;    /* rowsum(dO * O), indexed as the LSE */
    float scale; /* the softmax scale: dS to dQ and dK */
    int64_t batch;
};

/* Rows [0, rows) x columns [0, cols) of a strided tile of any dtype into a
 * [R][D + 8] shared tile of T, zero elsewhere: cp.async where `direct`
 * (the tile is T with 16-byte rows), converted element by element else. */
template <int D, int R, int THREADS, typename T>
__device__ __forceinline__ void load_tile_any(T *s, const void *g, int dtype, int64_t row_stride,
                                              int rows, int cols, int direct)
{
    if (direct) {
        load_tile<D, R, THREADS>(s, (const T *)g, row_stride, rows, cols, 1);
        return;
    }
    constexpr int DS = D + 8;
    for (int e = threadIdx.x; e < R * D; e += THREADS) {
        const int r = e / D, c = e % D;
        s[r * DS + c] = r < rows && c < cols ? T(load_any(g, dtype, r * row_stride + c)) : T(0.0f);
    }
}

/* acc (16 x 8 NT) += A B^T: A the 16 rows at sA, B the 8 NT rows at sB, both
 * [row][16 KS] in shared memory with row stride DS (S = Q K^T's operands). */
template <bool BF16, int NT, int KS, int DS, typename T>
__device__ __forceinline__ void mma_a_bt(float (*acc)[4], const T *sA, const T *sB, int lane)
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_u32(sA + (lane % 16) * DS + kk * 16 + (lane / 16) * 8));
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            ldmatrix_x4(b, smem_u32(sB + (np * 16 + lane % 8 + (lane / 16) * 8) * DS + kk * 16 +
                                    ((lane / 8) % 2) * 8));
            mma<BF16>(acc[2 * np], a, b[0], b[1]);
            mma<BF16>(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* acc (16 x 8 NT) += A B: A in registers as KS fragments of 16 x 16, B
 * [16 KS][8 NT] row-major at sB with row stride DS (O += P V's operands). */
template <bool BF16, int NT, int KS, int DS, typename T>
__device__ __forceinline__ void mma_frag_b(float (*acc)[4], const uint32_t (*a)[4], const T *sB,
                                           int lane)
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
#pragma unroll
        for (int dp = 0; dp < NT / 2; dp++) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, smem_u32(sB + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * DS +
                                          dp * 16 + (lane / 16) * 8));
            mma<BF16>(acc[2 * dp], a[kk], b[0], b[1]);
            mma<BF16>(acc[2 * dp + 1], a[kk], b[2], b[3]);
        }
}

/* An accumulator of 16 x 16 KS as the A fragments of the next product. */
template <bool BF16, int KS>
__device__ __forceinline__ void to_frags(uint32_t (*a)[4], const float (*x)[4])
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        a[kk][0] = pack2<BF16>(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = pack2<BF16>(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = pack2<BF16>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = pack2<BF16>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

/* The forward's LSE in the log2 domain; a row without keys (-inf) gets +inf
 * so that every P of it is 2^-inf = 0. */
__device__ __forceinline__ float lse_log2(float lse)
{
    return lse == -INFINITY ? INFINITY : lse * LOG2E_F;
}

__device__ __forceinline__ int64_t lse_index(const flash_params &p, int64_t b, int h, int64_t q0,
                                             int64_t sq, int64_t i)
{
    return p.varlen ? (int64_t)h * p.total_q + q0 + i : (b * p.heads + h) * sq + i;
}

/* Sequence b's packed offsets and lengths. */
__device__ __forceinline__ void seq_bounds(const flash_params &p, int64_t b, int64_t &q0,
                                           int64_t &sq, int64_t &k0, int64_t &sk, int64_t &tb)
{
    q0 = 0, sq = p.sq, k0 = 0, sk = p.sk, tb = b;
    if (p.varlen) {
        q0 = p.cu_q[b];
        sq = p.cu_q[b + 1] - q0;
        k0 = p.cu_k[b];
        sk = p.cu_k[b + 1] - k0;
        tb = 0;
    }
}

/* The dropout factor of key `col` for query `row` of head h of sequence b:
 * the forward's word for that element (dropout_pair_words' stream). */
__device__ __forceinline__ float keep_factor(const flash_params &p, int64_t b, int h, int64_t row,
                                             int64_t col)
{
    const int64_t g = col + p.pos_col0;
    const fmha_u32x4 w = fmha_dropout_words(p.seed, p.offset, b * p.pos_heads + p.pos_head0 + h,
                                            row + p.pos_row0, g);
    const uint32_t x = (g & 3) == 0   ? w.v[0]
                       : (g & 3) == 1 ? w.v[1]
                       : (g & 3) == 2 ? w.v[2]
                                      : w.v[3];
    return x >= p.drop_threshold ? p.drop_scale : 0.0f;
}

/* The first query row i in [0, sq] whose visible keys [lo, hi) have
 * hi > key (upper) or lo >= key (!upper): both bounds never decrease with i. */
__device__ __forceinline__ int64_t first_row(const flash_params &p, int64_t sq, int64_t sk,
                                             int64_t key, bool upper)
{
    int64_t lo = 0, hi = sq;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        int64_t l, h;
        fmha_mask_range(p.causal, p.window_left, p.window_right, mid, sq, sk, &l, &h);
        if (upper ? h > key : l >= key)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* A gradient row's elements: x(c) for columns [0, cols) times mul. */
template <int D, class X>
__device__ __forceinline__ void store_grad_frag(const bwd_params &P, int which, int64_t tb,
                                                int64_t tok, int head, int cols, int lane,
                                                float mul, X x)
{
    const int64_t base = tb * P.g_sb[which] + tok * P.g_ss[which] + head * P.g_sh[which];
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = j * 8 + (lane % 4) * 2 + e;
            if (c < cols)
                store_any(P.g[which], P.g_dtype[which], base + c, x(j, e) * mul);
        }
}

/* ------------------------------------------------------------- rowsum */

constexpr int ROWSUM_WARPS = 8;

/* One warp per (token, head): D of that query row, lanes over the channels. */
__global__ void __launch_bounds__(ROWSUM_WARPS * 32) bwd_rowsum(const bwd_params P)
{
    const flash_params &p = P.f;
    const int lane = threadIdx.x % 32;
    const int64_t rows = p.varlen ? p.total_q : P.batch * p.sq;
    const int64_t odt = p.out_dtype;
    for (int64_t w = (int64_t)blockIdx.x * ROWSUM_WARPS + threadIdx.x / 32; w < rows * p.heads;
         w += (int64_t)gridDim.x * ROWSUM_WARPS) {
        const int64_t t = w / p.heads;
        const int h = (int)(w % p.heads);
        const int64_t tb = p.varlen ? 0 : t / p.sq, tok = p.varlen ? t : t % p.sq;
        const int64_t idx = p.varlen ? (int64_t)h * p.total_q + t : (tb * p.heads + h) * p.sq + tok;
        const int64_t ob = tb * p.o_sb + tok * p.o_ss + h * p.o_sh;
        const int64_t gb = tb * P.do_sb + tok * P.do_ss + h * P.do_sh;
        float acc = 0.0f;
        for (int c = lane; c < p.dv; c += 32)
            acc += load_any(p.o, (int)odt, ob + c) * load_any(P.dout, P.do_dtype, gb + c);
#pragma unroll
        for (int s = 16; s > 0; s /= 2)
            acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (lane == 0)
            P.D[idx] = acc;
    }
}

/* ----------------------------------------------------------------- dq */

template <int D> struct dq_tile {
    static constexpr int WARPS = 4, THREADS = 128, BM = 16 * WARPS;
    static constexpr int BN = D <= 128 ? 64 : 32;
    static constexpr int DS = D + 8;
    static constexpr size_t SMEM = (size_t)(2 * BM + 2 * BN) * DS * 2;
};

template <int D, bool BF16, bool DROPOUT, bool MODS>
__global__ void __launch_bounds__(128) bwd_dq(const bwd_params P)
{
    typedef typename elem<BF16>::T T;
    typedef dq_tile<D> TL;
    constexpr int BM = TL::BM, BN = TL::BN, THREADS = TL::THREADS, DS = TL::DS;
    const flash_params &p = P.f;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = (T *)smem, *sdO = sQ + BM * DS, *sK = sdO + BM * DS, *sV = sK + BN * DS;

    block_span bs;
    if (!block_span_init(bs, p, BM, BN))
        return;
    const int64_t m0 = bs.m0, q0 = bs.q0, sq = bs.sq, k0 = bs.k0, sk = bs.sk, tb = bs.tb;
    const int h = bs.h, b = bs.b, hk = bs.hk, rows = bs.rows;
    const T *gq = (const T *)p.q + tb * p.q_sb + (q0 + m0) * p.q_ss + h * p.q_sh;
    const char *gdo = (const char *)P.dout + (tb * P.do_sb + (q0 + m0) * P.do_ss + h * P.do_sh) *
                                                 (P.do_dtype == FMHA_DTYPE_F32 ? 4 : 2);
    const T *gk = (const T *)p.k + tb * p.k_sb + k0 * p.k_ss + hk * p.k_sh;
    const T *gv = (const T *)p.v + tb * p.v_sb + k0 * p.v_ss + hk * p.v_sh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    load_tile<D, BM, THREADS>(sQ, gq, p.q_ss, rows, p.d, p.aligned);
    load_tile_any<D, BM, THREADS>(sdO, gdo, P.do_dtype, P.do_ss, rows, p.dv, P.do_direct);
    cp_async_commit();

    /* This thread's rows warp * 16 + lane / 4 + 8 rh: LSE, D and visible keys. */
    float lse2[2], Dr[2];
    int64_t lo[2], hi[2];
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = warp * 16 + lane / 4 + rh * 8;
        lse2[rh] = INFINITY, Dr[rh] = 0.0f, lo[rh] = hi[rh] = 0;
        if (r < rows) {
            const int64_t at = lse_index(p, b, h, q0, sq, m0 + r);
            lse2[rh] = lse_log2(p.lse[at]);
            Dr[rh] = P.D[at];
            fmha_mask_range(p.causal, p.window_left, p.window_right, m0 + r, sq, sk, &lo[rh],
                            &hi[rh]);
        }
    }

    float dq[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;

    for (int t = 0; t < bs.ntiles; t++) {
        const int64_t n0 = bs.kv_begin + (int64_t)t * BN;
        const int nvalid = (int)min64(BN, bs.kv_end - n0);
        __syncthreads(); /* the previous tile's reads are done */
        load_tile<D, BN, THREADS>(sK, gk + n0 * p.k_ss, p.k_ss, nvalid, p.d, p.aligned);
        load_tile<D, BN, THREADS>(sV, gv + n0 * p.v_ss, p.v_ss, nvalid, p.dv, p.aligned);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[i][e] = dp[i][e] = 0.0f;
        mma_a_bt<BF16, BN / 8, D / 16, DS>(s, sQ + warp * 16 * DS, sK, lane);
        mma_a_bt<BF16, BN / 8, D / 16, DS>(dp, sdO + warp * 16 * DS, sV, lane);

        const bool full = block_span_full(bs, n0, BN);
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int64_t row = m0 + warp * 16 + lane / 4 + rh * 8;
                const int c0 = i * 8 + (lane % 4) * 2;
                uint32_t w[2] = {0, 0};
                if (DROPOUT)
                    dropout_pair_words(p, b, h, row, n0 + c0, w);
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float x = s[i][2 * rh + e], g = 1.0f;
                    if (p.softcap_out != 0.0f) {
                        const float th = tanh_fast(x * p.softcap_in);
                        x = th * p.softcap_out;
                        g = 1.0f - th * th;
                    }
                    const int64_t key = n0 + c0 + e;
                    const bool vis = full || (c0 + e < nvalid && lo[rh] <= key && key < hi[rh]);
                    if (MODS && vis && row < sq)
                        x += p.bias_unit * score_bias(p, b, h, row, key, sq, sk);
                    const float pr = exp2_approx(fmaf(x, p.scale_log2, -lse2[rh]));
                    float f = 1.0f;
                    if (DROPOUT)
                        f = w[e] >= p.drop_threshold ? p.drop_scale : 0.0f;
                    s[i][2 * rh + e] = vis ? pr * g * (dp[i][2 * rh + e] * f - Dr[rh]) : 0.0f;
                }
            }

        uint32_t ds[BN / 16][4];
        to_frags<BF16, BN / 16>(ds, s);
        mma_frag_b<BF16, D / 8, BN / 16, DS>(dq, ds, sK, lane);
    }

#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = warp * 16 + lane / 4 + rh * 8;
        if (r < rows)
            store_grad_frag<D>(P, 0, tb, q0 + m0 + r, h, p.d, lane, P.scale,
                               [&](int j, int e) { return dq[j][2 * rh + e]; });
    }
}

/* --------------------------------------------------------------- dkdv */

template <int D> struct kv_tile {
    static constexpr int WARPS = 4, THREADS = 128, BN = 16 * WARPS;
    static constexpr int BQ = D <= 64 ? 64 : 32;
    static constexpr int DS = D + 8;
    static constexpr size_t SMEM = (size_t)(2 * BN + 2 * BQ) * DS * 2 + 2 * BQ * sizeof(float);
};

template <int D, bool BF16, bool DROPOUT, bool MODS, bool DK, bool DV>
__global__ void __launch_bounds__(128) bwd_dkdv(const bwd_params P)
{
    typedef typename elem<BF16>::T T;
    typedef kv_tile<D> TL;
    constexpr int BN = TL::BN, BQ = TL::BQ, THREADS = TL::THREADS, DS = TL::DS;
    const flash_params &p = P.f;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sK = (T *)smem, *sV = sK + BN * DS, *sQ = sV + BN * DS, *sdO = sQ + BQ * DS;
    float *sL = (float *)(sdO + BQ * DS), *sD = sL + BQ;

    const int hk = blockIdx.y;
    const int64_t b = blockIdx.z;
    int64_t q0, sq, k0, sk, tb;
    seq_bounds(p, b, q0, sq, k0, sk, tb);
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    if (n0 >= sk)
        return;
    const int nk = (int)min64(BN, sk - n0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T *gk = (const T *)p.k + tb * p.k_sb + (k0 + n0) * p.k_ss + hk * p.k_sh;
    const T *gv = (const T *)p.v + tb * p.v_sb + (k0 + n0) * p.v_ss + hk * p.v_sh;
    load_tile<D, BN, THREADS>(sK, gk, p.k_ss, nk, p.d, p.aligned);
    load_tile<D, BN, THREADS>(sV, gv, p.v_ss, nk, p.dv, p.aligned);
    cp_async_commit();

    float dk[D / 8][4], dv[D / 8][4]; /* the one not wanted is dead code */
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.0f;

    /* The query rows that see a key of [n0, n0 + nk). */
    const int64_t ia = first_row(p, sq, sk, n0, true), ib = first_row(p, sq, sk, n0 + nk, false);
    const int esz = P.do_dtype == FMHA_DTYPE_F32 ? 4 : 2;
    for (int h = hk * p.group; h < (hk + 1) * p.group; h++) {
        for (int64_t i0 = ia; i0 < ib; i0 += BQ) {
            const int nq = (int)min64(BQ, ib - i0);
            __syncthreads(); /* the previous step's reads are done */
            load_tile<D, BQ, THREADS>(
                sQ, (const T *)p.q + tb * p.q_sb + (q0 + i0) * p.q_ss + h * p.q_sh, p.q_ss, nq, p.d,
                p.aligned);
            load_tile_any<D, BQ, THREADS>(
                sdO,
                (const char *)P.dout + (tb * P.do_sb + (q0 + i0) * P.do_ss + h * P.do_sh) * esz,
                P.do_dtype, P.do_ss, nq, p.dv, P.do_direct);
            cp_async_commit();
            for (int r = threadIdx.x; r < BQ; r += THREADS) {
                const int64_t at = lse_index(p, b, h, q0, sq, i0 + r);
                sL[r] = r < nq ? lse_log2(p.lse[at]) : INFINITY;
                sD[r] = r < nq ? P.D[at] : 0.0f;
            }
            cp_async_wait<0>();
            __syncthreads();

            int64_t lo_last, hi_last, lo_first, hi_first;
            fmha_mask_range(p.causal, p.window_left, p.window_right, i0, sq, sk, &lo_first,
                            &hi_first);
            fmha_mask_range(p.causal, p.window_left, p.window_right, i0 + nq - 1, sq, sk, &lo_last,
                            &hi_last);
            const bool full = lo_last <= n0 && hi_first >= n0 + nk;

            /* S^T and dP^T: rows are this warp's 16 keys, columns the BQ queries. */
            float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
            for (int i = 0; i < BQ / 8; i++)
                st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.0f;
            mma_a_bt<BF16, BQ / 8, D / 16, DS>(st, sK + warp * 16 * DS, sQ, lane);
            if (DK) {
#pragma unroll
                for (int i = 0; i < BQ / 8; i++)
                    dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.0f;
                mma_a_bt<BF16, BQ / 8, D / 16, DS>(dpt, sV + warp * 16 * DS, sdO, lane);
            }

#pragma unroll
            for (int i = 0; i < BQ / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = i * 8 + (lane % 4) * 2 + e % 2; /* query column */
                    const int64_t key = n0 + warp * 16 + lane / 4 + (e / 2) * 8;
                    float x = st[i][e], g = 1.0f;
                    if (p.softcap_out != 0.0f) {
                        const float th = tanh_fast(x * p.softcap_in);
                        x = th * p.softcap_out;
                        g = 1.0f - th * th;
                    }
                    bool vis = full;
                    if (!vis) {
                        int64_t lo, hi;
                        fmha_mask_range(p.causal, p.window_left, p.window_right, i0 + c, sq, sk,
                                        &lo, &hi);
                        vis = c < nq && lo <= key && key < hi;
                    }
                    if (MODS && vis && c < nq && key < sk)
                        x += p.bias_unit * score_bias(p, b, h, i0 + c, key, sq, sk);
                    const float pr = exp2_approx(fmaf(x, p.scale_log2, -sL[c]));
                    const float f =
                        DROPOUT && vis && key < sk ? keep_factor(p, b, h, i0 + c, key) : 1.0f;
                    st[i][e] = vis ? pr * f : 0.0f;
                    if (DK)
                        dpt[i][e] = vis ? pr * g * (dpt[i][e] * f - sD[c]) : 0.0f;
                }

            if (DV) {
                uint32_t pa[BQ / 16][4];
                to_frags<BF16, BQ / 16>(pa, st);
                mma_frag_b<BF16, D / 8, BQ / 16, DS>(dv, pa, sdO, lane);
            }
            if (DK) {
                uint32_t da[BQ / 16][4];
                to_frags<BF16, BQ / 16>(da, dpt);
                mma_frag_b<BF16, D / 8, BQ / 16, DS>(dk, da, sQ, lane);
            }
        }
    }
    cp_async_wait<0>(); /* no query step: K and V's copies still land before exit */

#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = warp * 16 + lane / 4 + rh * 8;
        if (r >= nk)
            continue;
        if (DK && P.g[1])
            store_grad_frag<D>(P, 1, tb, k0 + n0 + r, hk, p.d, lane, P.scale,
                               [&](int j, int e) { return dk[j][2 * rh + e]; });
        if (DV && P.g[2])
            store_grad_frag<D>(P, 2, tb, k0 + n0 + r, hk, p.dv, lane, 1.0f,
                               [&](int j, int e) { return dv[j][2 * rh + e]; });
    }
}

/* ------------------------------------------------------ packed tails */

/* Rows of packed dq, dk, dv past the last sequence's end: 0. */
__global__ void bwd_zero_tails(const bwd_params P)
{
    for (int which = 0; which < 3; which++) {
        if (!P.g[which])
            continue;
        const int64_t from = (which == 0 ? P.f.cu_q : P.f.cu_k)[P.batch];
        const int64_t n = (P.g_rows[which] - from) * P.g_heads[which] * P.g_dim[which];
        for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
             e += (int64_t)gridDim.x * blockDim.x) {
            const int64_t c = e % P.g_dim[which], rest = e / P.g_dim[which];
            const int64_t h = rest % P.g_heads[which], s = from + rest / P.g_heads[which];
            store_any(P.g[which], P.g_dtype[which], s * P.g_ss[which] + h * P.g_sh[which] + c,
                      0.0f);
        }
    }
}

/* ------------------------------------------------------------- dsinks */

constexpr int DSINKS_THREADS = 256;

/* dsinks[h] = -sum over head h's rows of P_sink D, P_sink = e^(sink - lse):
 * one block per head, each thread's rows in a fixed order and a fixed tree
 * over the threads, so the bits depend on the inputs alone. */
__global__ void __launch_bounds__(DSINKS_THREADS) bwd_dsinks(const bwd_params P, float *dsinks)
{
    const flash_params &p = P.f;
    const int h = blockIdx.x;
    const float sink = p.sinks[h];
    double acc = 0.0;
    if (sink != -INFINITY) {
        /* padded: rows (b, i) at (b H + h) sq + i; packed: tokens [cu_q[0], cu_q[batch]) */
        const int64_t first = p.varlen ? p.cu_q[0] : 0;
        const int64_t n = p.varlen ? p.cu_q[P.batch] - first : P.batch * p.sq;
        for (int64_t t = threadIdx.x; t < n; t += DSINKS_THREADS) {
            const int64_t at = p.varlen ? (int64_t)h * p.total_q + first + t
                                        : ((t / p.sq) * p.heads + h) * p.sq + t % p.sq;
            const float lse = p.lse[at];
            if (lse != -INFINITY)
                acc -= exp((double)sink - (double)lse) * (double)P.D[at];
        }
    }
    __shared__ double part[DSINKS_THREADS];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = DSINKS_THREADS / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s)
            part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        dsinks[h] = (float)part[0];
}

/* ------------------------------------------------------------ launches */

template <class K>
cudaError_t launch_kernel(K kernel, dim3 grid, size_t smem, cudaStream_t stream,
                          const bwd_params &P)
{
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess)
        return err;
    kernel<<<grid, 128, smem, stream>>>(P);
    return cudaGetLastError();
}

template <int D, bool BF16, bool DROPOUT, bool MODS>
cudaError_t launch_dq(const bwd_params &P, int64_t max_sq, cudaStream_t stream)
{
    dim3 grid((unsigned)((max_sq + dq_tile<D>::BM - 1) / dq_tile<D>::BM), (unsigned)P.f.heads,
              (unsigned)P.batch);
    return launch_kernel(bwd_dq<D, BF16, DROPOUT, MODS>, grid, dq_tile<D>::SMEM, stream, P);
}

template <int D, bool BF16, bool DROPOUT, bool MODS>
cudaError_t launch_dkdv(const bwd_params &P, int64_t max_sk, cudaStream_t stream)
{
    dim3 grid((unsigned)((max_sk + kv_tile<D>::BN - 1) / kv_tile<D>::BN), (unsigned)P.f.kv_heads,
              (unsigned)P.batch);
    const size_t smem = kv_tile<D>::SMEM;
    if constexpr (D <= 128) {
        return launch_kernel(bwd_dkdv<D, BF16, DROPOUT, MODS, true, true>, grid, smem, stream, P);
    } else {
        cudaError_t err = cudaSuccess;
        if (P.g[2])
            err =
                launch_kernel(bwd_dkdv<D, BF16, DROPOUT, MODS, false, true>, grid, smem, stream, P);
        if (err == cudaSuccess && P.g[1])
            err =
                launch_kernel(bwd_dkdv<D, BF16, DROPOUT, MODS, true, false>, grid, smem, stream, P);
        return err;
    }
}

/* dq, then dk and dv, on the variant of the call's dropout and bias (a
 * mask or ALiBi slopes: sinks alone leave S as it is). */
template <int D, bool BF16, bool DROPOUT, bool MODS>
cudaError_t launch_grads_of(const bwd_params &P, const fmha_problem *pb, cudaStream_t stream)
{
    cudaError_t err = cudaSuccess;
    if (P.g[0] && pb->max_sq > 0)
        err = launch_dq<D, BF16, DROPOUT, MODS>(P, pb->max_sq, stream);
    if (err == cudaSuccess && (P.g[1] || P.g[2]) && pb->max_sk > 0)
        err = launch_dkdv<D, BF16, DROPOUT, MODS>(P, pb->max_sk, stream);
    return err;
}

template <int D, bool BF16>
cudaError_t launch_grads(const bwd_params &P, const fmha_problem *pb, cudaStream_t stream)
{
    const bool drop = P.f.drop_threshold != 0, bias = P.f.mask || P.f.alibi;
    return drop ? (bias ? launch_grads_of<D, BF16, true, true>(P, pb, stream)
                        : launch_grads_of<D, BF16, true, false>(P, pb, stream))
                : (bias ? launch_grads_of<D, BF16, false, true>(P, pb, stream)
                        : launch_grads_of<D, BF16, false, false>(P, pb, stream));
}

} // namespace

namespace fmha_cuda
{

fmha_status backward_variant(fmha_plan *plan)
{
    const int64_t dmax =
        plan->cfg.head_dim > plan->cfg.head_dim_v ? plan->cfg.head_dim : plan->cfg.head_dim_v;
#define FMHA_VARIANT(D)                \
    if (dmax <= D) {                   \
        plan->head_dim_variant = D;    \
        plan->tile_m = dq_tile<D>::BM; \
        plan->tile_n = kv_tile<D>::BN; \
        return FMHA_STATUS_OK;         \
    }
    FMHA_CUDA_BWD_HEAD_DIMS(FMHA_VARIANT)
#undef FMHA_VARIANT
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "head dim %lld is above 256, the largest CUDA backward", (long long)dmax);
}

fmha_status portable_backward(const fmha_plan *plan, const fmha_problem *pb)
{
    const fmha_backward_args *a = pb->bwd;
    bwd_params P;
    memset(&P, 0, sizeof P);
    fill_flash_params(pb, &P.f);
    P.f.cu_q = a->cu_seqlens_q; /* the device copies: pb->args holds validation's host ones */
    P.f.cu_k = a->cu_seqlens_k;
    P.dout = a->dout.data;
    P.do_sb = a->dout.stride_batch, P.do_ss = a->dout.stride_seq, P.do_sh = a->dout.stride_head;
    P.do_dtype = a->dout.dtype;
    P.do_direct = a->dout.dtype == plan->cfg.dtype && chunk_aligned(a->dout);
    const fmha_tensor *gs[3] = {&a->dq, &a->dk, &a->dv};
    for (int i = 0; i < 3; i++) {
        P.g[i] = gs[i]->data;
        P.g_sb[i] = gs[i]->stride_batch, P.g_ss[i] = gs[i]->stride_seq;
        P.g_sh[i] = gs[i]->stride_head;
        P.g_rows[i] = gs[i]->seqlen, P.g_heads[i] = gs[i]->heads, P.g_dim[i] = gs[i]->head_dim;
        P.g_dtype[i] = gs[i]->dtype;
    }
    P.scale = (float)pb->scale;
    P.batch = pb->batch;
    cudaStream_t stream = (cudaStream_t)a->stream;

    const int64_t nD = pb->varlen ? pb->heads * a->q.seqlen : pb->batch * pb->heads * a->q.seqlen;
    if (nD > 0) {
        if (fmha_alloc_injected_failure())
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "reserving %lld bytes of device scratch for the backward: "
                                  "allocation failure injected",
                                  (long long)(nD * 4));
        cudaError_t err = cudaMallocAsync((void **)&P.D, (size_t)nD * sizeof(float), stream);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return cuda_error(err, "the backward's scratch (cudaMallocAsync)");
        }
    }
    cudaError_t err = cudaSuccess;
    if (nD > 0) {
        const int64_t warps = nD;
        const int64_t blocks = min64((warps + ROWSUM_WARPS - 1) / ROWSUM_WARPS, 65535);
        bwd_rowsum<<<(unsigned)blocks, ROWSUM_WARPS * 32, 0, stream>>>(P);
        err = cudaGetLastError();
    }
    const bool bf16 = plan->cfg.dtype == FMHA_DTYPE_BF16;
#define FMHA_LAUNCH(D)                                     \
    if (err == cudaSuccess && plan->head_dim_variant == D) \
        err = bf16 ? launch_grads<D, true>(P, pb, stream) : launch_grads<D, false>(P, pb, stream);
    FMHA_CUDA_BWD_HEAD_DIMS(FMHA_LAUNCH)
#undef FMHA_LAUNCH
    if (err == cudaSuccess && pb->varlen) {
        bwd_zero_tails<<<64, 256, 0, stream>>>(P);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess && a->dsinks) { /* validation: dsinks comes with sinks */
        bwd_dsinks<<<(unsigned)pb->heads, DSINKS_THREADS, 0, stream>>>(P, a->dsinks);
        err = cudaGetLastError();
    }
    if (P.D)
        cudaFreeAsync(P.D, stream);
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the backward kernel launch");
}

} // namespace fmha_cuda
