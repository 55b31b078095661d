/* comm.c — the public communicator: fmha_comm_init picks the
 * implementation this build has (comm_mpi.c, comm_nccl.c) and owns the
 * wrapper; the implementations own their state. */
#include "transport.h"
#include "../alloc.h"
#ifdef FMHA_HAVE_MPI
#include "comm_mpi.h"
#endif
#ifdef FMHA_HAVE_NCCL
#include "comm_nccl.h"
#endif

int fmha_comm_built(fmha_comm_kind kind)
{
    switch (kind) {
#ifdef FMHA_HAVE_MPI
    case FMHA_COMM_MPI: return 1;
#endif
#ifdef FMHA_HAVE_NCCL
    case FMHA_COMM_NCCL: return 1;
#endif
    default: return 0;
    }
}

const char *fmha_comm_kind_name(fmha_comm_kind kind)
{
    switch (kind) {
    case FMHA_COMM_MPI: return "mpi";
    case FMHA_COMM_NCCL: return "nccl";
    }
    return "unknown";
}

fmha_status fmha_comm_init(fmha_comm **comm, fmha_comm_kind kind, const void *handle, void *stream)
{
    fmha_clear_error();
    if (!comm)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT, "comm out-pointer is NULL");
    *comm = NULL;
    if (kind != FMHA_COMM_MPI && kind != FMHA_COMM_NCCL)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "kind (%d) is not a fmha_comm_kind value (FMHA_COMM_MPI or "
                              "FMHA_COMM_NCCL)",
                              (int)kind);
    if (!handle)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "handle is NULL: pass the address of your %s",
                              kind == FMHA_COMM_MPI ? "MPI_Comm" : "ncclComm_t");
    if (kind == FMHA_COMM_MPI && stream)
        return fmha_set_error(FMHA_STATUS_INVALID_ARGUMENT,
                              "stream is given for an MPI communicator, which works on host "
                              "memory and has no stream: pass NULL");
    if (!fmha_comm_built(kind))
        return fmha_set_error(
            FMHA_STATUS_UNSUPPORTED,
            kind == FMHA_COMM_MPI
                ? "this fmha was built without MPI: install it (Debian: libopenmpi-dev) and "
                  "rebuild (CMake finds it; -DFMHA_MPI=ON insists)"
                : "this fmha was built without NCCL: it needs the CUDA backend and nccl.h "
                  "(CUDA 13's toolkit has it, or libnccl-dev); -DFMHA_NCCL=ON insists");
    fmha_comm *c = fmha_calloc(1, sizeof *c);
    if (!c)
        return fmha_set_error(FMHA_STATUS_OUT_OF_MEMORY, "out of memory for a communicator");
    c->kind = kind;
    fmha_status st = FMHA_STATUS_UNSUPPORTED;
#ifdef FMHA_HAVE_MPI
    if (kind == FMHA_COMM_MPI)
        st = fmha_comm_mpi_init(c, handle);
#endif
#ifdef FMHA_HAVE_NCCL
    if (kind == FMHA_COMM_NCCL)
        st = fmha_comm_nccl_init(c, handle, stream);
#endif
    if (st != FMHA_STATUS_OK) {
        fmha_free(c);
        return st;
    }
    *comm = c;
    return FMHA_STATUS_OK;
}

void fmha_comm_free(fmha_comm *comm)
{
    if (!comm)
        return;
    fmha_layer_free(comm->layer);
    comm->ops->destroy(comm);
    fmha_free(comm);
}

int fmha_comm_rank(const fmha_comm *comm)
{
    return comm ? comm->rank : -1;
}

int fmha_comm_size(const fmha_comm *comm)
{
    return comm ? comm->size : -1;
}

int64_t fmha_comm_bytes_sent(const fmha_comm *comm)
{
    return comm ? comm->bytes_sent : -1;
}
