/* test_sp_mpi.c — sequence parallelism over MPI on CPU ranks (run by ctest
 * under mpirun -np 2, 3 and 4): every split ulysses x ring of the ranks,
 * contiguous and zigzag, against a single-process fmha_forward over the
 * whole sequence and the float64 reference, on awkward sizes: MHA, GQA
 * (KV heads split and replicated), causal, sliding windows, softcap,
 * dropout, joint tokens in front and at the rear, bf16 and f32, ranks with
 * no token, packed sequences (cu_seqlens) of uneven lengths, empty ones
 * among them. Each rank's out and LSE are checked (poisoned gaps untouched),
 * then the refusals with their messages. */
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

static int rank, ranks;

typedef struct sp_case {
    int64_t b, s, t, h, kv, d;
    fmha_dtype dt, odt;
    int causal;
    int64_t wl, wr;
    double softcap, dropout;
    fmha_sp_joint joint;
    int nseq;    /* packed sequences (0: a padded batch of b); s is their total */
    int lens[8]; /* their lengths */
} sp_case;

/* The whole problem's tensors, the same on every rank (same seed). */
typedef struct whole {
    tu_tensor q, k, v, out, ref;
    float *lse, *lse_ref;
    int64_t n;     /* S + T */
    int32_t cu[9]; /* packed: the sequences' offsets */
} whole;

static int64_t img_pos(const sp_case *c, int64_t i)
{
    return c->joint == FMHA_SP_JOINT_FRONT ? c->t + i : i;
}

static int64_t text_pos(const sp_case *c, int64_t i)
{
    return c->joint == FMHA_SP_JOINT_REAR ? c->s + i : i;
}

static fmha_config config_of(const sp_case *c)
{
    fmha_config cfg;
    fmha_config_init(&cfg, c->h, c->kv, c->d);
    cfg.dtype = c->dt;
    cfg.causal = c->causal;
    cfg.window_left = c->wl;
    cfg.window_right = c->wr;
    cfg.softcap = c->softcap;
    cfg.dropout_p = c->dropout;
    cfg.num_threads = 1;
    return cfg;
}

static void whole_init(whole *w, const sp_case *c, uint64_t seed)
{
    tu_rng r = {seed};
    w->n = c->s + c->t;
    tu_tensor_init(&w->q, c->dt, c->b, w->n, c->h, c->d, 0, 0);
    tu_tensor_init(&w->k, c->dt, c->b, w->n, c->kv, c->d, 0, 0);
    tu_tensor_init(&w->v, c->dt, c->b, w->n, c->kv, c->d, 0, 0);
    tu_fill_normal(&w->q, &r, 1.0);
    tu_fill_normal(&w->k, &r, 1.0);
    tu_fill_normal(&w->v, &r, 1.0);
    tu_tensor_init(&w->out, FMHA_DTYPE_F32, c->b, w->n, c->h, c->d, 0, 0);
    tu_tensor_init(&w->ref, FMHA_DTYPE_F32, c->b, w->n, c->h, c->d, 0, 0);
    const int64_t nl = c->b * c->h * w->n;
    w->lse = malloc(sizeof(float) * (size_t)(nl ? nl : 1));
    w->lse_ref = malloc(sizeof(float) * (size_t)(nl ? nl : 1));
    fmha_config cfg = config_of(c);
    fmha_forward_args a = {0};
    a.q = w->q.t, a.k = w->k.t, a.v = w->v.t, a.out = w->out.t, a.lse = w->lse;
    a.seed = 1234, a.offset = 77;
    w->cu[0] = 0;
    for (int i = 0; i < c->nseq; i++)
        w->cu[i + 1] = w->cu[i] + c->lens[i];
    if (c->nseq) {
        a.cu_seqlens_q = a.cu_seqlens_k = w->cu;
        a.varlen_batch = c->nseq;
    }
    TU_CHECK(fmha_forward(&cfg, &a) == FMHA_STATUS_OK, "whole: %s", fmha_last_error());
    a.out = w->ref.t, a.lse = w->lse_ref;
    TU_CHECK(fmha_reference_forward(&cfg, &a) == FMHA_STATUS_OK, "reference: %s",
             fmha_last_error());
}

static void whole_free(whole *w)
{
    tu_tensor_free(&w->q), tu_tensor_free(&w->k), tu_tensor_free(&w->v);
    tu_tensor_free(&w->out), tu_tensor_free(&w->ref);
    free(w->lse), free(w->lse_ref);
}

/* Copies rows of `from` at sequence positions pos[i] into rows i of `to`. */
static void gather_rows(tu_tensor *to, const tu_tensor *from, const int64_t *pos, int64_t n)
{
    for (int64_t b = 0; b < to->t.batch; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < to->t.heads; h++)
                for (int64_t e = 0; e < to->t.head_dim; e++)
                    tu_set(to, b, i, h, e, tu_get(from, b, pos[i], h, e));
}

/* Largest |x - y| over rows i of x against rows pos[i] of y. */
static double rows_err(const tu_tensor *x, const tu_tensor *y, const int64_t *pos, int64_t n,
                       int *bad)
{
    double m = 0;
    for (int64_t b = 0; b < x->t.batch; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < x->t.heads; h++)
                for (int64_t e = 0; e < x->t.head_dim; e++) {
                    const double a = tu_get(x, b, i, h, e), r = tu_get(y, b, pos[i], h, e);
                    if (!isfinite(a))
                        *bad = 1;
                    else if (fabs(a - r) > m)
                        m = fabs(a - r);
                }
    return m;
}

static double lse_rows_err(const float *x, const float *y, const sp_case *c, int64_t nw,
                           const int64_t *pos, int64_t n, int *bad)
{
    double m = 0;
    for (int64_t b = 0; b < c->b; b++)
        for (int64_t h = 0; h < c->h; h++)
            for (int64_t i = 0; i < n; i++) {
                const float a = x[(b * c->h + h) * n + i], r = y[(b * c->h + h) * nw + pos[i]];
                if (isinf(r) || isinf(a))
                    *bad |= a != r;
                else if (!isfinite(a))
                    *bad = 1;
                else if (fabs(a - r) > m)
                    m = fabs(a - r);
            }
    return m;
}

static void describe(const sp_case *c, const fmha_sp_config *sp, char *buf, size_t n)
{
    snprintf(buf, n,
             "ranks=%d u=%d r=%d %s b=%lld s=%lld t=%lld(%s) h=%lld kv=%lld d=%lld %s->%s "
             "causal=%d win=(%lld,%lld) softcap=%g drop=%g nseq=%d",
             ranks, sp->ulysses, sp->ring,
             sp->layout == FMHA_SP_LAYOUT_ZIGZAG ? "zigzag" : "contig", (long long)c->b,
             (long long)c->s, (long long)c->t,
             c->joint == FMHA_SP_JOINT_FRONT  ? "front"
             : c->joint == FMHA_SP_JOINT_REAR ? "rear"
                                              : "-",
             (long long)c->h, (long long)c->kv, (long long)c->d, fmha_dtype_name(c->dt),
             fmha_dtype_name(c->odt), c->causal, (long long)c->wl, (long long)c->wr, c->softcap,
             c->dropout, c->nseq);
}

/* The tokens rank p holds, of every packed sequence. */
static int64_t rank_tokens(const sp_case *c, const fmha_sp_config *sp, int p)
{
    int64_t n = 0;
    for (int i = 0; i < (c->nseq ? c->nseq : 1); i++) {
        int64_t start[2], len[2];
        int nseg;
        fmha_sp_tokens(sp, c->nseq ? c->lens[i] : c->s, p, start, len, &nseg);
        n += len[0] + (nseg > 1 ? len[1] : 0);
    }
    return n;
}

/* What one rank sends (docs/sequence_parallel.md): Ulysses' q, k, v of its
 * n tokens for the other members' heads and the slot's output rows (and
 * LSE) of theirs back, the ring's K/V of the slot it holds at each of r - 1
 * steps, and its text partial (f32 out and LSE) to every other rank. */
static int64_t expected_bytes(const sp_case *c, const fmha_sp_config *sp, int64_t n)
{
    const int64_t u = sp->ulysses, r = sp->ring, e = (int64_t)fmha_dtype_size(c->dt);
    const int64_t oe = (int64_t)fmha_dtype_size(c->odt), hl = c->h / u;
    const int64_t kvl = c->kv % u == 0 ? c->kv / u : 1, slot = rank / u, member = rank % u;
    int64_t total = 0;
    int64_t slot_len[64] = {0};
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < u; j++)
            slot_len[i] += rank_tokens(c, sp, (int)(i * u + j));
    for (int64_t j = 0; j < u; j++) {
        if (j == member)
            continue;
        const int64_t lj = rank_tokens(c, sp, (int)(slot * u + j));
        total += n * c->b * (hl + 2 * kvl) * c->d * e; /* q, k, v in */
        total += lj * c->b * hl * (c->d * oe + 4);     /* out and lse back */
    }
    for (int64_t t = 0; t + 1 < r; t++)
        total += slot_len[(slot - t + r) % r] * c->b * 2 * kvl * c->d * e;
    if (c->joint)
        total += (u * r - 1) * c->t * c->b * hl * (c->d + 1) * 4;
    return total;
}

/* A tensor of n tokens (n may be 0: a rank without tokens). */
static void tensor_n(tu_tensor *x, fmha_dtype dt, int64_t b, int64_t n, int64_t h, int64_t d,
                     int layout, unsigned char poison)
{
    tu_tensor_init(x, dt, b, n ? n : 1, h, d, layout, poison);
    x->t.seqlen = n;
}

static void run_mode(const sp_case *c, const whole *w, fmha_comm *comm, const fmha_sp_config *sp)
{
    char what[256];
    describe(c, sp, what, sizeof what);
    int64_t n = 0, *pos = malloc(sizeof(int64_t) * (size_t)(c->s + 1));
    for (int b = 0; b < (c->nseq ? c->nseq : 1); b++) {
        int64_t start[2], len[2];
        int nseg;
        TU_CHECK(fmha_sp_tokens(sp, c->nseq ? c->lens[b] : c->s, rank, start, len, &nseg) ==
                     FMHA_STATUS_OK,
                 "tokens: %s", fmha_last_error());
        for (int i = 0; i < nseg; i++)
            for (int64_t j = 0; j < len[i]; j++)
                pos[n++] = c->nseq ? w->cu[b] + start[i] + j : img_pos(c, start[i] + j);
    }
    int64_t *tpos = malloc(sizeof(int64_t) * (size_t)(c->t + 1));
    for (int64_t i = 0; i < c->t; i++)
        tpos[i] = text_pos(c, i);

    const unsigned char poison = 0xC3;
    tu_tensor q, k, v, out, qj, kj, vj, oj;
    tensor_n(&q, c->dt, c->b, n, c->h, c->d, 1, 0);
    tensor_n(&k, c->dt, c->b, n, c->kv, c->d, 0, 0);
    tensor_n(&v, c->dt, c->b, n, c->kv, c->d, 2, 0);
    tensor_n(&out, c->odt, c->b, n, c->h, c->d, 2, poison);
    gather_rows(&q, &w->q, pos, n);
    gather_rows(&k, &w->k, pos, n);
    gather_rows(&v, &w->v, pos, n);
    const int64_t T = c->joint ? c->t : 0;
    tu_tensor_init(&qj, c->dt, c->b, T ? T : 1, c->h, c->d, 0, 0);
    tu_tensor_init(&kj, c->dt, c->b, T ? T : 1, c->kv, c->d, 0, 0);
    tu_tensor_init(&vj, c->dt, c->b, T ? T : 1, c->kv, c->d, 0, 0);
    tu_tensor_init(&oj, c->odt, c->b, T ? T : 1, c->h, c->d, 2, poison);
    if (T) {
        gather_rows(&qj, &w->q, tpos, T);
        gather_rows(&kj, &w->k, tpos, T);
        gather_rows(&vj, &w->v, tpos, T);
    }
    float *lse = malloc(sizeof(float) * (size_t)(c->b * c->h * n + 1));
    float *lsej = malloc(sizeof(float) * (size_t)(c->b * c->h * T + 1));
    fmha_sp_args a;
    memset(&a, 0, sizeof a);
    a.q = q.t, a.k = k.t, a.v = v.t, a.out = out.t, a.lse = lse;
    a.seqlen = c->s;
    a.seed = 1234, a.offset = 77;
    if (c->nseq) {
        a.cu_seqlens = w->cu;
        a.varlen_batch = c->nseq;
    }
    if (T) {
        a.joint = c->joint;
        a.q_joint = qj.t, a.k_joint = kj.t, a.v_joint = vj.t, a.out_joint = oj.t;
        a.lse_joint = lsej;
    }
    const fmha_config cfg = config_of(c);
    const int64_t sent0 = fmha_comm_bytes_sent(comm);
    fmha_status st = fmha_sp_forward(&cfg, sp, comm, &a);
    const int64_t sent = fmha_comm_bytes_sent(comm) - sent0;
    TU_CHECK(st == FMHA_STATUS_OK, "%s: %s", what, fmha_last_error());
    if (st == FMHA_STATUS_OK) {
        int bad = 0;
        /* Within twice the single-process kernel's own error (the merges add
         * f32 rounding), plus a 16-bit output's rounding. */
        const double round = c->odt == FMHA_DTYPE_F32 ? 1e-5 : 8e-3;
        const double e_kernel = tu_max_err(&w->out, &w->ref, &bad);
        const double e_sp = rows_err(&out, &w->ref, pos, n, &bad);
        const double e_vs_kernel = rows_err(&out, &w->out, pos, n, &bad);
        const double el = lse_rows_err(lse, w->lse_ref, c, w->n, pos, n, &bad);
        TU_CHECK(!bad && e_sp <= 2 * e_kernel + round && el <= 1e-4,
                 "%s rank %d: error %.3g vs reference (kernel %.3g), %.3g vs the kernel, LSE "
                 "%.3g%s",
                 what, rank, e_sp, e_kernel, e_vs_kernel, el, bad ? ", non-finite" : "");
        TU_CHECK(tu_gaps_untouched(&out, poison), "%s rank %d: wrote outside out", what, rank);
        const int64_t want = expected_bytes(c, sp, n);
        TU_CHECK(sent == want, "%s rank %d: sent %lld bytes, the traffic's formula says %lld", what,
                 rank, (long long)sent, (long long)want);
        if (T) {
            const double ej = rows_err(&oj, &w->ref, tpos, T, &bad);
            const double elj = lse_rows_err(lsej, w->lse_ref, c, w->n, tpos, T, &bad);
            TU_CHECK(!bad && ej <= 2 * e_kernel + round && elj <= 1e-4,
                     "%s rank %d: joint error %.3g (kernel %.3g), LSE %.3g", what, rank, ej,
                     e_kernel, elj);
            TU_CHECK(tu_gaps_untouched(&oj, poison), "%s rank %d: wrote outside out_joint", what,
                     rank);
        }
    }
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v), tu_tensor_free(&out);
    tu_tensor_free(&qj), tu_tensor_free(&kj), tu_tensor_free(&vj), tu_tensor_free(&oj);
    free(lse), free(lsej), free(pos), free(tpos);
}

/* Every split of the ranks whose Ulysses degree the heads allow, both
 * layouts where there is a ring. */
static void run_case(const sp_case *c, fmha_comm *comm, uint64_t seed)
{
    whole w;
    whole_init(&w, c, seed);
    for (int u = 1; u <= ranks; u++) {
        if (ranks % u || c->h % u || (c->kv % u && u % c->kv))
            continue;
        for (int layout = 0; layout < (ranks / u > 1 ? 2 : 1); layout++) {
            fmha_sp_config sp;
            fmha_sp_config_init(&sp, u, ranks / u);
            sp.layout = layout ? FMHA_SP_LAYOUT_ZIGZAG : FMHA_SP_LAYOUT_CONTIGUOUS;
            run_mode(c, &w, comm, &sp);
        }
    }
    whole_free(&w);
}

static void expect_error(fmha_comm *comm, const fmha_config *cfg, const fmha_sp_config *sp,
                         const fmha_sp_args *a, const char *want)
{
    fmha_status st = fmha_sp_forward(cfg, sp, comm, a);
    TU_CHECK(st == FMHA_STATUS_INVALID_ARGUMENT && strstr(fmha_last_error(), want),
             "expected \"%s\", got %s: %s", want, fmha_status_string(st), fmha_last_error());
}

static void test_refusals(fmha_comm *comm)
{
    fmha_config cfg;
    fmha_config_init(&cfg, 6, 3, 16);
    cfg.dtype = FMHA_DTYPE_F32;
    fmha_sp_config sp;
    char want[160];
    fmha_sp_args a;
    memset(&a, 0, sizeof a);
    tu_tensor q, k, out;
    tu_tensor_init(&q, FMHA_DTYPE_F32, 1, 5, 6, 16, 0, 0);
    tu_tensor_init(&k, FMHA_DTYPE_F32, 1, 5, 3, 16, 0, 0);
    tu_tensor_init(&out, FMHA_DTYPE_F32, 1, 5, 6, 16, 0, 0x11);
    a.q = q.t, a.k = k.t, a.v = k.t, a.out = out.t;
    a.seqlen = 5 * ranks;
    fmha_sp_config_init(&sp, ranks, 3);
    snprintf(want, sizeof want, "ulysses (%d) x ring (3) = %d ranks, but there are %d", ranks,
             3 * ranks, ranks);
    expect_error(comm, &cfg, &sp, &a, want);
    /* 6 heads over 4 ranks; on 2 ranks: 3 KV heads (with 6 query heads) over u = 2. */
    fmha_sp_config_init(&sp, ranks, 1);
    if (ranks == 4) {
        expect_error(comm, &cfg, &sp, &a, "num_heads (6) is not divisible by ulysses (4)");
    } else if (ranks == 3) { /* 6 / 3 heads each, but 2 KV heads neither split nor shared */
        cfg.num_kv_heads = 2;
        expect_error(comm, &cfg, &sp, &a,
                     "num_kv_heads (2) and ulysses (3): neither divides the other");
        cfg.num_kv_heads = 3;
    } else
        expect_error(comm, &cfg, &sp, &a,
                     "num_kv_heads (3) and ulysses (2): neither divides the other");
    fmha_sp_config_init(&sp, 1, ranks);
    a.seqlen = 100; /* each rank holds 100 / ranks tokens, not 5 */
    snprintf(want, sizeof want, "q.seqlen (5) differs from the %lld tokens rank %d holds",
             (long long)(100 * (rank + 1) / ranks - 100 * rank / ranks), rank);
    expect_error(comm, &cfg, &sp, &a, want);
    /* Packed sequences: both arrays or neither, their total, batch 1, no text. */
    const int32_t cu[3] = {0, 2 * ranks, 5 * ranks};
    a.seqlen = 5 * ranks;
    a.cu_seqlens = cu;
    expect_error(comm, &cfg, &sp, &a, "cu_seqlens (given) and varlen_batch (0): give both");
    a.varlen_batch = 2;
    a.seqlen = 5 * ranks + 1;
    snprintf(want, sizeof want, "cu_seqlens[2] (%d) differs from seqlen (%d)", 5 * ranks,
             5 * ranks + 1);
    expect_error(comm, &cfg, &sp, &a, want);
    a.seqlen = 5 * ranks;
    const int32_t cu_down[3] = {0, 3 * ranks, 2 * ranks};
    a.cu_seqlens = cu_down;
    expect_error(comm, &cfg, &sp, &a, "cu_seqlens decreases at entry 2");
    a.cu_seqlens = cu;
    a.q.batch = a.k.batch = a.v.batch = a.out.batch = 2; /* refused before anything is read */
    expect_error(comm, &cfg, &sp, &a, "packed sequences have batch 1 (q.batch is 2)");
    a.q.batch = a.k.batch = a.v.batch = a.out.batch = 1;
    const int32_t cu_one[3] = {0, 0, 7 * ranks}; /* one sequence of 7 per rank: not 5 */
    a.cu_seqlens = cu_one;
    a.seqlen = 7 * ranks;
    snprintf(want, sizeof want, "q.seqlen (5) differs from the 7 tokens rank %d holds of 2 packed",
             rank);
    expect_error(comm, &cfg, &sp, &a, want);
    a.cu_seqlens = NULL;
    a.varlen_batch = 0;
    a.seqlen = 5 * ranks;
    cfg.device = FMHA_DEVICE_CUDA;
    expect_error(comm, &cfg, &sp, &a, "cfg.device is cuda, but the mpi communicator moves host");
    cfg.device = FMHA_DEVICE_CPU;
    TU_CHECK(fmha_sp_forward(&cfg, &sp, NULL, &a) == FMHA_STATUS_INVALID_ARGUMENT &&
                 strstr(fmha_last_error(), "comm is NULL"),
             "NULL comm: %s", fmha_last_error());
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&out);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    fmha_comm *comm = NULL;
    MPI_Comm world = MPI_COMM_WORLD;
    fmha_status st = fmha_comm_init(&comm, FMHA_COMM_MPI, &world, NULL);
    TU_CHECK(st == FMHA_STATUS_OK, "comm: %s", fmha_last_error());
    TU_CHECK(fmha_comm_rank(comm) == rank && fmha_comm_size(comm) == ranks,
             "comm rank %d size %d, MPI %d %d", fmha_comm_rank(comm), fmha_comm_size(comm), rank,
             ranks);
    const fmha_dtype F32 = FMHA_DTYPE_F32, BF16 = FMHA_DTYPE_BF16;
    const sp_case cases[] = {
        /* b, s, t, h, kv, d, dt, odt, causal, wl, wr, softcap, dropout, joint, nseq, lens */
        {1, 113, 0, 4, 4, 32, F32, F32, 0, -1, -1, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {2, 239, 0, 4, 2, 40, BF16, F32, 1, -1, -1, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 200, 0, 4, 1, 64, F32, F32, 1, -1, -1, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 150, 0, 4, 4, 32, F32, F32, 0, 17, 5, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 131, 0, 4, 2, 32, F32, F32, 1, 40, -1, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 97, 0, 4, 4, 32, F32, F32, 0, -1, -1, 0, 0.3, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 120, 0, 8, 2, 32, F32, F32, 1, -1, -1, 0, 0.2, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 101, 19, 4, 4, 32, F32, F32, 0, -1, -1, 0, 0, FMHA_SP_JOINT_FRONT, 0, {0}},
        {2, 90, 13, 4, 2, 32, BF16, BF16, 0, -1, -1, 0, 0, FMHA_SP_JOINT_REAR, 0, {0}},
        {1, 77, 9, 4, 4, 32, F32, F32, 0, -1, -1, 30.0, 0.1, FMHA_SP_JOINT_FRONT, 0, {0}},
        {1, 7, 0, 4, 4, 16, F32, F32, 1, -1, -1, 0, 0, FMHA_SP_JOINT_NONE, 0, {0}},
        {1, 3, 5, 4, 4, 16, F32, F32, 0, 2, 2, 0, 0, FMHA_SP_JOINT_REAR, 0, {0}},
        /* packed sequences: b 1, s their total */
        {1,
         215,
         0,
         4,
         2,
         32,
         F32,
         F32,
         1,
         -1,
         -1,
         0,
         0,
         FMHA_SP_JOINT_NONE,
         5,
         {37, 0, 101, 3, 74}},
        {1, 190, 0, 4, 4, 40, BF16, F32, 0, -1, -1, 0, 0.2, FMHA_SP_JOINT_NONE, 3, {90, 1, 99}},
        {1, 160, 0, 4, 1, 32, F32, F32, 1, 23, -1, 0, 0.1, FMHA_SP_JOINT_NONE, 4, {64, 0, 33, 63}},
        {1, 119, 0, 8, 4, 16, F32, F32, 0, 9, 4, 20.0, 0, FMHA_SP_JOINT_NONE, 2, {0, 119}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], comm, 100 + i);
    test_refusals(comm);
    fmha_comm_free(comm);
    int failed = tu_failed, total_failed = 0, total_passed = 0;
    MPI_Allreduce(&failed, &total_failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&tu_passed, &total_passed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%d ranks: %d passed, %d failed\n", ranks, total_passed, total_failed);
    MPI_Finalize();
    return total_failed ? 1 : 0;
}
