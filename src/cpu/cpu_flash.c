/* cpu_flash.c — the CPU flash-attention forward. One task is 64 queries of
 * one (sequence, head); it walks the visible keys in blocks of 64 with an
 * online softmax, so memory is O(threads x tile). Tasks run under OpenMP and
 * each is computed by one thread in a fixed order: results do not depend on
 * the thread count. The arithmetic lives in the per-ISA micro-kernels. */
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { BR = FMHA_CPU_BR, BC = FMHA_CPU_BC };

static const fmha_cpu_ops *const ops_table[FMHA_KERNEL_COUNT] = {
#define FMHA_CPU_KERNEL(name, isa, compute) [FMHA_KERNEL_ID_##name] = &fmha_ops_##name,
#define FMHA_CUDA_KERNEL(name, min_sm)
#include "../kernels.def"
#undef FMHA_CPU_KERNEL
#undef FMHA_CUDA_KERNEL
};

static int64_t round_up(int64_t x, int64_t m)
{
    return (x + m - 1) / m * m;
}

/* One thread's scratch, carved from the layer's workspace. */
typedef struct task_scratch {
    void *qt;      /* Q^T of the task: [d][BR] f32 or [dp/2][BR][2] bf16 */
    void *kbuf;    /* a key block converted/padded: [BC][dp] */
    void *vbuf;    /* a value block: [BC][dvp] f32 or [BC/2][dvp][2] bf16 */
    float *st;     /* scores, then probabilities: [BC][BR] */
    uint16_t *p2;  /* probabilities as bf16 pairs: [BC/2][BR][2] */
    float *o;      /* output accumulator: [BR][dvp] */
    float *m, *l, *alpha; /* [BR] each */
    int64_t *lo, *hi;     /* [BR] each: the keys each query sees */
    int64_t *row_pos, *row_head; /* [BR] each: query position and head of each row */
} task_scratch;

typedef struct layout {
    int64_t dp, dvp;    /* padded head dims */
    size_t per_thread;  /* bytes of one thread's scratch, a multiple of 64 */
} layout;

static size_t align64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

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

/* Every buffer starts on its own cache line. */
static void scratch_take(arena *a, const fmha_cpu_ops *ops, const layout *L, task_scratch *s)
{
    enum { LINE = 64 };
    const size_t elem = ops->bf16dp ? 2 : 4, dp = (size_t)L->dp, dvp = (size_t)L->dvp;
    s->qt = arena_take(a, dp * BR * elem, LINE);
    s->kbuf = arena_take(a, BC * dp * elem, LINE);
    s->vbuf = arena_take(a, BC * dvp * elem, LINE);
    s->st = arena_take(a, sizeof(float) * BC * BR, LINE);
    s->p2 = arena_take(a, sizeof(uint16_t) * BC * BR, LINE);
    s->o = arena_take(a, sizeof(float) * BR * dvp, LINE);
    s->m = arena_take(a, sizeof(float) * BR, LINE);
    s->l = arena_take(a, sizeof(float) * BR, LINE);
    s->alpha = arena_take(a, sizeof(float) * BR, LINE);
    s->lo = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->hi = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->row_pos = arena_take(a, sizeof(int64_t) * BR, LINE);
    s->row_head = arena_take(a, sizeof(int64_t) * BR, LINE);
}

static void plan_layout(const fmha_problem *pb, const fmha_cpu_ops *ops, layout *L)
{
    L->dp = round_up(pb->d, 2);
    L->dvp = round_up(pb->dv, ops->lanes);
    arena count = {NULL, 0};
    task_scratch unused;
    scratch_take(&count, ops, L, &unused);
    L->per_thread = align64(count.used);
}

void fmha_cpu_workspace_free(fmha_cpu_workspace *ws)
{
    free(ws->buf);
    ws->buf = NULL;
    ws->size = 0;
}

static fmha_status workspace_reserve(fmha_cpu_workspace *ws, size_t size)
{
    if (ws->size >= size)
        return FMHA_STATUS_OK;
    void *p = aligned_alloc(64, align64(size));
    if (!p)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "out of memory reserving %zu bytes of CPU workspace", size);
    free(ws->buf);
    ws->buf = p;
    ws->size = size;
    return FMHA_STATUS_OK;
}


/* The next block's rows head for L2 while this one computes: rows of a head
 * sit a whole token apart, too far for the hardware prefetcher. K and V go
 * in two halves so that fewer requests are in flight at once. */
static void prefetch_rows(const fmha_tensor *t, int64_t tb, int64_t s0, int64_t h, int64_t bytes,
                          int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        const char *r = fmha_row(t, tb, s0 + j, h);
        for (int64_t byte = 0; byte < bytes; byte += 64)
            __builtin_prefetch(r + byte, 0, 2);
    }
}

/* Q^T of the task's rows (s->row_pos/row_head, positions from token q0):
 * zero past `rows` and past d. Rows go 16 at a time so that each store fills
 * whole cache lines of Q^T. */
static void pack_q(const fmha_problem *pb, const fmha_cpu_ops *ops, const layout *L, int64_t b,
                   int64_t tb, int64_t q0, int rows, task_scratch *s)
{
    enum { G = 16 };
    const fmha_tensor *q = &pb->args->q;
    const int64_t d = pb->d;
    if (ops->bf16dp) {
        uint32_t *qt = s->qt; /* [dp/2][BR] bf16 pairs as 32-bit words */
        memset(qt, 0, (size_t)L->dp * BR * 2);
        for (int i0 = 0; i0 < rows; i0 += G) {
            const int n = rows - i0 < G ? rows - i0 : G;
            uint16_t *tmp = s->kbuf; /* idle until the first key block: [G][dp] */
            for (int i = 0; i < n; i++) {
                memcpy(tmp + i * L->dp,
                       fmha_row(q, tb, q0 + s->row_pos[i0 + i], s->row_head[i0 + i]), (size_t)d * 2);
                if (d < L->dp)
                    tmp[i * L->dp + d] = 0;
            }
            for (int64_t cp = 0; cp < L->dp / 2; cp++)
                for (int i = 0; i < n; i++)
                    memcpy(&qt[cp * BR + i0 + i], tmp + i * L->dp + 2 * cp, 4);
        }
        return;
    }
    float *qt = s->qt;
    memset(qt, 0, (size_t)d * BR * 4);
    for (int i0 = 0; i0 < rows; i0 += G) {
        const int n = rows - i0 < G ? rows - i0 : G;
        float *tmp = s->kbuf; /* [G][dp] */
        for (int i = 0; i < n; i++) {
            const int64_t tok = q0 + s->row_pos[i0 + i], h = s->row_head[i0 + i];
            ops->to_f32(tmp + i * L->dp, fmha_row(q, tb, tok, h), q->dtype, d,
                       fmha_row_descale(pb, 0, b, tok, h));
        }
        for (int64_t c = 0; c < d; c++)
            for (int i = 0; i < n; i++)
                qt[c * BR + i0 + i] = tmp[i * L->dp + c];
    }
}

/* Query heads packed into one task: a KV head's whole group when it is small,
 * so that the group shares every packed K/V block (a decode step reads K and
 * V once per KV head, not once per query head). */
static int64_t heads_per_task(const fmha_problem *pb)
{
    return pb->group <= 16 ? pb->group : 1;
}

/* Runs one task of sequence b: query positions [t * tq, ...) of the heads
 * [hg * P, hg * P + P), P = heads_per_task, tq = BR / P. Row r of the task is
 * position t * tq + r / P of head hg * P + r % P: positions never decrease
 * with r, so each row's visible keys still move right with r. */
static void run_task(const fmha_problem *pb, const fmha_cpu_ops *ops, const layout *L, int64_t b,
                     int64_t hg, int64_t t, task_scratch *s)
{
    const fmha_forward_args *a = pb->args;
    const fmha_config *cfg = pb->cfg;
    int64_t q0, sq, k0, sk;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    const int64_t tb = pb->varlen ? 0 : b; /* tensor batch index */
    const int64_t P = heads_per_task(pb), tq = BR / P;
    const int64_t pos0 = t * tq;
    const int rows = (int)((sq - pos0 < tq ? sq - pos0 : tq) * P);
    const int64_t hk = hg * P / pb->group;
    for (int r = 0; r < rows; r++) {
        s->row_pos[r] = pos0 + r / P;
        s->row_head[r] = hg * P + r % P;
    }

    pack_q(pb, ops, L, b, tb, q0, rows, s);
    memset(s->o, 0, (size_t)BR * L->dvp * 4);
    for (int i = 0; i < BR; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }

    /* Keys visible to each row; the intervals move right with i. */
    for (int i = 0; i < rows; i++)
        fmha_visible_range(cfg, s->row_pos[i], sq, sk, &s->lo[i], &s->hi[i]);
    const int64_t lo_first = s->lo[0], hi_first = s->hi[0];
    const int64_t lo_last = s->lo[rows - 1], hi_last = s->hi[rows - 1];

    const float scale = cfg->softcap > 0 ? 1.0f : (float)(pb->scale * 1.4426950408889634);
    const int64_t kes = (int64_t)fmha_dtype_size(a->k.dtype);
    const int64_t ves = (int64_t)fmha_dtype_size(a->v.dtype);
    const int64_t vs = a->v.stride_seq;

    for (int64_t j0 = lo_first; j0 < hi_last; j0 += BC) {
        const int nj = (int)(hi_last - j0 < BC ? hi_last - j0 : BC);
        const int full = lo_last <= j0 && j0 + nj <= hi_first; /* every row sees every key */

        /* The queries that see any key of this block form one range (the
         * intervals move right with i); on a mask's edge the rest of the
         * task skips the block, whole vectors at a time. */
        int qa = 0, qb = rows;
        if (!full) {
            while (qa < rows && (s->hi[qa] <= j0 || s->lo[qa] >= s->hi[qa]))
                qa++;
            while (qb > qa && (s->lo[qb - 1] >= j0 + nj || s->lo[qb - 1] >= s->hi[qb - 1]))
                qb--;
        }
        if (qa >= qb)
            continue;
        const int qv = qa / FMHA_CPU_NQ * FMHA_CPU_NQ; /* first live query, vector aligned */
        const int nqb = (int)round_up(qb, FMHA_CPU_NQ) - qv;
        float *st = s->st + qv;
        const void *qt = ops->bf16dp ? (const void *)((const uint16_t *)s->qt + 2 * qv)
                                     : (const void *)((const float *)s->qt + qv);
        float *m = s->m + qv, *l = s->l + qv, *alpha = s->alpha + qv;
        float *o = s->o + (int64_t)qv * L->dvp;
        const int ia = qv, ib = qv + nqb < rows ? qv + nqb : rows; /* real rows in play */

        const int64_t next = hi_last - (j0 + BC) < BC ? hi_last - (j0 + BC) : BC;
        prefetch_rows(&a->k, tb, k0 + j0 + BC, hk, pb->d * kes, next);
        /* Key rows are copied into a dense block: rows a token apart alias in
         * L1 and the copy costs less than the misses. */
        if (ops->bf16dp) {
            uint16_t *kb = s->kbuf;
            for (int j = 0; j < nj; j++) {
                memcpy(kb + j * L->dp, fmha_row(&a->k, tb, k0 + j0 + j, hk), (size_t)pb->d * 2);
                if (pb->d < L->dp) /* odd head dim: the pair's second half is 0 */
                    kb[j * L->dp + pb->d] = 0;
            }
        } else {
            float *kb = s->kbuf;
            for (int j = 0; j < nj; j++)
                ops->to_f32(kb + j * L->dp, fmha_row(&a->k, tb, k0 + j0 + j, hk), a->k.dtype,
                           pb->d, fmha_row_descale(pb, 1, b, k0 + j0 + j, hk));
        }
        ops->qk(s->kbuf, L->dp, nj, nqb, qt, ops->bf16dp ? L->dp : pb->d, st);

        if (cfg->softcap > 0)
            ops->softcap(st, nj, nqb, (float)pb->scale, (float)cfg->softcap);

        /* Rows whose interval does not cover the whole block get -inf
         * outside it; most blocks of a masked problem need none. */
        if (!full) {
            /* Key j is seen by the rows [r1, r2): r1 the first with hi > j, r2
             * the first with lo > j; both only move forward as j grows. */
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

        ops->softmax(st, nj, nqb, scale, m, l, alpha);

        if (pb->drop_threshold) {
            const float keep_scale = (float)pb->drop_rescale;
            for (int i = ia; i < ib; i++) {
                for (int j = 0; j < nj; j++) {
                    int64_t col = j0 + j;
                    fmha_u32x4 w = fmha_dropout_words(a->seed, a->offset,
                                                      b * pb->heads + s->row_head[i],
                                                      s->row_pos[i], col);
                    float *p = &s->st[j * BR + i];
                    *p = w.v[col & 3] >= pb->drop_threshold ? *p * keep_scale : 0.0f;
                }
            }
        }

        prefetch_rows(&a->v, tb, k0 + j0 + BC, hk, pb->dv * ves, next);
        if (ops->bf16dp) {
            ops->pack_p(st, nj, nqb, s->p2 + 2 * qv);
            ops->pack_v((const uint16_t *)fmha_row(&a->v, tb, k0 + j0, hk), vs, nj, pb->dv, L->dvp,
                        s->vbuf);
            ops->pv(s->p2 + 2 * qv, nj, nqb, s->vbuf, L->dvp, L->dvp, alpha, o);
        } else {
            float *vb = s->vbuf;
            for (int j = 0; j < nj; j++) {
                ops->to_f32(vb + j * L->dvp, fmha_row(&a->v, tb, k0 + j0 + j, hk),
                           a->v.dtype, pb->dv, fmha_row_descale(pb, 2, b, k0 + j0 + j, hk));
                for (int64_t c = pb->dv; c < L->dvp; c++)
                    vb[j * L->dvp + c] = 0.0f;
            }
            ops->pv(st, nj, nqb, vb, L->dvp, L->dvp, alpha, o);
        }
    }

    /* Normalise and store; rows that saw no key are 0 with LSE -inf. */
    const fmha_tensor *out = &a->out;
    for (int i = 0; i < rows; i++) {
        const float l = s->l[i];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int64_t pos = s->row_pos[i], h = s->row_head[i];
        char *orow = fmha_row(out, tb, q0 + pos, h);
        const float *acc = s->o + (int64_t)i * L->dvp;
        if (out->dtype == FMHA_DTYPE_F32) {
            for (int64_t c = 0; c < pb->dv; c++)
                ((float *)orow)[c] = acc[c] * inv;
        } else {
            for (int64_t c = 0; c < pb->dv; c++)
                fmha_store_f32(orow, out->dtype, c, acc[c] * inv);
        }
        if (a->lse) {
            int64_t idx = pb->varlen ? h * a->q.seqlen + q0 + pos : (b * pb->heads + h) * sq + pos;
            a->lse[idx] = l > 0.0f ? (float)((s->m[i] + log2((double)l)) * 0.6931471805599453)
                                   : -INFINITY;
        }
    }
}

fmha_status fmha_cpu_forward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                             fmha_cpu_workspace *ws)
{
    const fmha_cpu_ops *ops = ops_table[kernel->id];
    layout L;
    plan_layout(pb, ops, &L);

    /* Tasks: (sequence, head group, query tile), counts prefix-summed over sequences. */
    const int64_t P = heads_per_task(pb), tq = BR / P, groups = pb->heads / P;
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(pb->batch + 1));
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
    fmha_status st = (size_t)nthreads > SIZE_MAX / L.per_thread
                         ? fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                          "CPU workspace of %d x %zu bytes overflows", nthreads,
                                          L.per_thread)
                         : workspace_reserve(ws, L.per_thread * (size_t)nthreads);
    if (st != FMHA_STATUS_OK) {
        free(tile_start);
        return st;
    }

#pragma omp parallel num_threads(nthreads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        arena slice = {(char *)ws->buf + L.per_thread * (size_t)tid, 0};
        task_scratch s;
        scratch_take(&slice, ops, &L, &s);
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
            run_task(pb, ops, &L, lo, local % groups, local / groups, &s);
        }
    }
    free(tile_start);
    return FMHA_STATUS_OK;
}
