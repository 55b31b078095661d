/* comm_nccl.h — the NCCL communicator (comm_nccl.c), built where CMake
 * finds NCCL and the CUDA backend (FMHA_HAVE_NCCL). */
#ifndef FMHA_SP_COMM_NCCL_H
#define FMHA_SP_COMM_NCCL_H

#include "transport.h"

/* Fills c from the ncclComm_t at `handle`, work queued on `stream`. */
fmha_status fmha_comm_nccl_init(fmha_comm *c, const void *handle, void *stream);

#endif /* FMHA_SP_COMM_NCCL_H */
