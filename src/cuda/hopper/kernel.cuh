/* kernel.cuh — hopper_fwd, the Hopper forward kernel (sm_90a): barrier set-up, then the producer
 * warp's loads and the two consumer warpgroups' pieces.
 *
 * Warp-specialized: a producer warp streams Q once and K/V tiles through a
 * shared-memory ring with the tensor copy engine (TMA), completing on
 * mbarriers; two consumer warpgroups of 64 queries each run S = Q K^T and
 * O += P V on wgmma and the online softmax in registers (S's accumulator
 * fragment is P's register operand). Every feature of the portable kernel
 * runs here: masks, softcap, GQA, varlen, LSE, dropout (same Philox stream),
 * head_dim_v (zero-padded to D). A block may run several query tiles in
 * turn, and pieces of tiles split along the keys (sched.cuh: persistent
 * blocks, split last round).
 *
 * The same kernel takes f8_e4m3 inputs (IN_E4M3): both GEMMs run on FP8
 * wgmma, whose B operand must be K-major, so V is first transposed into
 * scratch (vt_kernel, fp8_vt.cuh) with the keys of each 16-key group
 * permuted to match the order in which S's accumulator fragment hands P to
 * the second GEMM. The descales fold into the softmax scale and the final
 * 1 / l. */
#pragma once

#include "mainloop.cuh"
#include "ptx.cuh"
#include "tiles.cuh"

namespace
{

template <int D, int IN, bool DROPOUT, bool TWO_LEVEL, int CL>
__global__ void __launch_bounds__(384, 1) hopper_fwd(const __grid_constant__ hopper_params hp)
{
    typedef htile<D, IN> TL;
    /* CL = 2: a cluster of two blocks on neighbouring query tiles of one head
     * (sched.cuh); each loads half of every K/V tile into both. */
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
        for_each_piece(
            hp.s, p, BM, BN, [&](const segment &, const block_span &bs, uint32_t g, uint32_t nseg) {
                /* TMA coordinates are 32-bit: the piece in a few registers (24 here). */
                const int hk = bs.hk, tb = (int)bs.tb, ntiles = bs.ntiles, h = bs.h;
                const int k_row = (int)(bs.k0 + bs.kv_begin), q_row = (int)(bs.q0 + bs.m0);
                /* FP8: V^T tiles are one box of D rows x BN keys (vt_start). */
                const int vt_col =
                    (int)(p.varlen ? vt_start(bs.k0, bs.b) + bs.kv_begin : bs.kv_begin);
                /* A whole tile lands in this block; with CL = 2 this block loads
             * rows [rank BN / 2, (rank + 1) BN / 2) into both (box of BN / 2 rows). */
                auto load = [&](uint32_t dst, const CUtensorMap *map, int row, uint32_t bar) {
                    mbar_expect_tx(bar, TL::K_BYTES);
                    for (int c = 0; c < NCH; c++)
                        if (CL == 1)
                            tma_load(dst + c * BN * 128, map, c * CW, row, hk, tb, bar);
                        else
                            tma_load_multicast(dst + c * BN * 128 + rank * (BN / CL) * 128, map,
                                               c * CW, row + (int)rank * (BN / CL), hk, tb, bar,
                                               (1u << CL) - 1);
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

    for_each_piece(
        hp.s, p, BM, BN, [&](const segment &sg, const block_span &bs, uint32_t g, uint32_t nseg) {
            const int64_t m0 = bs.m0, sq = bs.sq, sk = bs.sk, kv_begin = bs.kv_begin,
                          kv_end = bs.kv_end;
            const int rows = bs.rows, ntiles = bs.ntiles;
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
                const float qk =
                    (p.descale_q ? p.descale_q[di] : 1.0f) * (p.descale_k ? p.descale_k[di] : 1.0f);
                if (p.softcap_out != 0.0f)
                    cap_in *= qk;
                else
                    scale_log2 *= qk;
                shift = hp.p_shift;
                o_scale = p.descale_v ? p.descale_v[di] : 1.0f;
            }
            /* IN_S8Q: q's scales are one per row, in the LSE's layout (no softcap:
             * validate.c refuses it with int8_qk). */
            float sl[2] = {scale_log2, scale_log2};
            if (IN == IN_S8Q && p.q_scale_per_row) {
#pragma unroll
                for (int rh = 0; rh < 2; rh++) {
                    const int r = row0 + 8 * rh;
                    const int64_t idx = p.varlen ? (int64_t)bs.h * p.total_q + bs.q0 + m0 + r
                                                 : ((int64_t)bs.b * p.heads + bs.h) * sq + m0 + r;
                    sl[rh] = r < rows ? scale_log2 * p.q_row_scale[idx] : scale_log2;
                }
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
                uint32_t si[C::SI];
                mbar_wait(k_full(stage(0)), phase(0));
                named_sync(BAR_TURN + cw, 256);
                wg_fence();
                C::template issue_scores<QR>(sc, si, q_rows, qa, sK + stage(0) * TL::K_BYTES);
                wg_commit();
                named_arrive(BAR_TURN + (1 - cw), 256);
                wg_wait<0>();
                C::landed(sc, si);
                release_kv(k_empty(stage(0)));
                q_done_after_s(0);
                C::mask(sc, p, cap_in, tile_n0(0), tile_valid(0), tile_full(0), row0, rows, m0, sq,
                        sk, lane);
                C::softmax(sc, m_row, l_row, alpha, sl, shift, hp.tau);
                alpha_p[0] = alpha[0];
                alpha_p[1] = alpha[1];
                if (DROPOUT)
                    C::dropout(sc, p, bs.b, bs.h, m0 + row0, tile_n0(0), lane);
                C::pack(sc, pa);
            }
            /* Tile t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} in flight together; the
         * softmax of S_t overlaps the second GEMM. */
            for (int t = 1; t < ntiles; t++) {
                const int s = stage(t), sp = stage(t - 1);
                float sc[BN / 2];
                uint32_t si[C::SI];
                mbar_wait(k_full(s), phase(t));
                named_sync(BAR_TURN + cw, 256);
                wg_fence();
                C::template issue_scores<QR>(sc, si, q_rows, qa, sK + s * TL::K_BYTES);
                wg_commit();
                mbar_wait(v_full(sp), phase(t - 1));
                wg_fence(); /* the barrier's wait loop ends the fenced group S_t was issued in */
                issue_pv(sV + sp * TL::V_BYTES);
                wg_commit();
                named_arrive(BAR_TURN + (1 - cw), 256);
                wg_wait<1>();
                C::landed(sc, si);
                release_kv(k_empty(s));
                q_done_after_s(t);
                C::mask(sc, p, cap_in, tile_n0(t), tile_valid(t), tile_full(t), row0, rows, m0, sq,
                        sk, lane);
                const bool grow = C::softmax(sc, m_row, l_row, alpha, sl, shift, hp.tau);
                if (PV_ANCHOR)
                    pv_anchor(anchor, l_row);
                wg_wait<0>();
                fold_pv();
                release_kv(v_empty(sp));
                if (!TWO_LEVEL && grow)
                    C::rescale(o, alpha);
                if (DROPOUT)
                    C::dropout(sc, p, bs.b, bs.h, m0 + row0, tile_n0(t), lane);
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
                        /* NaN for a NaN piece, so that the combine keeps it */
                        pl[r] = l_sum[rh] > 0.0f || l_sum[rh] != l_sum[rh]
                                    ? m_row[rh] - shift + log2f(l_sum[rh])
                                    : -INFINITY;
                    /* Columns c and c + 1 in one 8-byte store (c even; a column
                 * past dv lands in the row's padding, which the merge skips). */
                    float *prow = po + (int64_t)r * D + (lane % 4) * 2;
#pragma unroll
                    for (int j = 0; j < D / 8; j++)
                        if (8 * j + (lane % 4) * 2 < p.dv)
                            *(float2 *)(prow + 8 * j) = make_float2(
                                o[4 * j + 2 * rh] * inv[rh], o[4 * j + 2 * rh + 1] * inv[rh]);
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
                            const uint32_t off = (j / 8) * BM * 128 + r * 128 +
                                                 (((j % 8) ^ (r % 8)) * 16) + (lane % 4) * 4;
                            const float x0 = o[4 * j + 2 * rh] * inv[rh],
                                        x1 = o[4 * j + 2 * rh + 1] * inv[rh];
                            *(uint32_t *)(smem + off) =
                                out_bf16 ? pack2<true>(x0, x1) : pack2<false>(x0, x1);
                        }
                    if (o_tma)
                        fence_async_shared();
                    named_sync(BAR_EPILOGUE + cw, 128);
                    if (o_tma) {
                        if (threadIdx.x % 128 == 0) {
                            const uint32_t rows0 = sQ + TL::O_OFFSET + cw * 64 * 128;
                            for (int c = 0; 64 * c < p.dv; c++)
                                tma_store(&hp.to, rows0 + c * BM * 128, 64 * c,
                                          (int)(bs.m0 + cw * 64), bs.h, (int)bs.tb);
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
                        static_assert(UNITS % 2 == 0,
                                      "64 rows of pieces are whole rounds of 128 threads");
                        const int units = p.dv / 8;
                        char *const out0 = block_out_row(p, bs, 0);
                        const int64_t row_bytes = p.o_ss * 2; /* 16-bit out */
#pragma unroll 1
                        for (int k = 0; k < UNITS / 2; k++) {
                            const int idx = threadIdx.x % 128 + 128 * k;
                            const int r = cw * 64 + idx / UNITS, u = idx % UNITS;
                            if (r >= rows || u >= units)
                                continue;
                            const uint4 val = *(const uint4 *)(smem + (u / 8) * BM * 128 + r * 128 +
                                                               (((u % 8) ^ (r % 8)) * 16));
                            *(uint4 *)(out0 + r * row_bytes + u * 16) = val;
                        }
                    }
                } else {
#pragma unroll
                    for (int rh = 0; rh < 2; rh++) {
                        const int r = row0 + 8 * rh;
                        if (r < rows)
                            store_out_frag<D>(
                                p, block_out_row(p, bs, r), lane, 0,
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

} // namespace
