/* sched.cuh — how the Hopper kernel (src/cuda/hopper/) deals its query
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
 *   and the merge (combine_kernel) adds up each split tile's pieces.
 * Clusters (cl = 2): the blocks of a cluster share each K/V load (TMA
 * multicast), so they must run neighbouring query tiles of one head over the
 * same keys in step. The schedule above is then made for units of cl tiles
 * (tiles_x even: a unit never straddles two heads) and units of cl blocks:
 * `ctas`, `dp_tiles` and `sk_tiles` count units, block c is rank c % cl of
 * unit c / cl and runs tile cl u + c % cl of every tile unit u its unit runs,
 * over the same keys. Slots stay per block: 2 c + j. */
#pragma once

#include "../cuda_common.cuh" /* fmha_schedule, min64 */

#include <stdint.h>

namespace fmha_cuda
{

/* The most blocks a split tail is dealt to, so the most pieces a tile has. */
constexpr int SCHED_MAX_SPLIT_BLOCKS = 256;

struct hopper_sched {
    int ctas, dp_rounds, dp_tiles, sk_tiles, tiles_x, n; /* in units of cl (above) */
    int cl;                   /* blocks per cluster: 1, or 2 sharing K/V loads */
    int part_ld;              /* floats per partial row: the kernel's D, a multiple of 8 */
    float *part_o, *part_lse; /* [2 cl ctas][BM][part_ld], [2 cl ctas][BM] */
};

/* Key tiles [t_lo, t_hi) of query tile `tile` (t_hi < 0: all of them), to
 * partial slot `slot` (< 0: to the output). The schedule's numbers fit 32
 * bits (sched_plan), which keeps the kernel's producer within 24 registers. */
struct segment {
    int tile, t_lo, t_hi, slot;
};

/* The first split-tail key tile of unit c's range. */
__host__ __device__ __forceinline__ int sk_start(const hopper_sched &s, int c)
{
    return (int)((uint32_t)c * (uint32_t)(s.sk_tiles * s.n) / (uint32_t)s.ctas);
}

/* The unit whose range holds split-tail key tile u. */
__host__ __device__ __forceinline__ int sk_block_of(const hopper_sched &s, int u)
{
    const uint32_t units = (uint32_t)(s.sk_tiles * s.n);
    return (int)(((uint32_t)(u + 1) * (uint32_t)s.ctas + units - 1) / units) - 1;
}

/* Block b's piece number `item`; false past its last. */
__host__ __device__ __forceinline__ bool next_segment(const hopper_sched &s, int b, int item,
                                                      segment &g)
{
    const int c = s.cl == 1 ? b : b / s.cl, rank = s.cl == 1 ? 0 : b % s.cl;
    if (item < s.dp_rounds) {
        const int unit = c + item * s.ctas;
        g.tile = unit * s.cl + rank;
        g.t_lo = 0, g.t_hi = -1, g.slot = -1;
        return unit < s.dp_tiles;
    }
    const int j = item - s.dp_rounds;
    if (j > 1 || s.sk_tiles == 0)
        return false;
    const int lo = sk_start(s, c), hi = sk_start(s, c + 1);
    const int u = j == 0 ? lo : (int)((uint32_t)lo / (uint32_t)s.n + 1) * s.n;
    if (u >= hi)
        return false;
    const int r = (int)((uint32_t)u / (uint32_t)s.n);
    g.tile = (s.dp_tiles + r) * s.cl + rank;
    g.t_lo = u - r * s.n;
    const int end = hi - r * s.n; /* the range's end, counted from the tile's first key tile */
    g.t_hi = end < s.n ? end : s.n;
    g.slot = g.t_lo == 0 && g.t_hi == s.n ? -1 : 2 * b + j;
    return true;
}

/* The units [c1, c2] whose ranges touch split tile unit r: one (c1 == c2)
 * means its tiles were run whole and need no merge. */
__host__ __device__ __forceinline__ void split_blocks(const hopper_sched &s, int r, int &c1,
                                                      int &c2)
{
    c1 = sk_block_of(s, r * s.n);
    c2 = sk_block_of(s, (r + 1) * s.n - 1);
}

/* The slot of block b's piece of split tile unit r: its first (2 b) if its
 * unit's range starts in r, else its second; -1 where that range is empty. */
__host__ __device__ __forceinline__ int piece_slot(const hopper_sched &s, int b, int r)
{
    const int c = s.cl == 1 ? b : b / s.cl;
    const int lo = sk_start(s, c);
    if (sk_start(s, c + 1) == lo)
        return -1;
    return 2 * b + ((uint32_t)lo / (uint32_t)s.n == (uint32_t)r ? 0 : 1);
}

/* The schedule of `tiles` query tiles of n key tiles each for `resident`
 * blocks at a time, in clusters of cl blocks (1, or 2 where tiles_x is even
 * and resident a multiple of 2: callers check). Tiles that differ in length
 * (`uniform` false: causal, windowed or packed) keep one block per tile: the
 * GPU's own block scheduler balances them. ctas = -1: more tiles than 32-bit
 * tile numbers allow. */
inline hopper_sched sched_plan(int64_t tiles, int64_t tiles_x, int64_t n, int resident,
                               bool uniform, fmha_schedule mode, int cl = 1)
{
    hopper_sched s = {};
    if (tiles > INT32_MAX / 2) {
        s.ctas = -1;
        return s;
    }
    s.tiles_x = (int)tiles_x;
    s.cl = cl;
    tiles /= cl; /* from here on, units of cl tiles and of cl blocks */
    resident /= cl;
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
