/* cpu_backward.c — the CPU flash-attention backward, deterministic without
 * atomics. First D = rowsum(dO * O) for every query row; then two kinds of
 * task, each recomputing P = 2^(S - LSE) from q, k and the forward's LSE:
 * a dQ task owns up to BR query rows of one head and walks the keys they see
 * in blocks of BC; a dK/dV task owns up to BR keys of one KV head and walks,
 * for each query head of its group, the queries that see them in blocks of
 * BC (so GQA's sum over the group is a loop, not a copy). Every gradient row
 * is summed by one task in a fixed order: the bits depend on neither the
 * schedule nor the thread count. The cost is S and dP computed twice (seven
 * products of the tile sizes instead of five). The products are the
 * forward's qk and pv micro-kernels on other operands (cpu.h). */
#include "../alloc.h"
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { BR = FMHA_CPU_BR, BC = FMHA_CPU_BC, NQ = FMHA_CPU_NQ };

#define LOG2E 1.4426950408889634

/* Each backward kernel runs on the micro-kernels of its `ops` column. */
static const fmha_cpu_ops *const ops_table[FMHA_KERNEL_COUNT] = {
#define FMHA_CPU_BWD_KERNEL(name, isa, compute, inputs, ops) \
    [FMHA_KERNEL_ID_##name] = &fmha_ops_##ops,
#include "../kernels.def"
};

static int64_t round_up(int64_t x, int64_t m)
{
    return (x + m - 1) / m * m;
}

/* One thread's tiles. The dQ task and the dK/dV task use them in turn:
 * at, bt = Q^T, dO^T or K^T, V^T; xb, yb = blocks of K, V or of Q, dO. */
typedef struct bwd_scratch {
    float *at, *bt;          /* [dkp][BR], [dvp][BR] */
    float *xb, *yb;          /* [BC][dkp], [BC][dvp] */
    float *st, *dp, *t, *pd; /* [BC][BR]: S, then P, then dS; dP; softcap's output; dropped P */
    float *acc_x, *acc_y;    /* [BR][dkp]: dQ or dK; [BR][dvp]: dV */
    float *lse, *D, *ones;   /* [BR]: LSE (log2 domain) and D of the rows; 1s, pv's alpha */
    int64_t *lo, *hi;        /* [BR]: the keys each query row sees */
} bwd_scratch;

/* What every task of a call shares. */
typedef struct bwd_call {
    const fmha_problem *pb;
    const fmha_backward_args *a;
    const fmha_cpu_ops *ops;
    int64_t dkp, dvp; /* head dims rounded up to the ISA's lanes */
    float exp_scale;  /* S to the log2 domain: scale log2 e, or 1 after softcap */
    float bias_unit;  /* S's units per unit of score bias (mask, ALiBi); 0: none */
    const float *D;   /* rowsum(dO * O), indexed as the LSE */
    int want_dk, want_dv;
} bwd_call;

/* `n` items of `size` bytes at the next cache line of *p. */
static void *take(char **p, size_t n, size_t size)
{
    void *at = *p;
    *p += (n * size + 63) & ~(size_t)63;
    return at;
}

/* Carves one thread's tiles from `base` (NULL: only counts); returns the bytes. */
static size_t scratch_take(char *base, int64_t dkp, int64_t dvp, bwd_scratch *s)
{
    char *p = base;
    s->at = take(&p, (size_t)dkp * BR, 4);
    s->bt = take(&p, (size_t)dvp * BR, 4);
    s->xb = take(&p, (size_t)BC * dkp, 4);
    s->yb = take(&p, (size_t)BC * dvp, 4);
    s->st = take(&p, (size_t)BC * BR, 4);
    s->dp = take(&p, (size_t)BC * BR, 4);
    s->t = take(&p, (size_t)BC * BR, 4);
    s->pd = take(&p, (size_t)BC * BR, 4);
    s->acc_x = take(&p, (size_t)BR * dkp, 4);
    s->acc_y = take(&p, (size_t)BR * dvp, 4);
    s->lse = take(&p, BR, 4);
    s->D = take(&p, BR, 4);
    s->ones = take(&p, BR, 4);
    s->lo = take(&p, BR, 8);
    s->hi = take(&p, BR, 8);
    return (size_t)(p - base);
}

/* Where row i of head h of sequence b sits in the LSE (and in D). */
static int64_t lse_index(const fmha_problem *pb, int64_t b, int64_t h, int64_t q0, int64_t sq,
                         int64_t i)
{
    return pb->varlen ? h * pb->args->q.seqlen + q0 + i : (b * pb->heads + h) * sq + i;
}

/* The forward's LSE in the log2 domain; a row without keys (-inf) gets +inf
 * so that every P of it is 2^-inf = 0. */
static float lse_log2(float lse)
{
    return lse == -INFINITY ? INFINITY : (float)(lse * LOG2E);
}

/* Writes n rows of a gradient (acc rows `stride` apart) times `mul`. */
static void store_rows(const fmha_tensor *g, int64_t tb, int64_t tok, int64_t h, int n,
                       int64_t cols, const float *acc, int64_t stride, float mul)
{
    for (int r = 0; r < n; r++) {
        char *row = fmha_row(g, tb, tok + r, h);
        const float *x = acc + r * stride;
        if (g->dtype == FMHA_DTYPE_F32) {
            for (int64_t c = 0; c < cols; c++)
                ((float *)row)[c] = x[c] * mul;
        } else {
            for (int64_t c = 0; c < cols; c++)
                fmha_store_f32(row, g->dtype, c, x[c] * mul);
        }
    }
}

static void zero_rows(const fmha_tensor *g, int64_t s0, int64_t s1)
{
    const size_t bytes = (size_t)g->head_dim * fmha_dtype_size(g->dtype);
    for (int64_t s = s0; g->data && s < s1; s++)
        for (int64_t h = 0; h < g->heads; h++)
            memset(fmha_row(g, 0, s, h), 0, bytes);
}

/* The dropout factor of element (row, col) of head h: 0 or 1 / (1 - p).
 * Philox gives four columns per draw; `w` caches the draw of column col & ~3. */
static float keep_factor(const bwd_call *c, int64_t seq_head, int64_t row, int64_t col,
                         fmha_u32x4 *w, int64_t *w_col)
{
    const fmha_problem *pb = c->pb;
    if (*w_col != (col & ~(int64_t)3)) {
        *w = fmha_dropout_words(c->a->seed, c->a->offset, seq_head, row, col);
        *w_col = col & ~(int64_t)3;
    }
    return w->v[col & 3] >= pb->drop_threshold ? (float)pb->drop_rescale : 0.0f;
}

/* S's softcap (when on), keeping its output for softcap_grad: before the
 * mask, whose -inf would make 1 - t^2 infinite. */
static void softcap_keep(const bwd_call *c, bwd_scratch *s, int nr, int lane0, int nl)
{
    const fmha_config *cfg = c->pb->cfg;
    if (!(cfg->softcap > 0))
        return;
    c->ops->softcap(s->st + lane0, nr, nl, (float)c->pb->scale, (float)cfg->softcap);
    for (int r = 0; r < nr; r++)
        memcpy(s->t + r * BR + lane0, s->st + r * BR + lane0, sizeof(float) * (size_t)nl);
}

static void softcap_grad(const bwd_call *c, bwd_scratch *s, int nr, int lane0, int nl)
{
    const fmha_config *cfg = c->pb->cfg;
    if (cfg->softcap > 0)
        c->ops->softcap_grad(s->st + lane0, s->t + lane0, nr, nl,
                             (float)(1.0 / (cfg->softcap * LOG2E)));
}

/* ------------------------------------------------------------- dQ tasks */

/* Tile st [key][query]: query lanes [ia, ib) get `fill` at the keys of the
 * block [j0, j0 + nj) they do not see (the forward's mask_edges): -inf on S,
 * and 0 on dS, which a NaN in dP or D would reach otherwise (0 (NaN - D)). */
static void mask_lanes(bwd_scratch *s, int64_t j0, int nj, int ia, int ib, float fill)
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
            row[i] = fill;
        for (int i = v1; i < ib; i++)
            row[i] = fill;
    }
}

/* Query rows [i0, i0 + rows) of head h of sequence b: dq = scale * sum over
 * the key blocks of dS K, dS = P (dP - D), P = 2^(S - LSE), dP = dO V^T
 * (times the dropout factors). Tiles are [key][query], lanes over queries. */
static void dq_task(const bwd_call *c, bwd_scratch *s, int64_t b, int64_t h, int64_t tile)
{
    const fmha_problem *pb = c->pb;
    const fmha_backward_args *a = c->a;
    const fmha_cpu_ops *ops = c->ops;
    int64_t q0, sq, k0, sk;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    const int64_t tb = pb->varlen ? 0 : b, hk = h / pb->group, i0 = tile * BR;
    const int rows = (int)(sq - i0 < BR ? sq - i0 : BR);
    int64_t heads[BR], rpos[BR]; /* each row's head and position, for the score bias */
    for (int r = 0; r < rows; r++)
        heads[r] = h, rpos[r] = i0 + r;
    for (int r = 0; r < BR; r++) { /* lanes past the rows: P = 0, D = 0 */
        s->lse[r] = INFINITY;
        s->D[r] = 0.0f;
    }
    for (int r = 0; r < rows; r++) {
        fmha_visible_range(pb->cfg, i0 + r, sq, sk, &s->lo[r], &s->hi[r]);
        const int64_t at = lse_index(pb, b, h, q0, sq, i0 + r);
        s->lse[r] = lse_log2(a->lse[at]);
        s->D[r] = c->D[at];
    }
    ops->pack_rows_t(&a->q, tb, q0 + i0, h, rows, pb->d, s->at, s->xb);
    ops->pack_rows_t(&a->dout, tb, q0 + i0, h, rows, pb->dv, s->bt, s->yb);
    memset(s->acc_x, 0, sizeof(float) * BR * (size_t)c->dkp);

    const int64_t lo_first = s->lo[0], hi_first = s->hi[0];
    const int64_t lo_last = s->lo[rows - 1], hi_last = s->hi[rows - 1];
    for (int64_t j0 = lo_first; j0 < hi_last; j0 += BC) {
        const int nj = (int)(hi_last - j0 < BC ? hi_last - j0 : BC);
        /* The rows that see a key of the block (the forward's live_rows),
         * widened to whole vectors: lanes [qv, qv + nq), real rows to ib. */
        int qa = 0, qb = rows;
        while (qa < rows && (s->hi[qa] <= j0 || s->lo[qa] >= s->hi[qa]))
            qa++;
        while (qb > qa && (s->lo[qb - 1] >= j0 + nj || s->lo[qb - 1] >= s->hi[qb - 1]))
            qb--;
        if (qa >= qb)
            continue;
        const int qv = qa / NQ * NQ, nq = (int)round_up(qb, NQ) - qv;
        const int ib = qv + nq < rows ? qv + nq : rows;
        float *st = s->st + qv, *dp = s->dp + qv;

        ops->load_rows(&a->k, tb, k0 + j0, hk, nj, pb->d, c->dkp, s->xb);
        ops->qk(s->xb, c->dkp, nj, nq, s->at + qv, pb->d, st);
        softcap_keep(c, s, nj, qv, nq);
        if (c->bias_unit != 0.0f) /* st is [key][row] */
            fmha_cpu_add_bias(pb, b, sq, sk, heads, rpos, qv, ib, j0, nj, c->bias_unit, s->st, 1,
                              BR);
        const int edge = !(lo_last <= j0 && j0 + nj <= hi_first);
        if (edge)
            mask_lanes(s, j0, nj, qv, ib, -INFINITY);
        ops->exp_cols(st, nj, nq, c->exp_scale, s->lse + qv);
        ops->load_rows(&a->v, tb, k0 + j0, hk, nj, pb->dv, c->dvp, s->yb);
        ops->qk(s->yb, c->dvp, nj, nq, s->bt + qv, pb->dv, dp);
        if (pb->drop_threshold) {
            for (int i = qv; i < ib; i++) {
                fmha_u32x4 w;
                int64_t w_col = -1;
                for (int j = 0; j < nj; j++)
                    s->dp[j * BR + i] *=
                        keep_factor(c, b * pb->heads + h, i0 + i, j0 + j, &w, &w_col);
            }
        }
        ops->ds_cols(st, dp, nj, nq, s->D + qv);
        if (edge)
            mask_lanes(s, j0, nj, qv, ib, 0.0f);
        softcap_grad(c, s, nj, qv, nq);
        ops->pv(st, nj, nq, s->xb, c->dkp, s->ones, s->acc_x + qv * c->dkp);
    }
    store_rows(&a->dq, tb, q0 + i0, h, rows, pb->d, s->acc_x, c->dkp, (float)pb->scale);
}

/* ---------------------------------------------------------- dK/dV tasks */

/* The first query row i in [0, sq] whose visible keys [lo, hi) have
 * hi > key (upper 1) or lo >= key (upper 0): both bounds never decrease
 * with i. */
static int64_t first_row(const fmha_config *cfg, int64_t sq, int64_t sk, int64_t key, int upper)
{
    int64_t lo = 0, hi = sq;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        int64_t l, h;
        fmha_visible_range(cfg, mid, sq, sk, &l, &h);
        if (upper ? h > key : l >= key)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* Tile st [query][key]: row r gets 0 at the keys j0 + c (c < nk) it does not
 * see. Applied to P and to dS rather than -inf to S, so that a row whose LSE
 * is NaN (a NaN row of the forward) adds nothing to the keys it does not see. */
static void mask_rows(bwd_scratch *s, int nr, int64_t j0, int nk)
{
    for (int r = 0; r < nr; r++) {
        float *row = s->st + r * BR;
        const int64_t a = s->lo[r] - j0, b = s->hi[r] - j0;
        for (int k = 0; k < nk; k++)
            if (k < a || k >= b || a >= b)
                row[k] = 0.0f;
    }
}

/* Keys [j0, j0 + nk) of KV head hk of sequence b: dv = sum of P^T dO and
 * dk = scale * sum of dS^T Q over every query head of the group and every
 * query row that sees one of them. Tiles are [query][key], lanes over keys. */
static void dkv_task(const bwd_call *c, bwd_scratch *s, int64_t b, int64_t hk, int64_t tile)
{
    const fmha_problem *pb = c->pb;
    const fmha_config *cfg = pb->cfg;
    const fmha_backward_args *a = c->a;
    const fmha_cpu_ops *ops = c->ops;
    int64_t q0, sq, k0, sk;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    const int64_t tb = pb->varlen ? 0 : b, j0 = tile * BR;
    const int nk = (int)(sk - j0 < BR ? sk - j0 : BR), nl = (int)round_up(nk, NQ);
    int64_t heads[BC], rpos[BC]; /* each row's head and position, for the score bias */
    ops->pack_rows_t(&a->k, tb, k0 + j0, hk, nk, pb->d, s->at, s->xb);
    ops->pack_rows_t(&a->v, tb, k0 + j0, hk, nk, pb->dv, s->bt, s->yb);
    memset(s->acc_x, 0, sizeof(float) * BR * (size_t)c->dkp);
    memset(s->acc_y, 0, sizeof(float) * BR * (size_t)c->dvp);

    const int64_t ia = first_row(cfg, sq, sk, j0, 1), ib = first_row(cfg, sq, sk, j0 + nk, 0);
    for (int64_t h = hk * pb->group; h < (hk + 1) * pb->group; h++) {
        for (int64_t i0 = ia; i0 < ib; i0 += BC) {
            const int nr = (int)(ib - i0 < BC ? ib - i0 : BC);
            for (int r = 0; r < nr; r++) {
                fmha_visible_range(cfg, i0 + r, sq, sk, &s->lo[r], &s->hi[r]);
                const int64_t at = lse_index(pb, b, h, q0, sq, i0 + r);
                s->lse[r] = lse_log2(a->lse[at]);
                s->D[r] = c->D[at];
            }
            const int full = s->lo[nr - 1] <= j0 && s->hi[0] >= j0 + nk && s->lo[0] < s->hi[0];
            ops->load_rows(&a->q, tb, q0 + i0, h, nr, pb->d, c->dkp, s->xb);
            ops->load_rows(&a->dout, tb, q0 + i0, h, nr, pb->dv, c->dvp, s->yb);
            ops->qk(s->xb, c->dkp, nr, nl, s->at, pb->d, s->st);
            softcap_keep(c, s, nr, 0, nl);
            if (c->bias_unit != 0.0f) { /* st is [row][key] */
                for (int r = 0; r < nr; r++)
                    heads[r] = h, rpos[r] = i0 + r;
                fmha_cpu_add_bias(pb, b, sq, sk, heads, rpos, 0, nr, j0, nk, c->bias_unit, s->st,
                                  BR, 1);
            }
            ops->exp_rows(s->st, nr, nl, c->exp_scale, s->lse);
            if (!full)
                mask_rows(s, nr, j0, nk);
            if (c->want_dk)
                ops->qk(s->yb, c->dvp, nr, nl, s->bt, pb->dv, s->dp);
            const float *p = s->st;
            if (pb->drop_threshold) { /* P for dV dropped; dP times the same factors */
                for (int r = 0; r < nr; r++) {
                    fmha_u32x4 w;
                    int64_t w_col = -1;
                    for (int k = 0; k < nl; k++) {
                        const float f =
                            k < nk ? keep_factor(c, b * pb->heads + h, i0 + r, j0 + k, &w, &w_col)
                                   : 0.0f;
                        s->pd[r * BR + k] = s->st[r * BR + k] * f;
                        s->dp[r * BR + k] *= f;
                    }
                }
                p = s->pd;
            }
            if (c->want_dv)
                ops->pv(p, nr, nl, s->yb, c->dvp, s->ones, s->acc_y);
            if (c->want_dk) {
                ops->ds_rows(s->st, s->dp, nr, nl, s->D);
                if (!full)
                    mask_rows(s, nr, j0, nk);
                softcap_grad(c, s, nr, 0, nl);
                ops->pv(s->st, nr, nl, s->xb, c->dkp, s->ones, s->acc_x);
            }
        }
    }
    if (c->want_dk)
        store_rows(&a->dk, tb, k0 + j0, hk, nk, pb->d, s->acc_x, c->dkp, (float)pb->scale);
    if (c->want_dv)
        store_rows(&a->dv, tb, k0 + j0, hk, nk, pb->dv, s->acc_y, c->dvp, 1.0f);
}

/* ----------------------------------------------------------------- driver */

/* D = rowsum(dO * O) of every query row of (sequence b, head h), in double. */
static void rowsum_task(const bwd_call *c, float *D, int64_t b, int64_t h)
{
    const fmha_problem *pb = c->pb;
    const fmha_backward_args *a = c->a;
    int64_t q0, sq, k0, sk;
    fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
    const int64_t tb = pb->varlen ? 0 : b;
    for (int64_t i = 0; i < sq; i++) {
        const char *o = fmha_row(&a->out, tb, q0 + i, h), *g = fmha_row(&a->dout, tb, q0 + i, h);
        double acc = 0.0;
        for (int64_t e = 0; e < pb->dv; e++)
            acc += (double)fmha_load_f32(o, a->out.dtype, e) *
                   (double)fmha_load_f32(g, a->dout.dtype, e);
        D[lse_index(pb, b, h, q0, sq, i)] = (float)acc;
    }
}

/* dsinks[h] = -sum over the rows of head h of P_sink D, P_sink = e^(sink -
 * lse): a sink is a key of value 0, so its dP is 0 and dS = P (0 - D). */
static void sink_grads(const fmha_problem *pb, const float *D)
{
    const fmha_backward_args *a = pb->bwd;
    for (int64_t h = 0; h < pb->heads; h++) {
        double acc = 0.0;
        for (int64_t b = 0; a->sinks[h] != -INFINITY && b < pb->batch; b++) {
            int64_t q0, sq, k0, sk;
            fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
            for (int64_t i = 0; i < sq; i++) {
                const int64_t at = lse_index(pb, b, h, q0, sq, i);
                acc -= exp((double)a->sinks[h] - a->lse[at]) * D[at];
            }
        }
        a->dsinks[h] = (float)acc;
    }
}

/* The sequence of `task` among prefix sums start[0..n]. */
static int64_t seq_of(const int64_t *start, int64_t n, int64_t task)
{
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (start[mid] <= task)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

fmha_status fmha_cpu_backward(const fmha_problem *pb, const fmha_kernel_info *kernel,
                              fmha_cpu_workspace *ws)
{
    const fmha_backward_args *a = pb->bwd;
    const fmha_cpu_ops *ops = ops_table[kernel->id];
    bwd_call c = {.pb = pb,
                  .a = a,
                  .ops = ops,
                  .dkp = round_up(pb->d, ops->lanes),
                  .dvp = round_up(pb->dv, ops->lanes),
                  .exp_scale = pb->cfg->softcap > 0 ? 1.0f : (float)(pb->scale * LOG2E),
                  .bias_unit = fmha_cpu_bias_unit(pb),
                  .want_dk = a->dk.data != NULL,
                  .want_dv = a->dv.data != NULL};
    bwd_scratch unused;
    const size_t per_thread = scratch_take(NULL, c.dkp, c.dvp, &unused);
    /* D has one entry per LSE entry. */
    const int64_t nD = pb->varlen ? pb->heads * a->q.seqlen : pb->batch * pb->heads * a->q.seqlen;
    const size_t d_bytes = ((size_t)nD * sizeof(float) + 63) & ~(size_t)63;

    /* Tasks: dK/dV (sequence, KV head, key tile), then dQ (sequence, head,
     * query tile), counts prefix-summed over sequences. */
    int64_t *start = fmha_malloc(sizeof(int64_t) * 2 * (size_t)(pb->batch + 1));
    if (!start)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory planning CPU tasks");
    int64_t *kv_start = start, *q_start = start + pb->batch + 1;
    kv_start[0] = q_start[0] = 0;
    for (int64_t b = 0; b < pb->batch; b++) {
        int64_t q0, sq, k0, sk;
        fmha_seq_bounds(pb, b, &q0, &sq, &k0, &sk);
        const int kv = c.want_dk || c.want_dv, q = a->dq.data != NULL;
        kv_start[b + 1] = kv_start[b] + (kv ? (sk + BR - 1) / BR * pb->kv_heads : 0);
        q_start[b + 1] = q_start[b] + (q ? (sq + BR - 1) / BR * pb->heads : 0);
    }
    const int64_t n_kv = kv_start[pb->batch], ntasks = n_kv + q_start[pb->batch];

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
        (size_t)nthreads > (SIZE_MAX - d_bytes) / per_thread
            ? fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "CPU workspace of %d x %zu bytes overflows",
                             nthreads, per_thread)
            : fmha_cpu_workspace_reserve(ws, d_bytes + per_thread * (size_t)nthreads);
    if (st != FMHA_STATUS_OK) {
        fmha_free(start);
        return st;
    }
    float *D = ws->buf;
    c.D = D;

    /* Tokens of a packed batch that belong to no sequence get zero gradients. */
    if (pb->varlen) {
        zero_rows(&a->dq, a->cu_seqlens_q[pb->batch], a->q.seqlen);
        zero_rows(&a->dk, a->cu_seqlens_k[pb->batch], a->k.seqlen);
        zero_rows(&a->dv, a->cu_seqlens_k[pb->batch], a->v.seqlen);
    }

#pragma omp parallel num_threads(nthreads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        bwd_scratch s;
        scratch_take((char *)ws->buf + d_bytes + per_thread * (size_t)tid, c.dkp, c.dvp, &s);
        for (int i = 0; i < BR; i++)
            s.ones[i] = 1.0f;
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t b = 0; b < pb->batch; b++)
            for (int64_t h = 0; h < pb->heads; h++)
                rowsum_task(&c, D, b, h);
                /* (the loop's barrier: every D is there before a task reads it) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; task++) {
            if (task < n_kv) {
                const int64_t b = seq_of(kv_start, pb->batch, task), local = task - kv_start[b];
                dkv_task(&c, &s, b, local % pb->kv_heads, local / pb->kv_heads);
            } else {
                const int64_t b = seq_of(q_start, pb->batch, task - n_kv);
                const int64_t local = task - n_kv - q_start[b];
                dq_task(&c, &s, b, local % pb->heads, local / pb->heads);
            }
        }
    }
    fmha_free(start);
    if (a->dsinks)
        sink_grads(pb, D);
    return FMHA_STATUS_OK;
}
