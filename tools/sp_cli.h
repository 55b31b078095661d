/* sp_cli.h — `mpirun -np N fmha run|bench --sp-ulysses U --sp-ring R`: the
 * command's side of sequence parallelism on CPU ranks. Every rank makes (or
 * reads) the whole problem alike, takes its tokens, calls fmha_sp_forward over
 * MPI_COMM_WORLD, and rank 0 gathers the output and prints. mpi.h stays inside
 * sp_cli.c: in a build without MPI, cli_sp_setup refuses U x R > 1 with the
 * fix, and nothing else here is reached.
 *
 * One rank speaks. Ranks other than 0 send their stdout to /dev/null and their
 * stderr to a file of their own, so that every message of the command's usual
 * code is printed once. Before each step that needs every rank, cli_sp_agree
 * takes the worst exit status over the ranks, and rank 0 prints what the first
 * failed rank wrote to stderr. Once a failure is agreed no rank enters another
 * collective, so that a rank that fails never leaves the others waiting: a
 * rank that fails returns at once, and its cli_sp_end meets the others' next
 * cli_sp_agree.
 *
 * Usage:
 *
 *     cli_sp sp;
 *     cli_sp_begin(&sp, &argc, &argv);     // before the options are parsed
 *     ... parse the options ...
 *     rc = cli_sp_setup(&sp, o.sp_ulysses, o.sp_ring, o.sp_layout, "run");
 *     if (!rc && sp.on) {
 *         cli_sp_shard sh;
 *         rc = cli_sp_agree(&sp, cli_sp_shard_init(&sp, &sh, &whole));
 *         ... cli_sp_forward, cli_sp_agree, cli_sp_gather ...
 *         cli_sp_shard_free(&sh);
 *     }
 *     return cli_sp_end(&sp, rc);          // on every rank, whatever happened
 */
#ifndef FMHA_TOOLS_SP_CLI_H
#define FMHA_TOOLS_SP_CLI_H

#include "fmha.h"

#include <stdint.h>

typedef struct cli_sp {
    int on;          /* a sequence-parallel run over `ranks` ranks (cli_sp_setup) */
    int rank, ranks; /* 0 and 1 outside MPI */
    int ulysses, ring;
    fmha_sp_layout layout; /* of the ring's tokens */
    fmha_sp_joint joint;   /* text tokens every rank holds (--sp-joint), set by the command */
    int64_t joint_tokens;
    fmha_comm *comm;
    int mpi;     /* MPI was started here (an MPI launcher started the process) */
    int settled; /* a failure was agreed on, with this exit status: */
    int settled_rc;
    int quiet;       /* ranks other than 0: stdout and stderr redirected */
    int64_t err_off; /* how much of this rank's stderr file was passed on */
} cli_sp;

/* Before the options are parsed: starts MPI when an MPI launcher started this
 * process (mpirun or mpiexec of Open MPI, MPICH, Intel MPI, or a PMIx one), and
 * quiets ranks other than 0. A plain `fmha run` never touches MPI. */
void cli_sp_begin(cli_sp *s, int *argc, char ***argv);

/* After: the degrees the command line gave (0: not given, 1) and the ring's
 * token layout (contiguous, or zigzag: causal work balanced). U x R must be the
 * number of ranks; one process with 1 x 1 is the command as ever (s->on stays
 * 0). Makes the communicator. Returns 0 or the exit status of an error it
 * printed (2: U x R differs from the ranks, no mpirun, no MPI in this build). */
int cli_sp_setup(cli_sp *s, int ulysses, int ring, fmha_sp_layout layout, const char *command);

/* Collective while MPI runs: the worst of every rank's exit status `rc`; on a
 * failure rank 0 prints the first failed rank's messages (its own are out
 * already) and the failure is settled. Outside MPI, returns rc. */
int cli_sp_agree(cli_sp *s, int rc);

/* On every rank, last: the agreed exit status (collective once more unless a
 * failure was settled), the communicator freed, MPI finalized. */
int cli_sp_end(cli_sp *s, int rc);

/* This rank's tokens (fmha_sp_tokens, in s->layout) of a padded problem or
 * of every packed sequence, copied out of the whole tensors into buffers of
 * its own. */
typedef struct cli_sp_shard {
    fmha_sp_config sp;
    fmha_sp_args a;       /* q, k, v, out [batch, n, heads, d], lse [batch, heads, n] when the
                       whole problem has one; seqlen, seed, offset, cu_seqlens of the whole;
                       joint tokens: views of the whole's rows, lse_joint its own */
    int64_t *start, *len; /* the whole's rows start[i] .. start[i] + len[i], in order */
    int64_t nseg, cap;    /* runs, and room for */
    int64_t dist0;        /* the whole's first distributed row (after front text tokens) */
    void *mem;
} cli_sp_shard;

/* Refuses q of another length than k, and packed q and k of other
 * sequences (the sequences are split once, for q, k and v alike). With
 * s->joint, the whole's first (front) or last (rear) s->joint_tokens rows
 * are text tokens that every rank holds (a padded batch, fewer than the
 * whole's tokens). Returns 0, or 1 with a message. */
int cli_sp_shard_init(const cli_sp *s, cli_sp_shard *sh, const fmha_forward_args *whole);
void cli_sp_shard_free(cli_sp_shard *sh);

/* Collective: one fmha_sp_forward, the ranks started together. *secs is the
 * slowest rank's time (the same on every rank), *sent this rank's bytes. The
 * status is this rank's: agree on it before the next collective. */
fmha_status cli_sp_forward(cli_sp *s, const fmha_config *cfg, const cli_sp_shard *sh, double *secs,
                           int64_t *sent);

/* Collective: every rank's out (and lse) into whole->out (and whole->lse) on
 * rank 0. Returns the agreed exit status. */
int cli_sp_gather(cli_sp *s, const cli_sp_shard *sh, const fmha_forward_args *whole);

/* Collective: the sum of x, and the largest x, over the ranks, on every rank. */
double cli_sp_sum(cli_sp *s, double x);
int64_t cli_sp_max_i64(cli_sp *s, int64_t x);
/* Collective: each rank's x into all[rank] on rank 0 (all: s->ranks entries). */
void cli_sp_gather_i64(cli_sp *s, int64_t x, int64_t *all);

#endif
