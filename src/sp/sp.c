/* sp.c — sequence-parallel attention (fmha_sp_forward): Ulysses'
 * all-to-all, the ring's rotation with its partial results merged by their
 * LSEs, both at once, and joint tokens, on any fmha_comm (transport.h) and
 * the communicator's device through the backend's operations (backend.h).
 * The attention of every piece is fmha's own forward (layer.h's pieces). */
#include "transport.h"
#include "../alloc.h"
#include "../backends.h"
#include "../layer.h"
#include "../validate.h"

/* Buffers this call allocates; freed together. */
enum { MAX_BUFS = 32 };

typedef struct sp_run {
    const fmha_config *cfg;
    const fmha_sp_args *a;
    fmha_comm *comm;
    const fmha_backend *be;
    fmha_sp_problem pb;
    fmha_sp_config sp;
    fmha_layer *layer; /* H / u query heads, the pieces' masks replace its own */
    void *stream;
    int64_t head0; /* this rank's first query head */
    void *bufs[MAX_BUFS];
    int nbufs;
    void *pending;       /* the ring's transfer in flight, polled between pieces */
    struct run *run_mem; /* host memory of two run lists (runs_of) of run_cap each */
    int64_t run_cap;
    int64_t *member_at; /* [u], runs_of's scratch */
    /* The running result of this rank's query rows and of the text's rows. */
    fmha_tensor acc, tacc; /* f32, token-major */
    fmha_lse_view acc_lse, tacc_lse;
    fmha_tensor tmp; /* one piece's output, f32, token-major, rows of the longest */
    float *tmp_lse;
} sp_run;

static fmha_status take(sp_run *r, void **p, size_t bytes)
{
    if (r->nbufs == MAX_BUFS)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "sequence parallelism: too many buffers");
    fmha_status st = r->be->scratch(p, bytes ? bytes : 1, r->stream);
    if (st == FMHA_STATUS_OK)
        r->bufs[r->nbufs++] = *p;
    return st;
}

/* A token-major tensor [n tokens][batch][heads][d] seen as [batch, n, heads,
 * d]: a run of tokens is one contiguous block, as the transfers want. */
static fmha_tensor token_major(void *data, fmha_dtype dt, int64_t batch, int64_t n, int64_t heads,
                               int64_t d)
{
    fmha_tensor t = {data, dt, batch, n, heads, d, heads * d, batch * heads * d, d, 1};
    return t;
}

static size_t elem_bytes(const fmha_tensor *t)
{
    return fmha_dtype_size(t->dtype);
}

static fmha_tensor rows_of(fmha_tensor t, int64_t r0, int64_t n)
{
    if (n > 0)
        t.data = (char *)t.data + r0 * t.stride_seq * (int64_t)elem_bytes(&t);
    t.seqlen = n;
    return t;
}

static fmha_tensor heads_of(fmha_tensor t, int64_t h0, int64_t n)
{
    t.data = (char *)t.data + h0 * t.stride_head * (int64_t)elem_bytes(&t);
    t.heads = n;
    return t;
}

/* Bytes of a token-major block of n tokens. */
static size_t block_bytes(const fmha_tensor *t, int64_t n)
{
    return (size_t)(n * t->stride_seq) * elem_bytes(t);
}

/* LSE [batch][heads][rows] seen as a tensor [batch, heads, rows, 1] of f32,
 * tokens r0 .. r0 + n, so that copies move it like any view. */
static fmha_tensor lse_tensor(float *data, int64_t batch, int64_t heads, int64_t stride_batch,
                              int64_t stride_head, int64_t r0, int64_t n)
{
    fmha_tensor t = {data + r0, FMHA_DTYPE_F32, batch,       heads, n,
                     1,         stride_batch,   stride_head, 1,     1};
    return t;
}

static void poll(sp_run *r)
{
    if (r->pending && r->comm->ops->progress)
        r->comm->ops->progress(r->comm, r->pending);
}

/* Attention of query rows at sequence positions [qpos, qpos + nq) of
 * packed sequence `seq` (-1: the padded batch's sequences) (q, with
 * their running result at acc / acc_lse) to the keys at [kpos, kpos + nk)
 * (k, v), merged into the running result. The mask is the call's, at these
 * positions: rows and keys that see nothing of each other are trimmed, and
 * what is left runs as one piece whose bottom-right-aligned window is the
 * whole problem's band moved to the piece (the band offset e - b). */
static fmha_status attend(sp_run *r, int64_t seq, const fmha_tensor *q, int64_t qpos,
                          const fmha_tensor *acc, fmha_lse_view acc_lse, const fmha_tensor *k,
                          const fmha_tensor *v, int64_t kpos)
{
    const int64_t wl = r->cfg->window_left, wr = r->cfg->causal ? 0 : r->cfg->window_right;
    int64_t a = qpos, b = qpos + q->seqlen, c = kpos, e = kpos + k->seqlen;
    if (wr >= 0) { /* row i sees keys up to i + wr */
        if (e > b - 1 + wr + 1)
            e = b + wr;
        if (a < c - wr)
            a = c - wr;
    }
    if (wl >= 0) { /* row i sees keys from i - wl */
        if (b > e + wl)
            b = e + wl;
        if (c < a - wl)
            c = a - wl;
    }
    if (e <= c || b <= a)
        return FMHA_STATUS_OK;
    poll(r);
    const int64_t rows = b - a;
    fmha_forward_args f;
    memset(&f, 0, sizeof f);
    f.q = rows_of(*q, a - qpos, rows);
    f.k = rows_of(*k, c - kpos, e - c);
    f.v = rows_of(*v, c - kpos, e - c);
    const int64_t bh = r->pb.batch * r->pb.lheads;
    f.out = rows_of(r->tmp, 0, rows);
    f.lse = r->tmp_lse;
    f.seed = r->a->seed;
    f.offset = r->a->offset;
    f.stream = r->stream;
    /* A packed sequence's dropout stream: its heads follow the sequences
     * before it (the kernels draw at seq * heads + head, seq 0 here). */
    const int64_t head0 = (seq > 0 ? seq * r->pb.heads : 0) + r->head0;
    fmha_piece piece = {
        0, wl < 0 ? -1 : wl + (e - b), wr < 0 ? -1 : wr - (e - b), a, c, head0, r->pb.heads};
    fmha_status st = fmha_layer_forward_piece(r->layer, &f, &piece);
    if (st != FMHA_STATUS_OK)
        return st;
    poll(r);
    const fmha_tensor parts[2] = {rows_of(*acc, a - qpos, rows), f.out};
    const fmha_lse_view lses[2] = {
        {acc_lse.data + (a - qpos), acc_lse.stride_batch, acc_lse.stride_head},
        {r->tmp_lse, bh / r->pb.batch * rows, rows}};
    const fmha_merge_problem mp = {2, parts, lses, parts[0], lses[0]};
    return r->be->merge(&mp, r->stream);
}

/* A run of a slot's tokens in its buffers: rows [row, row + len) hold
 * positions [pos, pos + len) of packed sequence seq (-1: the padded batch,
 * whose sequences are the buffers' batch). */
typedef struct run {
    int64_t row, seq, pos, len;
} run;

typedef struct run_list {
    int64_t n, rows; /* runs, and the rows they cover */
    run *v;
} run_list;

/* Sequence b's tokens (the whole of them: s tokens, positions from pos0). */
static void sequence(const fmha_sp_problem *pb, int64_t b, int64_t *s, int64_t *pos0)
{
    *s = pb->nseq ? pb->cu[b + 1] - pb->cu[b] : pb->seqlen;
    *pos0 = pb->nseq ? 0 : pb->img0;
}

/* How many tokens Ulysses member j of ring slot `slot` holds. */
static int64_t member_count(const sp_run *r, int slot, int j)
{
    return fmha_sp_member_tokens(&r->sp, r->pb.seqlen, r->pb.cu, r->pb.nseq, slot, j);
}

/* Member j's rows of slot `slot`'s buffers: [*row0, *row0 + *n). */
static void member_rows(const sp_run *r, int slot, int j, int64_t *row0, int64_t *n)
{
    *row0 = 0;
    for (int m = 0; m < j; m++)
        *row0 += member_count(r, slot, m);
    *n = member_count(r, slot, j);
}

static int64_t slot_rows(const sp_run *r, int slot)
{
    int64_t n = 0;
    for (int j = 0; j < r->pb.u; j++)
        n += member_count(r, slot, j);
    return n;
}

/* Slot `slot`'s runs, listed sequence by sequence (the order attend_runs
 * pairs them in). The buffers hold the slot's tokens member by member (an
 * all-to-all moves one block per member), each member's as its own tensors
 * do: sequence 0's tokens, then sequence 1's. A padded batch is one
 * sequence, and its members' tokens follow each other: at most two runs. */
static void runs_of(const sp_run *r, int slot, run *mem, run_list *l)
{
    const fmha_sp_problem *pb = &r->pb;
    int64_t *at = r->member_at, s, pos0;
    at[0] = 0;
    for (int j = 1; j < pb->u; j++)
        at[j] = at[j - 1] + member_count(r, slot, j - 1);
    l->n = l->rows = 0;
    l->v = mem;
    for (int64_t b = 0; b < (pb->nseq ? pb->nseq : 1); b++) {
        sequence(pb, b, &s, &pos0);
        const fmha_sp_tokmap t = fmha_sp_slot_tokens(s, pb->r, r->sp.layout, slot);
        for (int j = 0; j < pb->u; j++) {
            const fmha_sp_tokmap m =
                fmha_sp_tokmap_range(&t, fmha_sp_member_offset(t.total, pb->u, j),
                                     fmha_sp_member_offset(t.total, pb->u, j + 1));
            for (int k = 0; k < m.n; k++) {
                const run x = {at[j], pb->nseq ? b : -1, pos0 + m.start[k], m.len[k]};
                run *last = l->n ? &l->v[l->n - 1] : NULL;
                if (last && last->seq == x.seq && last->row + last->len == x.row &&
                    last->pos + last->len == x.pos)
                    last->len += x.len; /* adjacent in the buffer and the sequence: one */
                else
                    l->v[l->n++] = x;
                at[j] += x.len;
                l->rows += x.len;
            }
        }
    }
}

/* The query rows of `qs` (tensor q, running result acc) against the keys
 * of `ks` (k, v) of the same sequence. */
static fmha_status attend_runs(sp_run *r, const fmha_tensor *q, const run_list *qs,
                               const fmha_tensor *acc, fmha_lse_view acc_lse, const fmha_tensor *k,
                               const fmha_tensor *v, const run_list *ks)
{
    int64_t j0 = 0;
    for (int64_t i = 0; i < qs->n; i++) {
        const run *x = &qs->v[i];
        while (j0 < ks->n && ks->v[j0].seq < x->seq)
            j0++;
        for (int64_t j = j0; j < ks->n && ks->v[j].seq == x->seq; j++) {
            const run *y = &ks->v[j];
            const fmha_tensor qi = rows_of(*q, x->row, x->len);
            const fmha_tensor ki = rows_of(*k, y->row, y->len);
            const fmha_tensor vi = rows_of(*v, y->row, y->len);
            const fmha_tensor ai = rows_of(*acc, x->row, x->len);
            const fmha_lse_view li = {acc_lse.data + x->row, acc_lse.stride_batch,
                                      acc_lse.stride_head};
            fmha_status st = attend(r, x->seq, &qi, x->pos, &ai, li, &ki, &vi, y->pos);
            if (st != FMHA_STATUS_OK)
                return st;
        }
    }
    return FMHA_STATUS_OK;
}

/* Starts transfers, counting the bytes sent (fmha_comm_bytes_sent). */
static fmha_status start(sp_run *r, const fmha_comm_xfer *x, int n, void **pending)
{
    for (int i = 0; i < n; i++)
        if (x[i].send)
            r->comm->bytes_sent += (int64_t)x[i].bytes;
    return r->comm->ops->start(r->comm, x, n, pending);
}

static fmha_status exchange(sp_run *r, const fmha_comm_xfer *x, int n)
{
    void *p;
    fmha_status st = start(r, x, n, &p);
    return st != FMHA_STATUS_OK ? st : r->comm->ops->wait(r->comm, p);
}

static int rank_of(const sp_run *r, int slot, int member)
{
    return slot * r->pb.u + member;
}

/* Ulysses, forward: this rank's tokens of every head to the members of its
 * slot, heads H / u of the slot's tokens back, q, k and v in one exchange.
 * Q, K, V are token-major [L][B][heads][d] buffers of the slot. */
static fmha_status ulysses_in(sp_run *r, const fmha_tensor *Q, const fmha_tensor *K,
                              const fmha_tensor *V)
{
    const fmha_sp_problem *pb = &r->pb;
    const fmha_sp_args *a = r->a;
    const int u = pb->u;
    int64_t my0, n;
    member_rows(r, pb->slot, pb->member, &my0, &n);
    /* Send blocks: member j's heads of this rank's n tokens, token-major. */
    const size_t qb = (size_t)(n * pb->batch * pb->lheads * pb->d) * fmha_dtype_size(Q->dtype);
    const size_t kb = (size_t)(n * pb->batch * pb->lkv * pb->d) * fmha_dtype_size(K->dtype);
    const size_t vb = (size_t)(n * pb->batch * pb->lkv * pb->dv) * fmha_dtype_size(V->dtype);
    char *send;
    fmha_status st = take(r, (void **)&send, (qb + kb + vb) * (size_t)u);
    if (st != FMHA_STATUS_OK)
        return st;
    fmha_comm_xfer *x = fmha_malloc(sizeof *x * 6 * (size_t)u);
    if (!x)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for %d transfers", 6 * u);
    int nx = 0;
    for (int j = 0; j < u && st == FMHA_STATUS_OK; j++) {
        const int64_t kv0 = fmha_sp_kv_head0(pb, j);
        int64_t off, len;
        member_rows(r, pb->slot, j, &off, &len);
        const fmha_tensor src[3] = {heads_of(a->q, j * pb->lheads, pb->lheads),
                                    heads_of(a->k, kv0, pb->lkv), heads_of(a->v, kv0, pb->lkv)};
        const fmha_tensor *whole[3] = {Q, K, V};
        char *blk = send + (qb + kb + vb) * (size_t)j;
        const size_t sizes[3] = {qb, kb, vb};
        for (int t = 0; t < 3 && st == FMHA_STATUS_OK; t++) {
            if (j == pb->member) { /* this rank's own heads: straight into place */
                const fmha_tensor dst = rows_of(*whole[t], my0, n);
                st = r->be->copy(&dst, &src[t], r->stream);
                continue;
            }
            const fmha_tensor dst =
                token_major(blk, whole[t]->dtype, pb->batch, n, src[t].heads, src[t].head_dim);
            st = r->be->copy(&dst, &src[t], r->stream);
            blk += sizes[t];
            x[nx++] = (fmha_comm_xfer){rank_of(r, pb->slot, j), 1, dst.data, sizes[t]};
            x[nx++] =
                (fmha_comm_xfer){rank_of(r, pb->slot, j), 0, rows_of(*whole[t], off, len).data,
                                 block_bytes(whole[t], len)};
        }
    }
    if (st == FMHA_STATUS_OK)
        st = exchange(r, x, nx);
    fmha_free(x);
    return st;
}

/* Ulysses, backward: the slot's rows of H / u heads (acc) to their owners,
 * this rank's rows of every head into out (and lse), in one exchange. */
static fmha_status ulysses_out(sp_run *r)
{
    const fmha_sp_problem *pb = &r->pb;
    const fmha_sp_args *a = r->a;
    const int u = pb->u;
    const int64_t L = r->acc.seqlen, n = pb->local, bh = pb->batch * pb->lheads;
    const fmha_dtype odt = a->out.dtype;
    char *obuf, *recv;
    float *lsend = NULL, *lrecv = NULL;
    const size_t ob = (size_t)(n * pb->batch * pb->lheads * pb->dv) * fmha_dtype_size(odt);
    fmha_status st = take(r, (void **)&obuf, block_bytes(&r->acc, L) / 4 * fmha_dtype_size(odt));
    if (st == FMHA_STATUS_OK)
        st = take(r, (void **)&recv, ob * (size_t)u);
    if (st == FMHA_STATUS_OK && a->lse) {
        st = take(r, (void **)&lsend, sizeof(float) * (size_t)(bh * L));
        if (st == FMHA_STATUS_OK)
            st = take(r, (void **)&lrecv, sizeof(float) * (size_t)(bh * n) * (size_t)u);
    }
    if (st != FMHA_STATUS_OK)
        return st;
    const fmha_tensor ot = token_major(obuf, odt, pb->batch, L, pb->lheads, pb->dv);
    if ((st = r->be->copy(&ot, &r->acc, r->stream)) != FMHA_STATUS_OK)
        return st;
    fmha_comm_xfer *x = fmha_malloc(sizeof *x * 4 * (size_t)u);
    if (!x)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for %d transfers", 4 * u);
    int nx = 0;
    for (int j = 0; j < u && st == FMHA_STATUS_OK; j++) {
        int64_t off, len;
        member_rows(r, pb->slot, j, &off, &len);
        const int peer = rank_of(r, pb->slot, j);
        if (j != pb->member) {
            x[nx++] = (fmha_comm_xfer){peer, 1, rows_of(ot, off, len).data, block_bytes(&ot, len)};
            x[nx++] = (fmha_comm_xfer){peer, 0, recv + ob * (size_t)j, ob};
        }
        if (a->lse) { /* [B][H/u][len] blocks, packed */
            float *blk = lsend + bh * off;
            const fmha_tensor src =
                lse_tensor(r->acc_lse.data, pb->batch, pb->lheads, r->acc_lse.stride_batch,
                           r->acc_lse.stride_head, off, len);
            const fmha_tensor dst =
                lse_tensor(blk, pb->batch, pb->lheads, pb->lheads * len, len, 0, len);
            st = r->be->copy(&dst, &src, r->stream);
            if (j != pb->member) {
                x[nx++] = (fmha_comm_xfer){peer, 1, blk, sizeof(float) * (size_t)(bh * len)};
                x[nx++] =
                    (fmha_comm_xfer){peer, 0, lrecv + bh * n * j, sizeof(float) * (size_t)(bh * n)};
            }
        }
    }
    if (st == FMHA_STATUS_OK)
        st = exchange(r, x, nx);
    fmha_free(x);
    int64_t my0, mine;
    member_rows(r, pb->slot, pb->member, &my0, &mine);
    for (int j = 0; j < u && st == FMHA_STATUS_OK; j++) {
        const fmha_tensor src = j == pb->member ? rows_of(ot, my0, n)
                                                : token_major(recv + ob * (size_t)j, odt, pb->batch,
                                                              n, pb->lheads, pb->dv);
        const fmha_tensor dst = heads_of(a->out, j * pb->lheads, pb->lheads);
        st = r->be->copy(&dst, &src, r->stream);
        if (st == FMHA_STATUS_OK && a->lse) {
            const fmha_tensor ls =
                j == pb->member
                    ? lse_tensor(lsend + bh * my0, pb->batch, pb->lheads, pb->lheads * n, n, 0, n)
                    : lse_tensor(lrecv + bh * n * j, pb->batch, pb->lheads, pb->lheads * n, n, 0,
                                 n);
            const fmha_tensor ld = lse_tensor(a->lse + j * pb->lheads * n, pb->batch, pb->lheads,
                                              pb->heads * n, n, 0, n);
            st = r->be->copy(&ld, &ls, r->stream);
        }
    }
    return st;
}

/* Joint tokens: every rank's partial result for the text rows of its heads
 * (its slot's keys; slot 0 also the text's own) to every rank, and there
 * merged slot by slot into out_joint. */
static fmha_status joint_out(sp_run *r)
{
    const fmha_sp_problem *pb = &r->pb;
    const fmha_sp_args *a = r->a;
    const int ranks = pb->u * pb->r, me = rank_of(r, pb->slot, pb->member);
    const int64_t T = pb->text, bh = pb->batch * pb->lheads;
    const size_t ob = block_bytes(&r->tacc, T), lb = sizeof(float) * (size_t)(bh * T);
    char *all;
    fmha_status st = take(r, (void **)&all, (ob + lb) * (size_t)ranks);
    if (st != FMHA_STATUS_OK)
        return st;
    fmha_comm_xfer *x = fmha_malloc(sizeof *x * 4 * (size_t)ranks);
    if (!x)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for %d transfers",
                              4 * ranks);
    int nx = 0;
    for (int p = 0; p < ranks; p++) {
        if (p == me)
            continue;
        char *slot = all + (ob + lb) * (size_t)p;
        x[nx++] = (fmha_comm_xfer){p, 1, r->tacc.data, ob};
        x[nx++] = (fmha_comm_xfer){p, 1, r->tacc_lse.data, lb};
        x[nx++] = (fmha_comm_xfer){p, 0, slot, ob};
        x[nx++] = (fmha_comm_xfer){p, 0, slot + ob, lb};
    }
    st = exchange(r, x, nx);
    fmha_free(x);
    /* Member j's heads: the r slots' partials, merged FMHA_MERGE_MAX_PARTS - 1 at a
     * time into the first, then written to out_joint in its dtype. */
    for (int j = 0; j < pb->u && st == FMHA_STATUS_OK; j++) {
        fmha_tensor parts[FMHA_MERGE_MAX_PARTS];
        fmha_lse_view lses[FMHA_MERGE_MAX_PARTS];
        int n = 0;
        for (int s = 0; s < pb->r && st == FMHA_STATUS_OK; s++) {
            const int p = rank_of(r, s, j);
            char *slot = all + (ob + lb) * (size_t)p;
            parts[n] = p == me
                           ? r->tacc
                           : token_major(slot, FMHA_DTYPE_F32, pb->batch, T, pb->lheads, pb->dv);
            lses[n] =
                p == me ? r->tacc_lse : (fmha_lse_view){(float *)(slot + ob), pb->lheads * T, T};
            n++;
            if (n == FMHA_MERGE_MAX_PARTS || s == pb->r - 1) {
                const fmha_merge_problem mp = {n, parts, lses, parts[0], lses[0]};
                st = r->be->merge(&mp, r->stream);
                n = 1; /* the merge so far is part 0 of the next */
            }
        }
        if (st != FMHA_STATUS_OK)
            break;
        const fmha_tensor dst = heads_of(a->out_joint, j * pb->lheads, pb->lheads);
        st = r->be->copy(&dst, &parts[0], r->stream);
        if (st == FMHA_STATUS_OK && a->lse_joint) {
            const fmha_tensor ls =
                lse_tensor(lses[0].data, pb->batch, pb->lheads, lses[0].stride_batch, T, 0, T);
            const fmha_tensor ld = lse_tensor(a->lse_joint + j * pb->lheads * T, pb->batch,
                                              pb->lheads, pb->heads * T, T, 0, T);
            st = r->be->copy(&ld, &ls, r->stream);
        }
    }
    return st;
}

static fmha_status sp_forward(sp_run *r)
{
    const fmha_sp_problem *pb = &r->pb;
    const fmha_sp_args *a = r->a;
    const int64_t B = pb->batch, Hl = pb->lheads, KVl = pb->lkv, T = pb->text;
    const fmha_dtype dt = r->cfg->dtype;
    fmha_status st;

    /* This slot's tokens and the longest slot's. */
    run_list mine, keys;
    runs_of(r, pb->slot, r->run_mem, &mine);
    const int64_t L = mine.rows;
    int64_t Lmax = 0;
    for (int s = 0; s < pb->r; s++) {
        const int64_t n = slot_rows(r, s);
        Lmax = n > Lmax ? n : Lmax;
    }
    const int64_t rows_max = L > T ? L : T;

    /* The slot's queries and the two K/V buffers of the ring (the first
     * holds this slot's keys). Without Ulysses or ring they are the
     * caller's views. */
    fmha_tensor Q = a->q, K[2] = {a->k, a->k}, V[2] = {a->v, a->v};
    void *p;
    if (pb->u > 1) {
        if ((st = take(r, &p, (size_t)(L * B * Hl * pb->d) * fmha_dtype_size(dt))) !=
            FMHA_STATUS_OK)
            return st;
        Q = token_major(p, dt, B, L, Hl, pb->d);
    }
    const int kv_buffers = pb->r > 1 ? 2 : pb->u > 1 ? 1 : 0;
    for (int i = 0; i < kv_buffers; i++) {
        if ((st = take(r, &p, (size_t)(Lmax * B * KVl * pb->d) * fmha_dtype_size(dt))) !=
            FMHA_STATUS_OK)
            return st;
        K[i] = token_major(p, dt, B, L, KVl, pb->d);
        if ((st = take(r, &p, (size_t)(Lmax * B * KVl * pb->dv) * fmha_dtype_size(dt))) !=
            FMHA_STATUS_OK)
            return st;
        V[i] = token_major(p, dt, B, L, KVl, pb->dv);
    }
    /* Running results and one piece's output. */
    if ((st = take(r, &p, sizeof(float) * (size_t)(L * B * Hl * pb->dv))) != FMHA_STATUS_OK)
        return st;
    r->acc = token_major(p, FMHA_DTYPE_F32, B, L, Hl, pb->dv);
    if ((st = take(r, &p, sizeof(float) * (size_t)(B * Hl * L))) != FMHA_STATUS_OK)
        return st;
    r->acc_lse = (fmha_lse_view){p, Hl * L, L};
    if ((st = take(r, &p, sizeof(float) * (size_t)(rows_max * B * Hl * pb->dv))) !=
            FMHA_STATUS_OK ||
        (st = take(r, (void **)&r->tmp_lse, sizeof(float) * (size_t)(B * Hl * rows_max))) !=
            FMHA_STATUS_OK)
        return st;
    r->tmp = token_major(p, FMHA_DTYPE_F32, B, rows_max, Hl, pb->dv);
    if ((st = r->be->fill_f32(r->acc_lse.data, B * Hl * L, -INFINITY, r->stream)) != FMHA_STATUS_OK)
        return st;
    fmha_tensor tq = {0}, tk = {0}, tv = {0};
    run text_run = {0, -1, pb->text0, T};
    const run_list text = {T > 0, T, &text_run};
    if (T > 0) {
        if ((st = take(r, &p, sizeof(float) * (size_t)(T * B * Hl * pb->dv))) != FMHA_STATUS_OK)
            return st;
        r->tacc = token_major(p, FMHA_DTYPE_F32, B, T, Hl, pb->dv);
        if ((st = take(r, &p, sizeof(float) * (size_t)(B * Hl * T))) != FMHA_STATUS_OK)
            return st;
        r->tacc_lse = (fmha_lse_view){p, Hl * T, T};
        if ((st = r->be->fill_f32(r->tacc_lse.data, B * Hl * T, -INFINITY, r->stream)) !=
            FMHA_STATUS_OK)
            return st;
        const int64_t kv0 = fmha_sp_kv_head0(pb, pb->member);
        tq = heads_of(a->q_joint, r->head0, Hl);
        tk = heads_of(a->k_joint, kv0, KVl);
        tv = heads_of(a->v_joint, kv0, KVl);
    }

    /* Ulysses: the slot's tokens of this rank's heads. */
    if (pb->u > 1) {
        if ((st = ulysses_in(r, &Q, &K[0], &V[0])) != FMHA_STATUS_OK)
            return st;
    } else if (pb->r > 1) {
        if ((st = r->be->copy(&K[0], &a->k, r->stream)) != FMHA_STATUS_OK ||
            (st = r->be->copy(&V[0], &a->v, r->stream)) != FMHA_STATUS_OK)
            return st;
    }

    /* Ring: at step t the keys of slot (slot - t) are here and those of the
     * slot before travel into the other buffer meanwhile. */
    const int next = rank_of(r, (pb->slot + 1) % pb->r, pb->member);
    const int prev = rank_of(r, (pb->slot + pb->r - 1) % pb->r, pb->member);
    for (int t = 0; t < pb->r && st == FMHA_STATUS_OK; t++) {
        const int cur = t & 1, slot = (pb->slot - t + pb->r) % pb->r;
        runs_of(r, slot, r->run_mem + r->run_cap, &keys);
        const int64_t klen = keys.rows;
        K[cur].seqlen = V[cur].seqlen = klen;
        r->pending = NULL;
        if (t < pb->r - 1) {
            const int64_t ilen = slot_rows(r, (slot + pb->r - 1) % pb->r);
            const fmha_comm_xfer x[4] = {
                {next, 1, K[cur].data, block_bytes(&K[cur], klen)},
                {next, 1, V[cur].data, block_bytes(&V[cur], klen)},
                {prev, 0, K[1 - cur].data, block_bytes(&K[1 - cur], ilen)},
                {prev, 0, V[1 - cur].data, block_bytes(&V[1 - cur], ilen)},
            };
            if ((st = start(r, x, 4, &r->pending)) != FMHA_STATUS_OK)
                return st;
        }
        st = attend_runs(r, &Q, &mine, &r->acc, r->acc_lse, &K[cur], &V[cur], &keys);
        if (st == FMHA_STATUS_OK && T > 0 && t == 0) {
            /* Joint tokens: this slot's rows to the text's keys, the text's rows to
             * this slot's keys, and (slot 0) the text's rows to its own keys. */
            st = attend_runs(r, &Q, &mine, &r->acc, r->acc_lse, &tk, &tv, &text);
            if (st == FMHA_STATUS_OK)
                st = attend_runs(r, &tq, &text, &r->tacc, r->tacc_lse, &K[cur], &V[cur], &keys);
            if (st == FMHA_STATUS_OK && pb->slot == 0)
                st = attend_runs(r, &tq, &text, &r->tacc, r->tacc_lse, &tk, &tv, &text);
        }
        if (r->pending) {
            fmha_status w = r->comm->ops->wait(r->comm, r->pending);
            r->pending = NULL;
            if (st == FMHA_STATUS_OK)
                st = w;
        }
    }
    if (st != FMHA_STATUS_OK)
        return st;

    /* Ulysses back, or the slot's rows straight out. */
    if (pb->u > 1) {
        st = ulysses_out(r);
    } else {
        st = r->be->copy(&a->out, &r->acc, r->stream);
        if (st == FMHA_STATUS_OK && a->lse) {
            const fmha_tensor ls = lse_tensor(r->acc_lse.data, B, Hl, Hl * L, L, 0, L);
            const fmha_tensor ld = lse_tensor(a->lse, B, Hl, Hl * L, L, 0, L);
            st = r->be->copy(&ld, &ls, r->stream);
        }
    }
    if (st == FMHA_STATUS_OK && T > 0)
        st = joint_out(r);
    return st;
}

void fmha_sp_config_init(fmha_sp_config *sp, int ulysses, int ring)
{
    memset(sp, 0, sizeof *sp);
    sp->ulysses = ulysses;
    sp->ring = ring;
    sp->layout = FMHA_SP_LAYOUT_CONTIGUOUS;
}

fmha_status fmha_sp_tokens(const fmha_sp_config *sp, int64_t seqlen, int rank, int64_t start[2],
                           int64_t len[2], int *nseg)
{
    fmha_clear_error();
    fmha_status st = fmha_validate_sp_config(sp, sp ? sp->ulysses * sp->ring : 0);
    if (st != FMHA_STATUS_OK)
        return st;
    if (!start || !len || !nseg)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "start, len and nseg must not be NULL");
    if (seqlen < 0 || seqlen > ((int64_t)1 << 40))
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "seqlen (%lld) must be in [0, 2^40]",
                              (long long)seqlen);
    if (rank < 0 || rank >= sp->ulysses * sp->ring)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "rank (%d) must be in [0, %d): ulysses %d x ring %d ranks", rank,
                              sp->ulysses * sp->ring, sp->ulysses, sp->ring);
    const fmha_sp_tokmap t = fmha_sp_rank_tokens(sp, seqlen, rank);
    *nseg = t.n;
    for (int i = 0; i < 2; i++) {
        start[i] = i < t.n ? t.start[i] : 0;
        len[i] = i < t.n ? t.len[i] : 0;
    }
    return FMHA_STATUS_OK;
}

/* comm's layer for `local` (the local heads' configuration): the one of the
 * latest call where the configuration is the same, else a new one that
 * replaces it. */
static fmha_status comm_layer(fmha_comm *comm, const fmha_config *local, fmha_layer **layer)
{
    if (comm->layer && !memcmp(&comm->layer_cfg, local, sizeof *local)) {
        *layer = comm->layer;
        return FMHA_STATUS_OK;
    }
    fmha_layer_free(comm->layer);
    comm->layer = NULL;
    const fmha_status st = fmha_layer_init(&comm->layer, local);
    if (st == FMHA_STATUS_OK)
        comm->layer_cfg = *local;
    *layer = comm->layer;
    return st;
}

fmha_status fmha_sp_forward(const fmha_config *cfg, const fmha_sp_config *sp, fmha_comm *comm,
                            const fmha_sp_args *args)
{
    fmha_clear_error();
    if (!comm)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "comm is NULL: make one with fmha_comm_init");
    sp_run r;
    memset(&r, 0, sizeof r);
    fmha_status st = fmha_validate_sp(cfg, sp, comm->rank, comm->size, comm->device,
                                      fmha_comm_kind_name(comm->kind), args, &r.pb);
    if (st != FMHA_STATUS_OK)
        return st;
    r.cfg = cfg;
    r.a = args;
    r.sp = *sp;
    r.comm = comm;
    r.stream = comm->stream;
    r.be = fmha_backend_of(cfg->device);
    r.head0 = r.pb.member * r.pb.lheads;
    if (!r.be)
        return fmha_set_error(FMHA_STATUS_UNSUPPORTED, "this fmha has no %s backend",
                              cfg->device == FMHA_DEVICE_CUDA ? "CUDA" : "CPU");
    /* At most two runs per member and sequence (zigzag). */
    r.run_cap = 2 * (int64_t)r.pb.u * (r.pb.nseq ? r.pb.nseq : 1);
    r.run_mem = fmha_malloc(sizeof(struct run) * 2 * (size_t)r.run_cap);
    r.member_at = fmha_malloc(sizeof(int64_t) * (size_t)r.pb.u);
    if (!r.run_mem || !r.member_at) {
        fmha_free(r.run_mem);
        fmha_free(r.member_at);
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY,
                              "out of memory for the token runs of %lld sequences over %d "
                              "Ulysses ranks",
                              (long long)(r.pb.nseq ? r.pb.nseq : 1), r.pb.u);
    }
    fmha_config local = *cfg;
    local.num_heads = r.pb.lheads;
    local.num_kv_heads = r.pb.lkv;
    if ((st = comm_layer(comm, &local, &r.layer)) == FMHA_STATUS_OK && r.pb.batch > 0)
        st = sp_forward(&r);
    if (r.pending)
        r.comm->ops->wait(r.comm, r.pending);
    for (int i = 0; i < r.nbufs; i++)
        r.be->scratch_free(r.bufs[i], r.stream);
    fmha_free(r.run_mem);
    fmha_free(r.member_at);
    return st;
}
