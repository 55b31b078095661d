/* tiles.cuh — what the Hopper kernel's parts share: the input kinds, the tuning knobs and the
 * tiles and shared memory they give (htile), the launch's parameters (hopper_params), FP8's V^T
 * layout, and where a scheduled piece's rows and keys lie (tile_span, for_each_piece). */
#pragma once

#include "../cuda_common.cuh"
#include "sched.cuh"

#include <cuda.h> /* CUtensorMap */

#include <stdint.h>

namespace
{
using namespace fmha_cuda;

/* The q, k, v dtype. IN_S8Q: q and k INT8 codes, v e4m3 (fp8_compute = int8_qk): S = Q K^T
 * on INT8 wgmma with exact s32 sums, P V as for IN_E4M3; every 8-bit layout is e4m3's. */
enum in_kind { IN_F16 = 0, IN_BF16 = 1, IN_E4M3 = 2, IN_S8Q = 3 };

/* Tiles and pipeline, per head dim D (Q/K/V rows are stored as chunks of
 * 128 bytes, 64 columns of 16-bit or 128 of FP8: TMA's 128-byte swizzle is
 * wgmma's native layout). Measured on the H200, 2026-12-02 (bench/NOTES.md
 * has the runs):
 *   BM 128: two consumer warpgroups x wgmma's M of 64.
 *   BN 128 for D <= 128: BN 176 and 160 ran 1-5% slower (S + P + O need
 *      196+ of the consumers' 232 registers, then, at 176; 16 bytes spilled).
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
    static constexpr bool FP8 = IN == IN_E4M3 || IN == IN_S8Q; /* 8-bit inputs */
    static constexpr int PV_IN = IN == IN_S8Q ? IN_E4M3 : IN;  /* P V's wgmma kind */
    static constexpr int EB = FP8 ? 1 : 2;                     /* bytes per element */
    static constexpr int CW = 128 / EB; /* columns per 128-byte swizzled row chunk */
    static constexpr int NCH = (D + CW - 1) / CW;
    static constexpr int WK = 32 / EB; /* k of one wgmma: 32 bytes */
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
    static constexpr uint32_t O_ROWS =
        ((D + 63) / 64) * BM * 128; /* 16-bit O in 64-column chunks */
    static constexpr uint32_t O_BYTES = RING_END + O_ROWS + BARS + 1024 <= 227 * 1024 ? O_ROWS : 0;
    static constexpr uint32_t O_OFFSET = O_BYTES ? RING_END : 0;
    static constexpr uint32_t BAR_OFFSET = RING_END + O_BYTES;
    static constexpr size_t SMEM = BAR_OFFSET + BARS + 1024; /* + alignment slack */
    static_assert(O_BYTES || !FP8, "FP8 O is staged in its own region (Q's rows are half as wide)");
};

/* The lazy max's slack (consumer::softmax), log2 units: 16-bit P takes 2^8
 * with room to spare; FP8's P shares e4m3's 448 with the 2^p_shift that keeps
 * small P out of the subnormals (2^2 * 2^6). Measured against a max that
 * moves every tile (H200, 2026-12-03): FP8 single-level +4.1% (FA3 d128),
 * +6.2% (Wan 480p), +3.6% (Flux), two runs back to back; 16-bit, one process,
 * within the board's power-limited spread: FA3 d128 +3.8%, Flux +0.6% and
 * -1.6%, Wan 720p +0.3%. */
__host__ __device__ constexpr float lazy_tau(int in)
{
    return in == IN_E4M3 || in == IN_S8Q ? 2.0f : 8.0f;
}

struct hopper_params {
    flash_params p;
    hopper_sched s;
    CUtensorMap tq, tk, tv; /* FP8: tv maps V^T */
    CUtensorMap to;         /* out, in boxes of 64 rows (o_tma) */
    int o_vec;              /* out rows take 16-byte stores (16-bit out, aligned) */
    int o_tma;              /* ... and, unpacked, bulk tensor stores through `to` */
    float p_shift;          /* FP8: P is stored times 2^p_shift, to stay above e4m3's subnormals */
    float tau; /* lazy_tau of the launch's input kind (a parameter: as a constant, ptxas
                               spills 8 bytes more in the dropout variants) */
};

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

/* Named barriers: 0 is __syncthreads; 1, 2 each consumer's epilogue; 3, 4
 * the ping-pong turns (consumer 0's, consumer 1's). */
constexpr int BAR_EPILOGUE = 1, BAR_TURN = 3;

/* The rows and keys of a piece; false for a query block past its sequence. */
__device__ __forceinline__ bool tile_span(block_span &bs, const flash_params &p,
                                          const hopper_sched &s, const segment &g, int BM, int BN)
{
    const uint32_t x = (uint32_t)g.tile % (uint32_t)s.tiles_x,
                   hb = (uint32_t)g.tile / (uint32_t)s.tiles_x;
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
__device__ __forceinline__ void for_each_piece(const hopper_sched &s, const flash_params &p, int BM,
                                               int BN, F f)
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

} // namespace
