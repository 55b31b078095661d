/* mainloop.cuh — a consumer warpgroup's work on a key tile: S = Q K^T and O += P V on wgmma,
 * and between them the online softmax (consumer); pv_anchor keeps the wait for P V behind it. */
#pragma once

#include "ptx.cuh"
#include "tiles.cuh"

#include <type_traits>

namespace
{

#include "wgmma.inc"

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
    static __device__ __forceinline__ void load_q(uint32_t (*qa)[4], uint32_t q_rows, int warp,
                                                  int lane)
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

    /* S's accumulators as wgmma writes them: f32, or IN_S8Q's s32 sums
     * (to_float turns them into the f32 scores). */
    static constexpr int SI = IN == IN_S8Q ? BN / 2 : 1;
    typedef typename std::conditional<IN == IN_S8Q, uint32_t, float>::type acc_t;

    /* Issues S = Q K^T: one wgmma per 32 bytes of the head dim, four per
     * 128-byte chunk; Q from shared memory, or from qa (QR). Into sc, or
     * IN_S8Q's si. */
    template <bool QR>
    static __device__ __forceinline__ void issue_scores(float *sc, uint32_t *si, uint32_t q_rows,
                                                        const uint32_t (*qa)[4], uint32_t k_stage)
    {
        const uint64_t kd = smem_desc(k_stage, 16, 1024), qd = smem_desc(q_rows, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < QA; ks++) {
            const uint32_t col = (ks % 4) * 32u;
            const uint64_t kdesc = desc_at(kd, (ks / 4) * BN * 128 + col);
            acc_t *acc;
            if constexpr (IN == IN_S8Q)
                acc = si;
            else
                acc = sc;
            if constexpr (QR)
                wgmma<BN, IN>::rsk(acc, qa[ks], kdesc, ks > 0);
            else
                wgmma<BN, IN>::ss(acc, desc_at(qd, (ks / 4) * TL::BM * 128 + col), kdesc, ks > 0);
        }
    }

    /* Issues O += P V (accumulate = 0: O = P V). 16-bit: V is [BN keys][D] in
     * 64-column chunks BN * 128 bytes apart (MN-major). FP8: V^T is [D][BN
     * keys], one 128-byte row per output column (K-major). */
    static __device__ __forceinline__ void issue_pv(float *o, const uint32_t (*pa)[4],
                                                    uint32_t v_stage, int accumulate)
    {
        const uint64_t vd =
            TL::FP8 ? smem_desc(v_stage, 16, 1024) : smem_desc(v_stage, BN * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < PA; kk++) {
            const uint64_t desc = desc_at(vd, TL::FP8 ? kk * 32 : kk * 16 * 128);
            wgmma<D, TL::PV_IN>::rs(o, pa[kk], desc, kk > 0 || accumulate);
        }
    }

    /* IN_S8Q: the scores in sc are OFF + the s32 sum, OFF = 1.5 * 2^23:
     * |sum| <= 127 * 127 * 256 < 2^22, so adding OFF's bits to the sum's puts
     * the sum in the mantissa of a float of that value, exactly (one integer
     * add; I2F would load the unit that exp2 needs). The softmax takes OFF
     * out once per row: (max - OFF) * scale, and -OFF * scale in the exponent's
     * bias, whose rounding (~0.75 units of the integer sum) is far below the
     * INT8 codes' own error. */
    static constexpr float OFF = IN == IN_S8Q ? 12582912.0f : 0.0f;

    /* After S has landed: its registers fenced, and IN_S8Q's sums in sc. */
    static __device__ __forceinline__ void landed(float *sc, uint32_t *si)
    {
        if constexpr (IN == IN_S8Q) {
            static_assert(D <= 256, "s32 sums above 2^22 for D > 256");
            fence_regs<SI>(si);
            /* The add in place (asm): as C, ptxas kept the sums and the floats in
             * separate registers and spilled 312 bytes in the two-level D = 128
             * variant (52 this way; E4M3's: 16). */
#pragma unroll
            for (int i = 0; i < BN / 2; i++) {
                asm("add.s32 %0, %0, 0x4B400000;" : "+r"(si[i]));
                sc[i] = __uint_as_float(si[i]);
            }
        } else {
            fence_regs<BN / 2>(sc);
        }
    }

    /* Softcap, then -inf where a row does not see a key (tile edges only). */
    static __device__ __forceinline__ void mask(float *sc, const flash_params &p, float cap_in,
                                                int64_t n0, int nvalid, bool full, int row0,
                                                int rows, int64_t m0, int64_t sq, int64_t sk,
                                                int lane)
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
     * 2^shift), and the factor alpha by which O must shrink. scale_log2[rh]:
     * row rh's (IN_S8Q's q scales differ by row). A row's keys sit
     * in one quad. The max moves lazily: a warp keeps its rows' old maxima,
     * and O unscaled, unless one of its rows grew by more than tau
     * (hopper_params, log2 units), so P stays below 2^tau (times 2^shift).
     * Returns whether the max moved, i.e. whether O must be rescaled. */
    static __device__ __forceinline__ bool softmax(float *sc, float *m_row, float *l_row,
                                                   float *alpha, const float *scale_log2,
                                                   float shift, float tau)
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
            mx[rh] = fmaxf(m_row[rh], (x - OFF) * scale_log2[rh]);
        }
        const bool grow = __any_sync(0xffffffffu, mx[0] > m_row[0] + tau || mx[1] > m_row[1] + tau);
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            const float m = grow ? mx[rh] : m_row[rh];
            const float base = m == -INFINITY ? 0.0f : m; /* no key yet: all terms 0 */
            alpha[rh] = grow ? exp2_approx(m_row[rh] - base) : 1.0f;
            const float nb = OFF == 0.0f ? shift - base : fmaf(-OFF, scale_log2[rh], shift - base);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[4 * j + 2 * rh + e];
                    x = exp2_approx(fmaf(x, scale_log2[rh], nb));
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
    static __device__ __forceinline__ void dropout(float *sc, const flash_params &p, int64_t b,
                                                   int64_t h, int64_t row, int64_t n0, int lane)
    {
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int rh = 0; rh < 2; rh++) {
                const int64_t col = n0 + j * 8 + (lane % 4) * 2; /* even: two keys */
                uint32_t w[2];
                dropout_pair_words(p, b, h, row + 8 * rh, col, w);
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[4 * j + 2 * rh + e];
                    x = w[e] >= p.drop_threshold ? x * p.drop_scale : 0.0f;
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

} // namespace
