/* sp_bench.c — sequence-parallel attention on CPU ranks over MPI: the time
 * of fmha_sp_forward for every split ulysses x ring of the ranks (both
 * layouts where there is a ring) beside one rank's fmha_forward of the whole
 * sequence, and the bytes each rank sent per call.
 *
 *     mpirun -np 2 build/sp_bench [S [H [D [iters [causal]]]]]   (default 4096 8 64 3 0)
 *
 * Prints one line per split from rank 0: median ms of `iters` calls, the
 * speedup over the whole forward on one rank, and the bytes sent (max over
 * ranks). */
#include "fmha.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, cmp);
    return t[n / 2];
}

static void fill(uint16_t *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = fmha_f32_to_bf16((float)((int)(seed >> 9) % 2001 - 1000) / 1000.0f);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    const int64_t S = argc > 1 ? atoll(argv[1]) : 4096, H = argc > 2 ? atoll(argv[2]) : 8;
    const int64_t D = argc > 3 ? atoll(argv[3]) : 64;
    const int iters = argc > 4 ? atoi(argv[4]) : 3, causal = argc > 5 ? atoi(argv[5]) : 0;
    fmha_config cfg;
    fmha_config_init(&cfg, H, H, D);
    cfg.causal = causal;
    const size_t whole = (size_t)(S * H * D);
    uint16_t *q = malloc(whole * 2), *k = malloc(whole * 2), *v = malloc(whole * 2);
    uint16_t *o = malloc(whole * 2);
    fill(q, whole, 1), fill(k, whole, 2), fill(v, whole, 3);
    double t[64];

    /* One rank alone, the whole sequence (rank 0, the others wait). */
    double single = 0;
    if (rank == 0) {
        fmha_forward_args a = {0};
        a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, 1, S, H, D);
        a.k = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, 1, S, H, D);
        a.v = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, 1, S, H, D);
        a.out = fmha_tensor_bshd(o, FMHA_DTYPE_BF16, 1, S, H, D);
        for (int i = 0; i < iters; i++) {
            const double t0 = MPI_Wtime();
            fmha_forward(&cfg, &a);
            t[i] = (MPI_Wtime() - t0) * 1e3;
        }
        single = median(t, iters);
        printf("shape [1, %lld, %lld, %lld] bf16%s, %d ranks, %d iterations (median)\n",
               (long long)S, (long long)H, (long long)D, causal ? " causal" : "", ranks, iters);
        printf("one rank, whole sequence: %.2f ms (%.1f GFLOP/s)\n", single,
               fmha_flops(&cfg, 1, S, S) / single * 1e-6);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    fmha_comm *comm;
    MPI_Comm world = MPI_COMM_WORLD;
    if (fmha_comm_init(&comm, FMHA_COMM_MPI, &world, NULL) != FMHA_STATUS_OK) {
        fprintf(stderr, "%s\n", fmha_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int u = 1; u <= ranks; u++) {
        if (ranks % u || H % u)
            continue;
        for (int layout = 0; layout < (ranks / u > 1 ? 2 : 1); layout++) {
            fmha_sp_config sp;
            fmha_sp_config_init(&sp, u, ranks / u);
            sp.layout = (fmha_sp_layout)layout;
            int64_t start[2], len[2], n = 0;
            int nseg;
            fmha_sp_tokens(&sp, S, rank, start, len, &nseg);
            for (int i = 0; i < nseg; i++)
                n += len[i];
            fmha_sp_args a;
            memset(&a, 0, sizeof a);
            /* Each rank's tokens as the first n rows of the buffers: the
             * timing does not depend on which tokens they are. */
            a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, 1, n, H, D);
            a.k = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, 1, n, H, D);
            a.v = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, 1, n, H, D);
            a.out = fmha_tensor_bshd(o, FMHA_DTYPE_BF16, 1, n, H, D);
            a.seqlen = S;
            int64_t sent = 0;
            for (int i = 0; i < iters; i++) {
                MPI_Barrier(MPI_COMM_WORLD);
                const int64_t b0 = fmha_comm_bytes_sent(comm);
                const double t0 = MPI_Wtime();
                if (fmha_sp_forward(&cfg, &sp, comm, &a) != FMHA_STATUS_OK) {
                    fprintf(stderr, "rank %d: %s\n", rank, fmha_last_error());
                    MPI_Abort(MPI_COMM_WORLD, 1);
                }
                double dt = (MPI_Wtime() - t0) * 1e3, slowest;
                MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                t[i] = slowest;
                sent = fmha_comm_bytes_sent(comm) - b0;
            }
            long long most;
            long long mine = (long long)sent;
            MPI_Reduce(&mine, &most, 1, MPI_LONG_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
            const double ms = median(t, iters);
            if (rank == 0)
                printf("ulysses %d x ring %d %-10s %8.2f ms  %.2fx one rank  %.1f%% efficiency  "
                       "%.2f MB sent per rank\n",
                       u, ranks / u, layout ? "zigzag" : "contiguous", ms, single / ms,
                       100.0 * single / ms / ranks, most / 1e6);
        }
    }
    fmha_comm_free(comm);
    free(q), free(k), free(v), free(o);
    MPI_Finalize();
    return 0;
}
