/* sp_cli.c — sequence parallelism for `fmha run` and `fmha bench` under
 * mpirun (sp_cli.h): MPI's start and end, the ranks' agreement on errors,
 * the shards and the gathering of the output on rank 0. Built without MPI,
 * only the refusal of U x R > 1 and the shards remain. */
#define _POSIX_C_SOURCE 200809L
#include "sp_cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EXIT_USAGE = 2 };

/* ------------------------------------------------------------------ shards */

static size_t tensor_bytes(const fmha_tensor *t)
{
    return (size_t)(t->batch * t->seqlen * t->heads * t->head_dim) * fmha_dtype_size(t->dtype);
}

/* Rows [from_row, from_row + n) of `from` into rows [to_row, to_row + n) of
 * `to`: same dtype, batch, heads and head dim; head_dim elements contiguous. */
static void copy_rows(const fmha_tensor *to, int64_t to_row, const fmha_tensor *from,
                      int64_t from_row, int64_t n)
{
    const int64_t es = (int64_t)fmha_dtype_size(to->dtype);
    for (int64_t b = 0; b < to->batch; b++)
        for (int64_t s = 0; s < n; s++)
            for (int64_t h = 0; h < to->heads; h++)
                memcpy((char *)to->data + (b * to->stride_batch + (to_row + s) * to->stride_seq +
                                           h * to->stride_head) *
                                              es,
                       (const char *)from->data +
                           (b * from->stride_batch + (from_row + s) * from->stride_seq +
                            h * from->stride_head) *
                               es,
                       (size_t)(to->head_dim * es));
}

/* The same for LSEs [batch, heads, rows]: `to` has to_rows rows, `from` from_rows. */
static void copy_lse(float *to, int64_t to_rows, int64_t to_row, const float *from,
                     int64_t from_rows, int64_t from_row, int64_t bh, int64_t n)
{
    for (int64_t i = 0; i < bh; i++)
        memcpy(to + i * to_rows + to_row, from + i * from_rows + from_row,
               sizeof(float) * (size_t)n);
}

/* Copies between the whole problem and a rank's tokens (rows start[i] ..
 * start[i] + len[i] of the whole are the rank's rows in order): q, k, v out
 * to the rank (to_rank), or out and lse back to the whole. */
static void move_tokens(const fmha_forward_args *whole, const fmha_sp_args *part,
                        const int64_t *start, const int64_t *len, int64_t nseg, int to_rank)
{
    const int64_t bh = whole->q.batch * whole->q.heads, S = whole->q.seqlen, n = part->q.seqlen;
    int64_t row = 0;
    for (int64_t i = 0; i < nseg; row += len[i], i++) {
        if (to_rank) {
            copy_rows(&part->q, row, &whole->q, start[i], len[i]);
            copy_rows(&part->k, row, &whole->k, start[i], len[i]);
            copy_rows(&part->v, row, &whole->v, start[i], len[i]);
        } else {
            copy_rows(&whole->out, start[i], &part->out, row, len[i]);
            if (whole->lse)
                copy_lse(whole->lse, S, start[i], part->lse, n, row, bh, len[i]);
        }
    }
}

/* Rows [row, row + n) of t, as a tensor of n rows. */
static fmha_tensor rows_of(const fmha_tensor *t, int64_t row, int64_t n)
{
    fmha_tensor v = *t;
    v.data = (char *)t->data + row * t->stride_seq * (int64_t)fmha_dtype_size(t->dtype);
    v.seqlen = n;
    return v;
}

/* Room for a rank's runs: two per sequence (a zigzag slot's two chunks). */
static int runs_alloc(cli_sp_shard *sh, const fmha_forward_args *w)
{
    sh->cap = 2 * (w->cu_seqlens_q ? w->varlen_batch : 1);
    sh->start = malloc(sizeof(int64_t) * (size_t)sh->cap);
    sh->len = malloc(sizeof(int64_t) * (size_t)sh->cap);
    if (sh->start && sh->len)
        return 0;
    fprintf(stderr, "fmha: out of memory for the token runs of %lld sequences\n",
            (long long)(sh->cap / 2));
    return 1;
}

/* Rank `rank`'s tokens of the whole problem w into sh->start, sh->len:
 * fmha_sp_tokens of the one sequence, or of each packed sequence in turn
 * (offset by its cu_seqlens). Returns the tokens, or -1 with a message. */
static int64_t runs_of(cli_sp_shard *sh, const fmha_forward_args *w, int rank)
{
    const int64_t nseq = w->cu_seqlens_q ? w->varlen_batch : 1;
    int64_t total = 0;
    sh->nseg = 0;
    for (int64_t b = 0; b < nseq; b++) {
        const int64_t s0 = w->cu_seqlens_q ? w->cu_seqlens_q[b] : sh->dist0;
        const int64_t s = w->cu_seqlens_q ? w->cu_seqlens_q[b + 1] - s0 : sh->a.seqlen;
        int64_t start[2], len[2];
        int n;
        const fmha_status st = fmha_sp_tokens(&sh->sp, s, rank, start, len, &n);
        if (st != FMHA_STATUS_OK) {
            fprintf(stderr, "fmha: %s (%s)\n", fmha_last_error(), fmha_status_string(st));
            return -1;
        }
        for (int i = 0; i < n; i++) {
            const int64_t at = sh->nseg - 1;
            total += len[i];
            if (at >= 0 && sh->start[at] + sh->len[at] == s0 + start[i]) {
                sh->len[at] += len[i]; /* adjacent in the whole: one run */
                continue;
            }
            sh->start[sh->nseg] = s0 + start[i];
            sh->len[sh->nseg++] = len[i];
        }
    }
    return total;
}

/* A shard's buffers start 64 bytes apart, or a multiple. */
static size_t round64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

/* Points sh->a's tensors at `mem` (NULL: only the size), rank of n tokens;
 * returns the bytes they take. */
static size_t lay_out(cli_sp_shard *sh, const fmha_forward_args *w, char *mem, int64_t n)
{
    const fmha_tensor *src[4] = {&w->q, &w->k, &w->v, &w->out};
    fmha_tensor *dst[4] = {&sh->a.q, &sh->a.k, &sh->a.v, &sh->a.out};
    size_t at = 0;
    for (int i = 0; i < 4; i++) {
        *dst[i] = fmha_tensor_bshd(mem ? mem + at : NULL, src[i]->dtype, src[i]->batch, n,
                                   src[i]->heads, src[i]->head_dim);
        at += round64(tensor_bytes(dst[i]));
    }
    sh->a.lse = w->lse && mem ? (float *)(mem + at) : NULL;
    if (w->lse)
        at += round64(sizeof(float) * (size_t)(w->q.batch * w->q.heads * n));
    return at;
}

int cli_sp_shard_init(const cli_sp *s, cli_sp_shard *sh, const fmha_forward_args *w)
{
    memset(sh, 0, sizeof *sh);
    if (!w->cu_seqlens_q != !w->cu_seqlens_k) {
        fprintf(stderr, "fmha: sequence parallelism takes cu_seqlens_q and cu_seqlens_k together "
                        "(one packed set of sequences for q, k and v)\n");
        return 1;
    }
    /* The shard copies rows of the whole before the library sees the call:
     * the offsets must name rows of it. */
    for (int64_t b = 0; w->cu_seqlens_q && b <= w->varlen_batch; b++) {
        const int32_t *cu = w->cu_seqlens_q;
        if ((b == 0 && cu[0] != 0) || (b > 0 && cu[b] < cu[b - 1]) ||
            (b == w->varlen_batch && cu[b] != w->q.seqlen)) {
            fprintf(stderr,
                    "fmha: cu_seqlens_q[%lld] = %d: packed offsets start at 0, never decrease and "
                    "end at the %lld tokens of q\n",
                    (long long)b, (int)cu[b], (long long)w->q.seqlen);
            return 1;
        }
    }
    for (int64_t b = 0; w->cu_seqlens_q && b <= w->varlen_batch; b++)
        if (w->cu_seqlens_q[b] != w->cu_seqlens_k[b]) {
            fprintf(stderr,
                    "fmha: sequence parallelism splits each sequence of q, k and v alike, but "
                    "cu_seqlens_q[%lld] = %d and cu_seqlens_k[%lld] = %d differ (cross-attention): "
                    "run it without --sp-ulysses and --sp-ring\n",
                    (long long)b, (int)w->cu_seqlens_q[b], (long long)b, (int)w->cu_seqlens_k[b]);
            return 1;
        }
    if (w->k.seqlen != w->q.seqlen) {
        fprintf(stderr,
                "fmha: sequence parallelism splits one sequence of q, k and v alike, but q has "
                "%lld tokens and k, v %lld (cross-attention): run it without --sp-ulysses and "
                "--sp-ring\n",
                (long long)w->q.seqlen, (long long)w->k.seqlen);
        return 1;
    }
    if (s->joint && (w->cu_seqlens_q || s->joint_tokens >= w->q.seqlen)) {
        fprintf(stderr,
                w->cu_seqlens_q
                    ? "fmha: --sp-joint: packed sequences take no joint tokens (fmha_sp_args); "
                      "run them without it\n"
                    : "fmha: --sp-joint %s:%lld: the text tokens must be fewer than the "
                      "sequence's %lld, the rest being distributed\n",
                s->joint == FMHA_SP_JOINT_FRONT ? "front" : "rear", (long long)s->joint_tokens,
                (long long)w->q.seqlen);
        return 1;
    }
    const int64_t text = s->joint ? s->joint_tokens : 0;
    sh->dist0 = s->joint == FMHA_SP_JOINT_FRONT ? text : 0;
    sh->a.seqlen = w->q.seqlen - text;
    fmha_sp_config_init(&sh->sp, s->ulysses, s->ring);
    sh->sp.layout = s->layout;
    if (runs_alloc(sh, w))
        return 1;
    const int64_t n = runs_of(sh, w, s->rank);
    if (n < 0)
        return 1;
    const size_t bytes = lay_out(sh, w, NULL, n);
    const size_t lse_text = w->lse ? sizeof(float) * (size_t)(w->q.batch * w->q.heads * text) : 0;
    sh->mem = malloc(bytes + lse_text ? bytes + lse_text : 1);
    if (!sh->mem) {
        fprintf(stderr, "fmha: out of memory for rank %d's %lld tokens (%zu bytes)\n", s->rank,
                (long long)n, bytes + lse_text);
        return 1;
    }
    lay_out(sh, w, sh->mem, n);
    if (text) { /* the text: the whole's own rows, out written in place on every rank */
        const int64_t t0 = s->joint == FMHA_SP_JOINT_FRONT ? 0 : sh->a.seqlen;
        sh->a.joint = s->joint;
        sh->a.q_joint = rows_of(&w->q, t0, text);
        sh->a.k_joint = rows_of(&w->k, t0, text);
        sh->a.v_joint = rows_of(&w->v, t0, text);
        sh->a.out_joint = rows_of(&w->out, t0, text);
        sh->a.lse_joint = lse_text ? (float *)((char *)sh->mem + bytes) : NULL;
    }
    sh->a.seed = w->seed;
    sh->a.offset = w->offset;
    if (w->cu_seqlens_q) {
        sh->a.cu_seqlens = w->cu_seqlens_q;
        sh->a.varlen_batch = w->varlen_batch;
    }
    move_tokens(w, &sh->a, sh->start, sh->len, sh->nseg, 1);
    return 0;
}

void cli_sp_shard_free(cli_sp_shard *sh)
{
    free(sh->mem);
    free(sh->start);
    free(sh->len);
    sh->mem = NULL;
    sh->start = sh->len = NULL;
}

/* ------------------------------------------------------------ without MPI */
#ifndef FMHA_HAVE_MPI

void cli_sp_begin(cli_sp *s, int *argc, char ***argv)
{
    memset(s, 0, sizeof *s);
    s->ranks = 1;
    s->ulysses = s->ring = 1;
}

/* An MPI launcher's word for the number of processes or this one's rank
 * (Open MPI's, else MPICH's name), 0 if none. */
static int launcher_says(const char *ompi, const char *pmi)
{
    const char *n = getenv(ompi);
    if (!n)
        n = getenv(pmi);
    return n ? atoi(n) : 0;
}

int cli_sp_setup(cli_sp *s, int ulysses, int ring, fmha_sp_layout layout, const char *command)
{
    s->ulysses = ulysses ? ulysses : 1;
    s->ring = ring ? ring : 1;
    s->layout = layout;
    const long long want = (long long)s->ulysses * s->ring;
    const int launched = launcher_says("OMPI_COMM_WORLD_SIZE", "PMI_SIZE");
    if (want == 1 && launched <= 1)
        return 0;
    if (launcher_says("OMPI_COMM_WORLD_RANK", "PMI_RANK") != 0)
        return EXIT_USAGE; /* the launcher's rank 0 says why */
    if (want > 1)
        fprintf(stderr,
                "fmha: --sp-ulysses %d x --sp-ring %d: sequence parallelism needs MPI, and this "
                "fmha was built without it: install it (Debian: libopenmpi-dev openmpi-bin) and "
                "rebuild (CMake finds it; -DFMHA_MPI=ON insists)\n",
                s->ulysses, s->ring);
    else
        fprintf(stderr,
                "fmha: an MPI launcher started %d processes, but this fmha was built without "
                "MPI, so each would run `fmha %s` alone: run one process, or rebuild with MPI "
                "(Debian: libopenmpi-dev openmpi-bin) for --sp-ulysses and --sp-ring\n",
                launched, command);
    return EXIT_USAGE;
}

int cli_sp_agree(cli_sp *s, int rc)
{
    return rc;
}

int cli_sp_end(cli_sp *s, int rc)
{
    return rc;
}

/* Not reached: cli_sp_setup leaves s->on 0 without MPI. */
fmha_status cli_sp_forward(cli_sp *s, const fmha_config *cfg, const cli_sp_shard *sh, double *secs,
                           int64_t *sent)
{
    return FMHA_STATUS_UNSUPPORTED;
}

int cli_sp_gather(cli_sp *s, const cli_sp_shard *sh, const fmha_forward_args *whole)
{
    return 1;
}

double cli_sp_sum(cli_sp *s, double x)
{
    return x;
}

int64_t cli_sp_max_i64(cli_sp *s, int64_t x)
{
    return x;
}

void cli_sp_gather_i64(cli_sp *s, int64_t x, int64_t *all)
{
    all[0] = x;
}

/* --------------------------------------------------------------- with MPI */
#else
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include "fmha_sp.h" /* after mpi.h: its MPI helpers are defined only then */

enum { TAG = 27 };
/* MPI counts are int: larger buffers go as several messages. */
#define CHUNK ((size_t)1 << 30)

/* Whether an MPI launcher started this process: mpirun / mpiexec of Open
 * MPI (OMPI_COMM_WORLD_SIZE), of MPICH and Intel MPI (PMI_SIZE), or a PMIx
 * launcher such as srun --mpi=pmix (PMIX_RANK). */
static int launched(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

/* Ranks other than 0: stdout to /dev/null, stderr to an unlinked file of
 * their own, read back by cli_sp_agree when this rank is the one to report. */
static void quiet(cli_sp *s)
{
    fflush(stdout);
    fflush(stderr);
    int null = open("/dev/null", O_WRONLY);
    FILE *err = tmpfile();
    if (null < 0 || !err)
        return; /* then this rank prints too: better than silence */
    dup2(null, STDOUT_FILENO);
    dup2(fileno(err), STDERR_FILENO); /* err's stream stays open: it holds the file */
    close(null);
    s->quiet = 1;
}

void cli_sp_begin(cli_sp *s, int *argc, char ***argv)
{
    memset(s, 0, sizeof *s);
    s->ranks = 1;
    s->ulysses = s->ring = 1;
    if (!launched())
        return;
    MPI_Init(argc, argv); /* fails fatally, with MPI's own message */
    s->mpi = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &s->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &s->ranks);
    if (s->rank != 0)
        quiet(s);
}

int cli_sp_setup(cli_sp *s, int ulysses, int ring, fmha_sp_layout layout, const char *command)
{
    s->ulysses = ulysses ? ulysses : 1;
    s->ring = ring ? ring : 1;
    s->layout = layout;
    const long long want = (long long)s->ulysses * s->ring;
    if (want == 1 && s->ranks == 1)
        return 0; /* one process: the command as ever */
    const char *given = ulysses || ring ? "" : " (the defaults)";
    if (!s->mpi) {
        fprintf(stderr,
                "fmha: --sp-ulysses %d x --sp-ring %d = %lld ranks, but this is a single process "
                "(not started by mpirun): run `mpirun -np %lld fmha %s ... --sp-ulysses %d "
                "--sp-ring %d`\n",
                s->ulysses, s->ring, want, want, command, s->ulysses, s->ring);
        return EXIT_USAGE;
    }
    if (want != s->ranks) {
        char other[64] = "run one process (without mpirun)";
        if (want > 1)
            snprintf(other, sizeof other, "start %lld (mpirun -np %lld)", want, want);
        fprintf(stderr,
                "fmha: --sp-ulysses %d x --sp-ring %d%s = %lld, but mpirun started %d ranks: give "
                "--sp-ulysses U --sp-ring R with U x R = %d (e.g. --sp-ring %d, or --sp-ulysses "
                "%d if the heads divide by %d), or %s\n",
                s->ulysses, s->ring, given, want, s->ranks, s->ranks, s->ranks, s->ranks, s->ranks,
                other);
        return EXIT_USAGE;
    }
    int rc = 0;
    fmha_status st = fmha_comm_init_mpi(&s->comm, MPI_COMM_WORLD); /* collective */
    if (st != FMHA_STATUS_OK) {
        fprintf(stderr, "fmha: no MPI communicator: %s (%s)\n", fmha_last_error(),
                fmha_status_string(st));
        rc = 1;
    }
    rc = cli_sp_agree(s, rc);
    s->on = rc == 0;
    return rc;
}

/* What this rank wrote to stderr since the last call (the last size - 1
 * bytes of it), into text. */
static void new_messages(cli_sp *s, char *text, size_t size)
{
    text[0] = '\0';
    if (!s->quiet)
        return;
    const off_t end = lseek(STDERR_FILENO, 0, SEEK_CUR);
    off_t from = s->err_off;
    if (end - from > (off_t)size - 1)
        from = end - ((off_t)size - 1);
    const ssize_t n = end > from ? pread(STDERR_FILENO, text, (size_t)(end - from), from) : 0;
    text[n > 0 ? n : 0] = '\0';
    s->err_off = end;
}

int cli_sp_agree(cli_sp *s, int rc)
{
    if (!s->mpi)
        return rc;
    if (s->settled)
        return s->settled_rc;
    int worst;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (worst == 0)
        return 0;
    int mine = rc ? s->rank : s->ranks, first;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first != 0) { /* rank 0 failed too: its messages are out already */
        char text[2048];
        if (s->rank == first)
            new_messages(s, text, sizeof text);
        MPI_Bcast(text, (int)sizeof text, MPI_CHAR, first, MPI_COMM_WORLD);
        if (s->rank == 0) {
            const char *msg = strncmp(text, "fmha: ", 6) ? text : text + 6;
            fprintf(stderr, "fmha: rank %d of %d: %s", first, s->ranks,
                    msg[0] ? msg : "failed without a message\n");
        }
    }
    s->settled = 1;
    s->settled_rc = worst;
    return worst;
}

int cli_sp_end(cli_sp *s, int rc)
{
    rc = cli_sp_agree(s, rc);
    fmha_comm_free(s->comm);
    s->comm = NULL;
    if (s->mpi) {
        fflush(stdout);
        MPI_Finalize();
    }
    return rc;
}

fmha_status cli_sp_forward(cli_sp *s, const fmha_config *cfg, const cli_sp_shard *sh, double *secs,
                           int64_t *sent)
{
    /* Started together, the slowest rank's time is the call's, not a late start's. */
    MPI_Barrier(MPI_COMM_WORLD);
    const int64_t before = fmha_comm_bytes_sent(s->comm);
    const double t0 = MPI_Wtime();
    const fmha_status st = fmha_sp_forward(cfg, &sh->sp, s->comm, &sh->a);
    const double mine = MPI_Wtime() - t0;
    *sent = fmha_comm_bytes_sent(s->comm) - before;
    MPI_Allreduce(&mine, secs, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return st;
}

static void send_all(const void *p, size_t bytes, int to)
{
    for (size_t off = 0; off < bytes; off += CHUNK) {
        const size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        MPI_Send((const char *)p + off, (int)n, MPI_BYTE, to, TAG, MPI_COMM_WORLD);
    }
}

static void recv_all(void *p, size_t bytes, int from)
{
    for (size_t off = 0; off < bytes; off += CHUNK) {
        const size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        MPI_Recv((char *)p + off, (int)n, MPI_BYTE, from, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
}

int cli_sp_gather(cli_sp *s, const cli_sp_shard *sh, const fmha_forward_args *w)
{
    /* Rank 0 receives each rank's tokens into one buffer of the largest
     * rank's size, allocated before anyone sends. */
    cli_sp_shard other;
    memset(&other, 0, sizeof other);
    other.sp = sh->sp;
    other.dist0 = sh->dist0;
    other.a.seqlen = sh->a.seqlen;
    int64_t most = 0;
    int rc = 0;
    if (s->rank == 0)
        rc = runs_alloc(&other, w);
    for (int r = 1; s->rank == 0 && r < s->ranks && rc == 0; r++) {
        const int64_t n = runs_of(&other, w, r); /* valid: this rank's own call was */
        most = n > most ? n : most;
    }
    if (s->rank == 0 && rc == 0) {
        const size_t bytes = lay_out(&other, w, NULL, most);
        other.mem = malloc(bytes ? bytes : 1);
        if (!other.mem) {
            fprintf(stderr, "fmha: out of memory for gathering the output (%zu bytes)\n", bytes);
            rc = 1;
        }
    }
    if ((rc = cli_sp_agree(s, rc)) != 0) {
        cli_sp_shard_free(&other);
        return rc;
    }
    if (s->rank != 0) {
        send_all(sh->a.out.data, tensor_bytes(&sh->a.out), 0);
        if (sh->a.lse)
            send_all(sh->a.lse,
                     sizeof(float) * (size_t)(sh->a.q.batch * sh->a.q.heads * sh->a.q.seqlen), 0);
        return 0;
    }
    move_tokens(w, &sh->a, sh->start, sh->len, sh->nseg, 0);
    if (sh->a.lse_joint) { /* the text's out is in place already, its LSE is not */
        const int64_t t0 = sh->a.joint == FMHA_SP_JOINT_FRONT ? 0 : sh->a.seqlen;
        const int64_t text = sh->a.out_joint.seqlen;
        copy_lse(w->lse, w->q.seqlen, t0, sh->a.lse_joint, text, 0, w->q.batch * w->q.heads, text);
    }
    for (int r = 1; r < s->ranks; r++) {
        const int64_t n = runs_of(&other, w, r);
        lay_out(&other, w, other.mem, n);
        recv_all(other.a.out.data, tensor_bytes(&other.a.out), r);
        if (other.a.lse)
            recv_all(other.a.lse, sizeof(float) * (size_t)(w->q.batch * w->q.heads * n), r);
        move_tokens(w, &other.a, other.start, other.len, other.nseg, 0);
    }
    cli_sp_shard_free(&other);
    return 0;
}

double cli_sp_sum(cli_sp *s, double x)
{
    double sum = x;
    if (s->mpi)
        MPI_Allreduce(&x, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return sum;
}

int64_t cli_sp_max_i64(cli_sp *s, int64_t x)
{
    int64_t most = x;
    if (s->mpi)
        MPI_Allreduce(&x, &most, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    return most;
}

void cli_sp_gather_i64(cli_sp *s, int64_t x, int64_t *all)
{
    if (!s->mpi) {
        all[0] = x;
        return;
    }
    MPI_Gather(&x, 1, MPI_INT64_T, all, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
}
#endif
