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
#include "../kernels.def"
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

/* Query heads packed into one task: a KV head's whole group when it is small,
 * or when all its queries fit one task (decode: MQA's 32 heads of one
 * query), so that the group shares every packed K/V block (a decode step
 * reads K and V once per KV head, not once per query head). */
static int64_t heads_per_task(const fmha_problem *pb)
{
    return pb->group <= 16 || pb->group * pb->max_sq <= BR ? pb->group : 1;
}

/* How a call's query rows become tasks. A head group is P query heads
 * (heads_per_task); a task holds a query tile of tq positions of one head
 * group or, in a decode call whose groups are a few rows each, `slots` head
 * groups side by side, each in `width` rows (a multiple of FMHA_CPU_NQ).
 * With slots, one task walks the keys of several KV heads block by block, so
 * that the cache rows of one token, which sit side by side, are read
 * together rather than by different tasks at different times. */
typedef struct task_layout {
    int64_t P, tq, groups;
    int64_t slots, width;
    int64_t group_tasks; /* tasks over one tile's head groups: ceil(groups / slots) */
} task_layout;

static task_layout layout_of(const fmha_problem *pb)
{
    task_layout L = {.P = heads_per_task(pb), .slots = 1, .width = BR};
    L.tq = BR / L.P;
    L.groups = pb->heads / L.P;
    if (pb->kv_cache && L.P * pb->max_sq * 2 <= BR) { /* one tile per sequence */
        const int64_t width = round_up(L.P * pb->max_sq, FMHA_CPU_NQ);
        const int64_t slots = BR / width < L.groups ? BR / width : L.groups;
        if (slots > 1) {
            L.slots = slots;
            L.width = width;
        }
    }
    L.group_tasks = (L.groups + L.slots - 1) / L.slots;
    return L;
}

/* s from row r0 on: the view of one slot's rows. kbuf and vbuf are shared. */
static task_scratch rows_from(const task_scratch *s, int r0, int64_t dvp)
{
    task_scratch v = *s;
    v.qt = (char *)s->qt + (size_t)r0 * 4; /* 4-byte cells in every layout */
    v.st = s->st + r0;
    v.o = s->o + r0 * dvp;
    v.m = s->m + r0;
    v.l = s->l + r0;
    v.alpha = s->alpha + r0;
    v.lo = s->lo + r0;
    v.hi = s->hi + r0;
    v.row_pos = s->row_pos + r0;
    v.row_head = s->row_head + r0;
    return v;
}

/* Task t of head-group task g of sequence b (layout L): query positions
 * [t * tq, ...) of head groups [g * slots, ...). Slot k holds head group
 * hg = g * slots + k in rows [k * width, ...): row i of the slot is position
 * t * tq + i / P of head hg * P + i % P, so positions never decrease with i
 * and each row's visible keys move right with i; with several slots, rows
 * past a slot's own repeat its last one and see no key. The task sees keys
 * [ka, kb) of the sequence only (its split; the whole sequence unsplit).
 * Sets tk's geometry (rows: what pack_q packs; slot_rows: the rows of each
 * slot) and s's rows, their visible keys, o = 0, m = -inf and l = 0, and
 * returns the task's slot count. */
static int task_begin(fmha_cpu_task *tk, task_scratch *s, const task_layout *L, int64_t b,
                      int64_t g, int64_t t, int64_t ka, int64_t kb)
{
    const fmha_problem *pb = tk->pb;
    int64_t sk;
    fmha_seq_bounds(pb, b, &tk->q0, &tk->sq, &tk->k0, &sk);
    tk->sk = sk;
    tk->b = b;
    tk->tb = pb->varlen ? 0 : b;
    const int64_t P = L->P, pos0 = t * L->tq, first = g * L->slots;
    const int slots = (int)(L->groups - first < L->slots ? L->groups - first : L->slots);
    const int rows = (int)((tk->sq - pos0 < L->tq ? tk->sq - pos0 : L->tq) * P);
    const int width = L->slots > 1 ? (int)L->width : rows;
    for (int k = 0; k < slots; k++) {
        for (int i = 0; i < width; i++) {
            const int r = k * width + i, src = i < rows ? i : rows - 1;
            s->row_pos[r] = pos0 + src / P;
            s->row_head[r] = (first + k) * P + src % P;
            fmha_visible_range(pb->cfg, s->row_pos[r], tk->sq, sk, &s->lo[r], &s->hi[r]);
            s->lo[r] = s->lo[r] > ka ? s->lo[r] : ka;
            s->hi[r] = s->hi[r] < kb ? s->hi[r] : kb;
            if (s->hi[r] < s->lo[r] || i >= rows) /* nothing of this split: an empty interval */
                s->hi[r] = s->lo[r];
        }
    }
    tk->rows = slots * width;
    tk->slot_rows = rows;
    tk->row_pos = s->row_pos;
    tk->row_head = s->row_head;
    memset(s->o, 0, sizeof(float) * (size_t)fmha_cpu_vector_rows(tk->rows) * (size_t)tk->dvp);
    for (int i = 0; i < BR; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
    return slots;
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

float fmha_cpu_bias_unit(const fmha_problem *pb)
{
    if (!pb->args->mask.data && !pb->args->alibi_slopes)
        return 0.0f;
    return pb->cfg->softcap > 0 ? 1.4426950408889634f : (float)(1.0 / pb->scale);
}

/* fmha_cpu_add_bias with its steps constants where it is inlined (row_step
 * 1: the inner loops run over adjacent floats and vectorise). */
static inline __attribute__((always_inline)) void
add_bias_steps(const fmha_problem *pb, int64_t b, int64_t sq, int64_t sk, const int64_t *head,
               const int64_t *pos, int ia, int ib, int64_t j0, int nj, float unit, float *st,
               const int64_t row_step, const int64_t key_step)
{
    const fmha_forward_args *a = pb->args;
    const fmha_attn_mask *m = &a->mask;
    if (a->alibi_slopes) {         /* key by key over the rows: -slope x unit x |diagonal - key| */
        float slope[BR], diag[BR]; /* diag: f32, past 2^24 keys rounded as the bias would be */
        for (int i = ia; i < ib; i++) {
            slope[i] = -a->alibi_slopes[b * a->alibi_stride_batch + head[i]] * unit;
            diag[i] = (float)(pos[i] + sk - sq - j0);
        }
        for (int c = 0; c < nj; c++) {
            float *x = st + c * key_step;
            for (int i = ia; i < ib; i++)
                x[i * row_step] += slope[i] * fabsf(diag[i] - (float)c);
        }
    }
    if (!m->data)
        return;
    /* the mask row by row: a row's elements lie along the keys (stride_k) */
    const fmha_dtype dt = fmha_mask_dtype(m->type);
    const int64_t sj = m->stride_k;
    for (int i = ia; i < ib; i++) {
        const int64_t e =
            b * m->stride_batch + head[i] * m->stride_head + pos[i] * m->stride_q + j0 * sj;
        float *x = st + i * row_step;
        if (m->type == FMHA_MASK_BOOL) {
            const uint8_t *keep = (const uint8_t *)m->data + e;
            for (int c = 0; c < nj; c++)
                x[c * key_step] = keep[c * sj] ? x[c * key_step] : -INFINITY;
        } else {
            for (int c = 0; c < nj; c++)
                x[c * key_step] += unit * fmha_load_f32(m->data, dt, e + c * sj);
        }
    }
}

void fmha_cpu_add_bias(const fmha_problem *pb, int64_t b, int64_t sq, int64_t sk,
                       const int64_t *head, const int64_t *pos, int ia, int ib, int64_t j0, int nj,
                       float unit, float *st, int64_t row_step, int64_t key_step)
{
    if (row_step == 1 && key_step == BR) /* the forward's and dq's [key][row] tiles */
        add_bias_steps(pb, b, sq, sk, head, pos, ia, ib, j0, nj, unit, st, 1, BR);
    else
        add_bias_steps(pb, b, sq, sk, head, pos, ia, ib, j0, nj, unit, st, row_step, key_step);
}

/* The sinks (fmha_forward_args) into the softmax state of the slot's `rows`
 * rows, once their keys are done: a logit of a key whose value is 0, so m
 * and l take it in and o is rescaled with them (all in the log2 domain). */
static void add_sinks(const fmha_cpu_task *tk, task_scratch *s, int rows)
{
    const float *sinks = tk->pb->args->sinks;
    for (int i = 0; sinks && i < rows; i++) {
        const float x = sinks[s->row_head[i]] * 1.4426950408889634f, m = s->m[i];
        if (x == -INFINITY || isnan(m) || isnan(s->l[i]))
            continue;
        const float mn = m > x ? m : x, f = exp2f(m - mn);
        float *o = s->o + (int64_t)i * tk->dvp;
        for (int64_t c = 0; c < tk->dvp; c++)
            o[c] *= f;
        s->l[i] = s->l[i] * f + exp2f(x - mn);
        s->m[i] = mn;
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
            const int64_t col = pb->pos_col0 + j0 + j;
            fmha_u32x4 w =
                fmha_dropout_words(pb->args->seed, pb->args->offset,
                                   tk->b * pb->pos_heads + pb->pos_head0 + s->row_head[i],
                                   pb->pos_row0 + s->row_pos[i], col);
            float *p = &s->st[j * BR + i];
            *p = w.v[col & 3] >= pb->drop_threshold ? *p * keep_scale : 0.0f;
        }
    }
}

/* Key splits of a call (flash-decoding): split `split` of `n` covers keys
 * [*ka, *kb) of a sequence of sk keys, whole blocks of BC but the last. */
static void split_range(int64_t sk, int64_t split, int64_t n, int64_t *ka, int64_t *kb)
{
    const int64_t chunk = round_up((sk + n - 1) / n, BC);
    *ka = split * chunk < sk ? split * chunk : sk;
    *kb = *ka + chunk < sk ? *ka + chunk : sk;
}

/* A split task's result, for merge_splits: each row's O / l and its LSE in
 * the log2 domain (m + log2 l; -inf where the split showed the row no key),
 * in partial[((split * heads + h) * sq + pos) * (dvp + 1)] of sequence b's
 * block. */
static void store_partial(const fmha_cpu_task *tk, const task_scratch *s, float *partial,
                          int64_t split)
{
    const fmha_problem *pb = tk->pb;
    const int64_t w = tk->dvp + 1;
    for (int i = 0; i < tk->rows; i++) {
        const float l = s->l[i], inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *dst = partial + ((split * pb->heads + s->row_head[i]) * tk->sq + s->row_pos[i]) * w;
        for (int64_t c = 0; c < pb->dv; c++)
            dst[c] = s->o[(int64_t)i * tk->dvp + c] * inv;
        dst[tk->dvp] = l > 0.0f ? s->m[i] + log2f(l) : isnan(l) || isnan(s->m[i]) ? NAN : -INFINITY;
    }
}

/* One block of keys [j0, j0 + nj) for the `rows` rows of s (one slot) with
 * tk's micro-kernels: QK^T, softcap, mask, online softmax, dropout and PV.
 * The products are the tiles' or, by_rows, decode's row products (cpu.h's
 * row_qk, which run_task has run for the block's keys, and row_pv). */
static void run_block(const fmha_cpu_ops *ops, const fmha_cpu_task *tk, task_scratch *s,
                      int by_rows, int rows, int64_t j0, int nj, float scale, float bias_unit)
{
    const fmha_problem *pb = tk->pb;
    const int full = s->lo[rows - 1] <= j0 && j0 + nj <= s->hi[0]; /* every row sees every key */
    int qa, qb;
    live_rows(s, rows, j0, nj, &qa, &qb);
    if (qa >= qb)
        return;
    /* The live rows widened to whole vectors: nq queries from qv, of which
     * [qv, ib) are real rows (by rows, fewer than one vector: qv = 0). */
    const int qv = qa / FMHA_CPU_NQ * FMHA_CPU_NQ;
    const int nq = (int)round_up(qb, FMHA_CPU_NQ) - qv;
    const int ib = qv + nq < rows ? qv + nq : rows;
    const void *qt = (const char *)s->qt + (size_t)qv * 4; /* 4-byte cells */
    float *st = s->st + qv, *m = s->m + qv, *l = s->l + qv, *alpha = s->alpha + qv;
    float *o = s->o + (int64_t)qv * tk->dvp;

    if (!by_rows) {
        ops->load_k(tk, j0, nj, s->kbuf);
        ops->qk(s->kbuf, tk->dp, nj, nq, qt, pb->d, st);
    }
    if (pb->cfg->softcap > 0)
        ops->softcap(st, nj, nq, (float)pb->scale, (float)pb->cfg->softcap);
    if (bias_unit != 0.0f) /* st is [key][row] */
        fmha_cpu_add_bias(pb, tk->b, tk->sq, tk->sk, s->row_head, s->row_pos, qv, ib, j0, nj,
                          bias_unit, s->st, 1, BR);
    if (!full)
        mask_edges(s, j0, nj, qv, ib);
    ops->softmax(st, nj, nq, scale, m, l, alpha);
    if (pb->drop_threshold)
        dropout(tk, s, j0, nj, qv, ib);
    if (by_rows) {
        ops->row_pv(tk, st, rows, j0, nj, alpha, o);
    } else {
        ops->load_v(tk, j0, nj, s->vbuf);
        ops->pack_p(st, nj, nq);
        ops->pv(st, nj, nq, s->vbuf, tk->dvp, alpha, o);
    }
}

/* The task's query rows for the row products, dp elements apart (zero
 * past d): f32 rows, or in bf16-pair tables (elem 2) bf16 rows, q's own
 * values (those tables take bf16 inputs alone). */
static void pack_q_rows(const fmha_cpu_task *tk, int elem, void *qr)
{
    const fmha_problem *pb = tk->pb;
    const fmha_tensor *q = &pb->args->q;
    for (int r = 0; r < tk->rows; r++) {
        const char *row = fmha_row(q, tk->tb, tk->q0 + tk->row_pos[r], tk->row_head[r]);
        if (elem == 2) {
            uint16_t *dst = (uint16_t *)qr + r * tk->dp;
            memcpy(dst, row, (size_t)pb->d * 2);
            for (int64_t c = pb->d; c < tk->dp; c++)
                dst[c] = 0;
            continue;
        }
        float *dst = (float *)qr + r * tk->dp;
        for (int64_t c = 0; c < tk->dp; c++)
            dst[c] = c < pb->d ? fmha_load_f32(row, q->dtype, c) : 0.0f;
    }
}

/* Runs task t of head-group task g of sequence b (task_begin): Q^T once,
 * then each key block for each slot in turn, then per slot O / l and the
 * LSE — or, for split `split` of `nsplit` > 1, the partial result of its
 * keys into `partial`. */
static void run_task(const fmha_cpu_ops *ops, fmha_cpu_task *tk, task_scratch *s,
                     const task_layout *L, int64_t b, int64_t g, int64_t t, int64_t split,
                     int64_t nsplit, float *partial)
{
    const fmha_problem *pb = tk->pb;
    const fmha_config *cfg = pb->cfg;
    int64_t q0, sq, k0, sk, ka = 0, kb;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    kb = sk;
    if (nsplit > 1)
        split_range(sk, split, nsplit, &ka, &kb);
    const int slots = task_begin(tk, s, L, b, g, t, ka, kb);
    const int rows = tk->slot_rows, width = tk->rows / slots;
    const float scale = cfg->softcap > 0 ? 1.0f : (float)(pb->scale * 1.4426950408889634);
    const float bias_unit = fmha_cpu_bias_unit(pb);

    /* Decode slots of fewer rows than a vector step take the row products
     * (the Q^T tile then holds the rows themselves: pack_q_rows); FP8 caches
     * in the f32 tables' (the bf16-pair tables do not read them). */
    const int by_rows = ops->row_qk && pb->kv_cache && rows < FMHA_CPU_NQ &&
                        (pb->args->k.dtype != FMHA_DTYPE_F8_E4M3 || ops->elem == 4);
    if (by_rows)
        pack_q_rows(tk, ops->elem, s->qt);
    else
        ops->pack_q(tk, s->qt, s->kbuf);
    /* Each slot's view of the scratch and its KV head. Slots differ in heads
     * only: their rows see the same keys. */
    task_scratch view[BR / FMHA_CPU_NQ];
    int64_t hk[BR / FMHA_CPU_NQ];
    for (int k = 0; k < slots; k++) {
        view[k] = rows_from(s, k * width, tk->dvp);
        hk[k] = (g * L->slots + k) * L->P / pb->group;
    }
    for (int64_t j0 = s->lo[0]; j0 < s->hi[rows - 1]; j0 += BC) {
        const int nj = (int)(s->hi[rows - 1] - j0 < BC ? s->hi[rows - 1] - j0 : BC);
        if (by_rows)
            ops->row_qk(tk, s->qt, rows, slots, width, hk, j0, nj, s->st);
        for (int k = 0; k < slots; k++) {
            tk->hk = hk[k];
            run_block(ops, tk, &view[k], by_rows, rows, j0, nj, scale, bias_unit);
        }
    }
    tk->rows = rows;
    for (int k = 0; k < slots; k++) {
        tk->row_pos = view[k].row_pos;
        tk->row_head = view[k].row_head;
        if (nsplit > 1) {
            store_partial(tk, &view[k], partial + b * nsplit * pb->heads * sq * (tk->dvp + 1),
                          split);
        } else {
            add_sinks(tk, &view[k], rows);
            ops->store(tk, view[k].o, view[k].m, view[k].l);
        }
    }
}

/* Merges the splits of every row by their LSEs (store_partial's) into out
 * and lse: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M the
 * largest; a row no split showed a key gets 0 and -inf, a NaN split makes
 * the row NaN (docs/reliability.md). */
static void merge_splits(const fmha_problem *pb, const float *partial, int64_t nsplit, int64_t dvp,
                         int nthreads)
{
    const fmha_forward_args *a = pb->args;
    const int64_t sq = pb->max_sq, w = dvp + 1, rows = pb->batch * pb->heads * sq;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (pb->heads * sq), h = row / sq % pb->heads, pos = row % sq;
        const float *p = partial + (b * nsplit * pb->heads + h) * sq * w + pos * w;
        const int64_t step = pb->heads * sq * w; /* from one split to the next */
        /* the sink (fmha_forward_args), a split of its own: one key of value 0 */
        const float sink = a->sinks ? a->sinks[h] * 1.4426950408889634f : -INFINITY;
        float m = sink;
        int nan = 0;
        for (int64_t s = 0; s < nsplit; s++) {
            const float x = p[s * step + dvp];
            nan |= isnan(x);
            m = x > m ? x : m;
        }
        double l = sink != -INFINITY ? exp2((double)sink - m) : 0.0;
        char *orow = fmha_row(&a->out, b, pos, h);
        for (int64_t c = 0; c < pb->dv; c++) {
            double acc = 0.0;
            for (int64_t s = 0; s < nsplit; s++) {
                const float x = p[s * step + dvp];
                if (x != -INFINITY)
                    acc += exp2((double)x - m) * p[s * step + c];
            }
            if (c == 0)
                for (int64_t s = 0; s < nsplit; s++)
                    l += p[s * step + dvp] != -INFINITY ? exp2((double)p[s * step + dvp] - m) : 0.0;
            fmha_store_f32(orow, a->out.dtype, c, nan ? NAN : l > 0.0 ? (float)(acc / l) : 0.0f);
        }
        if (a->lse)
            a->lse[(b * pb->heads + h) * sq + pos] =
                nan       ? NAN
                : l > 0.0 ? (float)((m + log2(l)) * 0.6931471805599453)
                          : -INFINITY;
    }
}

/* How many key splits a call's tasks get: 1 but for decode calls, which
 * take num_splits or, for 0, enough splits of at least 512 keys for 64
 * tasks — from the shape alone, so that the result does not depend on the
 * thread count. */
static int64_t splits_of(const fmha_problem *pb, int64_t ntasks)
{
    if (!pb->kv_cache || pb->varlen || pb->max_sk <= BC)
        return 1;
    int64_t n = pb->num_splits;
    if (n == 0) {
        enum { TARGET_TASKS = 64, MIN_KEYS = 512 };
        n = ntasks >= TARGET_TASKS ? 1 : (TARGET_TASKS + ntasks - 1) / ntasks;
        if (n > pb->max_sk / MIN_KEYS)
            n = pb->max_sk / MIN_KEYS;
    }
    const int64_t blocks = (pb->max_sk + BC - 1) / BC;
    return n < 1 ? 1 : n > blocks ? blocks : n;
}

fmha_status fmha_cpu_forward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                             fmha_cpu_workspace *ws)
{
    const fmha_cpu_ops *ops = ops_table[kernel->id];
    const int64_t dp = round_up(pb->d, 2), dvp = round_up(pb->dv, ops->lanes);
    const size_t per_thread = scratch_size(ops, dp, dvp);

    /* Tasks: (sequence, head group, query tile), counts prefix-summed over sequences. */
    const task_layout L = layout_of(pb);
    int64_t *tile_start = fmha_malloc(sizeof(int64_t) * (size_t)(pb->batch + 1));
    if (!tile_start)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory planning CPU tasks");
    tile_start[0] = 0;
    for (int64_t b = 0; b < pb->batch; b++) {
        int64_t q0, sq, k0, sk;
        fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
        tile_start[b + 1] = tile_start[b] + (sq + L.tq - 1) / L.tq * L.group_tasks;
    }
    const int64_t nsplit = splits_of(pb, tile_start[pb->batch]);
    const int64_t ntasks = tile_start[pb->batch] * nsplit;
    float *partial = NULL;
    if (nsplit > 1) {
        const size_t n = (size_t)(pb->batch * nsplit * pb->heads * pb->max_sq * (dvp + 1));
        if (!(partial = fmha_malloc(sizeof(float) * n))) {
            fmha_free(tile_start);
            return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                                  "out of memory for %lld key splits' partial results",
                                  (long long)nsplit);
        }
    }

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
        fmha_free(partial);
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
        fmha_cpu_task tk = {.pb = pb, .dp = dp, .dvp = dvp};
        /* Longest tiles first: with a causal mask later query tiles see more keys. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = ntasks - 1; task >= 0; task--) {
            const int64_t tile = task / nsplit, split = task % nsplit;
            int64_t lo = 0, hi = pb->batch; /* the sequence holding this tile */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (tile_start[mid] <= tile)
                    lo = mid;
                else
                    hi = mid;
            }
            int64_t local = tile - tile_start[lo];
            run_task(ops, &tk, &s, &L, lo, local % L.group_tasks, local / L.group_tasks, split,
                     nsplit, partial);
        }
    }
    if (nsplit > 1)
        merge_splits(pb, partial, nsplit, dvp, nthreads);
    fmha_free(partial);
    fmha_free(tile_start);
    return FMHA_STATUS_OK;
}
