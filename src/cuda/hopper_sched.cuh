/* hopper_sched.cuh — how the Hopper kernel (cuda_hopper.cu) deals its query
 * tiles to blocks: integer arithmetic only, the same on the host (plan, and
 * tests/test_hopper_sched.cu, which checks it on every kind of launch without
 * a GPU) and on the device (the kernel's piece walk and the merge).
 *
 * The work of one launch: T = tiles_x x heads x batch query tiles of BM rows,
 * tile tau being query block tiles_x - 1 - tau % tiles_x (from the end: under
 * a causal mask the longest first) of head tau / tiles_x % heads, sequence
 * tau / (tiles_x heads), run by `ctas` blocks.
 *   Data-parallel rounds: block c runs tiles c, c + ctas, ... below dp_tiles.
 *   Split tail (sk_tiles > 0, every tile n key tiles long): the last sk_tiles
 *   tiles, fewer than one per block, are cut along their keys. Their
 *   sk_tiles * n key tiles are dealt out as ctas contiguous ranges, one per
 *   block, so that the blocks end together instead of the last round running
 *   on a fraction of the SMs. A range, shorter than a tile, touches at most
 *   two tiles; a piece that is not a whole tile writes O / l (f32) and its
 *   log2 LSE to slot 2 c + (0 for the block's first piece, 1 for its second),
 *   and the merge (combine_kernel) adds up each split tile's pieces. */
#pragma once

#include "cuda_common.cuh" /* fmha_schedule, min64 */

#include <stdint.h>

namespace fmha_cuda {

/* The most blocks a split tail is dealt to, so the most pieces a tile has. */
constexpr int SCHED_MAX_SPLIT_BLOCKS = 256;

struct hopper_sched {
    int ctas, dp_rounds, dp_tiles, sk_tiles, tiles_x, n;
    int part_ld;              /* floats per partial row: the kernel's D, a multiple of 8 */
    float *part_o, *part_lse; /* [2 ctas][BM][part_ld], [2 ctas][BM] */
};

/* Key tiles [t_lo, t_hi) of query tile `tile` (t_hi < 0: all of them), to
 * partial slot `slot` (< 0: to the output). The schedule's numbers fit 32
 * bits (sched_plan), which keeps the kernel's producer within 24 registers. */
struct segment {
    int tile, t_lo, t_hi, slot;
};

/* The first split-tail key tile of block c's range. */
__host__ __device__ __forceinline__ int sk_start(const hopper_sched &s, int c)
{
    return (int)((uint32_t)c * (uint32_t)(s.sk_tiles * s.n) / (uint32_t)s.ctas);
}

/* The block whose range holds split-tail key tile u. */
__host__ __device__ __forceinline__ int sk_block_of(const hopper_sched &s, int u)
{
    const uint32_t units = (uint32_t)(s.sk_tiles * s.n);
    return (int)(((uint32_t)(u + 1) * (uint32_t)s.ctas + units - 1) / units) - 1;
}

/* Block c's piece number `item`; false past its last. */
__host__ __device__ __forceinline__ bool next_segment(const hopper_sched &s, int c, int item, segment &g)
{
    if (item < s.dp_rounds) {
        g.tile = c + item * s.ctas;
        g.t_lo = 0, g.t_hi = -1, g.slot = -1;
        return g.tile < s.dp_tiles;
    }
    const int j = item - s.dp_rounds;
    if (j > 1 || s.sk_tiles == 0)
        return false;
    const int lo = sk_start(s, c), hi = sk_start(s, c + 1);
    const int u = j == 0 ? lo : (int)((uint32_t)lo / (uint32_t)s.n + 1) * s.n;
    if (u >= hi)
        return false;
    const int r = (int)((uint32_t)u / (uint32_t)s.n);
    g.tile = s.dp_tiles + r;
    g.t_lo = u - r * s.n;
    const int end = hi - r * s.n; /* the range's end, counted from the tile's first key tile */
    g.t_hi = end < s.n ? end : s.n;
    g.slot = g.t_lo == 0 && g.t_hi == s.n ? -1 : 2 * c + j;
    return true;
}

/* The blocks [c1, c2] whose ranges touch split tile r: one block (c1 == c2)
 * means the tile was run whole and needs no merge. */
__host__ __device__ __forceinline__ void split_blocks(const hopper_sched &s, int r, int &c1, int &c2)
{
    c1 = sk_block_of(s, r * s.n);
    c2 = sk_block_of(s, (r + 1) * s.n - 1);
}

/* The slot of block c's piece of split tile r: its first (2 c) if its range
 * starts in r, else its second; -1 for a block whose range is empty. */
__host__ __device__ __forceinline__ int piece_slot(const hopper_sched &s, int c, int r)
{
    const int lo = sk_start(s, c);
    if (sk_start(s, c + 1) == lo)
        return -1;
    return 2 * c + ((uint32_t)lo / (uint32_t)s.n == (uint32_t)r ? 0 : 1);
}

/* The schedule of `tiles` query tiles of n key tiles each for `resident`
 * blocks at a time. Tiles that differ in length (`uniform` false: causal,
 * windowed or packed) keep one block per tile: the GPU's own block scheduler
 * balances them. ctas = -1: more tiles than 32-bit tile numbers allow. */
inline hopper_sched sched_plan(int64_t tiles, int64_t tiles_x, int64_t n, int resident, bool uniform,
                               fmha_schedule mode)
{
    hopper_sched s = {};
    if (tiles > INT32_MAX / 2) {
        s.ctas = -1;
        return s;
    }
    s.tiles_x = (int)tiles_x;
    if (!uniform || mode == FMHA_SCHEDULE_TILES || resident < 1) {
        s.ctas = (int)tiles;
        s.dp_rounds = 1;
        s.dp_tiles = (int)tiles;
        return s;
    }
    const int64_t rounds = tiles / resident, rest = tiles % resident;
    if (mode == FMHA_SCHEDULE_SPLIT && rest > 0 && 5 * rest <= 4 * resident && n >= 4 &&
        resident <= SCHED_MAX_SPLIT_BLOCKS && rest * n * (resident + 1) <= INT32_MAX) {
        /* Split the tail when its round would leave a fifth of the SMs or more idle. */
        s.ctas = resident;
        s.dp_rounds = (int)rounds;
        s.dp_tiles = (int)(rounds * resident);
        s.sk_tiles = (int)rest;
        s.n = (int)n;
    } else {
        s.ctas = (int)min64(tiles, resident);
        s.dp_rounds = (int)((tiles + s.ctas - 1) / s.ctas);
        s.dp_tiles = (int)tiles;
    }
    return s;
}

} // namespace fmha_cuda
