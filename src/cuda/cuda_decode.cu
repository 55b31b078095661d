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

#include <cuda_fp8.h>
#include "../alloc.h"

#include <stdint.h>
#include <type_traits>
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
    int l2_prefetch; /* the loads' L2 prefetch size, 0/128/256 (the FMHA_CUDA_DECODE_L2PF knob) */
    const float *k_descale, *v_descale; /* FP8 caches (fmha_kv_descale_layout) */
    int kv_descale_layout;
    int device_checked;       /* the index arrays unchecked by the host (max_seqlen_k): seq_ok */
    int64_t max_keys;         /* keys of the longest sequence, or max_seqlen_k */
    int64_t cache_rows;       /* pages of a paged cache, rows of a contiguous one */
    int64_t split_keys;       /* keys of a split, a multiple of the tile */
    float *part_o, *part_lse; /* splits > 1: [split][batch][heads][sq][dv], [split][...] */
    const float *alibi;       /* ALiBi slopes [b * alibi_sb + h] (NULL: none) */
    int64_t alibi_sb;
    const float *sinks; /* a logit per query head (NULL: none): in the last merge */
};

constexpr float LN2_F = 0.69314718055994531f, LOG2E_F = 1.4426950408889634f;

/* A block: RT tiles of 16 rows (RT = 2 where a KV head has more than 16
 * rows: a large GQA group or MQA, so two row tiles share each K/V tile),
 * four key quarters per row tile, and DSP warps per quarter (each P.V over
 * 1 / DSP of the columns: DSP times the warps at the same shared memory, a
 * DSP-th of the accumulators each): 2 at D = 256, and at D = 128 for paged
 * caches with one row tile (launch_rows).
 *
 * F8 (FP8 caches): the stages hold e4m3 codes; each tile is decoded into a
 * 16-bit tile (cur) that the warps then read as for 16-bit caches. The
 * products run in f16 there: a code c becomes the f16 of bits
 * (c & 0x7F) << 7 | (c & 0x80) << 8, exactly c's value times 2^-8
 * (subnormals included); q rows are scaled by a power of two into f16's
 * range; the keys' descales multiply the f32 scores, the values' multiply P
 * relative to the split's first value descale, and the powers of two and
 * that descale are taken out again in f32. */
template <int D, int RT, bool F8 = false, int DSP = (D >= 256 ? 2 : 1)> struct dtile {
    static constexpr int DIM = D, KQ = 4, DSPLIT = DSP;
    static constexpr int WARPS = KQ * DSPLIT * RT, THREADS = 32 * WARPS, STAGES = 3;
    static constexpr int MINB =
        D <= 128 ? 2 : 1;                  /* blocks per multiprocessor the registers allow */
    static constexpr int KT = 64;          /* keys per stage */
    static constexpr int BN = KT / KQ;     /* keys of a key quarter */
    static constexpr int DS = D + 8;       /* 16-bit shared row stride (ldmatrix conflict-free) */
    static constexpr int EB = F8 ? 1 : 2;  /* bytes of a cache element */
    static constexpr int CE = 16 / EB;     /* elements of a 16-byte chunk */
    static constexpr int CH = D / CE;      /* 16-byte chunks of a row */
    static constexpr int SB = D * EB + 16; /* bytes between a stage's rows */
    static constexpr int KPT = KT * CH / THREADS; /* keys a thread loads chunks of per stage */
    static_assert(KT * CH % THREADS == 0, "a stage's chunks divide among the threads");
    static constexpr size_t STAGE = (size_t)2 * KT * SB + (F8 ? 2 * KT * 4 : 0); /* + descales */
    static constexpr size_t CUR = F8 ? (size_t)2 * KT * DS * 2 : 0;
    static constexpr size_t MERGE = (size_t)RT * KQ * 16 * (D + 2) * 4;
    static constexpr size_t BODY = STAGES * STAGE + CUR;
    static constexpr size_t MAIN = (size_t)16 * RT * DS * 2 + (BODY > MERGE ? BODY : MERGE);
    static constexpr size_t SMEM = MAIN + (size_t)2 * 16 * RT * 4; /* + ALiBi's per row */
};

__device__ __forceinline__ int64_t seq_keys(const dec_params &p, int b)
{
    return (p.cache_seqlens ? p.cache_seqlens[b] : p.capacity) + p.seqlen_new;
}

/* Whether sequence b's own entries of the index arrays hold, where the host
 * did not check them (device_checked): its cache length, with the new
 * tokens, within max_keys, and its cache row a row of the cache. A
 * sequence that fails gets nothing appended and NaN rows (fmha.h). */
__device__ __forceinline__ bool seq_ok(const dec_params &p, int b)
{
    if (!p.device_checked)
        return true;
    const int64_t cached = p.cache_seqlens ? p.cache_seqlens[b] : p.capacity;
    if (cached < 0 || cached > p.max_keys - p.seqlen_new)
        return false;
    return p.page_table || !p.kv_batch || (p.kv_batch[b] >= 0 && p.kv_batch[b] < p.cache_rows);
}

/* Page and slot of key j of sequence b in a paged cache (32-bit division
 * where the key index allows); false, and page 0, where the block table
 * names no page of the cache (device_checked calls only: the host checked
 * the others). */
__device__ __forceinline__ bool page_slot(const dec_params &p, int b, int64_t j, int32_t *page,
                                          int32_t *slot)
{
    const int64_t pi =
        j <= UINT32_MAX ? (int64_t)((uint32_t)j / (uint32_t)p.page_size) : j / p.page_size;
    *page = __ldg(p.page_table + b * p.page_stride + pi);
    *slot = (int32_t)(j - pi * p.page_size);
    if (*page >= 0 && *page < p.cache_rows)
        return true;
    *page = 0;
    return false;
}

/* Element offset of key j's row of KV head hk in a cache of strides (sb, ss,
 * sh); -1 where the block table names no page of the cache. */
__device__ __forceinline__ int64_t cache_row(const dec_params &p, int b, int64_t j, int hk,
                                             int64_t sb, int64_t ss, int64_t sh)
{
    if (p.page_table) {
        int32_t page, slot;
        if (!page_slot(p, b, j, &page, &slot))
            return -1;
        return page * sb + slot * ss + hk * sh;
    }
    return (int64_t)(p.kv_batch ? p.kv_batch[b] : b) * sb + j * ss + hk * sh;
}

/* Index into an FP8 cache's descales of key j's row (page or cache row
 * `row`) of KV head hk (fmha_kv_descale_layout). */
__device__ __forceinline__ int64_t descale_index(const dec_params &p, int64_t row, int hk)
{
    return p.kv_descale_layout == FMHA_KV_DESCALE_PER_TENSOR ? 0
           : p.kv_descale_layout == FMHA_KV_DESCALE_PER_HEAD ? hk
                                                             : row * p.kv_heads + hk;
}

/* The pages and slots of the keys a thread loads in a stage, looked up a
 * stage ahead so that the block table's latency hides behind a tile. */
template <int KPT> struct key_pages {
    int32_t page[KPT], slot[KPT];
};

template <class G>
__device__ __forceinline__ void tile_pages(const dec_params &p, int b, int64_t n0, int64_t n_end,
                                           key_pages<G::KPT> &kp, bool &bad)
{
    if (!p.page_table) /* a contiguous cache's rows need no lookup */
        return;
#pragma unroll
    for (int i = 0; i < G::KPT; i++) {
        const int64_t j = n0 + (threadIdx.x + i * G::THREADS) / G::CH;
        kp.page[i] = kp.slot[i] = 0;
        if (j < n_end)
            bad |= !page_slot(p, b, j, &kp.page[i], &kp.slot[i]);
    }
}

/* 16 bytes from global src to shared dst (bytes of them; the rest zero),
 * with the loads' L2 prefetch size (p.l2_prefetch). */
__device__ __forceinline__ void cp_chunk(const dec_params &p, uint32_t dst, const void *src,
                                         int bytes)
{
    if (p.l2_prefetch == 256)
        cp_async16_pf<256>(dst, src, bytes);
    else if (p.l2_prefetch == 128)
        cp_async16_pf<128>(dst, src, bytes);
    else
        cp_async16(dst, src, bytes);
}

/* Keys [n0, n0 + KT) of sequence b (those below n_end) into a stage: K rows
 * at sK, V rows at sV (G::SB bytes apart), zero past n_end and past each
 * head dim; F8: each key's descales at sKD, sVD. kbase and vbase: the
 * offsets of KV head hk's row 0 (contiguous: in the sequence's cache; paged:
 * in page 0); kp: the keys' pages (paged caches). */
template <class G, typename E>
__device__ __forceinline__ void load_stage(const dec_params &p, char *sK, char *sV, float *sKD,
                                           float *sVD, int b, int hk, int64_t kbase, int64_t vbase,
                                           int64_t n0, int64_t n_end, const key_pages<G::KPT> &kp)
{
    constexpr int KT = G::KT, CH = G::CH, CE = G::CE, SB = G::SB, THREADS = G::THREADS;
    const E *kc = (const E *)p.kc, *vc = (const E *)p.vc;
    const int64_t crow = p.kv_batch ? p.kv_batch[b] : b; /* a contiguous cache's row */
    if (p.aligned) {
#pragma unroll
        for (int i = 0; i < G::KPT; i++) {
            const int c = threadIdx.x + i * THREADS, key = c / CH, ch = c % CH;
            const int64_t j = n0 + key;
            const bool live = j < n_end;
            int64_t ko = kbase + j * p.k_ss, vo = vbase + j * p.v_ss;
            if (p.page_table) {
                ko = kbase + kp.page[i] * p.k_sb + kp.slot[i] * p.k_ss;
                vo = vbase + kp.page[i] * p.v_sb + kp.slot[i] * p.v_ss;
            }
            const bool kl = live && ch * CE < p.d, vl = live && ch * CE < p.dv;
            cp_chunk(p, smem_u32(sK + key * SB + ch * 16),
                     kl ? (const void *)(kc + ko + ch * CE) : kc, kl ? 16 : 0);
            cp_chunk(p, smem_u32(sV + key * SB + ch * 16),
                     vl ? (const void *)(vc + vo + ch * CE) : vc, vl ? 16 : 0);
            if (G::EB == 1 && ch == 0) {
                const int64_t di = descale_index(p, p.page_table ? kp.page[i] : crow, hk);
                cp_async4(smem_u32(sKD + key), live ? p.k_descale + di : p.k_descale, live ? 4 : 0);
                cp_async4(smem_u32(sVD + key), live ? p.v_descale + di : p.v_descale, live ? 4 : 0);
            }
        }
    } else { /* rows not in 16-byte chunks: element by element (correct, slower) */
        for (int e = threadIdx.x; e < KT * G::DIM; e += THREADS) {
            const int key = e / G::DIM, c = e % G::DIM;
            const bool live = n0 + key < n_end;
            E kx = E(0), vx = E(0);
            const int64_t ko = live ? cache_row(p, b, n0 + key, hk, p.k_sb, p.k_ss, p.k_sh) : -1;
            const int64_t vo = live ? cache_row(p, b, n0 + key, hk, p.v_sb, p.v_ss, p.v_sh) : -1;
            if (ko >= 0 && c < p.d) /* ko < 0: no page (tile_pages flags the block) */
                kx = kc[ko + c];
            if (vo >= 0 && c < p.dv)
                vx = vc[vo + c];
            ((E *)(sK + key * SB))[c] = kx;
            ((E *)(sV + key * SB))[c] = vx;
            if (G::EB == 1 && c == 0) {
                int64_t row = crow;
                if (p.page_table && live) {
                    int32_t slot;
                    int32_t page;
                    page_slot(p, b, n0 + key, &page, &slot);
                    row = page;
                }
                const int64_t di = descale_index(p, row, hk);
                sKD[key] = live ? p.k_descale[di] : 0.0f;
                sVD[key] = live ? p.v_descale[di] : 0.0f;
            }
        }
    }
}

/* Four e4m3 codes (a word) as two f16 pairs of 2^-8 times their values. */
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t *lo, uint32_t *hi)
{
    const uint32_t a = __byte_perm(w, 0, 0x4140), b = __byte_perm(w, 0, 0x4342);
    *lo = ((a & 0x007F007Fu) << 7) | ((a & 0x00800080u) << 8);
    *hi = ((b & 0x007F007Fu) << 7) | ((b & 0x00800080u) << 8);
}

/* An FP8 stage's K and V codes into the f16 tile cur (K rows, then V rows,
 * DS elements apart). */
template <class G>
__device__ __forceinline__ void decode_stage(const char *sK, const char *sV, __half *cur)
{
    constexpr int KT = G::KT, CH = G::CH, SB = G::SB, DS = G::DS;
    for (int c = threadIdx.x; c < 2 * KT * CH; c += G::THREADS) {
        const int kv = c / (KT * CH), key = c / CH % KT, ch = c % CH;
        const uint4 w = *(const uint4 *)((kv ? sV : sK) + key * SB + ch * 16);
        uint4 o0, o1;
        e4m3x4_to_f16(w.x, &o0.x, &o0.y);
        e4m3x4_to_f16(w.y, &o0.z, &o0.w);
        e4m3x4_to_f16(w.z, &o1.x, &o1.y);
        e4m3x4_to_f16(w.w, &o1.z, &o1.w);
        uint4 *dst = (uint4 *)(cur + (kv * KT + key) * DS + ch * 16);
        dst[0] = o0;
        dst[1] = o1;
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
template <int D, bool BF16, int RT, bool F8, int DSP>
__global__ void __launch_bounds__(dtile<D, RT, F8, DSP>::THREADS, dtile<D, RT, F8, DSP>::MINB)
    decode_kernel(const dec_params p)
{
    typedef typename elem<BF16>::T T;
    typedef typename elem<BF16 && !F8>::T MT; /* the products' inputs: f16 for FP8 caches */
    typedef typename std::conditional<F8, uint8_t, T>::type E; /* a cache element */
    constexpr bool MB = BF16 && !F8;
    typedef dtile<D, RT, F8, DSP> G;
    constexpr int KT = G::KT, BN = G::BN, DS = G::DS, STAGES = G::STAGES, KQ = G::KQ;
    constexpr int SB = G::SB, DW = D / G::DSPLIT; /* DW: columns of a warp's P.V */
    extern __shared__ __align__(16) unsigned char smem[];
    MT *sQ = (MT *)smem;                         /* [16 * RT][DS] */
    char *sBody = (char *)(sQ + 16 * RT * DS);   /* STAGES x stage, then cur */
    MT *cur = (MT *)(sBody + STAGES * G::STAGE); /* F8: [2][KT][DS], K then V */
    float *sM = (float *)sBody; /* after the loop: [RT][KQ][16] max, sum, then [RT][KQ][16][D] o */
    float *sL = sM + RT * KQ * 16, *sO = sL + RT * KQ * 16;
    /* ALiBi, per block row: -slope log2 e / scale_log2 per key of distance,
     * and the row's query position among the keys (a float: exact below 2^24
     * keys). In shared memory, read per tile: registers held across the loop
     * would spill in the variants without ALiBi too. */
    float *sSlope = (float *)(smem + G::MAIN), *sDiag = sSlope + 16 * RT;
    auto stage_k = [&](int s) { return sBody + s * G::STAGE; };
    auto stage_v = [&](int s) { return sBody + s * G::STAGE + KT * SB; };
    auto stage_kd = [&](int s) { return (float *)(sBody + s * G::STAGE + 2 * KT * SB); };
    auto stage_vd = [&](int s) { return stage_kd(s) + KT; };

    const int rb = blockIdx.x % p.row_blocks;
    const int hk = (blockIdx.x / p.row_blocks) % p.kv_heads;
    const int b = blockIdx.x / p.row_blocks / p.kv_heads;
    const int split = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kq = warp % KQ, dh = warp / KQ % G::DSPLIT, rl = warp / (KQ * G::DSPLIT);
    const int r0 = rb * 16 * RT, rows = min(16 * RT, p.rows - r0);
    const int wr0 = r0 + rl * 16, wrows = min(16, p.rows - wr0); /* this warp's row tile */

    /* Channel c of the block's row r, with its LSE: into out (and lse), or
     * this split's normalised part. */
    auto put = [&](int r, int c, float x, float lse) {
        const int pr = r0 + r, i = pr / p.group, h = hk * p.group + pr % p.group;
        const int64_t lrow = ((int64_t)b * p.heads + h) * p.sq + i;
        if (p.splits > 1) {
            const int64_t prow = (int64_t)split * p.batch * p.heads * p.sq + lrow;
            p.part_o[prow * p.dv + c] = x;
            if (c == 0)
                p.part_lse[prow] = lse;
            return;
        }
        char *orow = (char *)p.o + (b * p.o_sb + (int64_t)i * p.o_ss + (int64_t)h * p.o_sh) *
                                       (p.out_dtype == FMHA_DTYPE_F32 ? 4 : 2);
        store_any(orow, p.out_dtype, c, x);
        if (p.lse && c == 0)
            p.lse[lrow] = lse;
    };
    if (!seq_ok(p, b)) { /* index arrays the host did not check, and wrong: NaN rows */
        for (int e = threadIdx.x; e < rows * p.dv; e += G::THREADS)
            put(e / p.dv, e % p.dv, NAN, NAN);
        return;
    }
    bool bad = false; /* a page index outside the cache (device_checked): NaN rows */
    const int64_t sk = seq_keys(p, b);
    /* Device-checked paged calls: every block table entry of the sequence's
     * keys must name a page of the cache, read by this block or not (a
     * window or a split may skip pages), as the host's check asks. */
    if (p.device_checked && p.page_table)
        for (int64_t t = threadIdx.x; t * p.page_size < sk; t += G::THREADS) {
            const int32_t pg = __ldg(p.page_table + b * p.page_stride + t);
            bad |= pg < 0 || pg >= p.cache_rows;
        }

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
    if (p.alibi)
        for (int r = threadIdx.x; r < 16 * RT; r += G::THREADS) {
            const int pr = r0 + r;
            sSlope[r] = r < rows ? -p.alibi[b * p.alibi_sb + hk * p.group + pr % p.group] *
                                       LOG2E_F / p.scale_log2
                                 : 0.0f;
            sDiag[r] = (float)(pr / p.group + sk - p.sq);
        } /* read after the __syncthreads before the first tile */
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

    /* Q: row r is q[b, i, hk * group + g]; F8: times a power of two that
     * brings the row's largest magnitude into [2^13, 2^14) (sM holds them
     * until the stages are loaded). */
    const T *q = (const T *)p.q;
    auto q_at = [&](int r, int c) {
        const int pr = r0 + r;
        return q[b * p.q_sb + (int64_t)(pr / p.group) * p.q_ss +
                 (int64_t)(hk * p.group + pr % p.group) * p.q_sh + c];
    };
    float rowf[2] = {1.0f, 1.0f}; /* F8: what takes a score of the f16 tiles back to q . k */
    if (F8) {
        for (int r = warp; r < 16 * RT; r += G::WARPS) {
            float mx = 0.0f;
            for (int c = lane; r < rows && c < p.d; c += 32)
                mx = fmaxf(mx, fabsf((float)q_at(r, c)));
#pragma unroll
            for (int o = 16; o > 0; o /= 2)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            if (lane == 0)
                sM[r] = mx > 0.0f && mx <= 3.0e38f ? ldexpf(1.0f, 13 - ilogbf(mx)) : 1.0f;
        }
        __syncthreads();
#pragma unroll
        for (int rh = 0; rh < 2; rh++)
            rowf[rh] = 256.0f / sM[rl * 16 + lane / 4 + rh * 8];
    }
    for (int e = threadIdx.x; e < 16 * RT * D; e += G::THREADS) {
        const int r = e / D, c = e % D;
        float x = 0.0f;
        if (r < rows && c < p.d)
            x = (float)q_at(r, c) * (F8 ? sM[r] : 1.0f);
        sQ[r * DS + c] = MT(x);
    }
    /* F8: the value descale that P is taken relative to (the split's first key's). */
    float vref = 1.0f;
    if (F8 && n_begin < n_end) {
        int64_t row = p.kv_batch ? p.kv_batch[b] : b;
        if (p.page_table) {
            int32_t page, slot;
            bad |= !page_slot(p, b, n_begin, &page, &slot);
            row = page;
        }
        vref = p.v_descale[descale_index(p, row, hk)];
    }
    __syncthreads(); /* sM's row scales read: the stages may fill */

    int64_t kbase = (int64_t)hk * p.k_sh, vbase = (int64_t)hk * p.v_sh;
    if (!p.page_table) {
        const int64_t row = p.kv_batch ? p.kv_batch[b] : b;
        kbase += row * p.k_sb;
        vbase += row * p.v_sb;
    }
    key_pages<G::KPT> kp;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ntiles) {
            tile_pages<G>(p, b, n_begin + (int64_t)s * KT, n_end, kp, bad);
            load_stage<G, E>(p, stage_k(s), stage_v(s), stage_kd(s), stage_vd(s), b, hk, kbase,
                             vbase, n_begin + (int64_t)s * KT, n_end, kp);
        }
        cp_async_commit();
    }
    if (STAGES - 1 < ntiles)
        tile_pages<G>(p, b, n_begin + (int64_t)(STAGES - 1) * KT, n_end, kp, bad);

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
                load_stage<G, E>(p, stage_k(st), stage_v(st), stage_kd(st), stage_vd(st), b, hk,
                                 kbase, vbase, n_begin + (int64_t)tn * KT, n_end, kp);
                if (tn + 1 < ntiles)
                    tile_pages<G>(p, b, n_begin + (int64_t)(tn + 1) * KT, n_end, kp, bad);
            }
            cp_async_commit();
        }
        const MT *cK = (const MT *)stage_k(t % STAGES) + kq * BN * DS;
        if (F8) {
            decode_stage<G>(stage_k(t % STAGES), stage_v(t % STAGES), (__half *)cur);
            __syncthreads(); /* tile t decoded */
            cK = cur + kq * BN * DS;
        }
        if (wrows <= 0)
            continue; /* the last row block's second tile may hold no rows */
        const MT *cV = cK + KT * DS;
        const MT *wQ = sQ + rl * 16 * DS;
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
                mma<MB>(s[2 * np], a, bk[0], bk[1]);
                mma<MB>(s[2 * np + 1], a, bk[2], bk[3]);
            }
        }
        if (F8) { /* the rows' powers of two out, the keys' descales in */
            const float *kd = stage_kd(t % STAGES) + kq * BN;
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[i][e] *= rowf[e / 2] * kd[i * 8 + (lane % 4) * 2 + e % 2];
        }
        if (p.softcap_out != 0.0f) {
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[i][e] = tanh_fast(s[i][e] * p.softcap_in) * p.softcap_out;
        }
        if (p.alibi) { /* the slope's bias, in S's units (times scale_log2 below) */
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int r = rl * 16 + lane / 4 + rh * 8;
                const float sl = sSlope[r], dg = sDiag[r];
#pragma unroll
                for (int i = 0; i < BN / 8; i++)
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        s[i][2 * rh + e] +=
                            sl * fabsf(dg - (float)(n0 + i * 8 + (lane % 4) * 2 + e));
            }
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
        if (F8) { /* P times each value's descale, relative to vref */
            const float *vd = stage_vd(t % STAGES) + kq * BN;
            const float inv_ref = 1.0f / vref;
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[i][e] *= vd[i * 8 + (lane % 4) * 2 + e % 2] * inv_ref;
        }
        /* O += P V over this warp's columns, P from S's accumulators. */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t pa[4];
            pa[0] = pack2<MB>(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack2<MB>(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack2<MB>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack2<MB>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DW / 16; dp++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv,
                                  smem_u32(cV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * DS +
                                           dh * DW + dp * 16 + (lane / 16) * 8));
                mma<MB>(o[2 * dp], pa, bv[0], bv[1]);
                mma<MB>(o[2 * dp + 1], pa, bv[2], bv[3]);
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
    const bool any_bad = __syncthreads_or(bad);

    /* Merge each row tile's key quarters and store: the output itself, or
     * this split's normalised part and LSE. */
    const float oscale = F8 ? 256.0f * vref : 1.0f; /* F8: the values' 2^-8 and vref out */
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
        if (p.splits == 1 && p.sinks) { /* else the splits' merge adds the sink */
            float f;
            const int pr = r0 + r;
            add_sink(p.sinks, hk * p.group + pr % p.group, mx, l, f);
            x *= f;
        }
        const float inv = l > 0.0f ? oscale / l : 0.0f;
        /* A NaN row keeps a NaN LSE; a row of no key -inf (store_lse's rule). */
        const float lse = l > 0.0f || l != l ? (mx + log2f(l)) * LN2_F : -INFINITY;
        put(r, c, any_bad ? NAN : x * inv, any_bad ? NAN : lse);
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
    const int i = (int)(row % p.sq), h = (int)(row / p.sq % p.heads),
              b = (int)(row / p.sq / p.heads);
    /* the sink: one more part, of logit sinks[h] and output 0 */
    const float sink = p.sinks ? p.sinks[h] : -INFINITY;
    float mx = sink;
    for (int s = 0; s < p.splits; s++)
        mx = fmaxf(mx, p.part_lse[s * nrows + row]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float total = sink == -INFINITY ? 0.0f : __expf(sink - base);
    for (int s = 0; s < p.splits; s++)
        total += __expf(p.part_lse[s * nrows + row] - base);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
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
 * token i, sequence b), threads over KV heads and channels. E: the caches'
 * element, T or (FP8 caches) an e4m3 code of value / descale. */
template <typename T, typename E>
__device__ __forceinline__ void cache_put(const dec_params &p, E *dst, float x, const float *ds,
                                          int b, int64_t pos, int h)
{
    if constexpr (std::is_same<E, uint8_t>::value) {
        int64_t row = p.kv_batch ? p.kv_batch[b] : b;
        if (p.page_table) {
            int32_t page, slot;
            page_slot(p, b, pos, &page, &slot);
            row = page;
        }
        *dst = (uint8_t)__nv_cvt_float_to_fp8(x / ds[descale_index(p, row, h)], __NV_SATFINITE,
                                              __NV_E4M3);
    } else {
        *dst = T(x);
    }
}

template <typename T, typename E>
__global__ void append_kv(const dec_params p, const T *k_new, const T *v_new, int64_t kn_sb,
                          int64_t kn_ss, int64_t kn_sh, int64_t vn_sb, int64_t vn_ss, int64_t vn_sh,
                          const float *cos_t, const float *sin_t, int rotary_dim, int interleaved)
{
    const int i = blockIdx.x, b = blockIdx.y;
    if (!seq_ok(p, b))
        return; /* its attention writes NaN rows */
    const int64_t pos = p.cache_seqlens[b] + i;
    E *kc = (E *)p.kc, *vc = (E *)p.vc;
    for (int e = threadIdx.x; e < p.kv_heads * p.d; e += blockDim.x) {
        const int h = e / p.d, c = e % p.d;
        const T *src = k_new + b * kn_sb + (int64_t)i * kn_ss + (int64_t)h * kn_sh;
        const int64_t row = cache_row(p, b, pos, h, p.k_sb, p.k_ss, p.k_sh);
        if (row >= 0) /* else no page of the cache: nothing written */
            cache_put<T>(p, kc + row + c,
                         rotated(src, c, rotary_dim, interleaved, cos_t, sin_t, pos), p.k_descale,
                         b, pos, h);
    }
    for (int e = threadIdx.x; e < p.kv_heads * p.dv; e += blockDim.x) {
        const int h = e / p.dv, c = e % p.dv;
        const int64_t row = cache_row(p, b, pos, h, p.v_sb, p.v_ss, p.v_sh);
        if (row >= 0)
            cache_put<T>(p, vc + row + c,
                         (float)v_new[b * vn_sb + (int64_t)i * vn_ss + (int64_t)h * vn_sh + c],
                         p.v_descale, b, pos, h);
    }
}

/* append_kv on caches of T, or of e4m3 codes (f8). */
template <typename T>
void launch_append(const dec_params &p, bool f8, dim3 grid, cudaStream_t stream,
                   const fmha_kvcache_args *a, int rd, int il)
{
    const fmha_tensor &kn = a->k_new, &vn = a->v_new;
    auto kernel = f8 ? append_kv<T, uint8_t> : append_kv<T, T>;
    kernel<<<grid, 256, 0, stream>>>(p, (const T *)kn.data, (const T *)vn.data, kn.stride_batch,
                                     kn.stride_seq, kn.stride_head, vn.stride_batch, vn.stride_seq,
                                     vn.stride_head, a->rotary_cos, a->rotary_sin, rd, il);
}

/* q rotated into q_rot (contiguous [batch, sq, heads, d]): one block per
 * (query i, sequence b). */
template <typename T>
__global__ void rotate_q(const dec_params p, const T *q, int64_t q_sb, int64_t q_ss, int64_t q_sh,
                         T *q_rot, const float *cos_t, const float *sin_t, int rotary_dim,
                         int interleaved, int per_query)
{
    const int i = blockIdx.x, b = blockIdx.y;
    if (!seq_ok(p, b))
        return; /* its attention writes NaN rows without reading q */
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
    p->device_checked = pb->device_checked;
    p->max_keys = pb->max_sk;
    p->cache_rows = a->k.batch;
    p->k_descale = kv->k_descale;
    p->v_descale = kv->v_descale;
    p->kv_descale_layout = (int)kv->kv_descale_layout;
    if (a->k.dtype == FMHA_DTYPE_F8_E4M3) { /* rows in 16-byte chunks of 16 codes */
        const fmha_tensor *c[2] = {&a->k, &a->v};
        p->aligned = 1;
        for (int i = 0; i < 2; i++)
            p->aligned &= (uintptr_t)c[i]->data % 16 == 0 && c[i]->stride_batch % 16 == 0 &&
                          c[i]->stride_seq % 16 == 0 && c[i]->stride_head % 16 == 0 &&
                          c[i]->head_dim % 16 == 0;
    } else {
        p->aligned = chunk_aligned(a->q) && chunk_aligned(a->k) && chunk_aligned(a->v);
    }
    p->splits = 1;
    p->alibi = kv->alibi_slopes;
    p->alibi_sb = kv->alibi_stride_batch;
    p->sinks = kv->sinks;
}

/* How many splits: num_splits where the caller gave one, else the fewest
 * that fill the device's resident blocks (`slots`) to 90%, but no more than
 * give each of the `sms` multiprocessors one block, each split at least two
 * tiles long; never more splits than tiles. The cap is the H100 sweep's
 * (bench/NOTES.md, "Decode on CUDA"): with few blocks (batch 1 at 128k keys,
 * MQA), filling a second block per SM cost 12-30% against one. */
int choose_splits(int64_t blocks, int64_t slots, int64_t sms, int64_t max_keys, int kt,
                  int64_t asked)
{
    const int64_t tiles = (max_keys + kt - 1) / kt;
    int64_t most = tiles > 1 ? tiles : 1;
    if (most > 65535)
        most = 65535;
    if (asked > 0)
        return (int)(asked < most ? asked : most);
    int64_t cap = tiles / 2 < 1 ? 1 : tiles / 2 < most ? tiles / 2 : most;
    const int64_t one_per_sm = blocks > 0 ? (sms + blocks - 1) / blocks : 1;
    cap = cap < one_per_sm ? cap : one_per_sm > 1 ? one_per_sm : 1;
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

template <int D, bool BF16, int RT, bool F8, int DSP = (D >= 256 ? 2 : 1)>
fmha_status launch(dec_params &p, const fmha_problem *pb, fmha_workspace *ws, cudaStream_t stream)
{
    typedef dtile<D, RT, F8, DSP> G;
    const size_t smem = G::SMEM;
    cudaError_t err = cudaFuncSetAttribute(decode_kernel<D, BF16, RT, F8, DSP>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int dev = 0, sms = 1, per_sm = 1;
    if (err == cudaSuccess)
        err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err == cudaSuccess)
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, decode_kernel<D, BF16, RT, F8, DSP>, G::THREADS, smem);
    if (err != cudaSuccess)
        return cuda_error(err, "preparing the decode kernel");
    p.row_blocks = (p.rows + 16 * RT - 1) / (16 * RT);
    const int64_t blocks = (int64_t)p.batch * p.kv_heads * p.row_blocks;
    if (blocks > INT32_MAX)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                              "batch x kv heads x row blocks (%lld) exceeds the grid: split the "
                              "batch into calls",
                              (long long)blocks);
    p.splits = choose_splits(blocks, (int64_t)sms * (per_sm > 0 ? per_sm : 1), sms, pb->max_sk,
                             G::KT, pb->num_splits);
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
    decode_kernel<D, BF16, RT, F8, DSP><<<grid, G::THREADS, smem, stream>>>(p);
    if (p.splits > 1 && (err = cudaGetLastError()) == cudaSuccess) {
        const int64_t nrows = pb->batch * pb->heads * pb->max_sq;
        merge_splits<<<(unsigned)((nrows + 3) / 4), 128, 0, stream>>>(p);
    }
    err = cudaGetLastError();
    return err == cudaSuccess ? FMHA_STATUS_OK : cuda_error(err, "the decode kernel launch");
}

/* FP8 caches on their kernel; else two row tiles per block where a KV head
 * has more than 16 rows (head dims to 128: above, the block's accumulators
 * would not fit its registers). Paged caches at D = 128 with one row tile:
 * two warps per key quarter (on an H100, bench/NOTES.md: 16-token pages
 * 16% faster at batch 16 and 14% at 64; contiguous caches no faster, batch
 * 1 at 128k keys and MQA's two row tiles slower). */
template <int D, bool BF16>
fmha_status launch_rows(dec_params &p, const fmha_problem *pb, fmha_workspace *ws,
                        cudaStream_t stream)
{
    constexpr int RT2 = D <= 128 ? 2 : 1;
    if (pb->args->k.dtype == FMHA_DTYPE_F8_E4M3)
        return launch<D, BF16, 1, true>(p, pb, ws, stream);
    if (p.rows > 16)
        return launch<D, BF16, RT2, false>(p, pb, ws, stream);
    if constexpr (D == 128)
        if (p.page_table)
            return launch<D, BF16, 1, false, 2>(p, pb, ws, stream);
    return launch<D, BF16, 1, false>(p, pb, ws, stream);
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
    p.l2_prefetch = plan->knobs.decode_l2_prefetch;
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
    /* Every pointer of the call before the first write (the index arrays
     * too: with max_seqlen_k no host copy has checked them). */
    const void *ptrs[14] = {a->q.data,     a->k_cache.data,  a->v_cache.data,    a->out.data,
                            a->lse,        a->k_new.data,    a->v_new.data,      a->rotary_cos,
                            a->rotary_sin, a->cache_seqlens, a->cache_batch_idx, a->block_table,
                            a->k_descale,  a->v_descale};
    const char *names[14] = {"q",          "k_cache",       "v_cache",         "out",
                             "lse",        "k_new",         "v_new",           "rotary_cos",
                             "rotary_sin", "cache_seqlens", "cache_batch_idx", "block_table",
                             "k_descale",  "v_descale"};
    for (int i = 0; i < 14; i++) {
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
        const bool f8 = pb->args->k.dtype == FMHA_DTYPE_F8_E4M3;
        if (bf16)
            launch_append<__nv_bfloat16>(p, f8, grid, stream, a, rd, il);
        else
            launch_append<__half>(p, f8, grid, stream, a, rd, il);
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
