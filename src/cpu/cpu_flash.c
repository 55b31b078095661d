/* cpu_flash.c — the CPU flash-attention forward. One task is up to
 * FMHA_CPU_BR (256) query rows of one sequence: positions of one head, or of
 * a small GQA group's heads side by side. It walks the visible keys in blocks
 * of FMHA_CPU_BC (64) with an online softmax, so memory is O(threads x tile).
 * Tasks run under OpenMP and each is computed by one thread in a fixed order:
 * results do not depend on the thread count. The arithmetic and the moves
 * between tensors and tiles are the ISA's micro-kernels (cpu.h). */
#include "../alloc.h"
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { BR = FMHA_CPU_BR, BC = FMHA_CPU_BC };

static const fmha_cpu_ops *const ops_table[FMHA_KERNEL_COUNT] = {
#define FMHA_CPU_KERNEL(name, ...) [FMHA_KERNEL_ID_##name] = &fmha_ops_##name,
#define FMHA_CUDA_KERNEL(name, ...)
#define FMHA_CPU_BWD_KERNEL(name, ...)
#include "../kernels.def"
#undef FMHA_CPU_KERNEL
#undef FMHA_CUDA_KERNEL
#undef FMHA_CPU_BWD_KERNEL
};

static int64_t round_up(int64_t x, int64_t m)
{
    return (x + m - 1) / m * m;
}

static size_t align64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

/* One thread's scratch: the tiles of the task it runs (layouts in cpu.h). */
typedef struct task_scratch {
    void *qt;                    /* Q^T of the task, pack_q's */
    void *kbuf;                  /* a key block, load_k's [BC][dp]; pack_q's tmp before the first */
    void *vbuf;                  /* a value block, load_v's */
    float *st;                   /* scores, then probabilities, then pack_p's P: [BC][BR] */
    float *o;                    /* output accumulator: [BR][dvp] */
    float *m, *l, *alpha;        /* [BR] each */
    int64_t *lo, *hi;            /* [BR] each: the keys each row sees */
    int64_t *row_pos, *row_head; /* [BR] each: query position and head of each row */
} task_scratch;

/* A bump allocator over one thread's slice of the workspace. With base NULL
 * it only counts, so that the calls which carve a slice also size it. */
typedef struct arena {
    char *base;
    size_t used;
} arena;

/* `bytes` at the next multiple of `align` (a power of two, at most the
 * base's alignment of 64). */
static void *arena_take(arena *a, size_t bytes, size_t align)
{
    const size_t at = (a->used + align - 1) & ~(align - 1);
    a->used = at + bytes;
    return a->base ? a->base + at : NULL;
}

/* Every buffer starts on its own cache line. dp, dvp: the padded head dims. */
static void scratch_take(arena *a, const fmha_cpu_ops *ops, int64_t dp, int64_t dvp,
                         task_scratch *s)
{
    enum { LINE = 64 };
    const size_t elem = (size_t)ops->elem;
    s->qt = arena_take(a, (size_t)dp * BR * elem, LINE);
    s->kbuf = arena_take(a, BC * (size_t)dp * elem, LINE);
    s->vbuf = arena_take(a, BC * (size_t)dvp * elem, LINE);
    s->st = arena_take(a, sizeof(float) * BC * BR, LINE);
    s->o = arena_take(a, sizeof(float) * BR * (size_t)dvp, LINE);
    s->m = arena_take(a, sizeof(float) * BR, LINE);
    s->l = arena_take(a, sizeof(float) * BR, LINE);
    s->alpha = arena_take(a, sizeof(float) * BR, LINE);
    s->lo = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->hi = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->row_pos = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->row_head = arena_take(a, sizeof(int64_t) * BR, LINE);
}

/* Bytes of one thread's slice: a multiple of 64, so that every slice starts
 * on a cache line. */
static size_t scratch_size(const fmha_cpu_ops *ops, int64_t dp, int64_t dvp)
{
    arena count = {NULL, 0};
    task_scratch unused;
    scratch_take(&count, ops, dp, dvp, &unused);
    return align64(count.used);
}

void fmha_cpu_workspace_free(fmha_cpu_workspace *ws)
{
    fmha_free(ws->buf);
    ws->buf = NULL;
    ws->size = 0;
}

fmha_status fmha_cpu_workspace_reserve(fmha_cpu_workspace *ws, size_t size)
{
    if (ws->size >= size)
        return FMHA_STATUS_OK;
    void *p = fmha_aligned_alloc(64, size);
    if (!p)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "out of memory reserving %zu bytes of CPU workspace", size);
    fmha_free(ws->buf);
    ws->buf = p;
    ws->size = size;
    return FMHA_STATUS_OK;
}

/* The next block's rows (keys [j, j + n) of the task's KV head, `bytes`
 * each) go to L2 while this one computes: rows of a head sit a whole token
 * apart, too far for the hardware prefetcher. K and V go in two halves so
 * that fewer requests are in flight at once. GCC 12 at -O3 finds this
 * function pure and drops its calls (its build issues no prefetch; clang's
 * does). */
static void prefetch_rows(const fmha_tensor *t, const fmha_cpu_task *tk, int64_t j, int64_t bytes,
                          int64_t n)
{
    for (int64_t r = 0; r < n; r++) {
        const char *row = fmha_row(t, tk->tb, tk->k0 + j + r, tk->hk);
        for (int64_t byte = 0; byte < bytes; byte += 64)
            __builtin_prefetch(row + byte, 0, 2);
    }
}

/* Query heads packed into one task: a KV head's whole group when it is small,
 * so that the group shares every packed K/V block (a decode step reads K and
 * V once per KV head, not once per query head). */
static int64_t heads_per_task(const fmha_problem *pb)
{
    return pb->group <= 16 ? pb->group : 1;
}

/* Task t of head group hg of sequence b: query positions [t * tq, ...) of the
 * heads [hg * P, hg * P + P), P = heads_per_task, tq = BR / P. Row r of the
 * task is position t * tq + r / P of head hg * P + r % P: positions never
 * decrease with r, so each row's visible keys move right with r. Sets tk's
 * geometry and s's rows, their visible keys, o = 0, m = -inf and l = 0. */
static void task_begin(fmha_cpu_task *tk, task_scratch *s, int64_t b, int64_t hg, int64_t t)
{
    const fmha_problem *pb = tk->pb;
    int64_t sk;
    fmha_seq_bounds(pb, b, &tk->q0, &tk->sq, &tk->k0, &sk);
    tk->b = b;
    tk->tb = pb->varlen ? 0 : b;
    const int64_t P = heads_per_task(pb), tq = BR / P, pos0 = t * tq;
    tk->rows = (int)((tk->sq - pos0 < tq ? tk->sq - pos0 : tq) * P);
    tk->hk = hg * P / pb->group;
    for (int r = 0; r < tk->rows; r++) {
        s->row_pos[r] = pos0 + r / P;
        s->row_head[r] = hg * P + r % P;
        fmha_visible_range(pb->cfg, s->row_pos[r], tk->sq, sk, &s->lo[r], &s->hi[r]);
    }
    memset(s->o, 0, sizeof(float) * BR * (size_t)tk->dvp);
    for (int i = 0; i < BR; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
}

/* The rows that see any key of the block [j0, j0 + nj) form one range
 * [*qa, *qb) (the intervals move right with the row); on a mask's edge the
 * rest of the task skips the block. */
static void live_rows(const task_scratch *s, int rows, int64_t j0, int nj, int *qa, int *qb)
{
    int a = 0, b = rows;
    while (a < rows && (s->hi[a] <= j0 || s->lo[a] >= s->hi[a]))
        a++;
    while (b > a && (s->lo[b - 1] >= j0 + nj || s->lo[b - 1] >= s->hi[b - 1]))
        b--;
    *qa = a;
    *qb = b;
}

/* Rows [ia, ib) whose interval does not cover the whole block get -inf
 * outside it; most blocks of a masked problem need none. Key j is seen by
 * the rows [r1, r2): r1 the first with hi > j, r2 the first with lo > j;
 * both only move forward as j grows. */
static void mask_edges(task_scratch *s, int64_t j0, int nj, int ia, int ib)
{
    int r1 = ia, r2 = ia;
    for (int j = 0; j < nj; j++) {
        float *row = s->st + j * BR;
        while (r1 < ib && s->hi[r1] <= j0 + j)
            r1++;
        while (r2 < ib && s->lo[r2] <= j0 + j)
            r2++;
        const int v0 = r1 < r2 ? r1 : r2, v1 = r1 < r2 ? r2 : r1;
        for (int i = ia; i < v0; i++)
            row[i] = -INFINITY;
        for (int i = v1; i < ib; i++)
            row[i] = -INFINITY;
    }
}

/* Drops probabilities of rows [ia, ib) as the shared Philox stream says and
 * scales the kept ones by 1 / (1 - p). */
static void dropout(const fmha_cpu_task *tk, task_scratch *s, int64_t j0, int nj, int ia, int ib)
{
    const fmha_problem *pb = tk->pb;
    const float keep_scale = (float)pb->drop_rescale;
    for (int i = ia; i < ib; i++) {
        for (int j = 0; j < nj; j++) {
            const int64_t col = j0 + j;
            fmha_u32x4 w =
                fmha_dropout_words(pb->args->seed, pb->args->offset,
                                   tk->b * pb->heads + s->row_head[i], s->row_pos[i], col);
            float *p = &s->st[j * BR + i];
            *p = w.v[col & 3] >= pb->drop_threshold ? *p * keep_scale : 0.0f;
        }
    }
}

/* Runs task t of head group hg of sequence b (task_begin) with tk's
 * micro-kernels: Q^T once, then per key block QK^T, softcap, mask, online
 * softmax, dropout and PV, then O / l and the LSE. */
static void run_task(const fmha_cpu_ops *ops, fmha_cpu_task *tk, task_scratch *s, int64_t b,
                     int64_t hg, int64_t t)
{
    const fmha_problem *pb = tk->pb;
    const fmha_config *cfg = pb->cfg;
    task_begin(tk, s, b, hg, t);
    const int rows = tk->rows;
    const int64_t lo_first = s->lo[0], hi_first = s->hi[0];
    const int64_t lo_last = s->lo[rows - 1], hi_last = s->hi[rows - 1];
    const float scale = cfg->softcap > 0 ? 1.0f : (float)(pb->scale * 1.4426950408889634);
    const int64_t kbytes = pb->d * (int64_t)fmha_dtype_size(pb->args->k.dtype);
    const int64_t vbytes = pb->dv * (int64_t)fmha_dtype_size(pb->args->v.dtype);

    ops->pack_q(tk, s->qt, s->kbuf);
    for (int64_t j0 = lo_first; j0 < hi_last; j0 += BC) {
        const int nj = (int)(hi_last - j0 < BC ? hi_last - j0 : BC);
        const int full = lo_last <= j0 && j0 + nj <= hi_first; /* every row sees every key */
        int qa, qb;
        live_rows(s, rows, j0, nj, &qa, &qb);
        if (qa >= qb)
            continue;
        /* The live rows widened to whole vectors: nq queries from qv, of
         * which [qv, ib) are real rows. */
        const int qv = qa / FMHA_CPU_NQ * FMHA_CPU_NQ;
        const int nq = (int)round_up(qb, FMHA_CPU_NQ) - qv;
        const int ib = qv + nq < rows ? qv + nq : rows;
        const void *qt = (const char *)s->qt + (size_t)qv * 4; /* 4-byte cells */
        float *st = s->st + qv, *m = s->m + qv, *l = s->l + qv, *alpha = s->alpha + qv;
        float *o = s->o + (int64_t)qv * tk->dvp;
        const int64_t next = hi_last - (j0 + BC) < BC ? hi_last - (j0 + BC) : BC;

        prefetch_rows(&pb->args->k, tk, j0 + BC, kbytes, next);
        ops->load_k(tk, j0, nj, s->kbuf);
        ops->qk(s->kbuf, tk->dp, nj, nq, qt, pb->d, st);
        if (cfg->softcap > 0)
            ops->softcap(st, nj, nq, (float)pb->scale, (float)cfg->softcap);
        if (!full)
            mask_edges(s, j0, nj, qv, ib);
        ops->softmax(st, nj, nq, scale, m, l, alpha);
        if (pb->drop_threshold)
            dropout(tk, s, j0, nj, qv, ib);
        prefetch_rows(&pb->args->v, tk, j0 + BC, vbytes, next);
        ops->load_v(tk, j0, nj, s->vbuf);
        ops->pack_p(st, nj, nq);
        ops->pv(st, nj, nq, s->vbuf, tk->dvp, alpha, o);
    }
    ops->store(tk, s->o, s->m, s->l);
}

fmha_status fmha_cpu_forward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                             fmha_cpu_workspace *ws)
{
    const fmha_cpu_ops *ops = ops_table[kernel->id];
    const int64_t dp = round_up(pb->d, 2), dvp = round_up(pb->dv, ops->lanes);
    const size_t per_thread = scratch_size(ops, dp, dvp);

    /* Tasks: (sequence, head group, query tile), counts prefix-summed over sequences. */
    const int64_t P = heads_per_task(pb), tq = BR / P, groups = pb->heads / P;
    int64_t *tile_start = fmha_malloc(sizeof(int64_t) * (size_t)(pb->batch + 1));
    if (!tile_start)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory planning CPU tasks");
    tile_start[0] = 0;
    for (int64_t b = 0; b < pb->batch; b++) {
        int64_t q0, sq, k0, sk;
        fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
        tile_start[b + 1] = tile_start[b] + (sq + tq - 1) / tq * groups;
    }
    const int64_t ntasks = tile_start[pb->batch];

    int nthreads = pb->cfg->num_threads;
#ifdef _OPENMP
    if (nthreads <= 0)
        nthreads = omp_get_max_threads();
#else
    nthreads = 1;
#endif
    if (nthreads > ntasks)
        nthreads = ntasks > 0 ? (int)ntasks : 1;
    fmha_status st =
        (size_t)nthreads > SIZE_MAX / per_thread
            ? fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "CPU workspace of %d x %zu bytes overflows",
                             nthreads, per_thread)
            : fmha_cpu_workspace_reserve(ws, per_thread * (size_t)nthreads);
    if (st != FMHA_STATUS_OK) {
        fmha_free(tile_start);
        return st;
    }

#pragma omp parallel num_threads(nthreads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        arena slice = {(char *)ws->buf + per_thread * (size_t)tid, 0};
        task_scratch s;
        scratch_take(&slice, ops, dp, dvp, &s);
        fmha_cpu_task tk = {
            .pb = pb, .dp = dp, .dvp = dvp, .row_pos = s.row_pos, .row_head = s.row_head};
        /* Longest tiles first: with a causal mask later query tiles see more keys. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = ntasks - 1; task >= 0; task--) {
            int64_t lo = 0, hi = pb->batch; /* the sequence holding this task */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (tile_start[mid] <= task)
                    lo = mid;
                else
                    hi = mid;
            }
            int64_t local = task - tile_start[lo];
            run_task(ops, &tk, &s, lo, local % groups, local / groups);
        }
    }
    fmha_free(tile_start);
    return FMHA_STATUS_OK;
}
