/* fmha_sp.h — typed helpers for fmha's sequence-parallel communicators.
 *
 * fmha.h declares fmha_comm_init with a `const void *` handle so that it
 * never includes mpi.h or nccl.h: programs that do not use them need
 * neither. Include this header after mpi.h and/or nccl.h to get helpers that
 * take the real types (and so catch a wrong argument at compile time):
 *
 *     #include <mpi.h>
 *     #include "fmha_sp.h"
 *     fmha_comm *comm;
 *     fmha_comm_init_mpi(&comm, MPI_COMM_WORLD);
 *
 *     #include <nccl.h>
 *     #include "fmha_sp.h"
 *     fmha_comm_init_nccl(&comm, nccl_comm, stream);   // stream: cudaStream_t
 *
 * The helpers are static inline: libfmha exports the same functions whether
 * or not it was built with MPI or NCCL (fmha_comm_built says which work).
 * The MPI_Comm must come from the MPI libfmha was built with. */
#ifndef FMHA_SP_H
#define FMHA_SP_H

#include "fmha.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MPI_VERSION)
static inline fmha_status fmha_comm_init_mpi(fmha_comm **comm, MPI_Comm mpi_comm)
{
    return fmha_comm_init(comm, FMHA_COMM_MPI, &mpi_comm, NULL);
}
#endif

#if defined(NCCL_MAJOR)
/* `stream` is a cudaStream_t (void * here, so that cuda_runtime.h is not
 * needed); NULL is the default stream. */
static inline fmha_status fmha_comm_init_nccl(fmha_comm **comm, ncclComm_t nccl_comm, void *stream)
{
    return fmha_comm_init(comm, FMHA_COMM_NCCL, &nccl_comm, stream);
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* FMHA_SP_H */
