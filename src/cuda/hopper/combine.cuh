/* combine.cuh — the split-KV combine kernel: merges the pieces of each split tile (sched.cuh)
 * into out and LSE, launched behind the Hopper kernel. */
#pragma once

#include "tiles.cuh"

namespace
{

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
    const int r = blockIdx.x / s.cl, rank = blockIdx.x % s.cl; /* split tile unit r (sched.cuh) */
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

} // namespace
