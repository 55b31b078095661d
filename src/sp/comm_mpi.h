/* comm_mpi.h — the MPI communicator (comm_mpi.c), built where CMake finds
 * MPI (FMHA_HAVE_MPI). */
#ifndef FMHA_SP_COMM_MPI_H
#define FMHA_SP_COMM_MPI_H

#include "transport.h"

/* Fills c from the MPI_Comm at `handle` (duplicated: collective). */
fmha_status fmha_comm_mpi_init(fmha_comm *c, const void *handle);

#endif /* FMHA_SP_COMM_MPI_H */
