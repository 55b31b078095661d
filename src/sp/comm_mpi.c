/* comm_mpi.c — fmha_comm over MPI (host memory): a duplicate of the
 * caller's communicator, its errors returned rather than fatal, and each
 * start posted as MPI_Irecv / MPI_Isend (the ring's next block travels while
 * the current one is attended to), waited for with MPI_Waitall. */
#include "comm_mpi.h"
#include "../alloc.h"

#include <limits.h>
#include <mpi.h>

enum { TAG = 26 };
/* MPI counts are int: larger transfers go as several messages. */
#define CHUNK ((size_t)1 << 30)

typedef struct mpi_pending {
    int n;
    MPI_Request req[];
} mpi_pending;

static fmha_status mpi_error(int code, const char *what)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS)
        msg[0] = '\0';
    return fmha_set_error(FMHA_STATUS_BACKEND_ERROR, "MPI error in %s: %s", what, msg);
}

static MPI_Comm comm_of(const fmha_comm *c)
{
    return *(const MPI_Comm *)c->impl;
}

static fmha_status mpi_start(fmha_comm *c, const fmha_comm_xfer *x, int n, void **pending)
{
    size_t count = 0;
    for (int i = 0; i < n; i++)
        count += (x[i].bytes + CHUNK - 1) / CHUNK;
    mpi_pending *p = fmha_malloc(sizeof *p + (count + 1) * sizeof(MPI_Request));
    if (!p)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for %zu MPI requests",
                              count);
    p->n = 0;
    /* Receives first, so that a peer's sends find them posted. */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            if (x[i].send != pass)
                continue;
            /* Empty transfers are skipped on both sides (both know the size). */
            for (size_t off = 0; off < x[i].bytes; off += CHUNK) {
                const size_t len = x[i].bytes - off < CHUNK ? x[i].bytes - off : CHUNK;
                char *buf = (char *)x[i].buf + off;
                int rc = pass ? MPI_Isend(buf, (int)len, MPI_BYTE, x[i].peer, TAG, comm_of(c),
                                          &p->req[p->n])
                              : MPI_Irecv(buf, (int)len, MPI_BYTE, x[i].peer, TAG, comm_of(c),
                                          &p->req[p->n]);
                if (rc != MPI_SUCCESS) {
                    MPI_Waitall(p->n, p->req, MPI_STATUSES_IGNORE);
                    fmha_free(p);
                    return mpi_error(rc, pass ? "MPI_Isend" : "MPI_Irecv");
                }
                p->n++;
            }
        }
    *pending = p;
    return FMHA_STATUS_OK;
}

static fmha_status mpi_wait(fmha_comm *c, void *pending)
{
    (void)c;
    mpi_pending *p = pending;
    int rc = MPI_Waitall(p->n, p->req, MPI_STATUSES_IGNORE);
    fmha_free(p);
    return rc == MPI_SUCCESS ? FMHA_STATUS_OK : mpi_error(rc, "MPI_Waitall");
}

static void mpi_progress(fmha_comm *c, void *pending)
{
    (void)c;
    mpi_pending *p = pending;
    int done = 0;
    MPI_Testall(p->n, p->req, &done, MPI_STATUSES_IGNORE);
}

static void mpi_destroy(fmha_comm *c)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
        MPI_Comm_free((MPI_Comm *)c->impl);
    fmha_free(c->impl);
}

static const fmha_comm_ops mpi_ops = {mpi_start, mpi_wait, mpi_progress, mpi_destroy};

fmha_status fmha_comm_mpi_init(fmha_comm *c, const void *handle)
{
    int init = 0, finalized = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&finalized);
    if (!init || finalized)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "MPI is %s: call MPI_Init before fmha_comm_init (and "
                              "MPI_Finalize after fmha_comm_free)",
                              finalized ? "finalized" : "not initialized");
    MPI_Comm *own = fmha_malloc(sizeof *own);
    if (!own)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for an MPI communicator");
    int rc = MPI_Comm_dup(*(const MPI_Comm *)handle, own);
    if (rc != MPI_SUCCESS) {
        fmha_free(own);
        return mpi_error(rc, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(*own, MPI_ERRORS_RETURN);
    MPI_Comm_rank(*own, &c->rank);
    MPI_Comm_size(*own, &c->size);
    c->ops = &mpi_ops;
    c->device = FMHA_DEVICE_CPU;
    c->impl = own;
    return FMHA_STATUS_OK;
}
