/* cuda_decode.cu — decode on CUDA (fmha_layer_decode): new queries against
 * KV caches, contiguous or paged, on the decode kernel of kernels.def
 * (cuda_decode_sm80, sm_80 and later).
 *
 * Decode reads every cached key and value once and does little arithmetic
 * on them, so the kernel is built to keep memory busy:
 *   - GQA packing: a block owns 16 query rows of one KV head (the head's
 *     group of query heads times the new queries; 32 where a head has more
 *     than 16), so each K/V byte is read once for all of them;
 *   - split keys (flash-decoding): a sequence's keys are cut into `splits`
 *     ranges run by separate blocks, chosen so that the blocks fill the
 *     device; each writes its normalised partial output and LSE, and a
 *     second launch merges them by their LSEs;
 *   - inside a block, K/V tiles of KT keys stream through a three-stage
 *     cp.async ring; a paged cache's rows are looked up through the block
 *     table one by one (any page size works), a tile ahead of their loads;
 *     four warps take a quarter of each tile each (per row tile, and for
 *     D = 256 two warps per quarter, each P.V over half the columns), with
 *     their own online softmax; the warps' results merge through shared
 *     memory at the end.
 * S = Q K^T and O += P V run on mma.sync m16n8k16 (f32 accumulate) as in
 * cuda_flash.cu. The new keys and values enter the caches first
 * (kv_append, rotated where rotary is on), on the same stream. */
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "../alloc.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace
{
using namespace fmha_cuda;

/* A validated decode call as kernel parameters. Row r of a (sequence, KV
 * head) is query i = r / group of query head hk * group + r % group. */
struct dec_params {
    const void *q, *kc, *vc;
    void *o;
    float *lse;
    int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
    const int32_t *cache_seqlens; /* NULL: every cache holds `capacity` */
    const int32_t *kv_batch;      /* contiguous: the cache row of each sequence (NULL: b) */
    const int32_t *page_table;    /* paged: [batch][page_stride] */
    int64_t page_stride;
    int page_size;
    int64_t capacity, seqlen_new;
    int batch, heads, kv_heads, group, sq, rows, row_blocks; /* row blocks: of 16 x RT rows */
    int d, dv;
    float scale_log2, softcap_in, softcap_out;
    int causal;
    int64_t window_left, window_right;
    int out_dtype;
    int aligned; /* caches' and q's rows in 16-byte chunks */
    int splits;
    int l2_prefetch;    /* tuning: FMHA_CUDA_DECODE_L2PF=128|256, the loads' L2 prefetch size */
    int64_t split_keys; /* keys of a split, a multiple of the tile */
    float *part_o, *part_lse; /* splits > 1: [split][batch][heads][sq][dv], [split][...] */
};

/* A block: RT tiles of 16 rows (RT = 2 where a KV head has more than 16
 * rows: a large GQA group or MQA, so two row tiles share each K/V tile),
 * four key quarters per row tile, and for D = 256 two warps per quarter
 * (each P.V over half the columns: twice the warps at the same shared
 * memory, half the accumulators each). */
template <int D, int RT> struct dtile {
    static constexpr int KQ = 4, DSPLIT = D >= 256 ? 2 : 1;
    static constexpr int WARPS = KQ * DSPLIT * RT, THREADS = 32 * WARPS, STAGES = 3;
    static constexpr int MINB =
        D <= 128 ? 2 : 1;              /* blocks per multiprocessor the registers allow */
    static constexpr int KT = 64;      /* keys per stage */
    static constexpr int BN = KT / KQ; /* keys of a key quarter */
    static constexpr int DS = D + 8;   /* shared row stride (ldmatrix conflict-free) */
    static constexpr int CH = D / 8;   /* 16-byte chunks of a row */
    static constexpr int KPT = KT * CH / THREADS; /* keys a thread loads chunks of per stage */
    static_assert(KT * CH % THREADS == 0, "a stage's chunks divide among the threads");
    static constexpr size_t STAGE = (size_t)2 * KT * DS * 2;
    static constexpr size_t MERGE = (size_t)RT * KQ * 16 * (D + 2) * 4;
    static constexpr size_t SMEM =
        (size_t)16 * RT * DS * 2 + (STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE);
};

__device__ __forceinline__ int64_t seq_keys(const dec_params &p, int b)
{
    return (p.cache_seqlens ? p.cache_seqlens[b] : p.capacity) + p.seqlen_new;
}

/* Page and slot of key j of sequence b in a paged cache (32-bit division
 * where the key index allows). */
__device__ __forceinline__ void page_slot(const dec_params &p, int b, int64_t j, int32_t *page,
                                          int32_t *slot)
{
    const int64_t pi =
        j <= UINT32_MAX ? (int64_t)((uint32_t)j / (uint32_t)p.page_size) : j / p.page_size;
    *page = __ldg(p.page_table + b * p.page_stride + pi);
    *slot = (int32_t)(j - pi * p.page_size);
}

/* Element offset of key j's row of KV head hk in a cache of strides (sb, ss, sh). */
__device__ __forceinline__ int64_t cache_row(const dec_params &p, int b, int64_t j, int hk,
                                             int64_t sb, int64_t ss, int64_t sh)
{
    if (p.page_table) {
        int32_t page, slot;
        page_slot(p, b, j, &page, &slot);
        return page * sb + slot * ss + hk * sh;
    }
    return (int64_t)(p.kv_batch ? p.kv_batch[b] : b) * sb + j * ss + hk * sh;
}

/* The pages and slots of the keys a thread loads in a stage, looked up a
 * stage ahead so that the block table's latency hides behind a tile. */
template <int D, int RT> struct key_pages {
    int32_t page[dtile<D, RT>::KPT], slot[dtile<D, RT>::KPT];
};

template <int D, int RT>
__device__ __forceinline__ void tile_pages(const dec_params &p, int b, int64_t n0, int64_t n_end,
                                           key_pages<D, RT> &kp)
{
    constexpr int CH = dtile<D, RT>::CH, THREADS = dtile<D, RT>::THREADS;
#pragma unroll
    for (int i = 0; i < dtile<D, RT>::KPT; i++) {
        const int64_t j = n0 + (threadIdx.x + i * THREADS) / CH;
        kp.page[i] = kp.slot[i] = 0;
        if (j < n_end)
            page_slot(p, b, j, &kp.page[i], &kp.slot[i]);
    }
}

/* Keys [n0, n0 + KT) of sequence b (those below n_end) into a stage: K rows
 * at sK, V rows at sV, zero past n_end and past each head dim. kbase and
 * vbase: the offsets of KV head hk's row 0 (contiguous: in the sequence's
 * cache; paged: in page 0); kp: the keys' pages (paged caches). */
template <int D, int RT, typename T>
__device__ __forceinline__ void load_stage(const dec_params &p, T *sK, T *sV, int b, int hk,
                                           int64_t kbase, int64_t vbase, int64_t n0, int64_t n_end,
                                           const key_pages<D, RT> &kp)
{
    constexpr int KT = dtile<D, RT>::KT, DS = dtile<D, RT>::DS, THREADS = dtile<D, RT>::THREADS;
    constexpr int CH = dtile<D, RT>::CH;
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc;
    if (p.aligned) {
#pragma unroll
        for (int i = 0; i < dtile<D, RT>::KPT; i++) {
            const int c = threadIdx.x + i * THREADS, key = c / CH, ch = c % CH;
            const int64_t j = n0 + key;
            const bool live = j < n_end;
            int64_t ko = kbase + j * p.k_ss, vo = vbase + j * p.v_ss;
            if (p.page_table) {
                ko = kbase + kp.page[i] * p.k_sb + kp.slot[i] * p.k_ss;
                vo = vbase + kp.page[i] * p.v_sb + kp.slot[i] * p.v_ss;
            }
            const bool kl = live && ch * 8 < p.d, vl = live && ch * 8 < p.dv;
            const uint32_t dk = smem_u32(sK + key * DS + ch * 8),
                           dv = smem_u32(sV + key * DS + ch * 8);
            const void *sk = kl ? (const void *)(kc + ko + ch * 8) : kc;
            const void *sv = vl ? (const void *)(vc + vo + ch * 8) : vc;
            if (p.l2_prefetch == 256) {
                cp_async16_pf<256>(dk, sk, kl ? 16 : 0);
                cp_async16_pf<256>(dv, sv, vl ? 16 : 0);
            } else if (p.l2_prefetch == 128) {
                cp_async16_pf<128>(dk, sk, kl ? 16 : 0);
                cp_async16_pf<128>(dv, sv, vl ? 16 : 0);
            } else {
                cp_async16(dk, sk, kl ? 16 : 0);
                cp_async16(dv, sv, vl ? 16 : 0);
            }
        }
    } else { /* rows not in 16-byte chunks: element by element (correct, slower) */
        for (int e = threadIdx.x; e < KT * D; e += THREADS) {
            const int key = e / D, c = e % D;
            const bool live = n0 + key < n_end;
            T kx = T(0.0f), vx = T(0.0f);
            if (live && c < p.d)
                kx = kc[cache_row(p, b, n0 + key, hk, p.k_sb, p.k_ss, p.k_sh) + c];
            if (live && c < p.dv)
                vx = vc[cache_row(p, b, n0 + key, hk, p.v_sb, p.v_ss, p.v_sh) + c];
            sK[key * DS + c] = kx;
            sV[key * DS + c] = vx;
        }
    }
}

/* Channel c of row src (rotary_dim channels rotated) at position pos:
 * semantics.h's pairs, the tables [pos][rotary_dim / 2]. */
template <typename T>
__device__ __forceinline__ float rotated(const T *src, int c, int rotary_dim, int interleaved,
                                         const float *cos_t, const float *sin_t, int64_t pos)
{
    if (c >= rotary_dim)
        return (float)src[c];
    const int half = rotary_dim / 2, pc = interleaved ? c / 2 : c % half;
    int64_t c1, c2;
    fmha_rotary_pair(rotary_dim, interleaved, pc, &c1, &c2);
    const float x1 = (float)src[c1], x2 = (float)src[c2];
    const float cs = cos_t[pos * half + pc], sn = sin_t[pos * half + pc];
    return c == c1 ? x1 * cs - x2 * sn : x1 * sn + x2 * cs;
}

/* One block: RT x 16 rows of (sequence b, KV head hk), keys of one split.
 * Grid: x = (b * kv_heads + hk) * row_blocks + row block, y = split. */
template <int D, bool BF16, int RT>
__global__ void __launch_bounds__(dtile<D, RT>::THREADS, dtile<D, RT>::MINB)
    decode_kernel(const dec_params p)
{
    typedef typename elem<BF16>::T T;
    typedef dtile<D, RT> G;
    constexpr int KT = G::KT, BN = G::BN, DS = G::DS, STAGES = G::STAGES, KQ = G::KQ;
    constexpr int DW = D / G::DSPLIT; /* columns of a warp's P.V */
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = (T *)smem;          /* [16 * RT][DS] */
    T *sKV = sQ + 16 * RT * DS; /* STAGES x ([KT][DS] K, [KT][DS] V) */
    float *sM = (float *)sKV;   /* after the loop: [RT][KQ][16] max, sum, then [RT][KQ][16][D] o */
    float *sL = sM + RT * KQ * 16, *sO = sL + RT * KQ * 16;

    const int rb = blockIdx.x % p.row_blocks;
    const int hk = (blockIdx.x / p.row_blocks) % p.kv_heads;
    const int b = blockIdx.x / p.row_blocks / p.kv_heads;
    const int split = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kq = warp % KQ, dh = warp / KQ % G::DSPLIT, rl = warp / (KQ * G::DSPLIT);
    const int r0 = rb * 16 * RT, rows = min(16 * RT, p.rows - r0);
    const int wr0 = r0 + rl * 16, wrows = min(16, p.rows - wr0); /* this warp's row tile */
    const int64_t sk = seq_keys(p, b);

    /* The keys any row of the block sees, and this split's part of them. */
    int64_t lo_first, hi_first, lo_last, hi_last;
    fmha_mask_range(p.causal, p.window_left, p.window_right, r0 / p.group, p.sq, sk, &lo_first,
                    &hi_first);
    fmha_mask_range(p.causal, p.window_left, p.window_right, (r0 + rows - 1) / p.group, p.sq, sk,
                    &lo_last, &hi_last);
    const int64_t n_begin = lo_first + (int64_t)split * p.split_keys;
    const int64_t n_end = min64(hi_last, n_begin + p.split_keys);
    const int ntiles = n_end > n_begin ? (int)((n_end - n_begin + KT - 1) / KT) : 0;

    /* This thread's two rows (lane / 4 and lane / 4 + 8 of its row tile):
     * their visible keys within the split. */
    int64_t lo[2], hi[2];
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = lane / 4 + rh * 8;
        lo[rh] = hi[rh] = 0;
        if (r < wrows) {
            fmha_mask_range(p.causal, p.window_left, p.window_right, (wr0 + r) / p.group, p.sq, sk,
                            &lo[rh], &hi[rh]);
            lo[rh] = max64(lo[rh], n_begin);
            hi[rh] = max64(lo[rh], min64(hi[rh], n_end));
        }
    }

    /* Q: row r is q[b, i, hk * group + g]. */
    const T *q = (const T *)p.q;
    for (int e = threadIdx.x; e < 16 * RT * D; e += G::THREADS) {
        const int r = e / D, c = e % D;
        T x = T(0.0f);
        if (r < rows && c < p.d) {
            const int pr = r0 + r;
            x = q[b * p.q_sb + (int64_t)(pr / p.group) * p.q_ss +
                  (int64_t)(hk * p.group + pr % p.group) * p.q_sh + c];
        }
        sQ[r * DS + c] = x;
    }

    int64_t kbase = (int64_t)hk * p.k_sh, vbase = (int64_t)hk * p.v_sh;
    if (!p.page_table) {
        const int64_t row = p.kv_batch ? p.kv_batch[b] : b;
        kbase += row * p.k_sb;
        vbase += row * p.v_sb;
    }
    key_pages<D, RT> kp;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ntiles) {
            tile_pages(p, b, n_begin + (int64_t)s * KT, n_end, kp);
            load_stage<D, RT>(p, sKV + s * 2 * KT * DS, sKV + s * 2 * KT * DS + KT * DS, b, hk,
                              kbase, vbase, n_begin + (int64_t)s * KT, n_end, kp);
        }
        cp_async_commit();
    }
    if (STAGES - 1 < ntiles)
        tile_pages(p, b, n_begin + (int64_t)(STAGES - 1) * KT, n_end, kp);

    float o[DW / 8][4];
#pragma unroll
    for (int i = 0; i < DW / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.0f, 0.0f};

    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads(); /* tile t landed; every warp is done with tile t - 1 */
        {
            const int tn = t + STAGES - 1, st = tn % STAGES;
            if (tn < ntiles) {
                load_stage<D, RT>(p, sKV + st * 2 * KT * DS, sKV + st * 2 * KT * DS + KT * DS, b,
                                  hk, kbase, vbase, n_begin + (int64_t)tn * KT, n_end, kp);
                if (tn + 1 < ntiles)
                    tile_pages(p, b, n_begin + (int64_t)(tn + 1) * KT, n_end, kp);
            }
            cp_async_commit();
        }
        if (wrows <= 0)
            continue; /* the last row block's second tile may hold no rows */
        const T *cK = sKV + (t % STAGES) * 2 * KT * DS + kq * BN * DS;
        const T *cV = cK + KT * DS;
        const T *wQ = sQ + rl * 16 * DS;
        const int64_t n0 = n_begin + (int64_t)t * KT + kq * BN;

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, smem_u32(wQ + (lane % 16) * DS + kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int np = 0; np < BN / 16; np++) {
                uint32_t bk[4];
                ldmatrix_x4(bk, smem_u32(cK + (np * 16 + lane % 8 + (lane / 16) * 8) * DS +
                                         kk * 16 + ((lane / 8) % 2) * 8));
                mma<BF16>(s[2 * np], a, bk[0], bk[1]);
                mma<BF16>(s[2 * np + 1], a, bk[2], bk[3]);
            }
        }
        if (p.softcap_out != 0.0f) {
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[i][e] = tanh_fast(s[i][e] * p.softcap_in) * p.softcap_out;
        }
        /* Keys a row does not see (or past the split) out; then the online softmax. */
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float mx = m_row[rh];
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int64_t key = n0 + i * 8 + (lane % 4) * 2 + e;
                    float &x = s[i][2 * rh + e];
                    x = key >= lo[rh] && key < hi[rh] ? x * p.scale_log2 : -INFINITY;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = mx == -INFINITY ? 0.0f : mx;
            const float alpha = exp2_approx(m_row[rh] - base);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 2 * rh; e < 2 * rh + 2; e++) {
                    s[i][e] = exp2_approx(s[i][e] - base);
                    sum += s[i][e];
                }
            l_row[rh] = l_row[rh] * alpha + sum;
            m_row[rh] = mx;
#pragma unroll
            for (int i = 0; i < DW / 8; i++) {
                o[i][2 * rh] *= alpha;
                o[i][2 * rh + 1] *= alpha;
            }
        }
        /* O += P V over this warp's columns, P from S's accumulators. */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t pa[4];
            pa[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DW / 16; dp++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv,
                                  smem_u32(cV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * DS +
                                           dh * DW + dp * 16 + (lane / 16) * 8));
                mma<BF16>(o[2 * dp], pa, bv[0], bv[1]);
                mma<BF16>(o[2 * dp + 1], pa, bv[2], bv[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads(); /* the stages are free: the warps' results go there */

    const int wq = rl * KQ + kq; /* this warp's (row tile, key quarter) */
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        float l = l_row[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = lane / 4 + rh * 8;
        if (lane % 4 == 0 && dh == 0) {
            sM[wq * 16 + r] = m_row[rh];
            sL[wq * 16 + r] = l;
        }
#pragma unroll
        for (int j = 0; j < DW / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                sO[(wq * 16 + r) * D + dh * DW + j * 8 + (lane % 4) * 2 + e] = o[j][2 * rh + e];
    }
    __syncthreads();

    /* Merge each row tile's key quarters and store: the output itself, or
     * this split's normalised part and LSE. */
    for (int e = threadIdx.x; e < 16 * RT * D; e += G::THREADS) {
        const int r = e / D, c = e % D;
        if (r >= rows || c >= p.dv)
            continue;
        const int m0 = (r / 16) * KQ * 16 + r % 16; /* row r of key quarter 0 */
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < KQ; w++)
            mx = fmaxf(mx, sM[m0 + w * 16]);
        const float base = mx == -INFINITY ? 0.0f : mx;
        float l = 0.0f, x = 0.0f;
#pragma unroll
        for (int w = 0; w < KQ; w++) {
            const float f = exp2_approx(sM[m0 + w * 16] - base);
            l += sL[m0 + w * 16] * f;
            x += sO[(m0 + w * 16) * D + c] * f;
        }
        const int pr = r0 + r, i = pr / p.group, h = hk * p.group + pr % p.group;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        /* A NaN row keeps a NaN LSE; a row of no key -inf (store_lse's rule). */
        const float lse = l > 0.0f || l != l ? (mx + log2f(l)) * 0.69314718055994531f : -INFINITY;
        const int64_t lrow = ((int64_t)b * p.heads + h) * p.sq + i;
        if (p.splits > 1) {
            const int64_t prow = (int64_t)split * p.batch * p.heads * p.sq + lrow;
            p.part_o[prow * p.dv + c] = x * inv;
            if (c == 0)
                p.part_lse[prow] = lse;
            continue;
        }
        char *orow = (char *)p.o + (b * p.o_sb + (int64_t)i * p.o_ss + (int64_t)h * p.o_sh) *
                                       (p.out_dtype == FMHA_DTYPE_F32 ? 4 : 2);
        store_any(orow, p.out_dtype, c, x * inv);
        if (p.lse && c == 0)
            p.lse[lrow] = lse;
    }
}

/* The splits' parts of each row merged by their LSEs: one warp per row of
 * [batch][heads][sq]. */
__global__ void merge_splits(const dec_params p)
{
    const int64_t nrows = (int64_t)p.batch * p.heads * p.sq;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= nrows)
        return;
    float mx = -INFINITY;
    for (int s = 0; s < p.splits; s++)
        mx = fmaxf(mx, p.part_lse[s * nrows + row]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float total = 0.0f;
    for (int s = 0; s < p.splits; s++)
        total += __expf(p.part_lse[s * nrows + row] - base);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const int i = (int)(row % p.sq), h = (int)(row / p.sq % p.heads),
              b = (int)(row / p.sq / p.heads);
    char *orow = (char *)p.o + (b * p.o_sb + (int64_t)i * p.o_ss + (int64_t)h * p.o_sh) *
                                   (p.out_dtype == FMHA_DTYPE_F32 ? 4 : 2);
    for (int c = lane; c < p.dv; c += 32) {
        float x = 0.0f;
        for (int s = 0; s < p.splits; s++) {
            const float l = p.part_lse[s * nrows + row];
            if (l != -INFINITY) /* an empty split's part is 0 and weighs nothing */
                x += p.part_o[(s * nrows + row) * p.dv + c] * __expf(l - base);
        }
        store_any(orow, p.out_dtype, c, x * inv);
    }
    if (p.lse && lane == 0)
        p.lse[row] = total > 0.0f || total != total ? base + logf(total) : -INFINITY;
}

/* The new keys (rotated) and values into the caches: one block per (new
 * token i, sequence b), threads over KV heads and channels. */
template <typename T>
__global__ void append_kv(const dec_params p, const T *k_new, const T *v_new, int64_t kn_sb,
                          int64_t kn_ss, int64_t kn_sh, int64_t vn_sb, int64_t vn_ss, int64_t vn_sh,
                          const float *cos_t, const float *sin_t, int rotary_dim, int interleaved)
{
    const int i = blockIdx.x, b = blockIdx.y;
    const int64_t pos = p.cache_seqlens[b] + i;
    T *kc = (T *)p.kc, *vc = (T *)p.vc;
    for (int e = threadIdx.x; e < p.kv_heads * p.d; e += blockDim.x) {
        const int h = e / p.d, c = e % p.d;
        const T *src = k_new + b * kn_sb + (int64_t)i * kn_ss + (int64_t)h * kn_sh;
        kc[cache_row(p, b, pos, h, p.k_sb, p.k_ss, p.k_sh) + c] =
            T(rotated(src, c, rotary_dim, interleaved, cos_t, sin_t, pos));
    }
    for (int e = threadIdx.x; e < p.kv_heads * p.dv; e += blockDim.x) {
        const int h = e / p.dv, c = e % p.dv;
        vc[cache_row(p, b, pos, h, p.v_sb, p.v_ss, p.v_sh) + c] =
            v_new[b * vn_sb + (int64_t)i * vn_ss + (int64_t)h * vn_sh + c];
    }
}

/* q rotated into q_rot (contiguous [batch, sq, heads, d]): one block per
 * (query i, sequence b). */
template <typename T>
__global__ void rotate_q(const dec_params p, const T *q, int64_t q_sb, int64_t q_ss, int64_t q_sh,
                         T *q_rot, const float *cos_t, const float *sin_t, int rotary_dim,
                         int interleaved, int per_query)
{
    const int i = blockIdx.x, b = blockIdx.y;
    const int64_t pos = fmha_rotary_position(per_query, seq_keys(p, b) - p.seqlen_new, i);
    for (int e = threadIdx.x; e < p.heads * p.d; e += blockDim.x) {
        const int h = e / p.d, c = e % p.d;
        const T *src = q + b * q_sb + (int64_t)i * q_ss + (int64_t)h * q_sh;
        q_rot[(((int64_t)b * p.sq + i) * p.heads + h) * p.d + c] =
            T(rotated(src, c, rotary_dim, interleaved, cos_t, sin_t, pos));
    }
}

const char *const layer_fix = ", but the layer runs on CUDA: pass device memory (cudaMalloc) or "
                              "build the layer with device cpu";

/* The kernel parameters of a validated decode call (pb->kv: the caller's
 * device arrays). */
void fill_params(const fmha_problem *pb, dec_params *p)
{
    const fmha_forward_args *a = pb->args;
    const fmha_kvcache_args *kv = pb->kv;
    const fmha_config *cfg = pb->cfg;
    memset(p, 0, sizeof *p);
    p->q = a->q.data;
    p->kc = a->k.data;
    p->vc = a->v.data;
    p->o = a->out.data;
    p->lse = a->lse;
    p->q_sb = a->q.stride_batch, p->q_ss = a->q.stride_seq, p->q_sh = a->q.stride_head;
    p->k_sb = a->k.stride_batch, p->k_ss = a->k.stride_seq, p->k_sh = a->k.stride_head;
    p->v_sb = a->v.stride_batch, p->v_ss = a->v.stride_seq, p->v_sh = a->v.stride_head;
    p->o_sb = a->out.stride_batch, p->o_ss = a->out.stride_seq, p->o_sh = a->out.stride_head;
    p->cache_seqlens = kv->cache_seqlens;
    p->kv_batch = kv->block_table ? NULL : kv->cache_batch_idx;
    p->page_table = kv->block_table;
    p->page_stride = pb->page_stride;
    p->page_size = (int)pb->page_size;
    p->capacity = pb->capacity;
    p->seqlen_new = pb->seqlen_new;
    p->batch = (int)pb->batch;
    p->heads = (int)pb->heads;
    p->kv_heads = (int)pb->kv_heads;
    p->group = (int)pb->group;
    p->sq = (int)pb->max_sq;
    p->rows = p->group * p->sq;
    p->d = (int)pb->d;
    p->dv = (int)pb->dv;
    const double log2e = 1.4426950408889634;
    if (cfg->softcap > 0) {
        p->softcap_in = (float)(pb->scale / cfg->softcap);
        p->softcap_out = (float)(cfg->softcap * log2e);
        p->scale_log2 = 1.0f;
    } else {
        p->scale_log2 = (float)(pb->scale * log2e);
    }
    p->causal = cfg->causal;
    p->window_left = cfg->window_left;
    p->window_right = cfg->window_right;
    p->out_dtype = a->out.dtype;
    p->aligned = chunk_aligned(a->q) && chunk_aligned(a->k) && chunk_aligned(a->v);
    p->splits = 1;
}

/* How many splits: num_splits where the caller gave one, else the fewest
 * that fill the device's resident blocks (`slots`) to 90%, each split at
 * least two tiles long; never more splits than tiles. */
int choose_splits(int64_t blocks, int64_t slots, int64_t max_keys, int kt, int64_t asked)
{
    const int64_t tiles = (max_keys + kt - 1) / kt;
    int64_t most = tiles > 1 ? tiles : 1;
    if (most > 65535)
        most = 65535;
    if (asked > 0)
        return (int)(asked < most ? asked : most);
    const int64_t cap = tiles / 2 < 1 ? 1 : tiles / 2 < most ? tiles / 2 : most;
    int best = 1;
    double best_fill = 0.0;
    for (int64_t s = 1; s <= cap && s <= 256; s++) {
        const int64_t n = blocks * s, waves = (n + slots - 1) / slots;
        const double fill = (double)n / (double)(waves * slots);
        if (fill >= 0.9)
            return (int)s;
        if (fill > best_fill + 1e-9) {
            best_fill = fill;
            best = (int)s;
        }
    }
    return best;
}

template <int D, bool BF16, int RT>
fmha_status launch(dec_params &p, const fmha_problem *pb, fmha_workspace *ws, cudaStream_t stream)
{
    typedef dtile<D, RT> G;
    const size_t smem = G::SMEM;
    cudaError_t err = cudaFuncSetAttribute(decode_kernel<D, BF16, RT>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int dev = 0, sms = 1, per_sm = 1;
    if (err == cudaSuccess)
        err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err == cudaSuccess)
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<D, BF16, RT>,
                                                            G::THREADS, smem);
    if (err != cudaSuccess)
        return cuda_error(err, "preparing the decode kernel");
    p.row_blocks = (p.rows + 16 * RT - 1) / (16 * RT);
    const char *pf = getenv("FMHA_CUDA_DECODE_L2PF");
    p.l2_prefetch = pf ? atoi(pf) : 0;
    const int64_t blocks = (int64_t)p.batch * p.kv_heads * p.row_blocks;
    if (blocks > INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "batch x kv heads x row blocks (%lld) exceeds the grid: split the "
                              "batch into calls",
                              (long long)blocks);
    p.splits = choose_splits(blocks, (int64_t)sms * (per_sm > 0 ? per_sm : 1), pb->max_sk, G::KT,
                             pb->num_splits);
    const int64_t tiles = (pb->max_sk + G::KT - 1) / G::KT;
    p.split_keys = ((tiles + p.splits - 1) / p.splits) * G::KT;
    if (p.split_keys == 0)
        p.split_keys = G::KT;
    if (p.splits > 1) {
        const int64_t nrows = pb->batch * pb->heads * pb->max_sq;
        const size_t bytes = (size_t)p.splits * (size_t)nrows * (size_t)(pb->dv + 1) * 4;
        if (ws->size < bytes) {
            void *buf = NULL;
            fmha_status st = device_alloc(&buf, bytes);
            if (st != FMHA_STATUS_OK)
                return st;
            device_free(ws->buf); /* synchronises: no call still reads it */
            ws->buf = buf;
            ws->size = bytes;
        }
        p.part_o = (float *)ws->buf;
        p.part_lse = p.part_o + (size_t)p.splits * (size_t)nrows * (size_t)pb->dv;
    }
    dim3 grid((unsigned)blocks, (unsigned)p.splits);
    decode_kernel<D, BF16, RT><<<grid, G::THREADS, smem, stream>>>(p);
    if (p.splits > 1 && (err = cudaGetLastError()) == cudaSuccess) {
        const int64_t nrows = pb->batch * pb->heads * pb->max_sq;
        merge_splits<<<(unsigned)((nrows + 3) / 4), 128, 0, stream>>>(p);
    }
    err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the decode kernel launch");
}

/* Two row tiles per block where a KV head has more than 16 rows (head dims
 * to 128: above, the block's accumulators would not fit its registers). */
template <int D, bool BF16>
fmha_status launch_rows(dec_params &p, const fmha_problem *pb, fmha_workspace *ws,
                        cudaStream_t stream)
{
    if (D <= 128 && p.rows > 16)
        return launch < D, BF16, D <= 128 ? 2 : 1 > (p, pb, ws, stream);
    return launch<D, BF16, 1>(p, pb, ws, stream);
}

} // namespace

namespace fmha_cuda
{

fmha_status decode_variant(fmha_plan *plan)
{
    const int64_t dmax =
        plan->cfg.head_dim > plan->cfg.head_dim_v ? plan->cfg.head_dim : plan->cfg.head_dim_v;
#define FMHA_VARIANT(D)                 \
    if (dmax <= D) {                    \
        plan->head_dim_variant = D;     \
        plan->tile_m = 16;              \
        plan->tile_n = dtile<D, 1>::KT; \
        return FMHA_STATUS_OK;          \
    }
    FMHA_CUDA_HEAD_DIMS(FMHA_VARIANT)
#undef FMHA_VARIANT
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "head dim %lld is above 256, the largest CUDA kernel", (long long)dmax);
}

fmha_status decode_forward(const fmha_plan *plan, const fmha_problem *pb, fmha_workspace *ws,
                           cudaStream_t stream)
{
    dec_params p;
    fill_params(pb, &p);
    const bool bf16 = plan->cfg.dtype == FMHA_DTYPE_BF16;
    fmha_status st = fmha_set_error(FMHA_STATUS_UNSUPPORTED, "no decode variant for head dim %d",
                                    plan->head_dim_variant);
#define FMHA_LAUNCH(D)                                      \
    if (plan->head_dim_variant == D)                        \
        st = bf16 ? launch_rows<D, true>(p, pb, ws, stream) \
                  : launch_rows<D, false>(p, pb, ws, stream);
    FMHA_CUDA_HEAD_DIMS(FMHA_LAUNCH)
#undef FMHA_LAUNCH
    return st;
}

} // namespace fmha_cuda

extern "C" fmha_status fmha_cuda_host_kvcache(const fmha_kvcache_args *a, fmha_kvcache_host *h)
{
    h->cache_seqlens = h->cache_batch_idx = h->block_table = NULL;
    const int64_t batch = a->q.batch;
    if (batch <= 0 || batch > INT32_MAX)
        return FMHA_STATUS_OK; /* validation reads nothing, or refuses */
    if (a->block_table && a->block_table_stride > INT64_MAX / batch)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "block_table_stride (%lld) x batch (%lld) overflows int64",
                              (long long)a->block_table_stride, (long long)batch);
    const int64_t table =
        a->block_table && a->block_table_stride > 0 ? batch * a->block_table_stride : 0;
    struct {
        const int32_t *src;
        int32_t **dst;
        int64_t n;
        const char *name;
    } arrays[3] = {
        {a->cache_seqlens, &h->cache_seqlens, batch, "cache_seqlens"},
        {a->block_table ? NULL : a->cache_batch_idx, &h->cache_batch_idx, batch, "cache_batch_idx"},
        {table ? a->block_table : NULL, &h->block_table, table, "block_table"}};
    cudaStream_t stream = (cudaStream_t)a->stream;
    fmha_status st = FMHA_STATUS_OK;
    for (int i = 0; i < 3 && st == FMHA_STATUS_OK; i++) {
        if (!arrays[i].src)
            continue;
        if ((st = check_device_pointer(arrays[i].src, arrays[i].name, layer_fix)) != FMHA_STATUS_OK)
            break;
        const size_t bytes = sizeof(int32_t) * (size_t)arrays[i].n;
        if (!(*arrays[i].dst = (int32_t *)fmha_malloc(bytes))) {
            st = fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory copying %s (%zu bytes)",
                                arrays[i].name, bytes);
            break;
        }
        cudaError_t err =
            cudaMemcpyAsync(*arrays[i].dst, arrays[i].src, bytes, cudaMemcpyDeviceToHost, stream);
        if (err != cudaSuccess)
            st = cuda_error(err, "copying the decode call's index arrays to the host");
    }
    if (st == FMHA_STATUS_OK) {
        cudaError_t err = cudaStreamSynchronize(stream);
        if (err != cudaSuccess)
            st = cuda_error(err, "copying the decode call's index arrays to the host");
    }
    if (st != FMHA_STATUS_OK) {
        fmha_free(h->cache_seqlens);
        fmha_free(h->cache_batch_idx);
        fmha_free(h->block_table);
        h->cache_seqlens = h->cache_batch_idx = h->block_table = NULL;
    }
    return st;
}

extern "C" fmha_status fmha_cuda_kv_append(const fmha_problem *pb, const fmha_kvcache_args *a,
                                           const fmha_tensor *q_rot)
{
    /* Every pointer of the call before the first write. */
    const void *ptrs[9] = {a->q.data,     a->k_cache.data, a->v_cache.data, a->out.data,  a->lse,
                           a->k_new.data, a->v_new.data,   a->rotary_cos,   a->rotary_sin};
    const char *names[9] = {"q",     "k_cache", "v_cache",    "out",       "lse",
                            "k_new", "v_new",   "rotary_cos", "rotary_sin"};
    for (int i = 0; i < 9; i++) {
        fmha_status st =
            ptrs[i] ? check_device_pointer(ptrs[i], names[i], layer_fix) : FMHA_STATUS_OK;
        if (st != FMHA_STATUS_OK)
            return st;
    }
    if (pb->batch == 0)
        return FMHA_STATUS_OK;
    dec_params p;
    fill_params(pb, &p);
    cudaStream_t stream = (cudaStream_t)a->stream;
    const bool bf16 = pb->cfg->dtype == FMHA_DTYPE_BF16;
    const int rd = (int)a->rotary_dim, il = a->rotary_interleaved;
    if (pb->seqlen_new > 0) {
        dim3 grid((unsigned)pb->seqlen_new, (unsigned)pb->batch);
        const fmha_tensor &kn = a->k_new, &vn = a->v_new;
        if (bf16)
            append_kv<__nv_bfloat16><<<grid, 256, 0, stream>>>(
                p, (const __nv_bfloat16 *)kn.data, (const __nv_bfloat16 *)vn.data, kn.stride_batch,
                kn.stride_seq, kn.stride_head, vn.stride_batch, vn.stride_seq, vn.stride_head,
                a->rotary_cos, a->rotary_sin, rd, il);
        else
            append_kv<__half><<<grid, 256, 0, stream>>>(
                p, (const __half *)kn.data, (const __half *)vn.data, kn.stride_batch, kn.stride_seq,
                kn.stride_head, vn.stride_batch, vn.stride_seq, vn.stride_head, a->rotary_cos,
                a->rotary_sin, rd, il);
    }
    if (rd > 0 && pb->max_sq > 0) {
        const int per_query = fmha_rotary_per_query(pb->cfg);
        dim3 grid((unsigned)pb->max_sq, (unsigned)pb->batch);
        const fmha_tensor &q = a->q;
        if (bf16)
            rotate_q<__nv_bfloat16><<<grid, 256, 0, stream>>>(
                p, (const __nv_bfloat16 *)q.data, q.stride_batch, q.stride_seq, q.stride_head,
                (__nv_bfloat16 *)q_rot->data, a->rotary_cos, a->rotary_sin, rd, il, per_query);
        else
            rotate_q<__half><<<grid, 256, 0, stream>>>(
                p, (const __half *)q.data, q.stride_batch, q.stride_seq, q.stride_head,
                (__half *)q_rot->data, a->rotary_cos, a->rotary_sin, rd, il, per_query);
    }
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the KV cache append launch");
}
