/* test_hopper_sched.cu — the Hopper kernel's tile schedule (src/cuda/
 * hopper/sched.cuh), checked on the host without a GPU: on edge-case, model
 * and random launches under every mode, every key tile of every query tile
 * runs exactly once, whole tiles go straight to the output, split pieces get
 * slots of their own, the merge finds exactly the pieces of each split
 * tile, and the two blocks of a cluster run neighbouring tiles of one head
 * over the same keys in step (they share each K/V load). */
#include "cuda/hopper/sched.cuh"

#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

using namespace fmha_cuda;

static int passed, failed;

#define CHECK(cond, ...)                                \
    do {                                                \
        if (cond) {                                     \
            passed++;                                   \
        } else if (++failed <= 20) {                    \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

static const char *mode_name(fmha_schedule m)
{
    return m == FMHA_SCHEDULE_TILES        ? "tiles"
           : m == FMHA_SCHEDULE_PERSISTENT ? "persistent"
                                           : "split";
}

/* One launch of `tiles` query tiles (tiles_x per head) of n key tiles each
 * on `resident` blocks, in clusters of cl. */
static void check_launch(int64_t tiles, int64_t n, int resident, bool uniform, fmha_schedule mode,
                         int cl = 1, int64_t tiles_x = 7)
{
    char what[200];
    snprintf(what, sizeof what,
             "tiles %lld (%lld per head), key tiles %lld, resident %d, %s, %s, cluster %d",
             (long long)tiles, (long long)tiles_x, (long long)n, resident,
             uniform ? "uniform" : "ragged", mode_name(mode), cl);
    const hopper_sched s = sched_plan(tiles, tiles_x, n, resident, uniform, mode, cl);
    if (tiles > INT32_MAX / 2) {
        CHECK(s.ctas == -1, "%s: %d blocks, want the refusal (-1)", what, s.ctas);
        return;
    }
    const int64_t units = tiles / cl, resident_units = resident / cl;
    const bool dealt = uniform && mode != FMHA_SCHEDULE_TILES && resident_units >= 1;
    CHECK(s.cl == cl && (dealt ? s.ctas >= 1 && s.ctas <= resident_units : s.ctas == units),
          "%s: %d units of %d blocks", what, s.ctas, s.cl);
    CHECK(s.sk_tiles == 0 || (mode == FMHA_SCHEDULE_SPLIT && dealt && s.sk_tiles < s.ctas &&
                              s.ctas <= SCHED_MAX_SPLIT_BLOCKS && s.n == n),
          "%s: %d split tile units on %d block units", what, s.sk_tiles, s.ctas);
    CHECK(s.dp_tiles + s.sk_tiles == units, "%s: %d whole + %d split tile units", what, s.dp_tiles,
          s.sk_tiles);

    const int blocks = s.ctas * cl;
    std::vector<uint8_t> runs((size_t)(tiles * n), 0);
    std::vector<int> slot_tile((size_t)(2 * blocks), -1); /* the tile whose piece a slot holds */
    std::vector<std::vector<segment>> walk((size_t)blocks);
    int bad = 0;
    for (int c = 0; c < blocks; c++) {
        segment g;
        int items = 0;
        for (int item = 0; next_segment(s, c, item, g); item++) {
            items++;
            walk[c].push_back(g);
            const int lo = g.t_hi < 0 ? 0 : g.t_lo, hi = g.t_hi < 0 ? (int)n : g.t_hi;
            if (g.tile < 0 || g.tile >= tiles || lo < 0 || lo >= hi || hi > n) {
                bad++;
                continue;
            }
            for (int t = lo; t < hi; t++)
                runs[(size_t)g.tile * n + t]++;
            if (g.slot < 0) {
                bad += lo != 0 || hi != n; /* straight to the output: whole tiles only */
            } else {
                bad += g.slot / 2 != c || g.tile < s.dp_tiles * cl || (lo == 0 && hi == n) ||
                       slot_tile[g.slot] != -1;
                slot_tile[g.slot] = g.tile;
            }
        }
        bad += items > s.dp_rounds + 2;
    }
    CHECK(bad == 0, "%s: %d malformed pieces", what, bad);
    /* A cluster's blocks: tiles 2 u and 2 u + 1 of one head, the same keys, in step. */
    int apart = 0;
    for (int c = 0; cl == 2 && c < blocks; c += 2) {
        apart += walk[c].size() != walk[c + 1].size();
        for (size_t i = 0; i < walk[c].size() && i < walk[c + 1].size(); i++) {
            const segment &a = walk[c][i], &b = walk[c + 1][i];
            apart += a.tile % 2 != 0 || b.tile != a.tile + 1 ||
                     a.tile / tiles_x != b.tile / tiles_x || a.t_lo != b.t_lo || a.t_hi != b.t_hi ||
                     (a.slot < 0) != (b.slot < 0);
        }
    }
    CHECK(apart == 0, "%s: %d pieces where a cluster's blocks part", what, apart);
    const int64_t once = std::count(runs.begin(), runs.end(), 1);
    CHECK(once == tiles * n, "%s: %lld of %lld key tiles run exactly once", what, (long long)once,
          (long long)(tiles * n));

    /* The merge: blocks [c1, c2] touch split tile r; their piece_slot()s are
     * exactly the slots the pieces were written to. */
    int merge_bad = 0;
    for (int x = 0; x < s.sk_tiles * cl; x++) { /* split tile x: unit r, rank x % cl */
        const int r = x / cl, rank = x % cl;
        int c1, c2;
        split_blocks(s, r, c1, c2);
        std::vector<int> found, written;
        for (int c = c1; c <= c2; c++)
            if (piece_slot(s, c * cl + rank, r) >= 0)
                found.push_back(piece_slot(s, c * cl + rank, r));
        for (int k = 0; k < 2 * blocks; k++)
            if (slot_tile[k] == s.dp_tiles * cl + x)
                written.push_back(k);
        std::sort(found.begin(), found.end());
        merge_bad += c1 < 0 || c2 >= s.ctas || c1 > c2;
        merge_bad += c1 == c2 ? !written.empty() : (found != written || written.size() < 2);
    }
    CHECK(merge_bad == 0, "%s: the merge misses the pieces of %d split tiles", what, merge_bad);
}

int main(void)
{
    const fmha_schedule modes[] = {FMHA_SCHEDULE_TILES, FMHA_SCHEDULE_PERSISTENT,
                                   FMHA_SCHEDULE_SPLIT};
    /* The H200's 132 SMs on model shapes (bench/bench_cuda.py, 128-row and
     * 128-key tiles): Flux, FA3 grid d128, Wan 480p, cross-attention. */
    const int64_t models[][2] = {{864, 36}, {2048, 128}, {10240, 256}, {10240, 4}};
    for (auto &m : models)
        for (fmha_schedule mode : modes)
            for (int uniform = 0; uniform < 2; uniform++)
                check_launch(m[0], m[1], 132, uniform, mode);
    /* Edges: one tile, one key tile, fewer tiles than blocks, a tail of one
     * tile over many blocks (ranges shorter than a key tile, empty ranges),
     * the most blocks a split may have and one more, no resident count. */
    const int64_t edges[][3] = {{1, 1, 132},    {1, 4, 132},    {1, 200, 256}, {5, 3, 132},
                                {133, 4, 132},  {133, 5, 132},  {239, 9, 132}, {265, 1000, 132},
                                {300, 50, 256}, {300, 50, 257}, {7, 7, 1},     {50, 6, 0}};
    for (auto &e : edges)
        for (fmha_schedule mode : modes)
            check_launch(e[0], e[1], (int)e[2], true, mode);
    /* A split whose numbers would pass 32 bits falls back to whole tiles; past
     * 2^30 tiles the launch is refused. */
    check_launch(100, 200000, 132, true, FMHA_SCHEDULE_SPLIT);
    check_launch((int64_t)1 << 31, 4, 132, true, FMHA_SCHEDULE_SPLIT);
    /* Random launches. */
    uint64_t x = 20261203;
    auto next = [&](uint64_t m) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        return (int64_t)((x >> 33) % m);
    };
    for (int i = 0; i < 4000; i++)
        check_launch(1 + next(700), 1 + next(150), (int)next(300), next(4) != 0, modes[next(3)]);
    /* Clusters of two: an even number of tiles per head. */
    for (auto &m : models)
        for (fmha_schedule mode : modes)
            check_launch(m[0], m[1], 132, true, mode, 2, m[0] == 864 ? 36 : 128);
    for (int i = 0; i < 4000; i++) {
        const int64_t tiles_x = 2 * (1 + next(20));
        check_launch(tiles_x * (1 + next(40)), 1 + next(150), (int)next(300), next(4) != 0,
                     modes[next(3)], 2, tiles_x);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
