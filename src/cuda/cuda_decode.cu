/* cuda_decode.cu — decode on CUDA (fmha_layer_decode): new queries against
 * KV caches, contiguous or paged, on the decode kernel of kernels.def
 * (cuda_decode_sm80, sm_80 and later).
 *
 * Decode reads every cached key and value once and does little arithmetic
 * on them, so the kernel is built to keep memory busy:
 *   - GQA packing: a block owns 16 query rows of one KV head (the head's
 *     group of query heads times the new queries), so each K/V byte is
 *     read once for all of them;
 *   - split keys (flash-decoding): a sequence's keys are cut into `splits`
 *     ranges run by separate blocks, chosen so that the blocks fill the
 *     device; each writes its normalised partial output and LSE, and a
 *     second launch merges them by their LSEs;
 *   - inside a block, K/V tiles of KT keys stream through a three-stage
 *     cp.async ring (rows looked up through the page table one by one,
 *     so any page size works), and the four warps take a quarter of each
 *     tile each, with their own online softmax; the warps' results merge
 *     through shared memory at the end.
 * S = Q K^T and O += P V run on mma.sync m16n8k16 (f32 accumulate) as in
 * cuda_flash.cu. The new keys and values enter the caches first
 * (kv_append, rotated where rotary is on), on the same stream. */
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "../alloc.h"

#include <stdint.h>
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
    int batch, heads, kv_heads, group, sq, rows, row_tiles;
    int d, dv;
    float scale_log2, softcap_in, softcap_out;
    int causal;
    int64_t window_left, window_right;
    int out_dtype;
    int aligned; /* caches' and q's rows in 16-byte chunks */
    int splits;
    int64_t split_keys;       /* keys of a split, a multiple of the tile */
    float *part_o, *part_lse; /* splits > 1: [split][batch][heads][sq][dv], [split][...] */
};

template <int D> struct dtile {
    static constexpr int WARPS = 4, THREADS = 128, STAGES = 3;
    static constexpr int KT = 64;         /* keys per stage */
    static constexpr int BN = KT / WARPS; /* keys per warp per stage */
    static constexpr int DS = D + 8;      /* shared row stride (ldmatrix conflict-free) */
    static constexpr size_t STAGE = (size_t)2 * KT * DS * 2;
    static constexpr size_t MERGE = (size_t)WARPS * 16 * (D + 2) * 4;
    static constexpr size_t SMEM =
        (size_t)16 * DS * 2 + (STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE);
};

__device__ __forceinline__ int64_t seq_keys(const dec_params &p, int b)
{
    return (p.cache_seqlens ? p.cache_seqlens[b] : p.capacity) + p.seqlen_new;
}

/* Element offset of key j's row of KV head hk in a cache of strides (sb, ss, sh). */
__device__ __forceinline__ int64_t cache_row(const dec_params &p, int b, int64_t j, int hk,
                                             int64_t sb, int64_t ss, int64_t sh)
{
    if (p.page_table) {
        /* 32-bit division where the key index allows (all but > 2^32 keys) */
        const int64_t pi =
            j <= UINT32_MAX ? (int64_t)((uint32_t)j / (uint32_t)p.page_size) : j / p.page_size;
        const int64_t page = p.page_table[b * p.page_stride + pi];
        return page * sb + (j - pi * p.page_size) * ss + hk * sh;
    }
    return (int64_t)(p.kv_batch ? p.kv_batch[b] : b) * sb + j * ss + hk * sh;
}

/* Keys [n0, n0 + KT) of sequence b (those below n_end) into a stage: K rows
 * at sK, V rows at sV, zero past n_end and past each head dim. */
template <int D, typename T>
__device__ __forceinline__ void load_stage(const dec_params &p, T *sK, T *sV, int b, int hk,
                                           int64_t n0, int64_t n_end)
{
    constexpr int KT = dtile<D>::KT, DS = dtile<D>::DS, THREADS = dtile<D>::THREADS, CH = D / 8;
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc;
    if (p.aligned) {
        for (int c = threadIdx.x; c < KT * CH; c += THREADS) {
            const int key = c / CH, ch = c % CH;
            const bool live = n0 + key < n_end;
            int64_t ko = 0, vo = 0;
            if (live) {
                ko = cache_row(p, b, n0 + key, hk, p.k_sb, p.k_ss, p.k_sh);
                vo = cache_row(p, b, n0 + key, hk, p.v_sb, p.v_ss, p.v_sh);
            }
            const bool kl = live && ch * 8 < p.d, vl = live && ch * 8 < p.dv;
            cp_async16(smem_u32(sK + key * DS + ch * 8), kl ? (const void *)(kc + ko + ch * 8) : kc,
                       kl ? 16 : 0);
            cp_async16(smem_u32(sV + key * DS + ch * 8), vl ? (const void *)(vc + vo + ch * 8) : vc,
                       vl ? 16 : 0);
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

/* One block: 16 rows of (sequence b, KV head hk), keys of one split. Grid:
 * x = (b * kv_heads + hk) * row_tiles + row tile, y = split. */
template <int D, bool BF16>
__global__ void __launch_bounds__(dtile<D>::THREADS) decode_kernel(const dec_params p)
{
    typedef typename elem<BF16>::T T;
    constexpr int KT = dtile<D>::KT, BN = dtile<D>::BN, DS = dtile<D>::DS;
    constexpr int STAGES = dtile<D>::STAGES, WARPS = dtile<D>::WARPS, THREADS = dtile<D>::THREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = (T *)smem;        /* [16][DS] */
    T *sKV = sQ + 16 * DS;    /* STAGES x ([KT][DS] K, [KT][DS] V) */
    float *sM = (float *)sKV; /* after the loop: [WARPS][16] max, sum, then [WARPS][16][D] o */
    float *sL = sM + WARPS * 16, *sO = sL + WARPS * 16;

    const int rt = blockIdx.x % p.row_tiles;
    const int hk = (blockIdx.x / p.row_tiles) % p.kv_heads;
    const int b = blockIdx.x / p.row_tiles / p.kv_heads;
    const int split = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = rt * 16, rows = min(16, p.rows - r0);
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

    /* This thread's two rows (lane / 4 and lane / 4 + 8): their visible keys
     * within the split. */
    int64_t lo[2], hi[2];
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        const int r = lane / 4 + rh * 8;
        lo[rh] = hi[rh] = 0;
        if (r < rows) {
            fmha_mask_range(p.causal, p.window_left, p.window_right, (r0 + r) / p.group, p.sq, sk,
                            &lo[rh], &hi[rh]);
            lo[rh] = max64(lo[rh], n_begin);
            hi[rh] = max64(lo[rh], min64(hi[rh], n_end));
        }
    }

    /* Q: row r is q[b, i, hk * group + g]. */
    const T *q = (const T *)p.q;
    for (int e = threadIdx.x; e < 16 * D; e += THREADS) {
        const int r = e / D, c = e % D;
        T x = T(0.0f);
        if (r < rows && c < p.d) {
            const int pr = r0 + r;
            x = q[b * p.q_sb + (int64_t)(pr / p.group) * p.q_ss +
                  (int64_t)(hk * p.group + pr % p.group) * p.q_sh + c];
        }
        sQ[r * DS + c] = x;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ntiles)
            load_stage<D>(p, sKV + s * 2 * KT * DS, sKV + s * 2 * KT * DS + KT * DS, b, hk,
                          n_begin + (int64_t)s * KT, n_end);
        cp_async_commit();
    }

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.0f, 0.0f};

    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads(); /* tile t landed; every warp is done with tile t - 1 */
        {
            const int tn = t + STAGES - 1, st = tn % STAGES;
            if (tn < ntiles)
                load_stage<D>(p, sKV + st * 2 * KT * DS, sKV + st * 2 * KT * DS + KT * DS, b, hk,
                              n_begin + (int64_t)tn * KT, n_end);
            cp_async_commit();
        }
        const T *cK = sKV + (t % STAGES) * 2 * KT * DS + warp * BN * DS;
        const T *cV = cK + KT * DS;
        const int64_t n0 = n_begin + (int64_t)t * KT + warp * BN;

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, smem_u32(sQ + (lane % 16) * DS + kk * 16 + (lane / 16) * 8));
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
            for (int i = 0; i < D / 8; i++) {
                o[i][2 * rh] *= alpha;
                o[i][2 * rh + 1] *= alpha;
            }
        }
        /* O += P V, P from S's accumulators. */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t pa[4];
            pa[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv,
                                  smem_u32(cV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * DS +
                                           dp * 16 + (lane / 16) * 8));
                mma<BF16>(o[2 * dp], pa, bv[0], bv[1]);
                mma<BF16>(o[2 * dp + 1], pa, bv[2], bv[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads(); /* the stages are free: the warps' results go there */

#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        float l = l_row[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = lane / 4 + rh * 8;
        if (lane % 4 == 0) {
            sM[warp * 16 + r] = m_row[rh];
            sL[warp * 16 + r] = l;
        }
#pragma unroll
        for (int j = 0; j < D / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                sO[(warp * 16 + r) * D + j * 8 + (lane % 4) * 2 + e] = o[j][2 * rh + e];
    }
    __syncthreads();

    /* Merge the warps (each saw its own quarter of every tile) and store:
     * the output itself, or this split's normalised part and LSE. */
    for (int e = threadIdx.x; e < 16 * D; e += THREADS) {
        const int r = e / D, c = e % D;
        if (r >= rows || c >= p.dv)
            continue;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++)
            mx = fmaxf(mx, sM[w * 16 + r]);
        const float base = mx == -INFINITY ? 0.0f : mx;
        float l = 0.0f, x = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float f = exp2_approx(sM[w * 16 + r] - base);
            l += sL[w * 16 + r] * f;
            x += sO[(w * 16 + r) * D + c] * f;
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
    p->row_tiles = (p->rows + 15) / 16;
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

template <int D, bool BF16>
fmha_status launch(dec_params &p, const fmha_problem *pb, fmha_workspace *ws, cudaStream_t stream)
{
    const size_t smem = dtile<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(decode_kernel<D, BF16>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int dev = 0, sms = 1, per_sm = 1;
    if (err == cudaSuccess)
        err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err == cudaSuccess)
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<D, BF16>,
                                                            dtile<D>::THREADS, smem);
    if (err != cudaSuccess)
        return cuda_error(err, "preparing the decode kernel");
    const int64_t blocks = (int64_t)p.batch * p.kv_heads * p.row_tiles;
    if (blocks > INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "batch x kv heads x row tiles (%lld) exceeds the grid: split the "
                              "batch into calls",
                              (long long)blocks);
    p.splits = choose_splits(blocks, (int64_t)sms * (per_sm > 0 ? per_sm : 1), pb->max_sk,
                             dtile<D>::KT, pb->num_splits);
    const int64_t tiles = (pb->max_sk + dtile<D>::KT - 1) / dtile<D>::KT;
    p.split_keys = ((tiles + p.splits - 1) / p.splits) * dtile<D>::KT;
    if (p.split_keys == 0)
        p.split_keys = dtile<D>::KT;
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
    decode_kernel<D, BF16><<<grid, dtile<D>::THREADS, smem, stream>>>(p);
    if (p.splits > 1 && (err = cudaGetLastError()) == cudaSuccess) {
        const int64_t nrows = pb->batch * pb->heads * pb->max_sq;
        merge_splits<<<(unsigned)((nrows + 3) / 4), 128, 0, stream>>>(p);
    }
    err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the decode kernel launch");
}

} // namespace

namespace fmha_cuda
{

fmha_status decode_variant(fmha_plan *plan)
{
    const int64_t dmax =
        plan->cfg.head_dim > plan->cfg.head_dim_v ? plan->cfg.head_dim : plan->cfg.head_dim_v;
#define FMHA_VARIANT(D)              \
    if (dmax <= D) {                 \
        plan->head_dim_variant = D;  \
        plan->tile_m = 16;           \
        plan->tile_n = dtile<D>::KT; \
        return FMHA_STATUS_OK;       \
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
#define FMHA_LAUNCH(D)               \
    if (plan->head_dim_variant == D) \
        st = bf16 ? launch<D, true>(p, pb, ws, stream) : launch<D, false>(p, pb, ws, stream);
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
